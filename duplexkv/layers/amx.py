"""Python side of native_amx.h and native_vdp.h: the bf16 linear over a weight packed once (one
kernel for every row count), on AMX tiles or, where there is no AMX, by AVX-512 BF16 dot products;
and the AMX attention.

Built with the other native kernels (native.py); `available()` says whether this CPU has AMX and
Linux lent the process its tile state, `vdp_available()` whether the AVX-512 BF16 kernel was built
(the CPU has avx512_bf16). Weights are packed once (`pack`, one layout for both), then every
product of any number of rows runs `linear` on the kernels' own threads, on the AMX kernel where
it runs, else the AVX-512 BF16 one: a CPU runs one of the two for every product, so a row rounds
the same in a prefill chunk and in a decode step. `DUPLEXKV_AMX=0` leaves AMX alone, as on a CPU
without it: bf16 then runs the AVX-512 BF16 kernels where the CPU has `avx512_bf16` (A/B
measurements of a no-AMX CPU's path on an AMX one).
"""

from __future__ import annotations

import os

import torch

from duplexkv.layers import causal_kernel, native

K_MULTIPLE = 32  # native_amx.h: K a multiple of this
AMX = os.environ.get("DUPLEXKV_AMX", "1") != "0"
_amx: bool | None = None
_kernels: tuple[str, ...] | None = None


def available() -> bool:
    """Whether the AMX bf16 linear runs here: built with AMX (the CPU has amx_tile, amx_bf16 and
    avx512_bf16), not left alone (`DUPLEXKV_AMX=0`), and Linux lent this process the tile
    state."""
    global _amx
    if _amx is None:
        _amx = AMX and native.available() and native.library().dkv_amx_init() == 1
    return _amx


def vdp_available() -> bool:
    """Whether the AVX-512 BF16 linear (native_vdp.h) was built here (the CPU has avx512_bf16)."""
    return native.available() and native.library().dkv_vdp_available() == 1


def kernels() -> tuple[str, ...]:
    """The bf16 kernels (linear and attention) that run here: "amx", "vdp" (AVX-512 BF16), the
    one `linear` and `attention` pick first."""
    global _kernels
    if _kernels is None:
        _kernels = tuple(name for name, runs in (("amx", available), ("vdp", vdp_available))
                         if runs())
    return _kernels


def _pick(kernel: str | None, what: str) -> str:
    runs = kernels()
    kernel = kernel or (runs[0] if runs else None)
    if kernel not in runs:
        raise ValueError(f"bf16 {what}: kernel {kernel!r} does not run here (runs: {runs})")
    return kernel


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> the AMX tiles' layout (native_amx.h; native_vdp.h reads it too), N
    padded to 32."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or k % K_MULTIPLE:
        raise ValueError(f"bf16 pack: weight {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.bfloat16)
    native.library().dkv_amx_pack(weight.data_ptr(), out.data_ptr(), n, k)
    return out


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2 I, K] (gate rows, then up rows) -> the layout of `pack` with
    gate and up rows interleaved by 16, for `linear(..., silu=True)`. I % 16 == 0."""
    n, k = weight.shape
    if n % 32:
        raise ValueError(f"bf16 pack_gate_up: weight {tuple(weight.shape)}, 2 I not a multiple "
                         "of 32")
    gate, up = weight.view(2, n // 32, 16, k).unbind(0)
    return pack(torch.stack([gate, up], dim=1).reshape(n, k))


BF_OUT = {"bf16": 0, "silu": 1, "float32": 2}  # native_simd.h BF_OUT_*


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           silu: bool = False, kernel: str | None = None, float_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16 . W^T (+ bias) -> [M, n] bf16, W packed by `pack`; the same bits for a
    row whatever M (native_amx.h, native_vdp.h). With `silu` (W packed by `pack_gate_up`, n = 2 I,
    no bias): bf16(bf16(silu(gate)) * up) [M, I], the bits of the bf16 SiLU kernel on the plain
    product. With `float_out`: [M, n] float32, each value the bf16 result widened (the bits of
    `.float()` on the bf16 output, written by the kernel itself). `kernel`: "amx" or "vdp"
    (tests), else the first of `kernels()`."""
    m, k = x.shape
    kernel = _pick(kernel, "linear")
    if (x.dtype != torch.bfloat16 or not x.is_contiguous() or k % K_MULTIPLE
            or packed.numel() != (n + 31) // 32 * 32 * k
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)))
            or (silu and (n % 32 or bias is not None or float_out))):
        raise ValueError(f"bf16 linear: x {x.dtype} {tuple(x.shape)} for {n} columns")
    out = "silu" if silu else "float32" if float_out else "bf16"
    y = torch.empty(m, n // 2 if silu else n,
                    dtype=torch.float32 if float_out else torch.bfloat16)
    bias_ptr = None if bias is None else bias.data_ptr()
    lib = native.library()
    run = lib.dkv_amx_linear if kernel == "amx" else lib.dkv_vdp_linear
    if m and run(x.data_ptr(), packed.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, BF_OUT[out],
                 torch.get_num_threads()) != 0:
        raise RuntimeError(f"bf16 linear: the {kernel} kernel refused x {tuple(x.shape)} for {n} "
                           "columns")
    return y


MAX_HEAD_DIM = 256  # native_bf16_attn.h AT_MAX_D (and head_dim % 32 == 0)


def attention(q: torch.Tensor, seqs: list[causal_kernel.Seq], scale: float,
              kernel: str | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] bf16 (the step's tokens) -> [T, H, D] bf16, every
    sequence in one call (native_amx_attn.h on AMX, native_vdp_attn.h by AVX-512 BF16 dot
    products; seqs as causal_kernel.py describes them). A row's bits depend on its own query,
    keys and values only, whatever the split of its keys into steps or the other rows of the
    call. `kernel`: as `linear`'s."""
    if q.dtype != torch.bfloat16:
        raise ValueError(f"bf16 attention: q {q.dtype} {tuple(q.shape)}, {len(seqs)} sequences")
    lib = native.library()
    run = lib.dkv_amx_attention if _pick(kernel, "attention") == "amx" else lib.dkv_vdp_attention
    return causal_kernel.run(run, "bf16 attention", q, seqs, scale)
