"""Everything an engine is built from, resolved once from its config: the model files and config,
the dtype (with the reason it was chosen), the tokenizer and chat template, the generation
defaults, the KV pool's size, the model runner and the block manager seeded by the model's
fingerprint."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.dtype import read_cpu_flags, resolve_dtype
from duplexkv.engine.kv_pool import DTYPE, block_bytes, num_blocks_for
from duplexkv.engine.model_runner import ModelRunner
from duplexkv.model.chat_template import load_chat_template
from duplexkv.model.config import ModelConfig, ModelLoadError
from duplexkv.model.generation_config import sampling_defaults
from duplexkv.model.loader import load_config, load_weights
from duplexkv.model.registry import resolve_model
from duplexkv.model.tokenizer import Tokenizer
from duplexkv.wire.sampling import SamplingParams

log = logging.getLogger(__name__)


def model_fingerprint(model_dir: Path, dtype: str, block_size: int) -> bytes:
    """Seed of the block hash chain: same model files + dtype + layout => same hashes."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 16))
    h.update(f"{dtype}/{block_size}".encode())
    return h.digest()[:16]


@dataclass(frozen=True, slots=True)
class EngineParts:
    config: EngineConfig  # with max_model_len and dtype resolved
    model_dir: Path
    model_config: ModelConfig
    dtype_reason: str
    tokenizer: Tokenizer
    sampling_defaults: dict  # the model's generation config (a request's own values win)
    block_bytes: int
    fingerprint: bytes
    runner: ModelRunner
    bm: BlockManager


def build(config: EngineConfig) -> EngineParts:
    model_dir = resolve_model(config.model, config.revision)
    mc = load_config(model_dir)
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    choice = resolve_dtype(config.dtype, read_cpu_flags())
    log.info("dtype %s (%s)", choice.dtype, choice.reason)
    config = replace(config, max_model_len=max_len, dtype=choice.dtype)
    tok_dir = model_dir if config.tokenizer is None else \
        resolve_model(config.tokenizer, config.tokenizer_revision)
    tokenizer = Tokenizer.from_dir(tok_dir, load_chat_template(config.chat_template))
    defaults = _sampling_defaults(config, model_dir)
    dtype = DTYPE[config.dtype]
    num_blocks = num_blocks_for(mc, config.block_size, dtype, config.num_kv_blocks,
                                config.kv_cache_memory_gib)
    runner = ModelRunner(mc, load_weights(model_dir, mc, dtype), config.dtype,
                         config.block_size, num_blocks)
    fingerprint = model_fingerprint(model_dir, config.dtype, config.block_size)
    bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, fingerprint)
    return EngineParts(config, model_dir, mc, choice.reason, tokenizer, defaults,
                       block_bytes(mc, config.block_size, dtype), fingerprint, runner, bm)


def _sampling_defaults(config: EngineConfig, model_dir: Path) -> dict:
    defaults = sampling_defaults(config.generation_config, model_dir)
    try:
        SamplingParams(**{"max_tokens": 16, **defaults})
    except ValueError as e:
        raise ModelLoadError(f"generation config ({config.generation_config}): {e}") from None
    if defaults:
        log.info("sampling defaults from the model's generation config (a request's own "
                 "values win): %s", defaults)
    return defaults
