"""`duplexkv bench read_limits` with tiny sizes: its probe reads every float of the KV it is
given (its sum is theirs), with and without software prefetch, on one thread or several, and the
benchmark prints and writes every row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duplexkv.cli import main
from duplexkv.layers import native
from duplexkv_bench import read_limits

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels (no compiler)")


@pytest.mark.parametrize("ahead", [0, 12])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("fmas", "fma_loads"), [(0, 0), (16, 0), (23, 0), (16, 1), (23, 1)])
def test_the_probe_reads_every_float_once_per_pass(ahead: int, threads: int, fmas: int,
                                                    fma_loads: int) -> None:
    kv = read_limits.KV(batch=3, context=40, kv_heads=2, head_dim=32, count=2)
    k, v, units = kv.units()
    assert units == 2 * 3 * 2
    want = sum(float(b.double().sum()) for b in kv.bufs)
    lib = read_limits.probe_library()
    for passes in (1, 2):
        got = lib.probe_rows(k, v, units, kv.context, kv.head_dim, ahead, fmas, fma_loads,
                             passes, threads)
        assert got == pytest.approx(passes * want, rel=1e-5)


def test_read_limits_measures_every_row(tmp_path: Path, capfd) -> None:
    out = tmp_path / "limits.json"
    assert main(["bench", "read_limits", "--preset", "tiny", "--batch", "2", "--context", "128",
                 "--rounds", "2", "--working-set-mib", "1", "--sum-mib", "8", "--json",
                 str(out)]) == 0
    result = json.loads(out.read_text())
    # tiny: 2 queries a KV head of 32 floats, 2 x 2 x 32 / 8 = 16 vector FMAs a key
    names = ["sum", "kv, hardware prefetch", "kv, hardware prefetch + 32 FMAs",
             "kv, software prefetch", "kv, software prefetch + 32 FMAs",
             "kv, software prefetch + 16 FMAs, a load each",
             "kv, software prefetch + 32 FMAs, a load each", "attention", "weights x1",
             "weights x8"]
    assert list(result["rows"]) == names
    for name in names:
        row = result["rows"][name]
        assert len(row["samples_gbps"]) == 2 and row["median_gbps"] > 0
    table = [line for line in capfd.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == names


@pytest.mark.parametrize(("argv", "named"), [(["--rounds", "0"], "--rounds"),
                                              (["--ahead", "-1"], "--ahead"),
                                              (["--preset", "nope"], "--preset"),
                                              (["--json", "/nonexistent/x.json"], "--json")])
def test_bad_arguments_get_a_clear_error(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "read_limits", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err
