"""The environment a worker's libraries must see before they load (OpenMP, oneDNN), set by the
worker itself at start (`duplexkv serve`, before torch is imported), so a worker started by hand
gets what `duplexkv up` and the launcher give theirs (issue 32: without the caps, under 40
conversations for 240 s P grew +77 MB/min and D +121 MB/min; with them +5 and +9).

A value the user set wins; an empty value means "the library's own default" (the variable is
removed, not defaulted).

Several workers share the cores of one machine. OpenMP threads that spin while waiting for work
(libgomp's default) steal those cores from the other worker: P prefilling while D decodes, 2
threads each on 2 cores, ran 2.4-3.5x slower than with passive waiting, which costs nothing for a
worker running alone (`duplexkv bench omp_contention`). libgomp reads OMP_WAIT_POLICY when it is
loaded (with torch).
oneDNN keeps a JIT-compiled matmul per input shape in two LRU caches (its primitive cache and
ideep's), 1024 entries each by default: in bf16 on an AMX CPU every new prefill length adds
~0.3 MB there, so a worker's RSS rose by ~600 MB before the caches filled. 256 entries still hold
every decode batch size (<= 64 per weight shape). (Free heap memory is returned by the engine's
periodic malloc_trim: engine/memory.py.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WORKER_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
                       "LRU_CACHE_CAPACITY": "256"}


def apply_worker_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each default the environment lacks; drop the ones set empty. Returns what was set
    (to log). Raises RuntimeError when torch is already imported and something had to be set:
    the libraries would not see it."""
    changed = {}
    for key, value in WORKER_ENV_DEFAULTS.items():
        if key not in environ:
            environ[key] = changed[key] = value
        elif environ[key] == "":
            del environ[key]
    if changed and "torch" in sys.modules:
        raise RuntimeError(f"{', '.join(changed)} must be set before torch is imported")
    return changed
