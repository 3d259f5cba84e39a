"""The KV pool: one tensor in the cross-layer block layout, sized by blocks or by memory."""

from __future__ import annotations

import torch

from duplexkv.model.config import ModelConfig

DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def block_shape(cfg: ModelConfig, block_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in block_shape(cfg, block_size):
        n *= d
    return n * dtype.itemsize


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                   num_kv_blocks: int | None, memory_gib: float) -> int:
    if num_kv_blocks is not None:
        return num_kv_blocks
    return max(1, int(memory_gib * 2**30) // block_bytes(cfg, block_size, dtype))


def allocate_pool(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  num_blocks: int) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, kv_heads, head_dim], contiguous, zeroed."""
    return torch.zeros((num_blocks, *block_shape(cfg, block_size)), dtype=dtype)
