"""`bench engine_ab`'s arguments (the A/B itself loads the bench model twice: a benchmark)."""

import pytest

from duplexkv_bench import engine_ab


def test_cases_parse_and_bad_ones_are_refused():
    assert engine_ab.parse_case("prefill:2048") == ("prefill", 2048, 1)
    assert engine_ab.parse_case("decode:4096x8") == ("decode", 4096, 8)
    with pytest.raises(Exception):
        engine_ab.parse_case("decode:4kx8")


def test_more_than_two_dtypes_is_an_error_naming_the_fix(capsys):
    with pytest.raises(SystemExit) as exc:
        engine_ab.main(["--old", ".", "--new", ".", "--dtype", "float32", "bfloat16", "float16"])
    assert exc.value.code == 2
    assert "two (the old side's, then the new side's)" in capsys.readouterr().err
