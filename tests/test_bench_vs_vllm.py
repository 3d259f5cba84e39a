"""`duplexkv bench vs_vllm`'s arguments and table (the benchmark itself needs vLLM and minutes:
not part of the suite)."""

from __future__ import annotations

import pytest

from duplexkv_bench import vs_vllm
from duplexkv_bench.vllm_venv import vllm_command


def test_defaults_cover_the_issue_sizes():
    a = vs_vllm.parse_args([])
    assert a.lengths == [2048, 4096, 8192, 16384] and a.decode_contexts == [4096, 8192]
    assert a.batches == [1, 8] and a.dtype == "float32"
    assert a.max_model_len >= 16384 + a.decode_tokens  # the longest prompt and its answer fit


def test_bfloat16_refused_without_native_bf16(tmp_path, monkeypatch, capsys):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2\n")
    monkeypatch.setenv("DUPLEXKV_CPUINFO", str(cpuinfo))
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--dtype", "bfloat16"])
    assert "no native bfloat16" in capsys.readouterr().err
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert vs_vllm.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_table_gives_ratio_and_target():
    vllm = {"ttft 2048": 1.0, "tpot 4096 x8": 0.040}
    ours = {"ttft 2048": 0.85, "tpot 4096 x8": 0.036}
    rows = vs_vllm.table(vllm, ours).splitlines()
    assert rows[2] == "| TTFT, 2,048 tokens | 1 s | 0.85 s | 0.850 | ≤ 0.9 (met) |"
    assert rows[3] == ("| time per output token at 4,096 context, batch 8 | 40 ms | 36 ms | "
                       "0.900 | ≤ 0.8 (missed) |")
    assert "—" in vs_vllm.table({}, ours)  # one side only: no ratio


def test_vllm_gets_the_same_limits_as_our_worker(tmp_path):
    cmd = vllm_command(tmp_path, tmp_path / "m", "float32", 17000, 8000)
    for flag, value in [("--dtype", "float32"), ("--max-model-len", "17000"),
                        ("--max-num-batched-tokens", "17000"), ("--host", "127.0.0.1")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
