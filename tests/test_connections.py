"""Issue 32, bounded connections: idle and slow clients cannot take a worker or the router offline.

Measured on main before the change, under a 1,024 open-files limit: 1,100 idle connections made
accept() fail with EMFILE thousands of times a second (300 MB of log in 93 s), /health and a real
request timed out, and no idle or slowloris connection was ever closed; a chunk size of
FFFFFFFFFFFFFFFF or 4 KB of junk without CRLF got no answer. Here the worker and the router run
as real processes at their defaults, started under `prlimit --nofile=1024:1024` (soft AND hard,
so raising the soft limit at start cannot escape it)."""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_router import ARGS, MODEL, bidi
from workers import Worker, raw_exchange, start_worker

from duplexkv.http.connections import DEFAULT_REQUEST_TIMEOUT_S
from duplexkv.launch import spawn, wait_ready, worker_args

LIMIT = ("prlimit", "--nofile=1024:1024")
IDLE, SLOW = 1100, 300
HEALTH_BOUND_S = 2.0  # each /health under the flood (a loaded 2-core machine)
COMPLETION_BOUND_S = 15.0  # a real 8-token completion under the flood
LOG_BOUND_BYTES = 20_000  # log growth during the whole flood
CLOSE_MARGIN_S = 15.0  # after the request deadline, for a loaded machine


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("connections")


@pytest.fixture(scope="module", autouse=True)
def own_files():
    """This process holds the flood's sockets: its soft limit up to its hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * (IDLE + SLOW) + 200:
        pytest.skip(f"the test needs {2 * (IDLE + SLOW) + 200} open files, the hard limit is "
                    f"{hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):
    """P as usual; D and the router under the 1,024 limit."""
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, "--no-enable-prefix-caching",
                     kv=bidi())
    name = Path(tiny_model_dir).name
    d_proc = spawn("d", worker_args(str(tiny_model_dir), bidi(), "--dtype", "float32",
                                    "--served-model-name", name, *ARGS), tmp,
                   {"UCX_NET_DEVICES": "lo", "DUPLEXKV_KV_SECRET":
                    "duplexkv-test-cluster-secret-0123456789"}, prefix=LIMIT)
    r_proc = None
    try:
        wait_ready([d_proc], 120)
        d = Worker(d_proc, name)
        r_proc = spawn("router", ["router", "--prefill", p.url, "--decode", d.url, "--port", "0"],
                       tmp, prefix=LIMIT)
        wait_ready([r_proc], 60)
        yield d, r_proc, name
    finally:
        for proc in (r_proc, d_proc, p):
            if proc is not None:
                proc.stop()


def open_flood(url: str, n: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    out = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.setblocking(False)
        out.append(s)
    return out


def closed(s: socket.socket) -> bool:
    """The server closed it (EOF after any answer, or a reset)."""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def slowloris(socks: list[socket.socket], stop: threading.Event) -> None:
    """A request line, then one header line a second: never a complete request."""
    for s in socks:
        try:
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            pass
    while not stop.wait(1.0):
        for s in socks:
            try:
                s.send(b"X-Slow: 1\r\n")
            except OSError:
                pass


def flood_and_check(url: str, log: Path, completion_body: dict, path: str) -> dict:
    size0 = log.stat().st_size
    t0 = time.monotonic()
    idle = open_flood(url, IDLE)
    slow = open_flood(url, SLOW)
    opened = time.monotonic()
    stop = threading.Event()
    loris = threading.Thread(target=slowloris, args=(slow, stop), daemon=True)
    loris.start()
    try:
        time.sleep(1.0)  # the server is accepting and shedding them now
        health = []
        with httpx.Client(timeout=30) as c:
            for _ in range(5):
                t = time.monotonic()
                r = c.get(url + "/health")
                health.append(time.monotonic() - t)
                assert r.status_code == 200, r.text
            t = time.monotonic()
            r = c.post(url + path, json=completion_body)
            completion_s = time.monotonic() - t
            assert r.status_code == 200, r.text
        assert max(health) < HEALTH_BOUND_S, health
        assert completion_s < COMPLETION_BOUND_S, completion_s
        everyone = idle + slow
        deadline = opened + DEFAULT_REQUEST_TIMEOUT_S + CLOSE_MARGIN_S
        while time.monotonic() < deadline:
            still = [s for s in everyone if not closed(s)]
            if not still:
                break
            time.sleep(0.5)
        still = [s for s in everyone if not closed(s)]
        assert not still, f"{len(still)} of {len(everyone)} flood connections still open " \
                          f"{time.monotonic() - opened:.0f} s after opening"
        closed_after = time.monotonic() - opened
    finally:
        stop.set()
        loris.join()
        for s in idle + slow:
            s.close()
    grew = log.stat().st_size - size0
    assert grew < LOG_BOUND_BYTES, f"the log grew {grew} bytes: {log.read_text()[-3000:]}"
    return {"health_s": max(health), "completion_s": completion_s, "closed_s": closed_after,
            "log_bytes": grew, "total_s": time.monotonic() - t0}


def test_worker_survives_idle_and_slow_flood(cluster):
    d, _, name = cluster
    got = flood_and_check(d.url, d.log, {"model": name, "prompt": "hello", "max_tokens": 8,
                                         "temperature": 0}, "/v1/completions")
    print("worker", got)


def test_router_survives_idle_and_slow_flood(cluster):
    _, router, name = cluster
    got = flood_and_check(router.url, router.log, {
        "model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "temperature": 0}, "/v1/chat/completions")
    print("router", got)


CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n\r\n")


PAYLOADS = {
    "junk-without-crlf": b"A" * 4096,
    "huge-chunk-size": CHUNKED + b"FFFFFFFFFFFFFFFF\r\n{\"prompt\":",
    "never-finished-body": CHUNKED + b"5\r\n{\"pro",
}


def test_unfinished_requests_get_an_answer(cluster):
    """Each got no answer at all before; now a 4xx within the request deadline (all at once on
    the worker and on the router)."""
    from concurrent.futures import ThreadPoolExecutor

    d, router, _ = cluster
    bound = DEFAULT_REQUEST_TIMEOUT_S + CLOSE_MARGIN_S

    def one(url: str, payload: bytes) -> tuple[bytes, float]:
        t = time.monotonic()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return raw_exchange(host, int(port), payload, bound), time.monotonic() - t

    cases = [(who, url, what) for who, url in (("worker", d.url), ("router", router.url))
             for what in PAYLOADS]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: one(c[1], PAYLOADS[c[2]]), cases))
    for (who, _, what), (answer, took) in zip(cases, got):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 4"), (who, what, answer[:300])
        assert took < bound, (who, what, took)
        if head.startswith(b"HTTP/1.1 408"):
            assert json.loads(body)["error"]["code"] == 408, (who, what, body)
