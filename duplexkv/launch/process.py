"""One started process: its command in its own session, its output in a log file of its own,
ready once it serves, stopped by SIGTERM then SIGKILL. Every process `up`, the demo, the
benchmarks, the multi-host harness and the tests start goes through `start` (another program,
e.g. vLLM's server) or `spawn` (`duplexkv ARGS`, in a worker's environment).

    p = spawn("decode-0", worker_args(...), log_dir)   # or start(name, argv, log_dir, env, url=)
    wait_ready([p])                                    # its URL, then /health answers 200
    p.stop()                                           # or stop_all([...]): all at once
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from duplexkv.engine.process_env import WORKER_ENV_DEFAULTS
from duplexkv.http.auth import API_KEY_ENV, WORKER_API_KEY_ENV
from duplexkv.kv.auth import ENV as KV_SECRET_ENV

READY = re.compile(r"(?:serving .* on|router listening on) (http://[\w.\-\[\]:]+:\d+)")


class LaunchError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str = ""  # where it serves: from its log's first line saying so, or given at start
    ready: bool = False  # set by wait_ready
    stop_timeout_s: float = 20  # how long stop() waits after SIGTERM before SIGKILL

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float | None = None, sig: int = signal.SIGTERM) -> None:
        """`sig`, then SIGKILL if it has not exited after `timeout_s` (default: its own)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
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


# The KV cluster secret of every process this launcher starts, unless the environment or the
# caller sets one: workers started together authenticate each other, and nothing else on the
# host can feed them KV or read theirs (docs/security.md). Passed by environment, never argv.
LAUNCH_SECRET = secrets.token_hex(32)


def worker_env(extra: dict | None = None) -> dict:
    """A worker's environment: WORKER_ENV_DEFAULTS (which the worker also sets itself:
    engine/process_env.py; here too, so the process has them from exec on) and the launcher's KV
    secret, then ours, loopback UCX unless set, `extra` (a None value there removes the
    variable)."""
    env = {**WORKER_ENV_DEFAULTS, KV_SECRET_ENV: LAUNCH_SECRET, **os.environ,
           "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(extra or {})}
    return {k: v for k, v in env.items() if v is not None}


def start(name: str, argv: list[str], log_dir: Path, env: dict | None = None,
          die_with_parent: bool = False, url: str = "") -> Proc:
    """Start `argv` in its own session (a terminal's Ctrl-C goes to the launcher only), its
    output to `log_dir/NAME.log`. `env` is the whole environment (None: ours). `url`: where it
    will serve, when its log does not say. `die_with_parent` ties the child to the calling
    thread's life: start from the main thread."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent if die_with_parent else None)
    return Proc(name, proc, log, url)


def spawn(name: str, args: list[str], log_dir: Path, env: dict | None = None,
          die_with_parent: bool = False, prefix: tuple[str, ...] = ()) -> Proc:
    """`start` of `duplexkv ARGS` in a worker's environment (worker_env) plus `env`. API key
    variables are not inherited: a child gets keys only through `env`. `prefix` runs the
    command through another that execs it (e.g. `ip netns exec NS`, duplexkv_bench/hosts)."""
    return start(name, [*prefix, sys.executable, "-m", "duplexkv.cli", *args], log_dir,
                 worker_env({API_KEY_ENV: None, WORKER_API_KEY_ENV: None, **(env or {})}),
                 die_with_parent)


def _serves(p: Proc, probe: str | None) -> bool:
    if not p.url:
        m = READY.search(p.log.read_text(errors="replace"))
        if m is None:
            return False
        p.url = m.group(1)
    if probe is None:
        return True
    try:
        return httpx.get(p.url + probe, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(procs: list[Proc], timeout_s: float = 300, probe: str | None = "/health") -> None:
    """Wait until every process serves: its URL known (its log says it), then `probe` answers
    200 (None: the URL is enough, as for a router whose workers may be down); raise LaunchError
    with the log's last lines when one exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = [p for p in procs if not p.ready]
    while pending:
        for p in list(pending):
            if not p.alive():
                raise LaunchError(f"{p.name} exited with code {p.proc.returncode} during "
                                  f"start-up; last lines of {p.log}:\n{p.tail()}")
            if _serves(p, probe):
                p.ready = True
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise LaunchError(f"{names} not ready after {timeout_s:.0f}s; see "
                              f"{pending[0].log}:\n{pending[0].tail()}")
        time.sleep(0.1)
