"""The `duplexkv` command. Each subcommand is one `add_<name>(subparsers)` function in COMMANDS
that registers its parser and sets `run`; errors print one `duplexkv: error: ...` line, exit 2.
`duplexkv COMMAND --config FILE.yaml ...` reads the command's flags from a file (config_file.py).
`demo` and `bench` need the `bench` extra (rich, matplotlib); without it they say so, and the
other commands (a worker, the router) never import it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from duplexkv import config_file
from duplexkv.version import __version__
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


def _needs_bench_extra(name: str, error: ImportError) -> Callable:
    def add(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser(name, help="(needs the bench extra: pip install 'duplexkv[bench]')",
                           add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(run=lambda _: fail(f"`duplexkv {name}` needs the bench extra, which is "
                                          f"not installed ({error}): pip install "
                                          "'duplexkv[bench]'"))
    return add


def _add_demo(sub: argparse._SubParsersAction) -> None:
    try:
        from duplexkv.bench.demo import add_demo
    except ImportError as e:  # rich is the bench extra's
        add_demo = _needs_bench_extra("demo", e)
    add_demo(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    try:
        from duplexkv.bench.multiturn import add_bench
    except ImportError as e:
        add_bench = _needs_bench_extra("bench", e)
    add_bench(sub)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_make_model, add_serve_parser, add_router_parser, add_up, _add_demo, _add_bench]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's own parser by name."""
    parser = _Parser(prog="duplexkv", description="Prefill/decode disaggregated LLM serving on CPU")
    parser.add_argument("--version", action="version", version=f"duplexkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    for name, command in sub.choices.items():
        if command.add_help and name != "bench":  # listed in --help; main() reads the file
            command.add_argument(config_file.FLAG, metavar="FILE.yaml",
                                 help="this command's flags from a YAML file (keys are the flag "
                                      "names); flags given here override it")
    return parser, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_SCRIPTS:
        return run_bench_script(argv[1], argv[2:])  # it parses its own arguments
    parser, commands = build_parser()
    try:
        rest, path = config_file.split_config(argv)
        if path is not None:
            if not rest or rest[0] not in commands or rest[0] == "bench":
                fail(f"{config_file.FLAG} goes after a command (serve, router, up, demo, "
                     "make-model): duplexkv COMMAND --config FILE")
            argv = config_file.expand(rest, commands[rest[0]], path)
    except config_file.ConfigFileError as e:
        fail(str(e))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ModelLoadError, ValueError, OSError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
