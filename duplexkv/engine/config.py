"""Engine-level configuration (frozen; derived values are properties or `resolve`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from duplexkv.engine.dtype import DTYPES, canonical


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "bench"  # a model directory, a preset name or an HF hub id in the local cache
    dtype: str = "auto"  # auto: bfloat16 where the CPU has it natively, else float32 (dtype.py)
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # wins over kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 4096  # chunked-prefill token budget per step
    max_num_seqs: int = 64
    seed: int = 0
    revision: str | None = None  # hub ids: a branch, tag or commit in the cache (default main)
    tokenizer: str | None = None  # a directory or hub id (default: the model's)
    tokenizer_revision: str | None = None
    chat_template: str | None = None  # a file or the template itself (default: the tokenizer's)
    generation_config: str = "auto"  # auto: the model's generation_config.json; vllm: none; DIR

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical(self.dtype))
        assert self.dtype in DTYPES
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least one block")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
