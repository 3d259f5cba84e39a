"""What `up`, the demo and the benchmarks launch: the command lines of a worker and a router,
the KV-transfer configuration of a bidirectional pair, and `Cluster`, a router in front of N
prefill + N decode workers on localhost, started together and stopped together."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from duplexkv.http.auth import API_KEY_ENV, ROUTER_SECRET_ENV, WORKER_API_KEY_ENV
from duplexkv.launch.process import KV_SECRET_ENV, Proc, spawn, stop_all, wait_ready


def worker_args(model: str, kv: dict | None, *extra: str, host: str = "127.0.0.1",
                port: int = 0) -> list[str]:
    """`duplexkv serve`'s arguments (port 0: a free one)."""
    args = ["serve", model, "--host", host, "--port", str(port), *extra]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return args


def router_args(prefill: list[str], decode: list[str], *extra: str, host: str = "127.0.0.1",
                port: int = 0, store: str = "memory") -> list[str]:
    """`duplexkv router`'s arguments in front of the given workers' URLs."""
    return ["router", "--host", host, "--port", str(port), "--store", store,
            "--prefill", *prefill, "--decode", *decode, *extra]


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
    # the router's client keys, and the key between the router and the workers (default: a
    # random one made at start, so only the router reaches a worker). The workers' KV cluster
    # secret is $DUPLEXKV_KV_SECRET if set, else the launcher's random one (docs/security.md).
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
    worker_api_key: str | None = field(default=None, init=False, repr=False)  # set by start()

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
        worker_key = self.worker_api_key = s.worker_api_key or secrets.token_urlsafe(24)
        worker_env = {API_KEY_ENV: worker_key, WORKER_API_KEY_ENV: None}  # None: unset
        # (their KV secret: $DUPLEXKV_KV_SECRET, else the launcher's random one, process.py)
        router_secret = os.environ.get(ROUTER_SECRET_ENV) or secrets.token_hex(32)
        router_env = {API_KEY_ENV: ",".join(s.api_keys) or None, WORKER_API_KEY_ENV: worker_key,
                      KV_SECRET_ENV: None, ROUTER_SECRET_ENV: router_secret}
        try:
            for role, n in (("prefill", s.prefill), ("decode", s.decode)):
                for i in range(n):
                    extra = [*s.worker_args, *(s.prefill_args if role == "prefill"
                                               else s.decode_args)]
                    self.workers.append(self._spawn(f"{role}-{i}", worker_args(s.model, kv,
                                                                               *extra),
                                                    worker_env))
            wait_ready(self.workers, timeout_s)
            self.router = self._spawn("router", router_args(
                [p.url for p in self.prefill], [d.url for d in self.decode], *s.router_args,
                host=s.host, port=s.port, store=s.store), router_env)
            wait_ready([self.router], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def worker_headers(self) -> dict[str, str]:
        """What a caller of a worker's guarded paths (/v1/..., /debug/...) must send."""
        return {"authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else {}

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
