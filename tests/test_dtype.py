"""`--dtype auto` (the default): bfloat16 where the CPU computes it natively, float32 elsewhere;
float16 and vLLM's aliases accepted. The choice is a pure function of the CPU's flags, so both
kinds of CPU are tested here whatever this machine is; a real worker reads the flags from
$DUPLEXKV_CPUINFO to run as if on another CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from duplexkv import LLM, SamplingParams
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.dtype import (
    AMX_FLAGS,
    AMX_REFUSED,
    CPUINFO_ENV,
    canonical,
    parse_cpu_flags,
    read_cpu_flags,
    resolve_dtype,
)
from workers import start_worker

# /proc/cpuinfo excerpts (flags trimmed to the relevant ones plus neighbours)
SAPPHIRE_RAPIDS = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: fpu "
                   "sse4_2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
COOPER_LAKE = ("vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512_vnni "
               "avx512_bf16\n")
# issue 31's Intel Xeon without AMX (avx512_bf16 and avx512_fp16)
XEON_NO_AMX = ("vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 "
               "avx512_fp16\n")
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse4a avx2 fma avx512f avx512vl avx512_vnni avx512_bf16\n")
ICE_LAKE = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C\nflags\t\t: fpu sse4_2 "
            "avx2 avx512f avx512dq avx512_vnni avx512_vbmi2 avx512_bitalg\n\n"
            "processor\t: 1\nflags\t\t: fpu sse4_2 avx2 avx512f avx512dq avx512_vnni\n")
ZEN3 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_2 sse4a avx2 fma\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha3 sve i8mm bf16 svebf16\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha1 sha2 crc32 atomics fphp\n"


@pytest.mark.parametrize("cpuinfo,want", [
    (SAPPHIRE_RAPIDS, "bfloat16"), (COOPER_LAKE, "float32"), (XEON_NO_AMX, "float32"),
    (ZEN4, "bfloat16"), (GRAVITON3, "bfloat16"), (ICE_LAKE, "float32"), (ZEN3, "float32"),
    (GRAVITON2, "float32"), ("", "float32")])
def test_auto_follows_the_cpu_flags(cpuinfo, want):
    choice = resolve_dtype("auto", parse_cpu_flags(cpuinfo))
    assert choice.dtype == want
    assert choice.reason.startswith("auto: ")
    if cpuinfo is ZEN4:  # AMD's avx512_bf16 with the engine's own kernels (session 51)
        assert "AMD with avx512_bf16" in choice.reason and "measured faster" in choice.reason
    elif want == "bfloat16":
        assert re.search(r"\((amx_bf16|bf16)\), faster than float32", choice.reason), \
            choice.reason
    elif cpuinfo in (COOPER_LAKE, XEON_NO_AMX):  # Intel without AMX: slower (issue 31)
        assert "avx512_bf16 on an Intel CPU without AMX, measured slower" in choice.reason, \
            choice.reason
    else:
        assert "no native bfloat16" in choice.reason
    assert resolve_dtype("auto", None).dtype == "float32"  # flags unknown: the safe choice


def test_the_vendor_is_read_as_a_pseudo_flag():
    assert "vendor:AuthenticAMD" in parse_cpu_flags(ZEN4)
    assert "vendor:GenuineIntel" in parse_cpu_flags(COOPER_LAKE)
    # the same flags without the vendor line (PyTorch's probes): not known to be AMD, float32
    no_vendor = parse_cpu_flags(ZEN4) - {"vendor:AuthenticAMD"}
    assert resolve_dtype("auto", no_vendor).dtype == "float32"


def test_explicit_dtypes_say_when_they_are_emulated():
    ice = parse_cpu_flags(ICE_LAKE)
    assert resolve_dtype("bfloat16", ice).dtype == "bfloat16"  # asked for: honoured
    assert "emulated" in resolve_dtype("bfloat16", ice).reason
    assert "emulated" not in resolve_dtype("bfloat16", parse_cpu_flags(SAPPHIRE_RAPIDS)).reason
    assert "emulated" in resolve_dtype("float16", ice).reason
    assert resolve_dtype("float32", ice).reason == "--dtype float32 as requested"


def test_amx_listed_but_refused_runs_as_intel_without_amx():
    refused = parse_cpu_flags(SAPPHIRE_RAPIDS) - AMX_FLAGS | {AMX_REFUSED, "vendor:GenuineIntel"}
    choice = resolve_dtype("auto", refused)
    assert choice.dtype == "float32" and "refused this process AMX's tile state" in choice.reason
    asked = resolve_dtype("bfloat16", refused)
    assert asked.dtype == "bfloat16" and "the AVX-512 BF16 kernels run instead" in asked.reason


SMALL_SIGNAL_STACK = """
import ctypes
class Stack(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8192)  # room for a signal frame without AMX's 8 KiB of tiles
assert ctypes.CDLL(None).sigaltstack(ctypes.byref(Stack(ctypes.addressof(buf), 0, 8192)),
                                     None) == 0
