"""Qwen3 / Llama / Qwen2 decoder in plain PyTorch, reading its KV from the paged pool.

`forward(input_ids, positions)` takes a step's tokens flattened; per-sequence attention metadata
comes from `duplexkv.layers.attention`'s context. Numerics follow HF transformers (RMSNorm in
float32, RoPE tables in float32) so float32 logits match it closely.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from duplexkv.layers import native
from duplexkv.layers.attention import get_context, paged_attention
from duplexkv.layers.decode_stack import DecodeStack
from duplexkv.layers.linear import Linear
from duplexkv.model.config import ModelConfig
from duplexkv.model.decode_stack_build import decode_stack_of

# on the packed bf16 kernel, SiLU x up in the gate/up product's epilogue;
# DUPLEXKV_FUSED_SILU=0: apart (A/B)
FUSED_SILU = os.environ.get("DUPLEXKV_FUSED_SILU", "1") != "0"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`, (RMSNorm(x + residual), x + residual) (the residual
        stream; a decode step's few float32 rows and bf16 rows of any count do both in one native
        call, in place)."""
        if native.rows_ok(x):
            out = native.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x
        # fused kernel; bit-identical to HF's formula in float32
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialisation: the weights always come from the
    checkpoint (`normal_` over a 32k vocabulary would be start-up time for nothing)."""

    def reset_parameters(self) -> None:
        pass


class Rotary(nn.Module):
    """RoPE's cos and sin per position, from tables of every position up to the highest one asked
    so far (grown by doubling). A step indexes them instead of computing cos/sin: torch's
    element-wise cos and sin can open an OpenMP region from 128 elements on (seen in a fresh
    process and at tiny's head dim with hidden 512, 8 sequences; not after the bench model's
    steps), and a region in a decode step wakes a thread that competes with the kernels' own pool
    (tests/test_parallel_regions.py). The tables hold the bits the same ops give per step: cos/sin
    of each product, float32, whatever the slice (checked for head dims 32-128 over 40k
    positions). Their size: head_dim x 4 bytes per position, at most max_position_embeddings
    positions unless a step asks for more (the bench model: 8 MiB)."""

    def __init__(self, head_dim: int, theta: float, max_pos: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", self.frequencies(head_dim, theta), persistent=False)
        self.max_pos = max_pos  # the tables' doubling stops here (positions past it still work)
        self.cos_table = self.sin_table = torch.empty(0, head_dim // 2)

    @staticmethod
    def frequencies(head_dim: int, theta: float) -> torch.Tensor:
        """float32 inverse frequencies, as HF computes them."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents)

    def tables(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [P, head_dim / 2] for positions 0 .. P - 1, P >= upto."""
        if upto > self.cos_table.shape[0]:
            size = max(upto, min(2 * self.cos_table.shape[0], self.max_pos), 1024)
            freqs = torch.arange(size).float()[:, None] * self.inv_freq[None, :]
            self.cos_table, self.sin_table = freqs.cos(), freqs.sin()
        return self.cos_table, self.sin_table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, 1, head_dim / 2]: HF's tables repeat these twice along the last axis."""
        cos, sin = self.tables(int(positions.max()) + 1)
        return (cos.index_select(0, positions).to(dtype)[:, None, :],
                sin.index_select(0, positions).to(dtype)[:, None, :])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, bit for bit (a + (-b) * s is a - b * s in IEEE
    arithmetic), on half-width tables and without materialising rotate_half: 3 passes over x
    instead of 5 (bench, 2k tokens: 2.5x faster)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, pool):
        qkv = self.qkv_proj(x)
        q, k = self._norm_rope(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv, self.head_dim)
        o = paged_attention(q, k, v, pool, self.layer, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))

    def _norm_rope(self, qkv, cos, sin):
        """q [T, H, D] and k [T, KVH, D] of qkv, each head normalised (qk_norm) and rotated."""
        if native.rows_ok(qkv):  # float32 decode rows, bf16 rows: both in one call
            return native.qk_norm_rope(qkv, self.qk_norm_weight if self.qk_norm else None, cos,
                                       sin, self.num_heads, self.num_kv, self.head_dim,
                                       self.q_norm.eps if self.qk_norm else 0.0)
        # q and k heads side by side: one norm and one RoPE for both
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv,
                                                       self.head_dim)
        if self.qk_norm:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps) * self.qk_norm_weight
        qk = apply_rope(qk, cos, sin)
        return qk.split([self.num_heads, self.num_kv], dim=1)

    def fuse_qk_norm(self) -> None:
        """Stack q_norm and k_norm weights per head (call after loading weights)."""
        if self.qk_norm:
            w = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                           self.k_norm.weight.expand(self.num_kv, -1)])
            self.register_buffer("qk_norm_weight", w.detach().clone(), persistent=False)


MLP_CHUNK_BYTES = 16 << 20  # float32 MLP: rows per piece so the gate/up product is this size


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if self.gate_up_proj.gate_up:  # packed bf16 kernel: SiLU fused into the product
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        rows = MLP_CHUNK_BYTES // (2 * self.inter * x.element_size())
        if x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 2 * rows:
            # a long prefill chunk in pieces: the [rows, 2 I] product stays below glibc's mmap
            # threshold (32 MiB) and comes from the heap again each time instead of being a
            # fresh mapping faulted in page by page (bench model, float32, 8k tokens: 1.2 GB of
            # page faults per prefill), and SiLU reads it from cache
            out = x.new_empty(x.shape[0], x.shape[1])
            for i in range(0, x.shape[0], rows):
                out[i : i + rows] = self._forward(x[i : i + rows])
            return out
        return self._forward(x)

    def _forward(self, x):
        gate_up = self.gate_up_proj(x)
        if native.rows_ok(gate_up):
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, pool):
        """x: the previous layer's output (the embeddings for the first), residual: the stream
        before it (None for the first) -> this layer's (output, residual), the adds fused into
        the norms."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, pool), residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_stack: DecodeStack | None = None  # `build_decode_stack`

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                pool: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        stack = self.decode_stack
        if stack is not None and stack.takes(input_ids, positions, ctx := get_context()):
            # what follows, in one native call (each position is its sequence's next)
            return stack(input_ids, self.rotary.tables, pool, ctx)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, pool)
        return self.norm(x, residual)[0]

    def build_decode_stack(self) -> bool:
        """Run decode steps through `DecodeStack` from now on, where it runs here (call after
        loading the weights and `pack_linears`; decode_stack_build.py). Returns whether it does."""
        self.decode_stack = decode_stack_of(self)
        return self.decode_stack is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, float_out=True)

    def pack_linears(self) -> int:
        """Pack every projection for the packed bf16 kernel where one runs (`Linear.pack`; call
        after loading the weights): each MLP's gate/up with SiLU x up fused in (`FUSED_SILU`). A
        tied LM head keeps the embedding's weight. Returns how many."""
        fused = sum(m.gate_up_proj.pack(gate_up=FUSED_SILU)
                    for m in self.modules() if isinstance(m, MLP))
        return fused + sum(m.pack(keep_weight=m.weight is self.embed_tokens.weight)
                           for m in self.modules() if isinstance(m, Linear))

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, merging q/k/v and gate/up into one matmul each. Drops the
        decode stack, which holds the old weights' addresses (`build_decode_stack` again)."""
        self.decode_stack = None
        def take(name: str) -> torch.Tensor:
            return weights[name]

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not self.cfg.tie_word_embeddings:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if self.cfg.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat(
                    [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if self.cfg.qk_norm:
                attn.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                attn.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
            layer.mlp.gate_up_proj.weight.copy_(torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            attn.fuse_qk_norm()
