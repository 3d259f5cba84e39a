"""The calling convention the native causal attention kernels share: bf16 on AMX
(native_amx_attn.h, `amx.attention`) and float32 prefill chunks on AVX-512
(native_f32_prefill.h, `f32_attention` here).

Every sequence of a step goes to one call: seqs[i] = (k, v, q_row, n_new, start), k/v
[KVH, >= start + n_new, D] views (any head and row strides, the last axis contiguous) holding
positions 0 .. start + n_new - 1; the sequence's n_new query rows from q_row of q [T, H, D] sit
at positions start ... The kernels read raw pointers, so every shape is checked here first.
"""

from __future__ import annotations

import ctypes

import torch

from duplexkv.layers import native

Seq = tuple[torch.Tensor, torch.Tensor, int, int, int]
F32_MAX_HEAD_DIM = 256  # native_f32_prefill.h FP_MAX_D (and head_dim % 16 == 0)


def run(kernel, name: str, q: torch.Tensor, seqs: list[Seq], scale: float,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernel` (a dkv_*_attention entry point) over q's rows of `seqs` into `out` (new if None;
    only those rows are written) -> out."""
    t, h, d = q.shape
    dtype = q.dtype
    if not q.is_contiguous() or not seqs or h % seqs[0][0].shape[0] or (out is not None and (
            out.shape != q.shape or out.dtype != dtype or not out.is_contiguous())):
        raise ValueError(f"{name}: q {dtype} {tuple(q.shape)}, {len(seqs)} sequences")
    num_kv = seqs[0][0].shape[0]
    for k, v, q_row, n_new, start in seqs:
        if (k.dtype != dtype or v.dtype != dtype or k.dim() != 3 or v.dim() != 3
                or k.shape[0] != num_kv or k.shape[2] != d or v.shape[0] != num_kv
                or v.shape[2] != d or k.stride(2) != 1 or v.stride(2) != 1
                or k.shape[1] < start + n_new or v.shape[1] < start + n_new or n_new < 1
                or start < 0 or q_row < 0 or q_row + n_new > t):
            raise ValueError(f"{name}: K/V {tuple(k.shape)}/{tuple(v.shape)} (strides "
                             f"{k.stride()}/{v.stride()}) for rows {q_row}+{n_new} at {start}")
    n = len(seqs)
    arr = ctypes.c_int64 * n
    cols = [arr(*vals) for vals in zip(*((k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                          v.stride(0), v.stride(1), q_row, n_new, start)
                                         for k, v, q_row, n_new, start in seqs))]
    if out is None:
        out = torch.empty_like(q)
    rc = kernel(q.data_ptr(), out.data_ptr(), n, *(ctypes.addressof(c) for c in cols), h, num_kv,
                d, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"{name}: unsupported shape or no memory for a thread's scratch")
    return out


_f32_built: bool | None = None  # whether this CPU's build has the float32 kernel (asked once)


def f32_ok(q: torch.Tensor, num_kv: int) -> bool:
    """Whether `f32_attention` takes float32 queries like q [T, H, D] over num_kv KV heads: the
    kernels are built with AVX-512 or AVX2 (16- or 8-float vectors), D % 16 == 0 up to
    F32_MAX_HEAD_DIM."""
    global _f32_built
    d = q.shape[-1]
    if q.dtype != torch.float32 or d % 16 or not 0 < d <= F32_MAX_HEAD_DIM or q.shape[1] % num_kv:
        return False
    if not native.available():  # (tests switch the kernels off in-process)
        return False
    if _f32_built is None:
        _f32_built = native.library().dkv_f32_attention_ok() == 1
    return _f32_built


def f32_attention(q: torch.Tensor, seqs: list[Seq], scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the float32 rows of `seqs` (prefill chunks: any n_new, any cached
    start) into `out` (native_f32_prefill.h); `f32_ok` first."""
    if q.dtype != torch.float32:
        raise ValueError(f"float32 attention: q {q.dtype} {tuple(q.shape)}")
    return run(native.library().dkv_f32_attention, "float32 attention", q, seqs, scale, out)
