"""Start `duplexkv` server processes on localhost and wait until they serve (for `up`, the demo
and the benchmarks). Each process logs to its own file; a failed start raises with its tail.

    spawn / wait_ready / stop_all   single processes
    Cluster(ClusterSpec)            a router in front of N prefill + N decode workers
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from duplexkv.http.auth import API_KEY_ENV, WORKER_API_KEY_ENV

READY = re.compile(r"(?:serving .* on|router listening on) (http://[\w.\-\[\]:]+:\d+)")


class LaunchError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str = ""

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def stop_all(procs: list[Proc], timeout_s: float = 20) -> None:
    """SIGTERM to every process at once, then wait for each (SIGKILL after `timeout_s`)."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux), so a launcher that is
    killed outright leaves no orphans."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# Several workers share the cores of one machine. OpenMP threads that spin while waiting for
# work (libgomp's default) steal those cores from the other worker: P prefilling while D
# decodes, 2 threads each on 2 cores, ran 2.4-3.5x slower than with passive waiting, which costs
# nothing for a worker running alone (`duplexkv bench omp_contention`). The user's setting wins.
# oneDNN keeps a JIT-compiled matmul per input shape in two LRU caches (its primitive cache and
# ideep's), 1024 entries each by default: in bf16 on an AMX CPU every new prefill length adds
# ~0.3 MB there, so a worker's RSS rose by ~600 MB before the caches filled. 256 entries still
# hold every decode batch size (<= 64 per weight shape). (Free heap memory is returned by the
# engine's periodic malloc_trim: engine/memory.py.)
WORKER_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
                       "LRU_CACHE_CAPACITY": "256"}


