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


_CHURN = """
import resource, sys
import torch
from duplexkv.engine.memory import tune_heap
if sys.argv[1] == "tuned":
    assert tune_heap()
def step():  # a prefill's activations: several tens of MB, freed at the end of the step
    xs = [torch.empty(6 << 20).fill_(1.0) for _ in range(4)]  # 4 x 24 MiB
    del xs
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_tuned_heap_keeps_a_steps_activations_for_the_next() -> None:
    """Untuned, glibc returns the freed top of the heap after every step and the next one faults
    its activations in again, page by page; tuned (what a worker does at start), it keeps them
    until the periodic trim."""
    import subprocess
    import sys

    if HeapTrimmer()._trim is None:
        pytest.skip("not glibc")
    faults = {}
    for mode in ("default", "tuned"):
        r = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        faults[mode] = int(r.stdout.split()[-1])
    assert faults["default"] > 5 * 6000  # 24 MiB pages, several times over: the churn is real
    assert faults["tuned"] < 1000, faults
