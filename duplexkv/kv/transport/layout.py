"""A registered KV pool as blocks: where block `b` lives, a READ's block ids checked against
both pools, and block ids grouped into runs of consecutive ids (one copy or region per run).

Every worker registers one pool tensor `[num_blocks, ...]` (contiguous, CPU), so block `b` is the
byte range `pool.data_ptr() + b * block_bytes` of length `block_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a registered pool lives and how it splits into blocks."""

    base_ptr: int
    num_blocks: int
    block_bytes: int

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolLayout:
        if pool.device.type != "cpu":
            raise ValueError(f"the KV pool must be a CPU tensor, got {pool.device}")
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be contiguous")
        if pool.dim() < 1 or pool.shape[0] < 1 or pool.numel() == 0:
            raise ValueError(f"the KV pool needs at least one non-empty block, got {tuple(pool.shape)}")
        nbytes = pool.numel() * pool.element_size()
        return cls(pool.data_ptr(), pool.shape[0], nbytes // pool.shape[0])

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


def check_block_ids(local: Sequence[int], remote: Sequence[int], local_blocks: int,
                    remote_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a READ's block ids (ValueError) and return them as tuples of int."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local block ids but {len(remote)} remote block ids")
    loc = tuple(int(b) for b in local)
    rem = tuple(int(b) for b in remote)
    for name, ids, n in (("local", loc, local_blocks), ("remote", rem, remote_blocks)):
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise ValueError(f"{name} block ids out of range [0, {n}): {bad[:8]}")
    if len(set(loc)) != len(loc):
        raise ValueError("local block ids must be distinct (two blocks would land in one)")
    return loc, rem


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Split block ids into maximal runs of consecutive ids: [(first_id, count), ...]."""
    out: list[tuple[int, int]] = []
    for b in ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
