"""The `duplexkv` command. Each subcommand is one `add_<name>(subparsers)` function in COMMANDS
that registers its parser and sets `run`; errors print one `duplexkv: error: ...` line, exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from duplexkv.bench.demo import add_demo
from duplexkv.bench.multiturn import add_bench
from duplexkv.bench.scripts import SCRIPTS as BENCH_SCRIPTS
from duplexkv.bench.scripts import run_script as run_bench_script
from duplexkv.model.config import ModelLoadError
from duplexkv.router.serve import add_router_parser
from duplexkv.server.serve import add_serve_parser
from duplexkv.up import add_up


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"duplexkv: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _make_model(args: argparse.Namespace) -> int:
    from duplexkv.model.loader import num_parameters
    from duplexkv.model.presets import get_preset
    from duplexkv.model.synth import make_model

    path = make_model(args.dir, args.preset, seed=args.seed)
    n = num_parameters(get_preset(args.preset))
    print(f"{path}  ({args.preset}, seed {args.seed}: {n:,} parameters, {n / 1e6:.1f} M)")
    return 0


def add_make_model(sub: argparse._SubParsersAction) -> None:
    from duplexkv.model.presets import DEFAULT_PRESET, PRESETS

    p = sub.add_parser("make-model", help="write a synthetic HF-format model directory")
    p.add_argument("dir", help="output directory (created; must be new or empty)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_make_model)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_make_model, add_serve_parser, add_router_parser, add_up, add_demo,
    add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="duplexkv", description="Prefill/decode disaggregated LLM serving on CPU")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_SCRIPTS:
        return run_bench_script(argv[1], argv[2:])  # it parses its own arguments
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ModelLoadError, ValueError, OSError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
