"""The documentation holds together: the README is a front door (the two set-up commands, the
architecture and the reuse parameters on its first screen, at most 300 lines), every relative link
in README.md, docs/**/*.md and tests/README.md reaches an existing file (and heading), every test
that tests/README.md names as the proof of a claim exists, the sources point at doc pages that
exist, and every source path or module the docs and sources name exists. Pure file reading: no
process, no model."""

import ast
import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PAGES = sorted([ROOT / "README.md", TESTS / "README.md", *(ROOT / "docs").rglob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a fenced line becomes empty)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def anchors(path: Path) -> Iterator[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as '-', repeats
    numbered."""
    seen: dict[str, int] = {}
    for line in prose(path):
        if m := HEADING.match(line):
            slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            yield slug if n == 0 else f"{slug}-{n}"


def links(path: Path) -> Iterator[tuple[int, str]]:
    for lineno, line in enumerate(prose(path), 1):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                yield lineno, target


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    screen = "\n".join(lines[:50])
    for needed in ("make demo", "make test",                                 # the two commands
                   "router", "P worker", "D worker", "kv_transfer_params",   # the diagram
                   "bidirectional_kv_xfer", "kv_recompute_threshold",        # the reuse parameters
                   "decoder_kv_lease_duration", "decoder_kv_blocks_ttl"):
        assert needed in screen, f"{needed!r} is not on the README's first screen (50 lines)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for lineno, target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}:{lineno}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            bad.append(f"{page.relative_to(ROOT)}:{lineno}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def functions_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test"):
                names.add(node.name)
    return names


TEST_REF = re.compile(r"^(?:(test_\w+\.py))?::(\*|[\w*]+)(?:\[[^\]]*\])?$")


def test_every_test_named_as_a_proof_exists():
    """Each row of tests/README.md's 'What the tests prove' names at least one test, and every test
    it names (file::name, ::name for the file before, file::* , name_* patterns, [params]) exists;
    so do the bare test names of the 'removing a feature' paragraph."""
    text = (TESTS / "README.md").read_text()
    section = text.split("## What the tests prove", 1)[1]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| claim") and "---" not in line]
    assert len(rows) >= 80, f"only {len(rows)} claims found"
    functions = {p.name: functions_of(p) for p in TESTS.glob("test_*.py")}
    missing, checked = [], 0
    for row in rows:
        cell = row.rstrip().rstrip("|").rsplit("|", 1)[-1]
        refs = [r for r in re.findall(r"`([^`]+)`", cell) if TEST_REF.match(r)]
        assert refs, f"claim without a test: {row[:100]}"
        current = None
        for ref in refs:
            file, name = TEST_REF.match(ref).groups()
            current = file or current
            if current not in functions:
                missing.append(f"{ref}: no file tests/{current}")
            elif name != "*" and not fnmatch.filter(functions[current], name):
                missing.append(f"{ref}: no test {name} in tests/{current}")
            checked += 1
    every = set().union(*functions.values())
    tail = section.split("Removing a feature makes a test fail", 1)[1]
    for name in re.findall(r"`(test_\w+)(?:\[[^\]]*\])?`", tail):
        checked += 1
        if name not in every:
            missing.append(f"{name}: no such test")
    assert not missing, "\n".join(missing)
    assert checked >= 140  # a parser that silently matched nothing would pass the rest


def test_sources_point_at_pages_that_exist():
    """Docstrings and comments name doc pages by path (docs/x.md, tests/README.md), never 'the
    README' for a detail that now lives in docs/."""
    sources = [*(ROOT / "duplexkv").rglob("*.py"), *(ROOT / "duplexkv").rglob("*.[ch]"),
               *(ROOT / "duplexkv_bench").rglob("*.py"), *TESTS.glob("*.py"),
               *(ROOT / "scripts").glob("*")]
    bad = []
    for path in sources:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        for ref in re.findall(r"\b((?:docs|tests)/[\w./-]+\.md)\b", text):
            if not (ROOT / ref).exists():
                bad.append(f"{path.relative_to(ROOT)}: {ref}")
        if re.search(r"\bREADME\b(?!\.md)", text):
            bad.append(f"{path.relative_to(ROOT)}: says 'README' instead of naming the docs page")
    assert not bad, "\n".join(bad)


SOURCE_PATH = re.compile(r"(?<![\w./~-])(duplexkv(?:_bench)?(?:/[\w.-]+)+)")
MODULE = re.compile(r"(?<![\w./~-])(duplexkv(?:_bench)?(?:\.[a-z_]\w*)+)")


def names_a_module(dotted: str) -> bool:
    """`a.b.c` is a module or package of ours, or one's attribute (`duplexkv.cli:main`'s left
    side, `duplexkv.launch.spawn`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return n >= len(parts) - 1
    return False


def test_source_paths_and_modules_named_exist():
    """A path like duplexkv/launch/process.py or a module like duplexkv_bench.vllm_venv named in
    the docs, the sources, the scripts, the Makefile or pyproject.toml exists: code that moves
    takes its mentions along."""
    texts = [*PAGES, *(ROOT / "duplexkv").rglob("*.py"), *(ROOT / "duplexkv_bench").rglob("*.py"),
             *TESTS.glob("*.py"), *(ROOT / "scripts").glob("*"), ROOT / "Makefile",
             ROOT / "pyproject.toml"]
    bad = []
    for path in texts:
        text = path.read_text(errors="replace")
        for ref in SOURCE_PATH.findall(text):
            if not (ROOT / ref.rstrip(".")).exists():
                bad.append(f"{path.relative_to(ROOT)}: {ref}")
        for ref in MODULE.findall(text):
            if not names_a_module(ref.rstrip(".")):
                bad.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not bad, "\n".join(bad)
