"""The model's weights on transparent huge pages.

A decode step reads every weight once, so its speed is the memory's read rate, and with 4 KiB pages
that rate is capped by address translation: a 2-thread stream over 1 GiB read 44-46 GB/s on 4 KiB
pages and 57-61 on 2 MiB pages (AMD EPYC Zen 4 VM, float32, in its fast memory spells; a weight-row
dot product like dkv_linear's 44-48 -> 56-61). Linux gives an anonymous mapping huge pages when it
is advised so (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, a common default) or
always; glibc's heap and torch's allocator do not advise by default. So `move_parameters` puts the
weights in one anonymous mapping of their own, aligned to 2 MiB, advised `MADV_HUGEPAGE`, in module
order (a decode step's reading order), after the packed bf16 kernels (where they run) have
released the plain copies of what they pack; the packed copies are buffers (`Linear.packed`) and
move with them (bf16 decode steps on Zen 4 with them in the arena or not: best 1.00-1.01x, no
measurable change; moved so that every weight a step reads is in one place). Bench model,
float32, in-process decode steps at 4k x 1, two engines in one process alternated: 0.94-0.96x the
time; prefill unchanged.

Only the weights: they are written once, at load. On this VM a huge page's first touch costs
~4-5 ms per MiB (the host backs the guest's memory lazily and takes freed 2 MiB blocks back), so
loading the bench model's 161 MB takes ~0.7 s longer; the KV pool and the decode mirrors are
touched while serving, where that would be a stall (a 16k-token mirror, 128 MiB: 0.4-0.5 s against
~0.08 s on 4 KiB pages), and they stay on the heap. Where the kernel has no THP (`never`) or the
advice fails, the mapping keeps 4 KiB pages and works the same. `DUPLEXKV_HUGEPAGES=0` keeps the
weights where torch put them (A/B).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

ENABLED = os.environ.get("DUPLEXKV_HUGEPAGES", "1") != "0"
HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: a tensor's start inside the weight arena (a cache line)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous zeroed mapping with a 2 MiB-aligned range of nbytes at the returned offset,
    advised to use huge pages."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))  # the export ends with the line
    offset = -base % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except (AttributeError, OSError) as e:  # no THP in this kernel: 4 KiB pages
        log.debug("MADV_HUGEPAGE refused (%s): 4 KiB pages", e)
    return buf, offset


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor; on huge pages when it spans at least one (and `ENABLED`)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not ENABLED or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    buf, offset = _mapping(nbytes)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)


def move_parameters(module: torch.nn.Module) -> int:
    """Move every parameter and buffer of `module` into one huge-page arena, in module order,
    keeping tied parameters tied (one copy per storage). Returns the arena's bytes (0 when not
    `ENABLED`). Under 2 MiB in all (the tests' tiny model) the arena has 4 KiB pages."""
    tensors: dict[int, list[torch.Tensor]] = {}  # data_ptr -> the tensors that hold it
    for t in [*module.parameters(), *module.buffers()]:
        if t.numel() and t.is_contiguous() and t.device.type == "cpu":
            tensors.setdefault(t.data_ptr(), []).append(t)
    sizes = {ptr: ts[0].numel() * ts[0].element_size() for ptr, ts in tensors.items()}
    if any(len({(t.shape, t.dtype) for t in ts}) > 1 for ts in tensors.values()):
        raise ValueError("move_parameters: tensors that share a start differ in shape or dtype")
    storages = {ts[0].untyped_storage().data_ptr() for ts in tensors.values()}
    if len(storages) < len(tensors):  # views into one storage: copies would stop aliasing
        raise ValueError("move_parameters: parameters that are views of one storage")
    padded = {ptr: -(-n // ALIGN) * ALIGN for ptr, n in sizes.items()}  # each start aligned
    total = sum(padded.values())
    if not ENABLED or not total:
        return 0
    buf, offset = _mapping(total)
    arena = torch.frombuffer(buf, dtype=torch.uint8, count=total, offset=offset)
    at = 0
    with torch.no_grad():
        for ptr, ts in tensors.items():
            first = ts[0]
            dst = arena[at : at + sizes[ptr]].view(first.dtype).view(first.shape)
            dst.copy_(first)
            for t in ts:
                t.data = dst
            at += padded[ptr]
    return total
