"""Contiguous per-sequence mirrors of the paged KV, so decode does not re-gather its context.

The pool stays the source of truth (prefix cache, transfers). A running sequence also gets a
mirror [num_layers, 2, kv_heads, capacity, head_dim] holding exactly its first `length` tokens;
each step appends the new K/V to both. Without it, every decode step would gather the whole
context from scattered blocks (at 8k tokens that copy costs as much as the attention itself).

    step for a sequence with `start` tokens already computed
      mirror.length == start  -> append the new tokens, attend over mirror[:start + n]
      otherwise (new, preempted, pulled from a peer) -> rebuild from the pool, then append
Mirrors live while their sequence runs, within a byte budget; beyond it, attention gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Mirror:
    kv: torch.Tensor  # [num_layers, 2, kv_heads, capacity, head_dim]
    length: int = 0  # tokens valid (the same for every layer once a step completes)
    rebuild: bool = True  # this step must first copy [0, start) from the pool

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]


class MirrorSet:
    def __init__(self, num_layers: int, num_kv: int, head_dim: int, dtype: torch.dtype,
                 budget_bytes: int) -> None:
        self.shape = (num_layers, 2, num_kv, head_dim)
        self.dtype = dtype
        self.token_bytes = num_layers * 2 * num_kv * head_dim * dtype.itemsize
        self.budget_bytes = budget_bytes
        self.mirrors: dict[str, Mirror] = {}

    @property
    def used_bytes(self) -> int:
        return sum(m.capacity for m in self.mirrors.values()) * self.token_bytes

    def drop_unless(self, live: set[str]) -> None:
        for rid in [r for r in self.mirrors if r not in live]:
            del self.mirrors[rid]

    def prepare(self, request_id: str, start: int, ctx_len: int) -> Mirror | None:
        """The mirror to use this step (growing it as needed), or None to gather instead."""
        m = self.mirrors.get(request_id)
        if m is not None and m.length != start:
            del self.mirrors[request_id]  # preempted or restarted: contents no longer line up
            m = None
        if m is not None and m.capacity >= ctx_len:
            m.rebuild = False
            return m
        cap = max(256, 1 << (ctx_len - 1).bit_length())
        extra = (cap - (m.capacity if m else 0)) * self.token_bytes
        if self.used_bytes + extra > self.budget_bytes:
            self.mirrors.pop(request_id, None)
            return None
        L, two, kvh, d = self.shape
        kv = torch.empty((L, two, kvh, cap, d), dtype=self.dtype)
        if m is not None:
            kv[:, :, :, : m.length] = m.kv[:, :, :, : m.length]
            m.kv, m.rebuild = kv, False
        else:
            m = Mirror(kv, 0, rebuild=start > 0)
            self.mirrors[request_id] = m
        return m
