"""The engine's periodic malloc_trim waits for an idle engine (a trim makes the next forward pass
fault its working set in again), unless a busy engine is overdue; timings by moving the clock
the trimmer last trimmed at, not by sleeping."""

from __future__ import annotations

import pytest

from duplexkv.engine.memory import OVERDUE, HeapTrimmer


def test_trim_waits_for_idle_unless_overdue() -> None:
    t = HeapTrimmer(interval_s=30.0)
    if t._trim is None:
        pytest.skip("not glibc: no malloc_trim")
    t.tick(idle=True)
    assert t.trims == 0  # the interval has not passed
    t._last -= 31.0
    t.tick(idle=False)
    assert t.trims == 0  # a request is in flight: wait
    t.tick(idle=True)
    assert t.trims == 1
    t._last -= OVERDUE * 30.0 + 1
    t.tick(idle=False)
    assert t.trims == 2  # never idle for OVERDUE intervals: trim between steps anyway



_PROBE = """
import sys
import torch
from duplexkv.engine.memory import tune_heap
if sys.argv[1] == "tuned":
    assert tune_heap()
def heap():
    for ln in open("/proc/self/maps"):
        if ln.rstrip().endswith("[heap]"):
            a, b = (int(x, 16) for x in ln.split()[0].split("-"))
            return a, b
    return 0, 0
x = torch.empty(6 << 20)  # 24 MiB, a prefill activation's size
big = torch.empty(12 << 20)  # 48 MiB: a 16k-token prefill's [T, 768] float32 (past the threshold)
a, b = heap()
in_heap = a <= x.data_ptr() < b
big_in_heap = a <= big.data_ptr() < b
xs = [torch.empty(6 << 20).fill_(1.0) for _ in range(7)]  # a step's worth, touched, then freed
del xs, x, big
a, b = heap()
print(int(in_heap), int(big_in_heap), (b - a) >> 20)
"""


def test_a_tuned_heap_keeps_a_steps_activations_for_the_next() -> None:
    """Untuned, glibc maps a fresh 24 MiB tensor on its own and returns a freed step's worth of
    them at once, so the next step faults its activations in again page by page; tuned (what a
    worker does at start), the tensor comes from the heap and the heap keeps the step's memory
    until the periodic trim. A 48 MiB tensor (past glibc's largest mmap threshold: a 16k-token
    prefill's) comes from the heap too."""
    import subprocess
    import sys

    if HeapTrimmer()._trim is None:
        pytest.skip("not glibc")
    got = {}
    for mode in ("default", "tuned"):
        r = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        in_heap, big_in_heap, heap_mb = (int(v) for v in r.stdout.split())
        got[mode] = (bool(in_heap), bool(big_in_heap), heap_mb)
    assert got["tuned"][0] and got["tuned"][2] >= 150, got  # 7 x 24 MiB still held
    assert got["tuned"][1], got  # past the mmap threshold too: no fresh mapping per tensor
    assert not (got["default"][0] and got["default"][2] >= 150), got  # what tuning changes
    assert not got["default"][1], got
