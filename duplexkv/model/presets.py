"""Synthetic model presets: Qwen3-architecture models made locally by `synth.make_model`.

`bench` is the benchmark model (40.5 M parameters, bf16 on disk); `tiny` keeps a test suite of many
generations fast (0.4 M parameters, fp32 on disk so engine-vs-transformers comparisons are exact).
Both use head sizes vLLM's CPU attention supports (32, 64, 80, ...), so vLLM serves them too; tiny's
2 query heads share 1 KV head (GQA, as bench's 8 share 2).

A preset's cache directory is named by a digest of its config and SYNTH_VERSION (registry.py), so a
changed preset or generator never loads a model made by an older version: bump SYNTH_VERSION with
any change to what `synth.make_model` writes for the same config.
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
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
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
SYNTH_VERSION = 3  # of synth.py's output for a given config (tokenizer, weights, files)
# (3: the chat template renders tool calls and tool results as Qwen's; weights unchanged)


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
