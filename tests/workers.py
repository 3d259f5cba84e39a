"""Real `duplexkv serve` worker processes on loopback, for the multi-process tests, started by
the project's one launcher (duplexkv/launch) as `up` and the benchmarks start theirs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from duplexkv.launch import Proc, spawn, wait_ready, worker_args
from duplexkv.launch import worker_env as worker_env  # re-exported: tests build environments
from duplexkv.launch.ports import free_port as free_port  # re-exported: tests take ports here
from duplexkv.wire.kv_params import miss_params

DUPLEXKV = str(Path(sys.executable).parent / "duplexkv")
NO_KEYS = {"DUPLEXKV_API_KEY": None, "DUPLEXKV_WORKER_API_KEY": None}  # None: unset (worker_env)
# every test worker shares this cluster secret, so cross-worker pulls take the signed,
# authenticated path (docs/protocol.md, section 6); `secret=None` starts a loopback-only worker
TEST_SECRET = "duplexkv-test-cluster-secret-0123456789"
MISS = miss_params()  # the prefill leg's params with nothing to pull (wire/kv_params.py)


def skip_or_fail(reason: str) -> None:
    """Skip on a developer machine; fail under CI (CI=1, set by .ci/run), where a missing
    dependency must not turn half of a test module into green skips."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: required in CI)")
    pytest.skip(reason)


def need_nixl() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError:
        skip_or_fail("NIXL is not installed (make install adds it)")


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.05):
    """Poll `cond()` until it returns a truthy value; fail with `what` after `timeout_s` (generous:
    the suite runs on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(interval_s)


def raw_exchange(host: str, port: int, data: bytes, timeout_s: float = 10) -> bytes:
    """Send raw bytes on a new TCP connection; what came back until the peer closed it or went
    quiet for `timeout_s` (tests of what the HTTP servers do with malformed or slow input)."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got




@dataclass
class Worker:
    launched: Proc
    name: str = ""  # the served model name the tests send
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    @property
    def url(self) -> str:
        return self.launched.url

    @property
    def proc(self) -> subprocess.Popen:
        return self.launched.proc

    @property
    def log(self) -> Path:
        return self.launched.log

    def post(self, path: str, body: dict | str, **kw) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return self.client.post(self.url + path, content=content,
                                headers={"content-type": "application/json"}, **kw)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def health(self) -> dict:
        return self.get("/health").json()

    def kv(self) -> dict:
        return self.health()["kv_transfer"]

    def assert_integrity(self) -> dict:
        r = self.get("/debug/engine").json()
        assert r["integrity"] == "ok", r
        return r

    def stop(self, sig=signal.SIGTERM) -> None:
        self.launched.stop(sig=sig)
        self.client.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start_worker(model: str | Path, log: Path, *args: str, kv: dict | None = None,
                 timeout_s: float = 120, dtype: str | None = "float32",
                 env: dict | None = None, secret: str | None = TEST_SECRET) -> Worker:
    """`dtype=None` leaves --dtype out: the worker runs its default (bfloat16). `env` adds to the
    environment; an API key variable inherited from the caller's is dropped unless given here.
    `secret`: the KV cluster secret (DUPLEXKV_KV_SECRET), None for none (the KV plane is then
    loopback only). Its output goes to `log` (LOG.log: the process's name is the file's stem);
    a worker that fails to start raises LaunchError with the log's last lines."""
    name = Path(model).name  # the served name the tests use (the default is `model` as given)
    named = () if {"--served-model-name", "--config"} & set(args) else \
        ("--served-model-name", name)
    argv = worker_args(str(model), kv, *(("--dtype", dtype) if dtype else ()), *named, *args)
    p = spawn(log.stem, argv, log.parent, {"UCX_NET_DEVICES": "lo",
                                           "DUPLEXKV_KV_SECRET": secret, **(env or {})})
    try:
        wait_ready([p], timeout_s)
    except BaseException:
        p.kill()
        raise
    return Worker(p, name)


def send_json(handler, status: int, body: dict) -> None:
    """A stand-in server's JSON answer (`http.server.BaseHTTPRequestHandler`)."""
    raw = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


@contextlib.contextmanager
def stopping(*procs):
    """`with stopping(a, b) as (a, b)` / `with stopping(r) as r`: stopped on the way out (a
    module fixture's `yield` inside it)."""
    try:
        yield procs if len(procs) > 1 else procs[0]
    finally:
        for proc in procs:
            proc.stop()


def start_p_and_d(model: str | Path, tmp: Path, *args: str, kv: dict, p_args: tuple = (),
                  d_args: tuple = (), p_env: dict | None = None,
                  d_env: dict | None = None) -> tuple[Worker, Worker]:
    """A P (without a local prefix cache, as in the reference evaluation: every reused token is
    pulled) and a D, started at once; `p_args`/`d_args` and `p_env`/`d_env` are for one of them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(start_worker, model, tmp / "p.log", *args, "--no-enable-prefix-caching",
                        *p_args, kv=kv, env=p_env)
        d = pool.submit(start_worker, model, tmp / "d.log", *args, *d_args, kv=kv, env=d_env)
        return p.result(), d.result()


def kv_config(connector: str, **extra) -> dict:
    """The tests of the transfer machinery pull under the fixed rule (a 64-token gain), as a
    tiny model recomputes a short history faster than a loopback round trip and the cost model
    would rightly decline; `kv_recompute_threshold=None` leaves the cost model in charge."""
    extra.setdefault("kv_recompute_threshold", 64)
    if extra["kv_recompute_threshold"] is None:
        del extra["kv_recompute_threshold"]
    return {"kv_connector": connector, "kv_role": "kv_both",
            "kv_load_failure_policy": extra.pop("policy", "recompute"),
            "kv_connector_extra_config": extra}


def prefill_leg(p: Worker, path: str, body: dict, params: dict | None = None) -> dict:
    """The router's P leg: max_tokens=1, no stream; returns P's response JSON."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=params or dict(MISS))
    r = p.post(path, leg)
    assert r.status_code == 200, r.text
    return r.json()


def decode_leg(d: Worker, path: str, body: dict, params: dict | None) -> httpx.Response:
    return d.post(path, {**body, "kv_transfer_params": params})


def sse_events(resp: httpx.Response) -> list[dict]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert resp.text.rstrip().endswith("data: [DONE]")
    return out
