"""The packages' layers only point down (docs/architecture.md), parsed from the source with `ast`:

    paths, flags, vllm_plugin, version, wire < layers, http, discovery < model < engine < kv < server < router, launch < up
    < config_file < cli  (the runtime package, duplexkv)
    < duplexkv_bench.hosts < duplexkv_bench  (the benchmarks, the demo, the multi-host harness)

The runtime never imports the benchmark package, not even lazily (the CLI finds `demo` and
`bench` through entry points). No import circles between modules, lazy (function-level) imports
included; the router never reaches torch or the engine (not even through what it imports), no
module grows past ~300 lines without saying why at its top, and no class past 200 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNTIME, BENCH = "duplexkv", "duplexkv_bench"
ROOT = REPO / RUNTIME
RANK = {"paths": -1, "flags": -1, "vllm_plugin": -1, "version": -1, "wire": -1, "layers": 0, "http": 0, "discovery": 0, "model": 1, "engine": 2, "kv": 3,
        "server": 4, "router": 5, "launch": 5, "up": 6, "config_file": 7, "cli": 8,
        "bench.hosts": 9, "bench": 10}
MAX_LINES = 300
WHY_LONG = "Longer than 300 lines:"
MAX_CLASS_LINES = 200


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for package in (RUNTIME, BENCH)
           for p in sorted((REPO / package).rglob("*.py"))}


def group(mod: str) -> str | None:
    """The layer a module belongs to (None: the runtime package's own __init__). The benchmark
    package is two layers above the whole runtime: its multi-host harness, then the rest."""
    parts = mod.split(".")
    if parts[0] == BENCH:
        return "bench.hosts" if parts[1:2] == ["hosts"] else "bench"
    return parts[1] if len(parts) > 1 else None


def imports(mod: str, top_level_only: bool = False, type_checking: bool = True) -> set[str]:
    """Our modules (and 'torch') that `mod` imports, resolved to existing modules: at its top
    level only, or anywhere (function-level imports too); `if TYPE_CHECKING:` blocks count
    unless `type_checking` is False (they are not imports at run time) or top-level only."""
    tree = ast.parse(MODULES[mod].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    skip: set[int] = set()
    if top_level_only or not type_checking:
        for n in ast.walk(tree):
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                skip.update(id(sub) for sub in ast.walk(n))
    out: set[str] = set()
    for node in nodes:
        if id(node) in skip:
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


def test_the_runtime_never_imports_the_benchmarks():
    """Not at the top, not in a function, not under TYPE_CHECKING, not by name through
    importlib: the runtime package runs without duplexkv_bench (a string naming it outside a
    docstring counts)."""
    bad = []
    for mod, path in MODULES.items():
        if mod.split(".")[0] != RUNTIME:
            continue
        bad += [f"{mod} -> {dep}" for dep in sorted(imports(mod)) if dep.split(".")[0] == BENCH]
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                        ast.AsyncFunctionDef)) and ast.get_docstring(n)}
        bad += [f"{mod}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and BENCH in n.value and id(n) not in docstrings]
    assert not bad, "the runtime reaches the benchmark package:\n" + "\n".join(bad)


def test_no_import_circles():
    """Lazy imports count: a function-level import that closes a circle is a circle (only
    `if TYPE_CHECKING:` blocks, never run, are left out)."""
    graph = {m: imports(m, type_checking=False) - {"torch"} for m in MODULES}
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


def test_no_long_classes():
    """A class is at most 200 lines, from its `class` line to its last one (ast's end_lineno;
    nested classes count in the class around them too)."""
    long = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long.append(f"{mod}.{node.name}: {n} lines (line {node.lineno})")
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(sorted(long))


# --- no reaching into another package's objects ----------------------------------------------
def _defined_names(tree: ast.Module) -> set[str]:
    """Attribute names a module defines: module and class level names (fields, methods,
    classes) and attributes assigned on self/cls anywhere (a function's locals are not
    attributes)."""
    out: set[str] = set()

    def names(target: ast.AST, own_level: bool) -> None:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name) and own_level:
                out.add(sub.id)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                    and sub.value.id in ("self", "cls"):
                out.add(sub.attr)

    def visit(body: list[ast.stmt], own_level: bool) -> None:
        for node in body:
            for child in ast.walk(node):
                if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                    for t in targets:
                        names(t, own_level and child in body)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and own_level:
                out.add(node.name)
            if isinstance(node, ast.ClassDef):
                visit(node.body, True)

    visit(tree.body, True)
    return out


TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
DEFINED_BY_GROUP: dict[str, set[str]] = {}
for _m, _t in TREES.items():
    DEFINED_BY_GROUP.setdefault(group(_m) or "", set()).update(_defined_names(_t))


def reachable_groups(g: str) -> set[str]:
    """Packages whose objects package `g` can hold: those of every module its modules import,
    transitively (lazy and TYPE_CHECKING imports included). Per package, not per module: an
    object travels inside its package (the server's app holds the connector that its KV hook
    built)."""
    todo = [m for m in MODULES if (group(m) or "") == g]
    seen = set(todo)
    while todo:
        for dep in imports(todo.pop()) - {"torch"}:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return {group(d) or "" for d in seen}


REACHABLE = {g: reachable_groups(g) for g in DEFINED_BY_GROUP}


def foreign_owner(mod: str, name: str) -> str | None:
    """The other package of ours that defines attribute `name` and whose objects `mod`'s
    package can reach, when its own package defines no such name (else None; "" is the
    package root)."""
    g = group(mod) or ""
    if name in DEFINED_BY_GROUP.get(g, set()):
        return None
    owners = sorted(o for o in REACHABLE[g] - {g} if name in DEFINED_BY_GROUP.get(o, ()))
    return owners[0] if owners else None


def cross_package_reaches(mod: str) -> list[str]:
    """`x._private` (x not self/cls, not a dunder) and `getattr/hasattr(x, "literal")` naming
    an attribute that only another of our packages defines."""
    out = []
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not (node.attr.startswith("__") and node.attr.endswith("__")) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            owner = foreign_owner(mod, node.attr)
            if owner is not None:
                out.append(f"{mod}:{node.lineno}: {ast.unparse(node)} (private to {owner})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            owner = foreign_owner(mod, node.args[1].value)
            if owner is not None:
                out.append(f"{mod}:{node.lineno}: {ast.unparse(node)} (an attribute of {owner or 'the package root'})")
    return out


def test_no_private_or_getattr_access_across_packages():
    """A package asks another's objects through their public methods: it never reads their
    private attributes (`aeng._streams`) nor probes them by name (`getattr(conn, "holder")`).
    A name counts as another package's when only that package (among the ones this module
    can reach through its imports) defines it."""
    bad = [line for mod in MODULES if group(mod) is not None
           for line in cross_package_reaches(mod)]
    assert not bad, "reaches into another package's objects:\n" + "\n".join(bad)