"""


@pytest.mark.skipif("amx_bf16" not in parse_cpu_flags(Path("/proc/cpuinfo").read_text()),
                    reason="this CPU lists no AMX")
@pytest.mark.parametrize("small_stack", [False, True], ids=["lent", "refused"])
def test_auto_on_a_process_linux_refuses_amx(tiny_model_dir, small_stack):
    """On an AMX CPU, a process with a thread whose signal stack cannot hold AMX's larger frame
    (an 8 KiB sigaltstack, glibc's old SIGSTKSZ) is refused the tile state by Linux: the kernels
    cannot use AMX there, so `auto` runs it as an Intel CPU without AMX (float32), and says why;
    the same engine in a process without one runs bfloat16 on AMX."""
    code = (SMALL_SIGNAL_STACK if small_stack else "") + (
        "from duplexkv import LLM, SamplingParams; from duplexkv.layers import amx\n"
        f"llm = LLM({str(tiny_model_dir)!r}, num_kv_blocks=16)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0]\n"
        "print(llm.engine.config.dtype, amx.available(), len(out.token_ids))\n"
        "print(llm.engine.dtype_reason)\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != CPUINFO_ENV})
    assert r.returncode == 0, r.stderr
    facts, reason = r.stdout.splitlines()[-2:]
    if small_stack:
        assert facts == "float32 False 3" and "refused this process AMX's tile state" in reason
    else:
        assert facts == "bfloat16 True 3" and "(amx_bf16), faster than float32" in reason


def test_vllm_names_and_bad_values():
    assert [canonical(n) for n in ("auto", "half", "float16", "float", "float32", "bfloat16")] \
        == ["auto", "float16", "float16", "float32", "float32", "bfloat16"]
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype="half").dtype == "float16"
    with pytest.raises(ValueError, match="auto, bfloat16, float16, float32, half, float"):
        EngineConfig(dtype="fp8")


def test_engine_default_follows_the_flags_it_reads(tiny_model_dir, monkeypatch, tmp_path):
    """LLM() without a dtype on an AMX CPU runs bfloat16, on Ice Lake float32 (KV pool too)."""
    for cpuinfo, want in ((SAPPHIRE_RAPIDS, torch.bfloat16), (ICE_LAKE, torch.float32)):
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        monkeypatch.setenv(CPUINFO_ENV, str(path))
        llm = LLM(str(tiny_model_dir), num_kv_blocks=16)
        assert llm.engine.runner.pool.dtype == want
        assert llm.engine.config.dtype == str(want).removeprefix("torch.")
        assert "auto: " in llm.engine.dtype_reason
    monkeypatch.delenv(CPUINFO_ENV)
    assert read_cpu_flags() is not None  # this machine's /proc/cpuinfo


def test_float16_runs_and_matches_float32(tiny_model_dir):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, "def fib(n):", list(range(40, 140))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    half = LLM(str(tiny_model_dir), dtype="float16", num_kv_blocks=32)
    assert half.engine.runner.pool.dtype == torch.float16
    want = [o.token_ids for o in LLM(str(tiny_model_dir), dtype="float32",
                                     num_kv_blocks=32).generate(prompts, greedy)]
    assert [o.token_ids for o in half.generate(prompts, greedy)] == want


def test_worker_on_a_cpu_without_native_bf16_runs_float32(tiny_model_dir, tmp_path):
    """`--dtype auto` on the command line; the worker logs the choice and why."""
    cpuinfo = tmp_path / "icelake"
    cpuinfo.write_text(ICE_LAKE)
    w = start_worker(tiny_model_dir, tmp_path / "w.log", "--num-kv-blocks", "32",
                     "--dtype", "auto", dtype=None, env={CPUINFO_ENV: str(cpuinfo)})
    try:
        assert w.get("/debug/engine").json()["dtype"] == "float32"
        r = w.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text
        log = w.log.read_text()
        assert "dtype float32 (auto: no native bfloat16 on this CPU" in log
    finally:
        w.stop()
