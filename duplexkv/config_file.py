"""`--config FILE.yaml`: a command's flags from a YAML mapping, as `vllm serve --config` reads it.

Keys are the flag names without the dashes (`max-model-len` or `max_model_len`); values are what
the flag takes: a scalar, a list for a flag taking several values (`served-model-name: [a, b]`)
or repeated (`api-key`), true/false for a switch, a mapping for a JSON flag
(`kv-transfer-config`). A command's positional argument may be given by its name
(`model: Qwen/Qwen3-0.6B`). The file's settings become ordinary arguments placed before the
command line's, so every value is checked exactly as on the command line, and a flag given on the
command line overrides the file's (vLLM's rule); a flag the command does not have is an error
naming the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FLAG = "--config"
# a command whose parser has this default set true takes no --config (one whose sub-commands
# have flags of their own, as `bench`)
NOT_TAKEN = "takes_no_config_file"


class ConfigFileError(ValueError):
    pass


def split_config(argv: list[str]) -> tuple[list[str], Path | None]:
    """argv without `--config FILE` / `--config=FILE`, and FILE."""
    out, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG or arg.startswith(FLAG + "="):
            if path is not None:
                raise ConfigFileError(f"{FLAG} given twice")
            if arg == FLAG:
                if i + 1 >= len(argv):
                    raise ConfigFileError(f"{FLAG} needs a YAML file")
                path, i = Path(argv[i + 1]), i + 2
            else:
                path, i = Path(arg.split("=", 1)[1]), i + 1
            continue
        out.append(arg)
        i += 1
    return out, path


def load(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigFileError(f"{FLAG} {path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{FLAG} {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigFileError(f"{FLAG} {path}: must be a mapping of flag names to values")
    return data


def _given(rest: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in rest if a.startswith("--")}


def _tokens(flag: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: must be true or false, got {value!r}")
        return [flag] if value else ["--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false: the switch itself
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (dict, list)) for v in values):
        raise ConfigFileError(f"{where}: nested lists are not a flag value")
    text = [json.dumps(v) if isinstance(v, bool) else str(v) for v in values]
    if isinstance(action, argparse._AppendAction):
        return [t for v in text for t in (flag, v)]
    if isinstance(value, list) and action.nargs in (None, "?"):
        raise ConfigFileError(f"{where}: takes one value, got a list")
    return [flag, *text]


def expand(argv: list[str], parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """`[command, *rest]` with the file's settings for `parser` (the command's) put in front of
    rest; flags in rest (and their mutually exclusive partners) drop the file's."""
    command, rest = argv[0], argv[1:]
    data = load(path)
    options = {o: a for a in parser._actions for o in a.option_strings}
    positionals = {a.dest: a for a in parser._actions
                   if not a.option_strings and a.dest != argparse.SUPPRESS}
    given = _given(rest)
    # a flag on the command line silences the file's: itself, its --no- form, its group
    silenced = set()
    for a in parser._actions:
        if given & set(a.option_strings):
            silenced.add(a.dest)
    for group in parser._mutually_exclusive_groups:
        if any(a.dest in silenced for a in group._group_actions):
            silenced.update(a.dest for a in group._group_actions)
    front: list[str] = []
    tokens: list[str] = []
    for key, value in data.items():
        name = key.strip().lstrip("-").replace("_", "-")
        where = f"{FLAG} {path}: {key}"
        if name.replace("-", "_") in positionals:
            if not rest or rest[0].startswith("-"):  # not given on the command line
                front.append(str(value))
            continue
        flag = "--" + name
        action = options.get(flag)
        if action is None or flag in ("--help", FLAG):
            raise ConfigFileError(f"{where}: `duplexkv {command}` has no flag {flag}")
        if value is None or action.dest in silenced:
            continue
        tokens += _tokens(flag, action, value, where)
    # the command line's leading positionals stay in front (a file's list value would take them)
    n = next((i for i, arg in enumerate(rest) if arg.startswith("-")), len(rest))
    return [command, *front, *rest[:n], *tokens, *rest[n:]]
