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
