"""Synthetic model presets: Qwen3-architecture models made locally by `synth.make_model`.

`bench` is the benchmark model (40.5 M parameters, bf16 on disk); `tiny` keeps a test suite of many
generations fast (0.4 M parameters, fp32 on disk so engine-vs-transformers comparisons are exact).
"""

from __future__ import annotations

from duplexkv.model.config import ModelConfig, ModelLoadError

PRESETS: dict[str, ModelConfig] = {
    "bench": ModelConfig(
        architecture="qwen3",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        torch_dtype="bfloat16",
    ),
    "tiny": ModelConfig(
        architecture="qwen3",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        torch_dtype="float32",
    ),
}
DEFAULT_PRESET = "bench"


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
