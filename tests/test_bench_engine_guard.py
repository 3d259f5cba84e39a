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
