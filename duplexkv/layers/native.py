"""The kernels of native_kernels.c, compiled for this machine on first use: float32 decode
kernels (native_f32_attn.h: attention), float32 prefill attention on AVX-512
(native_f32_prefill.h, bound in causal_kernel.py), bf16 element-wise kernels for any row count
(native_bf16.h), the AMX bf16 linear and attention (native_amx.h, native_amx_attn.h, bound in
amx.py) and the decode steps in one call (native_f32_decode.h, native_bf16_decode.h, bound in
decode_stack.py). The float32 kernels use vectors as wide as the CPU (16 floats with AVX-512, else 8).

Why our own: on the CPUs we run on, the BLAS in PyTorch's wheel packs the weight matrix before a
product even for the few rows of a decode step, and SDPA's flash kernel runs a decode query as
small GEMMs per key block; both stream memory at about half of what the machine gives (AMD EPYC
Zen 3, 2 threads, float32: 6-9 GB/s for 1-8 rows against 13-15 GB/s for a plain `sum`). Neither
NumPy's OpenBLAS, oneDNN's linear nor an inductor-compiled attention did better (measured the
same way). The kernels read each weight row and each cached K/V row once.

The source is compiled with the system's C compiler (`cc`, `-O3 -march=native`) into the cache
directory's kernels/ (`duplexkv.paths`), named by a digest of the sources, flags and CPU, so a
machine builds it once (~1 s) and another CPU never loads it. `-ffast-math` (vectorised `expf`,
reassociated sums) applies at compile time only: linking a shared object with it would set
flush-to-zero for the whole process. Without a compiler, or with `DUPLEXKV_NATIVE=0`, the engine
keeps its PyTorch paths (`available()` is False; the reason is logged once).

The kernels run on their own threads (native_pool.h), `torch.get_num_threads()` of them counting
the caller, not on torch's OpenMP team: workers run OpenMP with OMP_WAIT_POLICY=PASSIVE, whose
threads sleep after every parallel region, and a decode step's ~40 kernel calls each paid a
futex wake-up (an empty 2-thread region: 124 us here, against 9 us on the pool, whose helpers
spin 200 us after a job before they sleep). In-process A/B of the two builds (bench model,
float32, AMD EPYC VM, PASSIVE): a decode step 33.2 -> 28.5 ms at 8k context batch 1, 75.8 ->
65.5 ms at 4k batch 8.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from duplexkv.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
# what the build reads (the digest's): the .c file and the headers it includes
SOURCES = (SOURCE, *(SOURCE.with_name(h) for h in (
    "native_pool.h", "native_simd.h", "native_amx.h", "native_amx_attn.h", "native_vdp.h",
    "native_bf16_attn.h", "native_vdp_attn.h", "native_bf16.h", "native_f32_attn.h",
    "native_f32_attn_onepass.h", "native_f32_prefill.h", "native_causal.h", "native_f32_decode.h",
    "native_bf16_decode.h")))
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fPIC", "-std=gnu11",
                 "-pthread"]
LINK_FLAGS = ["-shared", "-pthread"]
ABI = 9  # dkv_abi() of the source this module binds
MAX_GROUP = 16  # native_kernels.c MAX_G
MAX_HEAD_DIM = 512  # native_kernels.c MAX_D
MAX_BF16_WIDTH = 32768  # native_bf16.h BF_MAX_N
ENABLED = os.environ.get("DUPLEXKV_NATIVE", "1") != "0"

_i64, _f32p, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_PACKED_LINEAR = [_f32p, _f32p, _f32p, _f32p, _i64, _i64, _i64, _int, _int]
_CAUSAL = [_f32p, _f32p, _i64, *[_f32p] * 9, _i64, _i64, _i64, _f32, _int]
_NORM = [_f32p, _f32p, _f32p, _f32p, _i64, _i64, _f32, _int]
_ROPE = [_f32p, _i64, _f32p, _f32p, _f32p, _f32p, _f32p, _i64, _i64, _i64, _i64, _f32, _int]
_SILU = [_f32p, _f32p, _i64, _i64, _int]
_SIGNATURES = {  # the kernels' C functions: (restype, argtypes)
    "dkv_linear": (None, [_f32p, _f32p, _f32p, _i64, _i64, _i64, _int]),
    "dkv_decode_attn": (_int, [*[_f32p] * 7, _i64, _i64, _i64, _i64, _f32, _int]),
    "dkv_add_rmsnorm": (None, _NORM), "dkv_bf16_add_rmsnorm": (None, _NORM),
    "dkv_qk_norm_rope": (None, _ROPE), "dkv_bf16_qk_norm_rope": (None, _ROPE),
    "dkv_silu_mul": (None, _SILU), "dkv_bf16_silu_mul": (None, _SILU),
    "dkv_amx_init": (_int, []), "dkv_amx_pack": (None, [_f32p, _f32p, _i64, _i64]),
    "dkv_amx_linear": (_int, _PACKED_LINEAR), "dkv_vdp_linear": (_int, _PACKED_LINEAR),
    "dkv_vdp_available": (_int, []),
    "dkv_kv_append": (None, [_f32p, _i64, _i64, _f32p, _i64, _i64, _i64, *[_f32p] * 7, _i64,
                             _i64, _i64]),
    "dkv_amx_attention": (_int, _CAUSAL), "dkv_vdp_attention": (_int, _CAUSAL),
    "dkv_f32_attention": (_int, _CAUSAL),
    "dkv_f32_attention_ok": (_int, []),
    "dkv_f32_decode_step": (_int, [_f32p] * 4 + [_int]),
    "dkv_bf16_decode_step": (_int, [_f32p] * 4 + [_int, _int]),
    "dkv_decode_profile": (_int, [_int, _f32p]),
}
_lib: ctypes.CDLL | None = None
_tried = False


def cpu_digest() -> str:  # what -march=native builds for: the architecture and every CPU flag
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def compiler() -> str | None:  # the kernels' C compiler: $CC, else cc or gcc on PATH
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(target: Path, source: Path, compile_flags: list[str],
                  link_flags: list[str]) -> None:
    """`source` compiled and linked into the shared library `target` (also `bench read_limits`'
    probe). OSError when there is no compiler or the build fails."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in ([cc, *compile_flags, "-c", str(source), "-o", str(obj)],
                    [cc, *link_flags, str(obj), "-o", str(lib), "-lm"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise OSError(f"{' '.join(cmd)} failed: {r.stderr.strip()[:500]}")
        os.replace(lib, target)  # atomic: workers building at once each get a whole file


def _build(target: Path) -> None:
    build_library(target, SOURCE, COMPILE_FLAGS, LINK_FLAGS)


def _load() -> ctypes.CDLL | None:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(
        COMPILE_FLAGS + LINK_FLAGS).encode() + cpu_digest().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"duplexkv-kernels-{key}.so"
    if not target.exists():
        _build(target)
    lib = ctypes.CDLL(str(target))
    if lib.dkv_abi() != ABI:
        raise OSError(f"{target}: ABI {lib.dkv_abi()}, expected {ABI}")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, no compiler, build failed: logged once)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if ENABLED:
            try:
                _lib = _load()
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("native decode kernels unavailable, using PyTorch's: %s", e)
        else:
            log.info("native decode kernels off (DUPLEXKV_NATIVE=0)")
    return _lib


