"""The `duplexkv` command. Each subcommand is one `add_<name>(subparsers)` function that
registers its parser and sets `run`: the runtime's in COMMANDS, and those another package
provides through the `duplexkv.commands` entry points (pyproject.toml: `demo` and `bench`, from
the benchmark package, which this package never imports). Errors print one `duplexkv: error: ...`
line, exit 2. `duplexkv COMMAND --config FILE.yaml ...` reads the command's flags from a file
(config_file.py). `demo` and `bench` need the `bench` extra (rich, matplotlib); without it they
say so, and the other commands (a worker, the router) never need it."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from typing import NoReturn

from duplexkv import config_file
from duplexkv.model.config import ModelLoadError
from duplexkv.router.serve import add_router_parser
from duplexkv.server.serve import add_serve_parser
from duplexkv.up import add_up
from duplexkv.version import __version__

ENTRY_POINTS = "duplexkv.commands"
# the commands the bench extra brings: when they cannot be loaded they say how to install them
EXTRA_COMMANDS = ("demo", "bench")
INSTALL_EXTRA = "pip install 'duplexkv[bench]'"


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


def _needs_bench_extra(name: str, why: str) -> Callable:
    def add(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser(name, help=f"(needs the bench extra: {INSTALL_EXTRA})", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(run=lambda _: fail(f"`duplexkv {name}` needs the bench extra, which is "
                                          f"not installed ({why}): {INSTALL_EXTRA}"))
    return add


def entry_point_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """The `add` functions of the `duplexkv.commands` entry points (by name); one that fails to
    import, or an extra command with no entry point, registers a parser that says what to
    install."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}
    adds = []
    for name in sorted(set(found) | set(EXTRA_COMMANDS)):
        if name not in found:
            adds.append(_needs_bench_extra(name, f"no {ENTRY_POINTS} entry point {name!r}"))
            continue
        try:
            adds.append(found[name].load())
        except ImportError as e:  # rich or matplotlib: the bench extra's
            adds.append(_needs_bench_extra(name, str(e)))
    return adds


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_make_model, add_serve_parser, add_router_parser, add_up]


def takes_config(command: argparse.ArgumentParser) -> bool:
    return command.add_help and not command.get_default(config_file.NOT_TAKEN)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's own parser by name."""
    parser = _Parser(prog="duplexkv", description="Prefill/decode disaggregated LLM serving on CPU")
    parser.add_argument("--version", action="version", version=f"duplexkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in [*COMMANDS, *entry_point_commands()]:
        add(sub)
    for command in sub.choices.values():
        if takes_config(command):  # listed in --help; main() reads the file
            command.add_argument(config_file.FLAG, metavar="FILE.yaml",
                                 help="this command's flags from a YAML file (keys are the flag "
                                      "names); flags given here override it")
    return parser, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser()
    try:
        rest, path = config_file.split_config(argv)
        if path is not None:
            if not rest or rest[0] not in commands or not takes_config(commands[rest[0]]):
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
