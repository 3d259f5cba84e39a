"""The package's layers only point down (docs/architecture.md), parsed from the source with `ast`:

    paths, flags, vllm_plugin, version, wire < layers, http, discovery < model < engine < kv < server < router, launch < up, hosts
    < bench, config_file < cli

No import circles between modules, the router never reaches torch or the engine (not even
through what it imports), and no module grows past ~300 lines without saying why at its top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "duplexkv"
RANK = {"paths": -1, "flags": -1, "vllm_plugin": -1, "version": -1, "wire": -1, "layers": 0, "http": 0, "discovery": 0, "model": 1, "engine": 2, "kv": 3,
        "server": 4, "router": 5, "launch": 5, "up": 6, "hosts": 6, "bench": 7, "config_file": 7,
        "cli": 8}
MAX_LINES = 300
WHY_LONG = "Longer than 300 lines:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def group(mod: str) -> str | None:
    """The layer a module belongs to (None: the package root's __init__)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def imports(mod: str, top_level_only: bool = False) -> set[str]:
    """duplexkv modules (and 'torch') that `mod` imports, resolved to existing modules."""
    tree = ast.parse(MODULES[mod].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks are not imports at run time
        nodes = [n for n in nodes if not (isinstance(n, ast.If)
                                          and "TYPE_CHECKING" in ast.unparse(n.test))]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from package import submodule` depends on the submodule (a package's own
            # __init__ always runs first: that is not an edge of the graph)
            names = subs if all(n in MODULES for n in subs) else [node.module] + subs
        for name in names:
            if name == "torch" or name.startswith("torch."):
                out.add("torch")
            elif name in MODULES and name != mod:
                out.add(name)
    return out


def type_checking_only(mod: str) -> set[str]:
    tree = ast.parse(MODULES[mod].read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module in MODULES:
                    out.add(sub.module)
    return out


def test_layers_only_point_down():
    bad = []
    for mod in MODULES:
        g = group(mod)
        if g is None:
            continue
        assert g in RANK, f"{mod}: the package {g!r} has no place in the layer order"
        for dep in imports(mod) - {"torch"} - type_checking_only(mod):
            d = group(dep)
            if d is None or d == g:
                continue
            if RANK[d] >= RANK[g]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_no_import_circles():
    graph = {m: imports(m, top_level_only=True) - {"torch"} for m in MODULES}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [m, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def closure(mod: str) -> set[str]:
    seen, todo = set(), [mod]
    while todo:
        m = todo.pop()
        for dep in imports(m, top_level_only=True) - type_checking_only(m):
            if dep not in seen:
                seen.add(dep)
                if dep != "torch":
                    todo.append(dep)
    return seen


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if group(m) == "router"))
def test_router_never_reaches_torch_or_the_engine(mod):
    reached = closure(mod)
    assert "torch" not in reached, f"{mod} reaches torch"
    heavy = sorted(m for m in reached if group(m) in ("engine", "model", "layers", "kv"))
    assert not heavy, f"{mod} reaches {heavy}"


def test_long_modules_say_why():
    long = []
    for mod, path in MODULES.items():
        text = path.read_text()
        n = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if n > MAX_LINES and WHY_LONG not in doc:
            long.append(f"{mod}: {n} lines")
    assert not long, (f"modules over {MAX_LINES} lines without '{WHY_LONG} ...' in their "
                      "docstring:\n" + "\n".join(long))
