"""Read an HF-format model directory: `config.json` -> ModelConfig, safetensors -> named tensors.

Weights keep HF parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...). Every failure
is a ModelLoadError that names the file and what was expected.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from duplexkv.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# buffers some checkpoints carry that are recomputed, never loaded
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs[0]!r}; supported: {supported}"
            )
        return SUPPORTED_ARCHITECTURES[archs[0]]
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise ModelLoadError(
        f"{path}: no supported 'architectures' entry (model_type={model_type!r}); "
        f"supported: {supported}"
    )


def _rope_theta(raw: dict[str, Any], path: Path) -> float:
    # transformers 4: top-level rope_theta + rope_scaling; transformers 5: rope_parameters
    theta = raw.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ModelLoadError(f"{path}: '{key}' must be an object or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise ModelLoadError(
                f"{path}: {key} type {kind!r} is not supported; only plain RoPE "
                "(rope_type 'default' or no rope_scaling) is"
            )
        theta = rope.get("rope_theta", theta)
    return float(10000.0 if theta is None else theta)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / CONFIG_FILE
    raw = read_json(path)
    arch = _architecture(raw, path)

    def need(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{path}: '{key}' must be a positive integer, got {value!r}")
        return value

    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu is)")
    if raw.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: use_sliding_window=true is not supported")
    bias = raw.get("attention_bias", False)
    if arch != "qwen2" and bias:
        # Llama/Qwen3 put that bias on o_proj too, which the engine does not implement
        raise ModelLoadError(f"{path}: attention_bias=true is supported only for Qwen2")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
            f"({kv_heads})"
        )
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(raw, path),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        torch_dtype=dtype,
    )


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        shapes |= {
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def num_parameters(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in expected_weight_shapes(cfg).values())


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one file, or the shards of an index)."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = {name: root / str(shard) for name, shard in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index} not found")
        return files
    single = root / WEIGHTS_FILE
    if not single.is_file():
        hint = " (only safetensors is supported)" if any(root.glob("*.bin")) else ""
        raise ModelLoadError(f"{single}: file not found, and no {INDEX_FILE} either{hint}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_weights(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    expected = expected_weight_shapes(cfg)
    files = weight_files(model_dir)
    where = f"{Path(model_dir)} ({', '.join(sorted({p.name for p in files.values()}))})"
    names = {
        n for n in files if not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    }
    missing, unexpected = sorted(expected.keys() - names), sorted(names - expected.keys())
    if missing:
        raise ModelLoadError(
            f"{where}: {len(missing)} tensor(s) missing for {cfg.architecture}, e.g. {missing[:3]}"
        )
    if unexpected:
        raise ModelLoadError(
            f"{where}: {len(unexpected)} unexpected tensor(s) for {cfg.architecture}, "
            f"e.g. {unexpected[:3]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in group:
                if name not in present:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} listed in {INDEX_FILE} not found"
                    )
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has shape {shape}, expected {expected[name]} "
                        f"from {CONFIG_FILE}"
                    )
                out[name] = f.get_tensor(name).to(dtype)
    return out
