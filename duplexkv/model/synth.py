"""Make a synthetic HF-format model directory that transformers itself loads.

No weights can be downloaded, so a preset is made locally: a byte-level BPE tokenizer trained on
the Python standard library's `.py` sources (sorted, non-UTF-8 files skipped, capped), and random
weights.

Initialisation. Plain random weights give nearly flat logits (greedy ties flip on rounding noise),
a tied lm_head makes the current token win (the residual holds its embedding), and sharp attention
makes the model chaotic (bf16 rounding flips tokens). The scheme, per tensor N(0, std) from a
generator seeded by (seed, crc32(name)):
  embed_tokens   rows N(0, 1/d) times a per-token scale exp(0.35 z), RMS-normalised to 1: a
                 Zipf-like prior, so the top-1 logit usually stands clear of the rest
  q/k/v_proj     std 1/sqrt(d); q_norm/k_norm weight 1 (attention logits ~N(0, 1): context- and
                 position-dependent, not chaotic)
  o_proj         std 1/sqrt(heads*head_dim): each layer's update is ~sqrt(d) times an embedding
  gate_proj      std 3/sqrt(d) (sharper SiLU gating: fewer repetition loops); up 1/sqrt(d)
  down_proj      std 1/sqrt(intermediate); input/post-attention norms 1
  model.norm     8 * random signs: logit std ~8, and the signs cancel the tied-embedding self-match
                 E_x . diag(g) . E_x, so "repeat the current token" is not favoured
Measured with transformers in float32, 20 random-token prompts x 32 greedy steps (seed 0; the
weights of SYNTH_VERSION 2, drawn in float64):
  top1-top2 gap  min / p1 / p5 / p25 / median   steps < 0.05   distinct tokens of 32 (mean, min)
  tiny           0.002 / 0.092 / 0.26 / 1.4 / 3.8   5 of 640       23.1, 13
  bench          0.010 / 0.103 / 0.38 / 1.8 / 4.1   2 of 640       27.8, 22
No eos emitted. Changing the 3rd prompt token
changes all 20 continuations (mostly at the first new token). The next token after a 40-token prompt
differs for 21-30 of 30 prompts with RoPE theta 1e4 instead of 1e6, with all positions 0, or with the
first 16 tokens dropped (tiny: 26, 21, 26); shifting all positions by 1000 changes none (RoPE is
relative). bf16 is not exact: computing bench in bf16 instead of fp32
(same bf16 weights) changes a greedy continuation after ~20 steps on median (bf16 logits alone are
quantised to ~0.1 at this scale), so exact-match tests should run float32.

Determinism: the same preset and seed give byte-identical files (on the same Python stdlib and
library versions, on any CPU: the weights are drawn in float64, whose PyTorch code is the same on
every CPU kind, and rounded to float32 once; the seed changes only the weights). The directory is written to a temporary
sibling and renamed into place, so concurrent makers of one model never leave a half-written one.
"""

from __future__ import annotations

import errno
import filecmp
import json
import math
import os
import shutil
import sysconfig
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from duplexkv.model.config import ModelConfig, ModelLoadError
from duplexkv.model.loader import expected_weight_shapes
from duplexkv.model.presets import get_preset
from duplexkv.model.synth_template import CHAT_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
ENDOFTEXT, IM_START, IM_END = range(3)
# Qwen2's pre-tokenizer split
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EMBED_SCALE_SPREAD = 0.35
GATE_GAIN = 3.0
LOGIT_SCALE = 8.0


def stdlib_corpus(max_chars: int) -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    total = 0
    for rel in rels:
        if rel.split("/")[0] in ("site-packages", "dist-packages"):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # ~400 chars of corpus per vocab entry reach the vocab size with margin
    tok.train_from_iterator(stdlib_corpus(max(1_000_000, 400 * vocab_size)), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ModelLoadError(
            f"tokenizer training reached {tok.get_vocab_size()} tokens, not {vocab_size}: "
            "the Python stdlib sources are too small"
        )
    return tok


def _randn(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """float64: PyTorch draws float32 normals with SIMD code chosen by the CPU (AVX2 and the
    portable path give other bits), float64 ones with the same scalar code everywhere."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """float32 weights under HF names; the scheme is in the module docstring."""
    d, q_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    std = {
        "q_proj": d**-0.5, "k_proj": d**-0.5, "v_proj": d**-0.5, "o_proj": q_dim**-0.5,
        "gate_proj": GATE_GAIN * d**-0.5, "up_proj": d**-0.5,
        "down_proj": cfg.intermediate_size**-0.5, "lm_head": d**-0.5,
    }
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(cfg).items():
        kind = name.split(".")[-2]
        if name == "model.embed_tokens.weight":
            z = _randn(name + ".scale", (shape[0],), 1.0, seed).tolist()
            # libm's exp and an exact sum: PyTorch's vectorised exp gave other last bits in 1 of
            # ~15 processes on a 2-core AVX-512 VM (unpinned), so the model file changed
            scale = [math.exp(EMBED_SCALE_SPREAD * v) for v in z]
            rms = math.sqrt(math.fsum(s * s for s in scale) / shape[0])
            w = (_randn(name, shape, d**-0.5, seed)
                 * torch.tensor(scale, dtype=torch.float64).unsqueeze(1) / rms)
        elif name == "model.norm.weight":
            w = LOGIT_SCALE * _randn(name, shape, 1.0, seed).sign()
        elif name.endswith(".bias"):
            w = torch.zeros(shape)
        elif kind.endswith("norm"):  # q_norm, k_norm, *_layernorm
            w = torch.ones(shape)
        else:
            w = _randn(name, shape, std[kind], seed)
        out[name] = w.float().contiguous()  # the float64 draws rounded once: the same bits on any CPU
    return out


def config_json(cfg: ModelConfig) -> dict:
    # what a Qwen3 checkpoint on the Hub carries; transformers 5 maps rope_theta/torch_dtype itself
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.num_layers,
        "model_type": "qwen3",
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.torch_dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": cfg.vocab_size,
    }


def tokenizer_config_json(cfg: ModelConfig) -> dict:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[IM_END],
        "errors": "replace",
        "model_max_length": cfg.max_position_embeddings,
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config_json() -> dict:
    return {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
            "pad_token_id": ENDOFTEXT}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def write_model_files(out: Path, cfg: ModelConfig, seed: int) -> None:
    dtype = getattr(torch, cfg.torch_dtype)
    weights = {k: v.to(dtype) for k, v in init_weights(cfg, seed).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    train_tokenizer(cfg.vocab_size).save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "config.json", config_json(cfg))
    _write_json(out / "tokenizer_config.json", tokenizer_config_json(cfg))
    _write_json(out / "generation_config.json", generation_config_json())
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def make_model(out_dir: str | Path, preset: str, seed: int = 0) -> Path:
    """Write preset `preset` to `out_dir` (created; must not hold other files) and return it."""
    cfg = get_preset(preset)
    out = Path(out_dir).absolute()
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ModelLoadError(f"{out}: already exists and holds other files; "
                             "choose a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_model_files(tmp, cfg, seed)
        try:
            os.rename(tmp, out)  # atomic; replaces an empty directory
            return out
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        # someone else made it first (deterministic output: identical), or out holds other files
        if out.is_dir() and _same_files(tmp, out):
            return out
        raise ModelLoadError(f"{out}: already exists and does not hold preset {preset!r} "
                             f"seed {seed}; choose a new or empty directory")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
