"""`GET /debug/memory`: what a process's memory is made of, to tell a Python reference leak from
native growth during a soak. Off unless `DUPLEXKV_DEBUG_MEMORY=1` is set (the route is then
added to the worker and the router); `DUPLEXKV_TRACEMALLOC=N` also starts tracemalloc with N
frames per trace at start-up (slow: for investigations only).

    rss_mb, threads, asyncio_tasks
    structures        sizes of the process's own maps and queues (given by the app)
    gc                objects tracked by the collector, and the most numerous types
    malloc            glibc's mallinfo2: bytes in use, free inside the heaps, mmapped; arenas
    maps              resident MB by kind of mapping (/proc/self/smaps): the main heap, anonymous
                      writable mappings (glibc's 64 MB-aligned thread arenas; others by size:
                      Python's 1 MB arenas, large tensors), anonymous executable ones (JIT-compiled
                      kernels), files, stacks; with the number of mappings of each kind
    tracemalloc       (when started) traced bytes and the top lines by growth since the last call
    ?trim=1           run malloc_trim(0) first and report the RSS before and after it
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import gc
import os
import re
import threading
import tracemalloc
from collections.abc import Callable

ENV = "DUPLEXKV_DEBUG_MEMORY"
TRACE_ENV = "DUPLEXKV_TRACEMALLOC"
_MB = 1 << 20


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def start_tracing() -> None:
    """Start tracemalloc if `DUPLEXKV_TRACEMALLOC=N` (N frames) asks for it."""
    frames = os.environ.get(TRACE_ENV, "")
    if frames.isdigit() and int(frames) > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(int(frames))


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def malloc_stats() -> dict | None:
    """glibc heap totals (MB) and the number of arenas; None off glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    out = {"heap_mb": round(mi.arena / _MB, 1),  # sbrk + arena heaps taken from the system
           "in_use_mb": round(mi.uordblks / _MB, 1),
           "free_in_heaps_mb": round(mi.fordblks / _MB, 1),
           "mmapped_mb": round(mi.hblkhd / _MB, 1), "mmapped_chunks": mi.hblks}
    if hasattr(libc, "open_memstream") and hasattr(libc, "malloc_info"):
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        libc.open_memstream.restype = ctypes.c_void_p
        fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if fp:
            libc.malloc_info(0, ctypes.c_void_p(fp))
            libc.fclose(ctypes.c_void_p(fp))
            xml = ctypes.string_at(buf, size.value).decode(errors="replace")
            libc.free(buf)
            out["arenas"] = len(re.findall(r"<heap nr=", xml))
    return out


def _map_kind(start: int, end: int, perms: str, name: str) -> str:
    if name == "[heap]":
        return "heap"
    if name.startswith("[stack"):
        return "stack"
    if name.startswith("["):
        return "other"
    if name:
        return "file"
    if "x" in perms:
        return "anon_exec"
    if perms.startswith("---"):
        return "anon_reserved"
    if start % (64 * _MB) == 0 and end - start <= 64 * _MB:
        return "anon_arena"  # glibc's thread arenas: 64 MB-aligned heaps, grown in place
    size = end - start
    if size <= _MB:
        return "anon_le_1mb"
    return "anon_1_64mb" if size < 64 * _MB else "anon_gt_64mb"


def maps_summary(path: str = "/proc/self/smaps") -> dict | None:
    """Resident MB and the count of mappings per kind (`_map_kind`); None off Linux."""
    head = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
    rss: dict[str, int] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    kind = "other"
    try:
        with open(path) as fh:
            for line in fh:
                m = head.match(line)
                if m:
                    kind = _map_kind(int(m[1], 16), int(m[2], 16), m[3], m[4].strip())
                    count[kind] += 1
                elif line.startswith("Rss:"):
                    rss[kind] += int(line.split()[1])
    except OSError:
        return None
    return {k: {"rss_mb": round(rss[k] / 1024, 1), "maps": count[k]} for k in sorted(count)}


def malloc_trim() -> bool:
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def gc_summary(top: int = 15) -> dict:
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    return {"objects": sum(counts.values()), "top_types": dict(counts.most_common(top))}


_last_snapshot: tracemalloc.Snapshot | None = None
_snap_lock = threading.Lock()


def tracemalloc_summary(top: int = 15) -> dict | None:
    """Traced totals and the lines that grew most since the previous call."""
    global _last_snapshot
    if not tracemalloc.is_tracing():
        return None
    with _snap_lock:
        snap = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),))
        cur, peak = tracemalloc.get_traced_memory()
        stats = (snap.compare_to(_last_snapshot, "lineno") if _last_snapshot is not None
                 else snap.statistics("lineno"))
        _last_snapshot = snap
    growth = [{"where": str(s.traceback[0]), "size_kb": round(s.size / 1024, 1),
               "diff_kb": round(getattr(s, "size_diff", s.size) / 1024, 1),
               "count": s.count, "count_diff": getattr(s, "count_diff", s.count)}
              for s in sorted(stats, key=lambda s: getattr(s, "size_diff", s.size),
                              reverse=True)[:top]]
    return {"traced_mb": round(cur / _MB, 1), "peak_mb": round(peak / _MB, 1),
            "top_growth": growth}


def report(structures: Callable[[], dict] | None = None, trim: bool = False) -> dict:
    """The whole answer of /debug/memory (call on the event loop thread)."""
    out: dict = {"rss_mb": round(rss_mb(), 1)}
    if trim:
        gc.collect()
        out["trimmed"] = malloc_trim()
        out["rss_before_trim_mb"], out["rss_mb"] = out["rss_mb"], round(rss_mb(), 1)
    out["threads"] = threading.active_count()
    try:
        out["asyncio_tasks"] = len(asyncio.all_tasks())
    except RuntimeError:
        pass
    if structures is not None:
        out["structures"] = structures()
    out["gc"] = gc_summary()
    out["malloc"] = malloc_stats()
    out["maps"] = maps_summary()
    out["tracemalloc"] = tracemalloc_summary()
    return out


def add_route(app, structures: Callable[[], dict] | None = None) -> None:
    """Add `GET /debug/memory` to a Starlette/FastAPI app when `DUPLEXKV_DEBUG_MEMORY` is set."""
    if not enabled():
        return
    from starlette.responses import JSONResponse

    start_tracing()

    async def debug_memory(request) -> JSONResponse:
        trim = request.query_params.get("trim", "") not in ("", "0")
        return JSONResponse(report(structures, trim))

    app.add_route("/debug/memory", debug_memory, methods=["GET"])