def available() -> bool:
    return library() is not None


def _fits_as(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def _fits(t: torch.Tensor) -> bool:
    return _fits_as(t, torch.float32)


def linear_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` below takes x [M, K] . weight[N, K]^T."""
    return (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.shape[1] % 16 == 0 and _fits(x) and _fits(weight) and available())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T -> [M, N] (check `linear_ok` first)."""
    m, k = x.shape
    y = torch.empty(m, weight.shape[0], dtype=torch.float32)
    _lib.dkv_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, weight.shape[0], k,
                    torch.get_num_threads())
    return y


def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """q [B, KVH * G, D] float32 (one query token per sequence); keys[b] / values[b] [KVH, L_b,
    D] views whose last axis is contiguous -> attention output [B, KVH * G, D]."""
    b, h, d = q.shape
    num_kv = keys[0].shape[0]
    q = q.contiguous()
    out = torch.empty_like(q)
    if (q.dtype != torch.float32 or len(keys) != b or len(values) != b or d % 16
            or d > MAX_HEAD_DIM or h // max(num_kv, 1) > MAX_GROUP):
        raise ValueError(f"native decode attention: q {q.dtype} {(b, h, d)} with {len(keys)} "
                         f"key and {len(values)} value tensors")
    for k, v in zip(keys, values):  # the kernel reads both through k's shape and strides
        if (k.dtype != torch.float32 or v.dtype != torch.float32 or k.shape != v.shape
                or k.stride() != v.stride() or k.shape[0] != num_kv or k.shape[2] != d
                or k.stride(2) != 1 or k.shape[1] < 1 or h % num_kv):
            raise ValueError(f"native decode attention: K/V {tuple(k.shape)}/{tuple(v.shape)} "
                             f"(strides {k.stride()}/{v.stride()}) do not fit q {(b, h, d)}")
    arr = _i64 * b
    kb = arr(*(k.data_ptr() for k in keys))
    vb = arr(*(v.data_ptr() for v in values))
    hs = arr(*(k.stride(0) for k in keys))
    rs = arr(*(k.stride(1) for k in keys))
    lens = arr(*(k.shape[1] for k in keys))
    rc = _lib.dkv_decode_attn(q.data_ptr(), out.data_ptr(), ctypes.addressof(kb),
                              ctypes.addressof(vb), ctypes.addressof(hs), ctypes.addressof(rs),
                              ctypes.addressof(lens), b, num_kv, h // num_kv, d, scale,
                              torch.get_num_threads())
    if rc != 0:
        raise MemoryError("native decode attention: out of memory or unsupported shape")
    return out


def attention_ok(q: torch.Tensor, num_kv: int) -> bool:
    """Whether `decode_attention` takes queries like q [T, H, D] over num_kv KV heads."""
    return (q.dtype == torch.float32 and q.shape[-1] % 16 == 0 and q.shape[-1] <= MAX_HEAD_DIM
            and q.shape[1] // num_kv <= MAX_GROUP and available())


def rows_ok(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels below take x [M, N]: float32 or bf16 (native_bf16.h; N <=
    MAX_BF16_WIDTH), contiguous, N % 16 == 0, any number of rows (a decode step's on the calling
    thread, a prefill chunk's on the pool)."""
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] % 16 or x.device.type != "cpu" \
            or not x.is_contiguous():
        return False
    if x.dtype == torch.bfloat16:
        return x.shape[1] <= MAX_BF16_WIDTH and available()
    return x.dtype == torch.float32 and available()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """RMSNorm of x [M, N] with `weight` [N]; with `residual` (same shape), x + residual is
    normalised and also left in `residual` (in place: the residual stream). float32 or bf16, all
    of the same dtype. `rows_ok(x)` first."""
    dt = x.dtype
    if dt not in (torch.float32, torch.bfloat16) or not _fits_as(x, dt) or x.dim() != 2 \
            or (residual is not None and (residual.shape != x.shape
                                          or not _fits_as(residual, dt))) \
            or weight.shape != (x.shape[1],) or not _fits_as(weight, dt):
        raise ValueError(f"native rmsnorm: x {dt} {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, weight "
                         f"{weight.dtype} {tuple(weight.shape)}")
    out = torch.empty_like(x)
    src, add = (x, None) if residual is None else (residual, x)
    args = (src.data_ptr(), None if add is None else add.data_ptr(), weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], eps)
    fn = _lib.dkv_bf16_add_rmsnorm if dt == torch.bfloat16 else _lib.dkv_add_rmsnorm
    fn(*args, torch.get_num_threads())
    return out


def qk_norm_rope(qkv: torch.Tensor, norm_weight: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [M, (heads + 2 kv_heads) * head_dim] -> q [M, heads, D], k [M, kv_heads, D]: each
    query and key head RMS-normalised (per-head weights [heads + kv_heads, D], or None for
    none), then rotated by RoPE with half-width tables cos/sin [M, D / 2]. float32 or bf16, all
    of the same dtype. `rows_ok(qkv)` first."""
    m, d, half, dt = qkv.shape[0], head_dim, head_dim // 2, qkv.dtype
    cos, sin = cos.reshape(m, -1), sin.reshape(m, -1)
    if (dt not in (torch.float32, torch.bfloat16) or not _fits_as(qkv, dt)
            or qkv.shape[1] != (heads + 2 * kv_heads) * d or d % 16 or d > MAX_HEAD_DIM
            or cos.shape != (m, half) or sin.shape != (m, half) or not _fits_as(cos, dt)
            or not _fits_as(sin, dt) or (norm_weight is not None and (
                norm_weight.shape != (heads + kv_heads, d) or not _fits_as(norm_weight, dt)))):
        raise ValueError(f"native qk norm/rope: qkv {dt} {tuple(qkv.shape)}, heads {heads}/"
                         f"{kv_heads} x {d}, cos {cos.dtype} {tuple(cos.shape)}")
    q = torch.empty(m, heads, d, dtype=dt)
    k = torch.empty(m, kv_heads, d, dtype=dt)
    args = (qkv.data_ptr(), qkv.shape[1], None if norm_weight is None else norm_weight.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), m, heads, kv_heads, d, eps)
    fn = _lib.dkv_bf16_qk_norm_rope if dt == torch.bfloat16 else _lib.dkv_qk_norm_rope
    fn(*args, torch.get_num_threads())
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2 I] (gate | up) -> silu(gate) * up [M, I], float32 or bf16. `rows_ok(gate_up)`
    first."""
    dt = gate_up.dtype
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or dt not in (torch.float32, torch.bfloat16) \
            or not _fits_as(gate_up, dt):
        raise ValueError(f"native silu_mul: gate_up {dt} {tuple(gate_up.shape)}")
    m, n = gate_up.shape
    out = torch.empty(m, n // 2, dtype=dt)
    fn = _lib.dkv_bf16_silu_mul if dt == torch.bfloat16 else _lib.dkv_silu_mul
    fn(gate_up.data_ptr(), out.data_ptr(), m, n // 2, torch.get_num_threads())
    return out
