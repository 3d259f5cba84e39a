"""Installs like a real package: a worker needs only the core dependencies (the `bench`, `redis`
and `nixl` extras are for demo/bench, a Redis store and the NIXL transport), `duplexkv --version`,
an Apache-2.0 LICENSE. The worker below runs in a process where the extras' modules cannot be
imported, and serves a request."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx

import duplexkv
from duplexkv.launch import start, wait_ready, worker_env
from workers import DUPLEXKV

ROOT = Path(__file__).resolve().parent.parent
EXTRA_MODULES = ("rich", "matplotlib", "redis", "nixl", "transformers", "openai", "hypothesis")
# runs the CLI with the extras' modules made unimportable (None in sys.modules: ImportError)
WITHOUT_EXTRAS = ("import sys\nfor m in %r: sys.modules[m] = None\n"
                  "from duplexkv.cli import main\nsys.exit(main(sys.argv[1:]))\n" % (EXTRA_MODULES,))


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_dependencies_are_a_workers_and_extras_hold_the_rest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    assert not core & {"rich", "matplotlib", "redis", "nixl", "transformers"}, core
    extras = project["optional-dependencies"]
    assert _names(extras["nixl"]) == {"nixl"} and _names(extras["redis"]) == {"redis"}
    assert {"rich", "matplotlib"} <= _names(extras["bench"])
    assert "duplexkv[nixl,redis,bench]" in extras["test"]  # the suite gets everything
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and project["license"] == "Apache-2.0"


def test_demo_and_bench_come_from_the_benchmark_package_by_entry_points():
    """The runtime's CLI lists `demo` and `bench` because pyproject.toml's `duplexkv.commands`
    entry points name their parsers in duplexkv_bench, shipped in the same distribution (the
    runtime never imports it: test_layering.py)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["duplexkv.commands"]
    assert sorted(declared) == ["bench", "demo"]
    assert all(v.startswith("duplexkv_bench.") for v in declared.values()), declared
    assert "duplexkv_bench" in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = {ep.name: ep for ep in importlib.metadata.entry_points(group="duplexkv.commands")}
    assert {n: ep.value for n, ep in installed.items()} == declared  # the install is current
    assert all(callable(ep.load()) for ep in installed.values())
    r = subprocess.run([DUPLEXKV, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and " demo " in r.stdout and " bench " in r.stdout, r.stdout


def test_version():
    r = subprocess.run([DUPLEXKV, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == f"duplexkv {duplexkv.__version__}"
    assert importlib.metadata.version("duplexkv") == duplexkv.__version__


def test_a_worker_runs_without_the_extras(tiny_model_dir, tmp_path):
    w = start("w", [sys.executable, "-c", WITHOUT_EXTRAS, "serve", str(tiny_model_dir), "--port",
                    "0", "--dtype", "float32", "--num-kv-blocks", "32"], tmp_path, worker_env({}))
    try:
        wait_ready([w], timeout_s=120)
        r = httpx.post(w.url + "/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        w.stop(30)


def test_commands_that_need_an_extra_say_which(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], capture_output=True,
                              text=True, timeout=60, env=worker_env({}))

    r = run("demo")
    assert r.returncode == 2 and "pip install 'duplexkv[bench]'" in r.stderr, r.stderr
    r = run("router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--port", "0", "--store", "redis://127.0.0.1:1/0")
    assert r.returncode == 2 and "pip install 'duplexkv[redis]'" in r.stderr, r.stderr
    r = run("serve", "--help")
    assert r.returncode == 0 and "--served-model-name" in r.stdout
