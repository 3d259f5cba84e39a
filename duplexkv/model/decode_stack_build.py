"""The decode stack of a loaded model (layers/decode_stack.py): the tensors each layer's kernels
read, taken from the model's modules, where the stack computes exactly what the layer loop would.

float32: the weights as they are. bf16: the packed copies `Linear.pack` made (the loop's products
run on them) and the qkv bias in float32 as `Linear.pack` keeps it; only when every layer's
product is packed, SiLU is fused into gate/up (`FUSED_SILU`) and attention runs our bf16 kernel
for this head size (`kernel_runs`): otherwise the loop would call other kernels than the stack's,
and the two paths would round differently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from duplexkv.layers.attention import kernel_runs
from duplexkv.layers.decode_stack import DecodeStack, Dims, LayerTensors
from duplexkv.layers.linear import Linear

if TYPE_CHECKING:
    from duplexkv.model.qwen3 import CausalLM


def decode_stack_of(model: CausalLM) -> DecodeStack | None:
    """The model's decode stack, or None where none runs here (call after loading the weights
    and `pack_linears`)."""
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or not DecodeStack.runs_here(dtype):
        return None
    bf16 = dtype == torch.bfloat16
    if bf16 and not (kernel_runs(dtype, model.cfg.head_dim)
                     and all(m.packed is not None for layer in model.layers
                             for m in layer.modules() if isinstance(m, Linear))
                     and all(layer.mlp.gate_up_proj.gate_up for layer in model.layers)):
        return None
    first = model.layers[0]
    if model.norm.eps != first.input_layernorm.eps:
        return None  # the stack's norms share one eps

    def product(lin: Linear) -> torch.Tensor:  # the packed copy in bf16, as the loop's
        return (lin.packed if bf16 else lin.weight).detach()

    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        bias = attn.qkv_proj.bias32 if bf16 else attn.qkv_proj.bias
        layers.append(LayerTensors(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            product(attn.qkv_proj), None if bias is None else bias.detach(),
            attn.qk_norm_weight if attn.qk_norm else None, product(attn.o_proj),
            product(mlp.gate_up_proj), product(mlp.down_proj)))
    # eps and scale as the layer loop's modules hold them, so both paths use the same values
    attn = first.self_attn
    dims = Dims(model.cfg.hidden_size, attn.num_heads, attn.num_kv, attn.head_dim,
                first.mlp.inter, first.input_layernorm.eps,
                attn.q_norm.eps if attn.qk_norm else 0.0, attn.scale)
    return DecodeStack(model.embed_tokens.weight.detach(), layers, model.norm.weight.detach(),
                       dims)