def worker_env(extra: dict | None = None) -> dict:
    """A worker's environment: the defaults above, then ours, loopback UCX unless set, `extra`
    (a None value there removes the variable)."""
    env = {**WORKER_ENV_DEFAULTS, **os.environ,
           "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(extra or {})}
    return {k: v for k, v in env.items() if v is not None}


def spawn(name: str, args: list[str], log_dir: Path, env: dict | None = None,
          die_with_parent: bool = False, prefix: tuple[str, ...] = ()) -> Proc:
    """Start `duplexkv ARGS` in its own session (a terminal's Ctrl-C goes to the launcher only).
    `die_with_parent` ties the child to the calling thread's life: spawn from the main thread.
    API key variables are not inherited: a child gets keys only through `env`. `prefix` runs the
    command through another that execs it (e.g. `ip netns exec NS`, duplexkv_bench/hosts)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    cmd = [*prefix, sys.executable, "-m", "duplexkv.cli", *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env=worker_env({API_KEY_ENV: None, WORKER_API_KEY_ENV: None,
                                                **(env or {})}),
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent if die_with_parent else None)
    return Proc(name, proc, log)


def wait_ready(procs: list[Proc], timeout_s: float = 300) -> None:
    """Wait until every process printed its URL and answers /health; raise on any failure."""
    deadline = time.monotonic() + timeout_s
    pending = [p for p in procs if not p.url]
    while pending:
        for p in list(pending):
            if not p.alive():
                raise LaunchError(f"{p.name} exited with code {p.proc.returncode} during "
                                  f"start-up; last lines of {p.log}:\n{p.tail()}")
            m = READY.search(p.log.read_text(errors="replace"))
            if m:
                try:
                    if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                        p.url = m.group(1)
                        pending.remove(p)
                except httpx.HTTPError:
                    pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise LaunchError(f"{names} not ready after {timeout_s:.0f}s; see "
                              f"{pending[0].log}:\n{pending[0].tail()}")
        time.sleep(0.1)


def worker_args(model: str, kv: dict | None, *extra: str, port: int = 0) -> list[str]:
    args = ["serve", model, "--host", "127.0.0.1", "--port", str(port), *extra]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return args


def bidirectional_kv(connector: str = "TcpConnector", enabled: bool = True, **extra) -> dict:
    return {"kv_connector": connector, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": enabled, **extra}}


@dataclass(frozen=True)
class ClusterSpec:
    model: str = "bench"  # a preset (made once, here, before any worker starts) or a directory
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # the router's; 0 = a free port (workers always take free ports)
    store: str = "memory"
    bidirectional: bool = True
    connector: str = "TcpConnector"
    worker_args: tuple[str, ...] = ()  # extra `serve` flags for every worker
    prefill_args: tuple[str, ...] = ()  # ... for prefill workers only (the benchmark passes
    decode_args: tuple[str, ...] = ()  # --no-enable-prefix-caching, as in AWS's evaluation)
    router_args: tuple[str, ...] = ()  # extra `router` flags (e.g. --placement auto)
    # extra kv_connector_extra_config keys for every worker (e.g. kv_recompute_threshold)
    kv_extra: dict = field(default_factory=dict)
    log_dir: Path | None = None  # default: a new temporary directory
    # API keys, passed to the processes by environment (never on a command line or in a log):
    # the router's client keys, and the key between the router and the workers (default with
    # client keys: a random one made at start; with neither, everything runs without keys)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    worker_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode worker")


@dataclass
class Cluster:
    """A router and its workers on localhost, started together and stopped together.

    start() raises LaunchError (with the failing process's log tail) after stopping whatever it
    had started; stop() stops the router first, then every worker at once."""

    spec: ClusterSpec
    on_event: Callable[[str], None] = lambda _msg: None
    log_dir: Path = field(init=False)
    workers: list[Proc] = field(default_factory=list, init=False)
    router: Proc | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.log_dir = self.spec.log_dir or Path(tempfile.mkdtemp(prefix="duplexkv-up-"))

    @property
    def url(self) -> str:
        return self.router.url if self.router else ""

    @property
    def prefill(self) -> list[Proc]:
        return [w for w in self.workers if w.name.startswith("prefill")]

    @property
    def decode(self) -> list[Proc]:
        return [w for w in self.workers if w.name.startswith("decode")]

    @property
    def procs(self) -> list[Proc]:
        return [*self.workers, *([self.router] if self.router else [])]

    def _spawn(self, name: str, args: list[str], env: dict) -> Proc:
        p = spawn(name, args, self.log_dir, env, die_with_parent=True)
        self.on_event(f"started {name} (pid {p.proc.pid}, log {p.log})")
        return p

    def start(self, timeout_s: float = 300) -> Cluster:
        s = self.spec
        from duplexkv.model.registry import resolve_model

        resolve_model(s.model)  # a preset is made once here, not raced by every worker
        kv = bidirectional_kv(s.connector, s.bidirectional, **s.kv_extra)
        worker_key = s.worker_api_key or (secrets.token_urlsafe(24) if s.api_keys else None)
        worker_env = {API_KEY_ENV: worker_key, WORKER_API_KEY_ENV: None}  # None: unset
        router_env = {API_KEY_ENV: ",".join(s.api_keys) or None, WORKER_API_KEY_ENV: worker_key}
        try:
            for role, n in (("prefill", s.prefill), ("decode", s.decode)):
                for i in range(n):
                    extra = [*s.worker_args, *(s.prefill_args if role == "prefill"
                                               else s.decode_args)]
                    self.workers.append(self._spawn(f"{role}-{i}", worker_args(s.model, kv,
                                                                               *extra),
                                                    worker_env))
            wait_ready(self.workers, timeout_s)
            self.router = self._spawn("router", [
                "router", "--host", s.host, "--port", str(s.port), "--store", s.store,
                "--prefill", *(p.url for p in self.prefill),
                "--decode", *(d.url for d in self.decode), *s.router_args], router_env)
            wait_ready([self.router], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def dead(self) -> Proc | None:
        """The first process that has exited, if any."""
        return next((p for p in self.procs if not p.alive()), None)

    def stop(self, timeout_s: float = 20) -> None:
        if self.router:
            stop_all([self.router], timeout_s)
        stop_all(self.workers, timeout_s)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
