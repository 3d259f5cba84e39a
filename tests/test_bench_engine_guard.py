"""`duplexkv bench engine_guard` on the tiny model with tiny sizes: it writes its rows and the
machine they ran on, and `--compare` flags exactly the rows slower than the file's (exit 1), for
rows just measured or another file's (`--rows`)."""

from __future__ import annotations

import json
from pathlib import Path

from duplexkv.cli import main

TINY = ["--prefill", "16", "32", "--decode-context", "16", "--decode-steps", "2", "--reps", "1"]


def test_engine_guard_writes_rows_and_compares(tiny_model_dir: Path, tmp_path: Path,
                                               capsys) -> None:
    out = tmp_path / "guard.json"
    assert main(["bench", "engine_guard", "--models", str(tiny_model_dir), *TINY,
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["what"] for r in result["rows"]] == ["prefill 16", "prefill 32",
                                                   "decode step @16"]
    assert all(r["median_s"] > 0 and len(r["samples_s"]) == 1 for r in result["rows"])
    assert {"cpu", "kernel_flags", "dtype", "torch", "load_average"} <= set(result["machine"])
    assert result["machine"]["dtype"] == "float32"

    # a baseline 1000x faster in its first row only: that row, and no other, is flagged
    base = json.loads(out.read_text())
    base["rows"][0]["median_s"] /= 1000
    for r in base["rows"][1:]:
        r["median_s"] *= 1000
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(base))
    capsys.readouterr()
    assert main(["bench", "engine_guard", "--compare", str(fast), "--rows", str(out)]) == 1
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    flagged = [line.split("|")[2].strip() for line in table if "SLOWER" in line]
    assert flagged == ["prefill 16"]

    # every baseline row 1000x slower: nothing is flagged
    for r in base["rows"]:
        r["median_s"] *= 1e6
    fast.write_text(json.dumps(base))
    assert main(["bench", "engine_guard", "--models", str(tiny_model_dir), *TINY,
                 "--compare", str(fast)]) == 0  # measuring, then comparing


def test_each_cpu_kind_and_dtype_has_its_own_baseline() -> None:
    from duplexkv_bench.engine_guard import baseline_path, cpu_kind

    amx = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert cpu_kind(amx) == "amx"
    assert cpu_kind(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "avx512"
    assert cpu_kind(frozenset({"avx2", "fma"})) == "avx2"
    assert cpu_kind(frozenset({"asimd"})) == "other"
    assert baseline_path("bfloat16", amx).name == "engine-guard-amx-bfloat16.json"
    committed = {p.name for p in baseline_path("float32", amx).parent.glob("engine-guard-*.json")}
    # the kinds sessions have measured so far; each file records the machine it came from
    assert {"engine-guard-avx2-float32.json", "engine-guard-amx-float32.json",
            "engine-guard-amx-bfloat16.json", "engine-guard-avx512-float32.json"} <= committed
    for name in committed:
        kind, dtype = name.removeprefix("engine-guard-").removesuffix(".json").split("-")
        meta = json.loads((baseline_path("float32").parent / name).read_text())["machine"]
        assert meta["dtype"] == dtype and cpu_kind(frozenset(meta["kernel_flags"])) == kind, name


def test_compare_baseline_without_one_names_the_command_that_makes_it(tmp_path, capsys,
                                                                        monkeypatch) -> None:
    import pytest

    from duplexkv_bench import engine_guard

    monkeypatch.setattr(engine_guard, "BASELINES", tmp_path)
    with pytest.raises(SystemExit) as e:
        engine_guard.main(["--compare", "baseline", "--dtype", "float16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no committed baseline" in err and "--dtype float16 --json" in err
