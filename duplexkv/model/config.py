"""The architecture description the engine runs, parsed from an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


class ModelLoadError(ValueError):
    """A model directory cannot be used; the message names the file and the fix."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMS norm on q and k per head
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    torch_dtype: str = "bfloat16"  # as in config.json; the engine's --dtype decides what runs

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of kv heads"

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim
