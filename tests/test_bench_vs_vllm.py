"""`duplexkv bench vs_vllm`'s arguments and table (the benchmark itself needs vLLM and minutes:
not part of the suite)."""

from __future__ import annotations

import pytest

from duplexkv_bench import machine_limits, vs_vllm
from duplexkv_bench.machine_limits import Limits, Shape
from duplexkv_bench.vllm_venv import vllm_command


def test_defaults_cover_the_issue_sizes():
    a = vs_vllm.parse_args([])
    assert a.lengths == [2048, 4096, 8192, 16384] and a.decode_contexts == [4096, 8192]
    assert a.batches == [1, 8] and a.dtype_requested == "auto"
    assert a.max_model_len >= 16384 + a.decode_tokens  # the longest prompt and its answer fit


@pytest.mark.parametrize("flags,picked", [
    ("fpu sse2 avx2", "float32"),  # no native bf16
    ("fpu avx2 avx512f avx512_bf16", "float32"),  # Intel without AMX: measured slower
    ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "bfloat16"),
])
def test_the_default_dtype_is_what_a_workers_auto_picks(flags, picked, tmp_path, monkeypatch):
    """Both servers run in the dtype a worker started with --dtype auto runs here, and the
    reason is kept for the header and the JSON."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"vendor_id\t: GenuineIntel\nflags\t\t: {flags}\n")
    monkeypatch.setenv("DUPLEXKV_CPUINFO", str(cpuinfo))
    a = vs_vllm.parse_args([])
    assert a.dtype == picked and a.dtype_reason.startswith("auto:")
    assert vs_vllm.parse_args(["--dtype", "float32"]).dtype == "float32"


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


BENCH = {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 32000}


def test_useful_work_of_a_prefill_and_a_decode_step():
    shape = Shape.from_config(BENCH)
    per_layer = 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1536  # q, o; k, v; gate, up, down
    assert shape.layer_weights() == per_layer
    t = 2048
    assert shape.prefill_flops(t) == (2 * 8 * per_layer * t + 4 * 8 * 8 * 64 * t * (t + 1) / 2
                                      + 2 * 512 * 32000)
    weights = (8 * per_layer + 512 * 32000) * 4
    assert shape.decode_bytes(4096, 8, "float32") == weights + 2 * 8 * 2 * 64 * 4096 * 8 * 4
    assert shape.decode_bytes(4096, 1, "bfloat16") == (weights + 2 * 8 * 2 * 64 * 4096 * 4) / 2
    # every weight meets each of the batch's rows; each query head meets every key and value
    assert shape.decode_flops(4096, 8) == (2 * (8 * per_layer + 512 * 32000) * 8
                                           + 4 * 8 * 8 * 64 * 4096 * 8)


def test_table_gives_each_sides_share_of_the_machines_limit():
    shape = Shape.from_config(BENCH)
    limits = Limits(gemm_gflops=100.0, read_gbs=10.0, dtype="float32")
    flops = shape.prefill_flops(2048)
    step = shape.decode_bytes(4096, 8, "float32")
    vllm = {"ttft 2048": flops / 50e9, "tpot 4096 x8": step / 8e9}  # 50 % and 80 %
    ours = {"ttft 2048": flops / 70e9, "tpot 4096 x8": step / 9e9}  # 70 % and 90 %
    rows = vs_vllm.table(vllm, ours, limits, shape).splitlines()
    assert rows[0].endswith("vLLM, of the limit | duplexkv, of the limit | decode floor / its "
                            "FLOPs at the GEMM rate |")
    floor_ms = step / 10e9 * 1e3
    compute_ms = shape.decode_flops(4096, 8) / 100e9 * 1e3
    assert rows[2].endswith("| 50% | 70% | — |")
    assert rows[3].endswith(f"| 80% | 90% | {floor_ms:.3g} ms / {compute_ms:.3g} ms |")


def test_a_decode_row_is_also_shared_against_the_bandwidth_read_beside_it():
    """The VM's memory switches between a slow and a fast mode within minutes: a decode row's
    share is given against the bandwidth read beside its own batch, then against the run's best."""
    shape = Shape.from_config(BENCH)
    limits = Limits(gemm_gflops=100.0, read_gbs=60.0, dtype="float32")
    step = shape.decode_bytes(4096, 1, "float32")
    ours = {"ttft 2048": 1.0, "tpot 4096 x1": step / 30e9}  # 30 GB/s of useful bytes
    vllm = {"ttft 2048": 1.0, "tpot 4096 x1": step / 15e9}
    beside = {"duplexkv": {"tpot 4096 x1": 33.0}, "vllm": {"tpot 4096 x1": 60.0}}
    rows = vs_vllm.table(vllm, ours, limits, shape, beside).splitlines()
    assert "of the limit (decode: of the bandwidth beside the row / of the run's)" in rows[0]
    assert "| — |" in rows[2]  # TTFT rows: no floor, one share each
    assert rows[3].endswith(f"| 25% / 25% | 91% / 50% | {step / 60e6:.3g} ms / "
                            f"{shape.decode_flops(4096, 1) / 100e9 * 1e3:.3g} ms |")
    assert limits.with_read_gbs(33.0) == Limits(100.0, 33.0, "float32")


def test_two_readings_of_the_limits_keep_the_higher_of_each():
    """A run reads the machine before its servers start and after they stop; a slow minute at
    either end must not lower the floor the shares are taken against."""
    start = Limits(gemm_gflops=180.0, read_gbs=56.0, dtype="float32")
    end = Limits(gemm_gflops=190.0, read_gbs=33.0, dtype="float32")
    assert start.best(end) == Limits(190.0, 56.0, "float32") == end.best(start)
    assert start.best(end).to_json() == {"gemm_gflops": 190.0, "read_gbs": 56.0}
    with pytest.raises(ValueError, match="do not combine"):
        start.best(Limits(400.0, 56.0, "bfloat16"))


def test_the_machines_limits_are_measured():
    assert machine_limits.gemm_gflops("float32", n=256, reps=2) > 0.1
    again = machine_limits.Bandwidth(nbytes=16 << 20)  # one buffer, read as often as asked
    assert again.read(2) > 0.1 and again.read(1) > 0.1
    assert machine_limits.measure("float32", again).read_gbs > 0.1  # from that buffer


def test_settle_waits_while_another_process_spins_and_not_when_idle():
    """Interleaved timing waits for the other server's after-request polling (vLLM spins ~1 s
    after a step) to end before the next request is timed."""
    import os
    import subprocess
    import sys

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(min(os.cpu_count() or 1, 8))]
    try:
        assert machine_limits.settle(limit=0.6) >= 0.6  # the cores are busy all along
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    assert machine_limits.settle(limit=3.0) < 2.0  # idle again: returns within a few windows
