"""A decode step from its token ids through every decoder layer and the final norm in one native
call: float32 on the float32 kernels (native_f32_decode.h), bf16 on the packed bf16 kernels, AMX
or AVX-512 BF16 (native_bf16_decode.h).

A decode step of a few sequences runs ~10 kernels per layer, each reached through Python: a
module call, shape checks, tensor views and allocations, a ctypes call. On the bench model
(float32, AMD EPYC Zen 4, 2 threads) that Python took ~2 ms of an 8.5 ms step at 4k context
x 1 sequence and ~2 ms of 25 ms at 4k x 8 (in-process), time in which memory stood still.
`DecodeStack` runs the same kernels in the same order on the same values from C, once per step,
with the embedding lookup, RoPE's cos/sin rows and the final norm before and after them (in Python
~0.15 ms of a 7 ms step at 4k x 1, AMD EPYC Zen 2): its hidden states equal the layer-by-layer
path's to the bit (tests/test_decode_stack.py), so it changes no token. In bf16 the step's bytes
are half float32's, so the same Python weighed twice as much: docs/engine.md has the A/B.

It takes a step when (`takes`): the model runs in float32 on the native kernels, or in bf16 with
every layer's product packed for the bf16 kernels and SiLU fused into gate/up (`Linear.pack`),
every sequence of the step decodes one token (no prefill chunk in the step) and has a mirror
(staging.py), and there are at most `linear.NATIVE_ROWS` of them. Any other step takes the
layer-by-layer path. `DUPLEXKV_DECODE_STACK=0` turns it off (A/B).

`profile(True)` has each step time its parts on the calling thread (bench decode_profile);
`profile(False)` turns that off again and returns what it measured.

The C side trusts the addresses it gets; `__call__` checks every shape, stride and bound first
(token ids against the embedding's rows, positions against the RoPE tables'). The weights'
addresses are taken once (`DecodeStack.__init__`): the model's parameters and packed weights are
made in place once and never replaced.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duplexkv.layers import amx, linear, native
from duplexkv.layers.attention import AttnContext, kernel_runs, rebuild_mirrors

ENABLED = os.environ.get("DUPLEXKV_DECODE_STACK", "1") != "0"

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class LayerWeights(ctypes.Structure):  # struct dkv_layer_weights / dkv_bf16_layer_weights
    _fields_ = [(name, _ptr) for name in ("in_norm", "post_norm", "qkv", "qkv_bias", "qk_norm",
                                          "o", "gate_up", "down")]


class StackDims(ctypes.Structure):  # struct dkv_stack_dims
    _fields_ = [*((name, _i64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                            "inter")),
                ("eps", _f32), ("qk_eps", _f32), ("scale", _f32)]


class DecodeRows(ctypes.Structure):  # struct dkv_decode_rows / dkv_bf16_decode_rows
    _fields_ = [("B", _i64), ("ids", _ptr), ("embed", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("norm", _ptr), ("mirror", _ptr), ("cap", _ptr), ("pos", _ptr), ("pool", _ptr),
                ("slot", _ptr), ("pool_layer", _i64), ("pool_kv", _i64)]


# a step's parts as native_f32_decode.h times them (enum DP_*, in order; then the whole call)
PARTS = ("norms", "qkv", "rope", "kv writes", "attention", "o", "gate_up", "silu", "down")


@dataclass(frozen=True, slots=True)
class StackProfile:
    """What the steps run while profiling was on took, per part and in all (ms a step)."""
    steps: int
    part_ms: dict[str, float]  # PARTS -> wall time a step on the calling thread
    call_ms: float  # the whole native call a step (the parts and the embedding, RoPE rows, etc.)


def profile(on: bool) -> StackProfile:
    """The steps' times since the last call (zero steps if profiling was off), then zeroed;
    profiling on from now if `on`. Only with the native kernels built (`runs_here`)."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("decode stack: the native kernels are not available")
    out = (_i64 * (len(PARTS) + 2))()
    parts = lib.dkv_decode_profile(int(on), ctypes.addressof(out))
    if parts != len(PARTS) + 1:
        raise RuntimeError(f"decode stack: the kernels time {parts} parts, expected "
                           f"{len(PARTS) + 1}")
    steps = out[len(PARTS) + 1]
    per = 1e-6 / steps if steps else 0.0
    return StackProfile(steps, {name: out[i] * per for i, name in enumerate(PARTS)},
                        out[len(PARTS)] * per)


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One decoder layer's weights, as the C side reads them: in float32 as they are; in bf16 the
    products packed (amx.py `pack`, gate/up by `pack_gate_up`: flat tensors) and the bias
    float32, as `Linear.pack` keeps them."""
    in_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) D]
    qk_norm: torch.Tensor | None  # [H + KVH, D]
    o: torch.Tensor  # [hidden, H D]
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor  # [hidden, I]


@dataclass(frozen=True, slots=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float  # the layers' RMSNorm
    qk_eps: float  # the per-head norm's (0 without one)
    scale: float  # attention's


DTYPES = (torch.float32, torch.bfloat16)


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str,
           dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() \
            or t.device.type != "cpu":
        raise ValueError(f"decode stack: {what} is {t.dtype} {tuple(t.shape)}, expected "
                         f"contiguous {dtype} {shape}")


def packed_shape(n: int, k: int) -> tuple[int]:
    """The flat shape `amx.pack` gives an [n, k] weight."""
    return ((n + 31) // 32 * 32 * k,)


class DecodeStack:
    def __init__(self, embed: torch.Tensor, layers: list[LayerTensors], norm: torch.Tensor,
                 dims: Dims) -> None:
        """embed: the embedding [vocab, hidden]; norm: the final norm's weight [hidden]. The
        embedding's dtype is the stack's (`DTYPES`); bf16 runs the first of `amx.kernels()`."""
        d, dt = dims, embed.dtype
        nqkv = (d.heads + 2 * d.kv_heads) * d.head_dim
        bf16 = dt == torch.bfloat16
        if dt not in DTYPES or not self.runs_here(dt) or (
                bf16 and not kernel_runs(dt, dims.head_dim)):
            raise ValueError(f"decode stack: no {dt} stack here (head dim {dims.head_dim})")
        if (d.kv_heads < 1 or d.heads % d.kv_heads or d.head_dim % 16
                or d.head_dim > native.MAX_HEAD_DIM or d.heads // d.kv_heads > native.MAX_GROUP
                or d.hidden % 16 or d.inter % 16 or not layers
                or (bf16 and (d.head_dim % 32 or d.head_dim > amx.MAX_HEAD_DIM
                              or d.hidden % amx.K_MULTIPLE or d.inter % amx.K_MULTIPLE
                              or d.hidden > native.MAX_BF16_WIDTH))):
            raise ValueError(f"decode stack: unsupported dimensions {d} in {dt}")
        products = ((nqkv, d.hidden, "qkv"), (d.hidden, d.heads * d.head_dim, "o"),
                    (2 * d.inter, d.hidden, "gate_up"), (d.hidden, d.inter, "down"))
        for i, w in enumerate(layers):
            _check(w.in_norm, (d.hidden,), f"layer {i} in_norm", dt)
            _check(w.post_norm, (d.hidden,), f"layer {i} post_norm", dt)
            for n, k, name in products:
                _check(getattr(w, name), packed_shape(n, k) if bf16 else (n, k),
                       f"layer {i} {name}", dt)
            if w.qkv_bias is not None:
                _check(w.qkv_bias, (nqkv,), f"layer {i} qkv_bias")  # float32 in both
            if w.qk_norm is not None:
                _check(w.qk_norm, (d.heads + d.kv_heads, d.head_dim), f"layer {i} qk_norm", dt)
        if embed.dim() != 2 or embed.shape[0] < 1:
            raise ValueError(f"decode stack: embedding {tuple(embed.shape)}")
        _check(embed, (embed.shape[0], d.hidden), "embedding", dt)
        _check(norm, (d.hidden,), "final norm", dt)
        self.dtype = dt
        # bf16: the packed kernel it runs ("amx" or "vdp", as `amx.linear` picks); None in float32
        self.kernel = amx.kernels()[0] if bf16 else None
        self._kernel = ("amx", "vdp").index(self.kernel) if bf16 else -1  # the C side's 0 / 1
        self.embed, self.norm = embed, norm
        self.layers, self.dims = layers, dims  # keeps the tensors alive
        self._weights = (LayerWeights * len(layers))(*(LayerWeights(
            w.in_norm.data_ptr(), w.post_norm.data_ptr(), w.qkv.data_ptr(),
            None if w.qkv_bias is None else w.qkv_bias.data_ptr(),
            None if w.qk_norm is None else w.qk_norm.data_ptr(), w.o.data_ptr(),
            w.gate_up.data_ptr(), w.down.data_ptr()) for w in layers))
        self._dims = StackDims(len(layers), d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter,
                               d.eps, d.qk_eps, d.scale)

    @staticmethod
    def runs_here(dtype: torch.dtype = torch.float32) -> bool:
        """Whether a model in `dtype` builds one here (kernels built, not turned off; bf16: a
        packed bf16 kernel runs here, `amx.kernels()`, and products are packed for it)."""
        if not ENABLED or not native.available():
            return False
        if dtype == torch.bfloat16:
            return linear.AMX_LINEAR and bool(amx.kernels())
        return dtype == torch.float32 and linear.ENABLED

    def takes(self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext) -> bool:
        """Whether this step (ids [B], its token ids at `positions`) runs here: see the module
        doc; each position must be its sequence's next (`start`), the one the stack uses."""
        seqs = ctx.seqs
        return (0 < len(seqs) == ids.shape[0] <= linear.NATIVE_ROWS
                and all(s.num_new == 1 and s.mirror is not None for s in seqs)
                and positions.tolist() == [s.start for s in seqs] and native.available())

    def __call__(self, ids: torch.Tensor, tables: Callable[[int], tuple[torch.Tensor, ...]],
                 pool: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The step of token ids [B] (`takes` first), each at its sequence's next position
        (`start`), with `tables(P)` RoPE's cos and sin [>= P, head_dim / 2] for positions 0 ..
        P - 1 (qwen3.py Rotary.tables) -> the final norm's output [B, hidden]: what the model's
        Python path returns, bit for bit."""
        d, L = self.dims, len(self.layers)
        if ids.dim() != 1 or ids.dtype != torch.long:
            raise ValueError(f"decode stack: token ids {ids.dtype} {tuple(ids.shape)}")
        b = ids.shape[0]
        half = d.head_dim // 2
        cos, sin = tables(max(s.start for s in ctx.seqs) + 1)
        rows = cos.shape[0]
        _check(cos, (rows, half), "cos")
        _check(sin, (rows, half), "sin")
        dt = self.dtype
        if pool.dtype != dt or pool.dim() != 6 or not pool.is_contiguous() \
                or pool.shape[1] != L or pool.shape[2] != 2 \
                or tuple(pool.shape[4:]) != (d.kv_heads, d.head_dim):
            raise ValueError(f"decode stack: pool {pool.dtype} {tuple(pool.shape)}")
        tokens = ids.tolist()
        blocks, offsets = ctx.blocks, ctx.offsets
        if len(blocks) != b or len(offsets) != b:
            raise ValueError(f"decode stack: {len(blocks)} slots for {b} rows")
        vocab = self.embed.shape[0]
        rebuild_mirrors(pool, ctx, L)
        mirrors, caps, pos, slots = [], [], [], []
        for i, s in enumerate(ctx.seqs):
            kv = s.mirror.kv
            if (kv.dtype != dt or kv.dim() != 5 or not kv.is_contiguous()
                    or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4])
                    != (L, 2, d.kv_heads, d.head_dim) or not 0 <= s.start < kv.shape[3]
                    or s.q_start != i or not 0 <= blocks[i] < pool.shape[0]
                    or not 0 <= offsets[i] < pool.shape[3]):
                raise ValueError(f"decode stack: sequence {i} at {s.start} (row {s.q_start}), "
                                 f"mirror {tuple(kv.shape)}, slot {blocks[i]}/{offsets[i]}")
            if not 0 <= tokens[i] < vocab or s.start >= rows:
                raise ValueError(f"decode stack: sequence {i}: token {tokens[i]} of {vocab}, "
                                 f"position {s.start} of {rows} in the RoPE tables")
            mirrors.append(kv.data_ptr())
            caps.append(kv.shape[3])
            pos.append(s.start)
            slots.append(blocks[i] * pool.stride(0) + offsets[i] * pool.stride(3))
        arr = _i64 * b
        cols = [arr(*c) for c in (tokens, mirrors, caps, pos, slots)]
        addr = [ctypes.addressof(c) for c in cols]
        step = DecodeRows(b, addr[0], self.embed.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          self.norm.data_ptr(), *addr[1:4], pool.data_ptr(), addr[4],
                          pool.stride(1), pool.stride(2))
        out = torch.empty(b, d.hidden, dtype=dt)
        args = (ctypes.addressof(self._weights), ctypes.addressof(self._dims),
                ctypes.addressof(step), out.data_ptr())
        lib = native.library()
        if dt == torch.bfloat16:
            rc = lib.dkv_bf16_decode_step(*args, self._kernel, torch.get_num_threads())
        else:
            rc = lib.dkv_f32_decode_step(*args, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native decode stack: out of memory or unsupported shape")
        return out
