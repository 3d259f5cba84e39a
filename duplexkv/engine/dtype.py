"""`--dtype`: which floating-point type the weights, activations and KV pool use.

`auto` (the default) picks bfloat16 where it is faster than float32 on the CPU, and float32
elsewhere. Measured, per kind of CPU:
- AMX (`amx_bf16`, Sapphire Rapids and later): bfloat16. Intel Xeon, 2 cores: a 2048^3 torch
  matmul ran 444 GFLOP/s in bfloat16 vs 231 in float32; bench preset, 2k-token prefill: 0.82-2.65 s
  in bfloat16 vs 4.5-5.8 s in float32 (four interleaved runs, loaded machine); on a quiet machine
  (`bench vs_vllm`, docs/results/vs-vllm.md) 0.33 vs 0.58 s. bf16 decode has its own AMX kernels
  there (docs/engine.md: a 4k-context, batch-1 step 9.15 -> 4.39 ms, faster than float32's ~9 ms).
- AMD with `avx512_bf16` (Zen 4 and later), no AMX: bfloat16. Since session 51 bf16 runs the
  engine's own AVX-512 BF16 kernels there (native_vdp.h: every product; native_vdp_attn.h:
  attention, invariant as on AMX), and a VDPBF16PS does two bf16 products per lane where an FMA
  does one float32 product: AMD EPYC Zen 4, 2 cores (`OMP_WAIT_POLICY=PASSIVE duplexkv bench
  engine_ab --old . --new . --dtype float32 bfloat16 --reps 3 --cases prefill:2048 prefill:8192
  decode:4096x1 decode:4096x8 decode:8192x1 decode:8192x8`, best / median bf16 over float32):
  prefill 2k 0.53 / 0.54, 8k 0.56 / 0.56; decode step 4k x 1 1.01 / 0.73, 4k x 8 0.90 / 0.75,
  8k x 1 0.71 / 0.69, 8k x 8 0.70 / 0.70.
- Intel with `avx512_bf16` but no AMX (Cooper Lake, or a VM hiding AMX): float32, for prefill:
  - Intel Xeon with avx512_bf16 and avx512_fp16, no AMX, 2 cores (issue 31's table), before the
    AVX-512 BF16 kernels: a 2048^3 torch matmul ran 90 GFLOP/s in bfloat16 vs 195 in float32; the
    engine's bfloat16 was 1.15x (2k prefill) to 1.9x (decode) slower than its float32.
  - With them, on an Intel Xeon with AMX left alone (`DUPLEXKV_AMX=0`: the kernels a CPU of this
    kind runs, on the same cores; session 59, 2 cores, `OMP_WAIT_POLICY=PASSIVE duplexkv bench
    engine_ab --old . --new . --dtype float32 bfloat16 --reps 3`, best bf16 / float32): prefill
    2k 1.51x, 8k 1.58x slower (a VDPBF16PS does as many multiply-adds a cycle as two float32 FMAs
    on these cores, unlike on Zen 4), decode steps 0.45x (4k and 8k x 1) and 0.69x (x 8) as long
    (half the bytes). A TTFT 1.5x longer outweighs the faster steps, so float32 stays; not
    measured on a CPU that lacks AMX itself.
  (On AMD EPYC Zen 4, before those kernels, the engine's bfloat16 ran PyTorch's ops: 0.73x float32
  at a 2k prefill, 1.00x at 8k, 1.59-1.64x slower per decode step; the matmul alone 405-420
  GFLOP/s in bfloat16 vs 165-182 in float32.)
- No native bfloat16 (AVX2, Ice Lake): float32. Every bfloat16 matmul is converted in software,
  ~3x slower (Ice Lake, 2k prefill: 2.29 s in bfloat16 vs 0.81 s in float32).
- Arm with the `bf16` feature (BFMMLA, Graviton 3): bfloat16 (not measured here).
An explicit `--dtype bfloat16` is honoured anywhere. The choice is a pure function of the CPU's
feature flags and vendor (`resolve_dtype`; the vendor as a pseudo-flag, `vendor:AuthenticAMD`), so
it is tested for every kind of CPU on any machine; `read_cpu_flags` reads them from /proc/cpuinfo
(or $DUPLEXKV_CPUINFO, a file in the same format, to try another CPU's flags), falling back to
PyTorch's own CPU probes where that file does not exist (no vendor there: AMD then gets float32).
A listed `amx_bf16` is not enough: Linux lends a process AMX's tile state only when it asks
(`arch_prctl(ARCH_REQ_XCOMP_PERM)`, what the kernels ask before using it) and refuses when a
thread's signal stack is too small for the larger signal frame, or a policy forbids it. Where it
refuses, this CPU computes bf16 as one without AMX would, so `read_cpu_flags` drops the AMX flags
and adds the pseudo-flag `amx:refused` (and `auto` picks float32 on Intel, as for Cooper Lake).

vLLM's names are accepted: `half` = float16, `float` = float32. vLLM's `auto` follows the
checkpoint's `torch_dtype`; ours follows the CPU, since on a CPU that is what decides the speed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
ALIASES = {"half": "float16", "float": "float32"}
DTYPE_CHOICES = DTYPES + tuple(ALIASES)
CPUINFO_ENV = "DUPLEXKV_CPUINFO"
# the flags that prove native bfloat16 arithmetic, strongest first (x86 AMX, x86 AVX-512, Arm)
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# those whose bfloat16 is faster than float32 (the module's docstring: measured), for `auto`
FAST_BF16_FLAGS = ("amx_bf16", "bf16")
AMD = "vendor:AuthenticAMD"  # parse_cpu_flags's pseudo-flag for the vendor_id line
NATIVE_FP16_FLAGS = frozenset(("amx_fp16", "avx512_fp16", "fphp"))
AMX_FLAGS = frozenset(("amx_bf16", "amx_tile", "amx_int8", "amx_fp16", "amx_complex"))
AMX_REFUSED = "amx:refused"  # read_cpu_flags's pseudo-flag: AMX listed, its tile state refused
AMX_REFUSED_WHY = ("the CPU lists amx_bf16 but Linux refused this process AMX's tile state "
                   "(ARCH_REQ_XCOMP_PERM: a thread's signal stack too small, or a policy)")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # bfloat16 | float16 | float32
    reason: str  # one line, for the log and the benchmarks' headers


def canonical(name: str) -> str:
    """A --dtype value (vLLM's aliases included) -> one of DTYPES; ValueError naming the choices."""
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return name


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in /proc/cpuinfo text (x86 `flags`, Arm `Features`), and the x86
    vendor as `vendor:<vendor_id>`."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
        elif sep and key.strip() == "vendor_id" and value.strip():
            flags.add("vendor:" + value.strip())
    return frozenset(flags)


def native_bf16_flag(flags: frozenset[str]) -> str | None:
    """The flag that shows native bfloat16 arithmetic, or None."""
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def resolve_dtype(requested: str, flags: frozenset[str] | None) -> DtypeChoice:
    """The dtype to run for `requested` on a CPU with `flags` (None: flags unknown)."""
    requested = canonical(requested)
    if requested != "auto":
        reason = f"--dtype {requested} as requested"
        if flags is not None and requested == "bfloat16" and not native_bf16_flag(flags):
            reason += "; no native bfloat16 on this CPU: emulated, ~3x slower than float32"
        elif flags is not None and requested == "bfloat16" and AMX_REFUSED in flags:
            reason += f"; {AMX_REFUSED_WHY}: the AVX-512 BF16 kernels run instead"
        if flags is not None and requested == "float16" and not NATIVE_FP16_FLAGS & flags:
            reason += "; no native float16 on this CPU: emulated, slower than float32"
        return DtypeChoice(requested, reason)
    if flags is None:
        return DtypeChoice("float32", "auto: the CPU's flags are unknown, so float32 (safe and "
                                      "fast everywhere)")
    fast = next((f for f in FAST_BF16_FLAGS if f in flags), None)
    if fast is not None:
        return DtypeChoice("bfloat16", f"auto: the CPU computes bfloat16 natively ({fast}), "
                                       "faster than float32")
    if "avx512_bf16" in flags and AMD in flags:
        return DtypeChoice("bfloat16", "auto: AMD with avx512_bf16 (Zen 4 or later): the "
                                       "engine's AVX-512 BF16 kernels measured faster than "
                                       "float32 (prefill ~1.8x, decode 1.0-1.4x)")
    if native_bf16_flag(flags) is not None and AMX_REFUSED in flags:
        return DtypeChoice("float32", f"auto: {AMX_REFUSED_WHY}, so bfloat16 would run the "
                                      "AVX-512 BF16 kernels, measured slower than float32 on "
                                      "Intel: float32")
    if native_bf16_flag(flags) is not None:
        return DtypeChoice("float32", "auto: native bfloat16 here is avx512_bf16 on an Intel "
                                      "CPU without AMX, measured slower than float32 for this "
                                      "engine, so float32")
    return DtypeChoice("float32", "auto: no native bfloat16 on this CPU (none of "
                                  f"{', '.join(NATIVE_BF16_FLAGS)}), so float32 (bfloat16 would "
                                  "be emulated, ~3x slower)")


def amx_tile_state_lent() -> bool | None:
    """Ask Linux to lend this process AMX's tile state, as native_amx.h's `dkv_amx_init` does
    before the kernels use it (granted once, for the whole process) -> whether it did; None
    where the question cannot be asked (not x86-64 Linux)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    return syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA


def with_amx_permission(flags: frozenset[str]) -> frozenset[str]:
    """This machine's `flags` as this process may use them: AMX listed but refused -> the AMX
    flags dropped and AMX_REFUSED added."""
    if "amx_bf16" not in flags or amx_tile_state_lent() is not False:
        return flags
    return (flags - AMX_FLAGS) | {AMX_REFUSED}


def read_cpu_flags() -> frozenset[str] | None:
    """This CPU's flags as this process may use them: $DUPLEXKV_CPUINFO (another CPU's, as
    written) or /proc/cpuinfo (`with_amx_permission`), else PyTorch's probes, else None."""
    override = os.environ.get(CPUINFO_ENV)
    try:
        flags = parse_cpu_flags(Path(override or "/proc/cpuinfo").read_text(errors="replace"))
        return flags if override else with_amx_permission(flags)
    except OSError:
        pass
    try:  # no /proc (macOS): ask PyTorch, which probes CPUID itself
        import torch

        probes = torch._C._cpu
        flags = set()
        if getattr(probes, "_is_amx_tile_supported", lambda: False)():
            flags.add("amx_bf16")
        if getattr(probes, "_is_avx512_bf16_supported", lambda: False)():
            flags.add("avx512_bf16")
        return frozenset(flags)
    except Exception:  # noqa: BLE001 - a private API: any failure means "unknown"
        return None


def cpu_bf16_status(flags: frozenset[str] | None = None) -> str:
    """`native bf16: yes (amx_bf16)` / `native bf16: no` / `native bf16: unknown`, for headers."""
    flags = read_cpu_flags() if flags is None else flags
    if flags is None:
        return "native bf16: unknown"
    flag = native_bf16_flag(flags)
    return f"native bf16: yes ({flag})" if flag else "native bf16: no"


def auto_dtype() -> DtypeChoice:
    return resolve_dtype("auto", read_cpu_flags())


def describe(requested: str | None) -> str:
    """One header line for benchmarks: `dtype bfloat16 (--dtype auto); CPU native bf16: yes
    (amx_bf16)` — what a worker started here with `requested` (None: the default) runs."""
    flags = read_cpu_flags()
    choice = resolve_dtype(requested or "auto", flags)
    return f"dtype {choice.dtype} (--dtype {requested or 'auto'}); CPU {cpu_bf16_status(flags)}"
