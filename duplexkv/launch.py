"""Start `duplexkv` server processes on localhost and wait until they serve (for `up`, the demo
and the benchmarks). Each process logs to its own file; a failed start raises with its tail."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

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


def spawn(name: str, args: list[str], log_dir: Path, env: dict | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "duplexkv.cli", *args]
    full_env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
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
