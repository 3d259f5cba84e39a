"""Give freed heap memory back to the system now and then (glibc's `malloc_trim`).

Prefill allocates and frees activation tensors of several MB every step. glibc's dynamic mmap
threshold rises with such frees until they come from the heaps, and what they leave free inside
the heaps stays in the process's RSS: a soak grew a worker's free-but-held heap by ~60 MB in
100 s. Fixing the threshold low (`MALLOC_MMAP_THRESHOLD_`) stops that but makes every large
tensor a fresh, zero-filled mapping: prefill took 1.8x as long (bench model, bf16, 8k tokens:
3.5 s vs 1.9 s). `malloc_trim(0)` returns the free pages instead, a few ms at most every
`interval_s`, on the engine thread between steps, when no request is in flight: a trim returns
the pages the next forward pass will fault in again (a 2k-token prefill, float32, `bench` model:
~35k extra minor page faults after a trim, i.e. its whole activation working set zero-filled
anew), so it must not land between the chunks of a prefill or the steps of a decode. A worker
that is never idle trims anyway once `OVERDUE` intervals have passed.

Between trims the heap keeps what a step freed (`tune_heap`, at the worker's start): left to
itself glibc returns the free top of the heap whenever it passes twice the mmap threshold, so
the next step's activations were faulted in again page by page (bench model, float32, an 8k-token
prefill: 100-300k minor faults, ~0.2 s). Fixing the trim threshold at 256 MiB (the periodic
trim still returns it) and the mmap threshold at glibc's ceiling of 32 MiB (fixing either stops
their dynamic adjustment; 32 MiB is where the dynamic one ends anyway) leaves none: the prefill
~4 % faster. Larger tensors were still fresh mappings (the float32 MLP works in pieces below
it, model/qwen3.py), and from 16k tokens on most of a layer's tensors are that large ([T, 512]
float32 is 32 MiB on the bench model): a 16k float32 prefill faulted 515-566k pages in, every
request (AMD EPYC Zen 4). So mmap is switched off for allocations (`M_MMAP_MAX` 0): they all come
from the heaps, which keep them for the next step; 0-116k faults per 16k request, TTFT 17.23 ->
16.97 s (mean of 3, same machine). Where a request cannot fit a thread's heap (glibc's non-main
heaps are 64 MiB at most) glibc still maps it on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)
TRIM_INTERVAL_S = 30.0
OVERDUE = 4  # intervals after which a busy engine trims between two steps anyway


def _glibc(fn: str, argtypes: list, restype):
    """glibc's function `fn` with its C signature, or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        f = getattr(ctypes.CDLL(name), fn) if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    if f is not None:
        f.argtypes, f.restype = argtypes, restype
    return f


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)


def tune_heap() -> bool:
    """Keep freed activations in the heap between trims (module docstring). False where the C
    library is not glibc."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    ok = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
          and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(M_MMAP_MAX, 0) == 1)
    if not ok:
        log.warning("mallopt refused the heap thresholds: prefill may fault its activations in")
    return ok


class HeapTrimmer:
    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._trim = _glibc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
        self._last = time.monotonic()
        self.trims = 0

    def tick(self, idle: bool = True) -> None:
        """Trim if `idle` (no request in flight) and the interval has passed since the last
        trim, or if OVERDUE intervals have passed (cheap otherwise)."""
        if self._trim is None:
            return
        waited = time.monotonic() - self._last
        if waited < self.interval_s or (not idle and waited < OVERDUE * self.interval_s):
            return
        self._trim(0)
        self.trims += 1
        self._last = time.monotonic()
