"""List flags accumulate on every command (issue 27): `--decode A --decode B` keeps both, the
first occurrence replaces a default, and no `nargs="+"` flag in the package is left without it."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from duplexkv.cli import build_parser
from duplexkv.flags import Accumulate

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (REPO / "duplexkv", REPO / "duplexkv_bench")  # the runtime and the benchmarks


def test_router_keeps_every_repeated_worker_flag():
    parser, _ = build_parser()
    args = parser.parse_args(["router", "--prefill", "http://p1", "--prefill", "http://p2",
                              "--decode", "http://d1", "http://d2", "--decode", "http://d3",
                              "--api-key", "k1", "--api-key", "k2"])
    assert args.prefill == ["http://p1", "http://p2"]
    assert args.decode == ["http://d1", "http://d2", "http://d3"]
    assert args.api_key == ["k1", "k2"]


def test_serve_keeps_every_served_model_name():
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "tiny", "--served-model-name", "a",
                              "--served-model-name", "b", "c"])
    assert args.served_model_name == ["a", "b", "c"]


def test_first_occurrence_replaces_a_default_and_later_ones_add():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", nargs="+", action=Accumulate, default=["1gbit", "10gbit"])
    assert ap.parse_args([]).rate == ["1gbit", "10gbit"]
    assert ap.parse_args(["--rate", "5mbit"]).rate == ["5mbit"]
    assert ap.parse_args(["--rate", "5mbit", "--rate", "6mbit"]).rate == ["5mbit", "6mbit"]
    ns = ap.parse_args(["--rate", "5mbit"])
    assert ap.parse_args([]).rate == ["1gbit", "10gbit"], "the default list was mutated"
    assert ns.rate == ["5mbit"]


def test_set_defaults_from_a_config_file_is_a_default_too():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", nargs="+", action=Accumulate, default=[])
    ap.set_defaults(decode=["http://from-config"])
    assert ap.parse_args([]).decode == ["http://from-config"]
    assert ap.parse_args(["--decode", "http://x", "--decode", "http://y"]).decode == \
        ["http://x", "http://y"]


def _list_flags_without_accumulate() -> list[str]:
    bad = []
    for path in (p for package in PACKAGES for p in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            nargs = kw.get("nargs")
            if isinstance(nargs, ast.Constant) and nargs.value in ("+", "*"):
                action = kw.get("action")
                if not (isinstance(action, ast.Name) and action.id == "Accumulate"):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return bad


def test_no_list_flag_keeps_only_its_last_occurrence():
    assert _list_flags_without_accumulate() == []


@pytest.mark.parametrize("nargs", ["?", 2])
def test_accumulate_refuses_other_nargs(nargs):
    with pytest.raises(ValueError):
        argparse.ArgumentParser().add_argument("--x", nargs=nargs, action=Accumulate)
