"""Contiguous per-sequence mirrors of the paged KV, so decode does not re-gather its context.

The pool stays the source of truth (prefix cache, transfers). A running sequence also gets a
mirror [num_layers, 2, kv_heads, capacity, head_dim] holding exactly its first `length` tokens;
each step appends the new K/V to both. Without it, every decode step would gather the whole
context from scattered blocks (at 8k tokens that copy costs as much as the attention itself).
A rebuild copies whole blocks with one `index_select` per layer and KV head straight into place
(bf16, 15.5k tokens: 0.45 ms per layer and K/V, against 1.1 ms for gather-then-transpose); the
head-major layout keeps decode attention on contiguous rows (a token-major mirror read through
strided views makes a 15.5k-token decode step's attention 10-25 % slower).

    step for a sequence with `start` tokens already computed
      mirror.length == start  -> append the new tokens, attend over mirror[:start + n]
      otherwise (new, preempted, pulled from a peer) -> rebuild from the pool, then append
Mirrors live while their sequence runs, within a byte budget; beyond it, attention gathers.
The buffer of the last dropped mirror is kept as a spare (inside the budget) for the next new
one: a fresh 16k-token buffer costs ~15 ms of page faults, which a decode node would pay on
every turn's first step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from duplexkv.layers import native


@dataclass(slots=True)
class Mirror:
    kv: torch.Tensor  # [num_layers, 2, kv_heads, capacity, head_dim]
    length: int = 0  # tokens valid (the same for every layer once a step completes)
    rebuild: bool = True  # this step must first copy [0, start) from the pool
    clean: int = 0  # every position below this holds KV or zeros (never stale or unset memory)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]


def fill_from_pool(dst: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, layer: int,
                   kv: int, num_tokens: int) -> None:
    """dst[:, :num_tokens] ([KVH, cap, D]) <- the first num_tokens of the blocks in table."""
    bs = pool.shape[3]
    full, rest = divmod(num_tokens, bs)
    for h in range(dst.shape[0]):
        if full:
            out = dst[h, : full * bs].view(full, bs, dst.shape[-1])
            torch.index_select(pool[:, layer, kv, :, h], 0, table[:full], out=out)
        if rest:
            dst[h, full * bs : num_tokens] = pool[table[full], layer, kv, :rest, h]


def kv_append(k: torch.Tensor, v: torch.Tensor,
              stores: list[tuple[torch.Tensor, torch.Tensor, int, int, int]]) -> None:
    """The step's new K/V rows (k, v [T, KVH, D], any row and head strides, the last axis
    contiguous) into each sequence's stores (mirrors) in one native call (`native.available()`
    first; native_kernels.c dkv_kv_append): stores[i] = (dk, dv, q_row, n_new, start), dk/dv
    [KVH, cap, D] with the same strides; rows q_row .. q_row + n_new - 1 go to positions
    start .. start + n_new - 1."""
    t, kvh, d = k.shape
    if (v.shape != k.shape or v.dtype != k.dtype or k.stride(2) != 1 or v.stride(2) != 1
            or k.device.type != "cpu" or v.device.type != "cpu"):
        raise ValueError(f"kv_append: k {k.dtype} {tuple(k.shape)}, v {v.dtype} {tuple(v.shape)}")
    for dk, dv, q_row, n_new, start in stores:
        if (dk.dtype != k.dtype or dv.dtype != k.dtype or dk.dim() != 3
                or dk.shape[0] != kvh or dk.shape[2] != d or dv.shape != dk.shape
                or dv.stride() != dk.stride() or dk.stride(2) != 1 or n_new < 0 or start < 0
                or start + n_new > dk.shape[1] or q_row < 0 or q_row + n_new > t):
            raise ValueError(f"kv_append: store {tuple(dk.shape)} (strides {dk.stride()}) for rows "
                             f"{q_row}+{n_new} at {start} of {t}")
    if not stores:
        return
    arr = ctypes.c_int64 * len(stores)
    cols = [arr(*vals) for vals in zip(*((dk.data_ptr(), dv.data_ptr(), dk.stride(0), dk.stride(1),
                                          q_row, n_new, start)
                                         for dk, dv, q_row, n_new, start in stores))]
    native.library().dkv_kv_append(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                                   v.stride(0), v.stride(1), len(stores),
                                   *(ctypes.addressof(c) for c in cols), kvh, d, k.element_size())


class MirrorSet:
    def __init__(self, num_layers: int, num_kv: int, head_dim: int, dtype: torch.dtype,
                 budget_bytes: int) -> None:
        self.shape = (num_layers, 2, num_kv, head_dim)
        self.dtype = dtype
        self.token_bytes = num_layers * 2 * num_kv * head_dim * dtype.itemsize
        self.budget_bytes = budget_bytes
        self.mirrors: dict[str, Mirror] = {}
        self.spare: torch.Tensor | None = None  # a dropped mirror's buffer, reused when it fits

    @property
    def used_bytes(self) -> int:
        spare = self.spare.shape[3] if self.spare is not None else 0
        return (sum(m.capacity for m in self.mirrors.values()) + spare) * self.token_bytes

    def _release(self, kv: torch.Tensor) -> None:
        """Keep a no longer used buffer as the spare if it is the larger one and fits."""
        if self.spare is not None and kv.shape[3] <= self.spare.shape[3]:
            return
        self.spare = None
        if self.used_bytes + kv.shape[3] * self.token_bytes <= self.budget_bytes:
            self.spare = kv

    def drop_unless(self, live: set[str]) -> None:
        for rid in [r for r in self.mirrors if r not in live]:
            self._release(self.mirrors.pop(rid).kv)

    def _buffer(self, cap: int, extra_bytes: int) -> torch.Tensor | None:
        """A [L, 2, KVH, >=cap, D] buffer: the spare if it fits, else a new one within budget."""
        if self.spare is not None and self.spare.shape[3] >= cap:
            kv, self.spare = self.spare, None
            return kv
        if self.used_bytes + extra_bytes > self.budget_bytes:
            self.spare = None
            if self.used_bytes + extra_bytes > self.budget_bytes:
                return None
        L, two, kvh, d = self.shape
        return torch.empty((L, two, kvh, cap, d), dtype=self.dtype)

    def prepare(self, request_id: str, start: int, ctx_len: int,
                block: int = 0) -> Mirror | None:
        """The mirror to use this step (growing it as needed), or None to gather instead. With
        `block`, the positions from ctx_len to the end of its `block`-aligned block (within the
        capacity) are zeros unless written: a kernel may then read the whole block, the keys
        past the context masked (a masked key adds an exact zero only if its value is finite;
        a buffer may come from another sequence, or be fresh memory)."""
        m = self._prepare(request_id, start, ctx_len)
        if m is not None and block:
            end = min(m.capacity, -(-ctx_len // block) * block)
            lo = max(ctx_len, m.clean)
            if lo < end:
                m.kv[:, :, :, lo:end].zero_()
            m.clean = max(m.clean, end)
        return m

    def _prepare(self, request_id: str, start: int, ctx_len: int) -> Mirror | None:
        m = self.mirrors.get(request_id)
        if m is not None and m.length != start:
            # preempted or restarted: contents no longer line up
            self._release(self.mirrors.pop(request_id).kv)
            m = None
        if m is not None and m.capacity >= ctx_len:
            m.rebuild = False
            return m
        cap = max(256, 1 << (ctx_len - 1).bit_length())
        kv = self._buffer(cap, (cap - (m.capacity if m else 0)) * self.token_bytes)
        if kv is None:
            self.mirrors.pop(request_id, None)
            return None
        if m is not None:
            kv[:, :, :, : m.length] = m.kv[:, :, :, : m.length]
            old, m.kv, m.rebuild, m.clean = m.kv, kv, False, m.length
            self._release(old)
        else:
            m = Mirror(kv, 0, rebuild=start > 0)
            self.mirrors[request_id] = m
        return m
