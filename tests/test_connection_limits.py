"""The bounded HTTP server's rules one by one, on an in-process server with a stand-in app and
small limits (the settings under test); the real worker and router at their defaults are in
test_connections.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import pytest

from duplexkv.http.connections import ConnectionLimits, raise_open_files
from duplexkv.http.log_repeats import RepeatFilter
from duplexkv.http.uvicorn_server import bounded_server
from workers import raw_exchange

DEADLINE_S = 0.6
SLOW_S = 1.5  # the app's own time: longer than the deadline, never cut


async def app(scope, receive, send):
    """Reads the body, then thinks SLOW_S (path /slow) and streams 3 chunks SLOW_S apart
    (/stream), or answers at once."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"] == "/hold":
        await asyncio.sleep(30)
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for i in range(3):
            await send({"type": "http.response.body", "body": b"chunk%d\n" % i,
                        "more_body": True})
            await asyncio.sleep(SLOW_S / 2)
    await send({"type": "http.response.body", "body": b"ok " + body})


@pytest.fixture(scope="module")
def server():
    limits = ConnectionLimits(max_connections=6, max_pending=3, request_timeout_s=DEADLINE_S)
    srv = bounded_server(app, "127.0.0.1", 0, limits, collapse_logs=False, lifespan="off")
    srv.capture_signals = contextlib.nullcontext  # signals belong to the main thread
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield port, srv
    srv.should_exit = True
    thread.join(10)


def request(port: int, raw: bytes, timeout_s: float = 10) -> tuple[bytes, float]:
    t = time.monotonic()
    got = raw_exchange("127.0.0.1", port, raw, timeout_s)
    return got, time.monotonic() - t


def get(path: str, close: bool = True) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + ("connection: close\r\n" if close else "")
            + "\r\n").encode()


def test_slow_app_and_long_stream_are_not_cut(server):
    port, _ = server
    got, took = request(port, get("/slow"))
    assert got.startswith(b"HTTP/1.1 200") and b"\r\nok \r\n0\r\n" in got, got
    assert took >= SLOW_S
    got, took = request(port, get("/stream"))
    assert got.startswith(b"HTTP/1.1 200") and b"chunk2" in got and b"ok " in got, got
    assert took >= SLOW_S


def test_trickled_body_gets_408_at_the_deadline(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\nabc")
        t = time.monotonic()
        got = s.recv(65536)
        took = time.monotonic() - t
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), got
    assert json.loads(body)["error"]["code"] == 408
    assert took < DEADLINE_S + 2


def test_silent_connection_closed_without_answer(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t = time.monotonic()
        assert s.recv(100) == b""
        assert time.monotonic() - t < DEADLINE_S + 2


def test_pending_cap_evicts_the_oldest_not_the_newcomer(server):
    port, _ = server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    try:
        got, took = request(port, get("/"))
        assert got.startswith(b"HTTP/1.1 200"), got
        assert took < DEADLINE_S  # answered, not waiting for the idle ones' deadline
        idle[0].settimeout(DEADLINE_S / 2)
        assert idle[0].recv(100) == b""  # the oldest was closed to make room
    finally:
        for s in idle:
            s.close()


def test_full_server_answers_503_in_openai_shape(server):
    port, srv = server
    busy = []
    try:
        for _ in range(6):  # every slot holds a request in progress
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(get("/hold"))
            busy.append(s)
            time.sleep(0.1)  # read before the next one connects (else it is pending, evictable)
        time.sleep(0.3)
        got, _ = request(port, get("/"))
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), got
        assert json.loads(body)["error"]["type"] == "service_unavailable_error"
        assert srv.connection_gate.refused >= 1
    finally:
        for s in busy:
            s.close()


def test_raise_open_files_reaches_the_hard_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert raise_open_files() == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_limits_leave_room_for_the_process():
    assert ConnectionLimits.for_files(1024) == ConnectionLimits(896, 448, 10.0)
    assert ConnectionLimits.for_files(1024, per_connection=2).max_connections == 448
    assert ConnectionLimits.for_files(1 << 20).max_connections == 8192
    with pytest.raises(ValueError):
        ConnectionLimits.for_files(1024, max_connections=0)


def test_repeated_errors_logged_once_per_interval_with_a_count():
    now = [0.0]
    f = RepeatFilter(10.0, clock=lambda: now[0])
    rec = lambda: logging.LogRecord("asyncio", logging.ERROR, "", 0,  # noqa: E731
                                    "socket.accept() out of system resource", (), None)
    passed = []
    for i in range(10_000):
        now[0] = i * 0.0001  # 10,000 a second for 1 s
        r = rec()
        if f.filter(r):
            passed.append(r.getMessage())
    now[0] = 11.0
    r = rec()
    assert f.filter(r)
    passed.append(r.getMessage())
    assert len(passed) == 2, passed
    assert "9999 more times" in passed[1], passed[1]
    info = logging.LogRecord("x", logging.INFO, "", 0, "a request", (), None)
    assert f.filter(info) and f.filter(info)  # info lines are never collapsed


def test_stream_on_a_reused_connection_is_not_cut(server):
    """A keep-alive connection's second request, streaming past the deadline, runs to its end."""
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(get("/", close=False))
        first = b""  # the whole first answer (chunked: headers and body may come in two reads)
        while not first.endswith(b"\r\n0\r\n\r\n"):
            chunk = s.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200"), first
        time.sleep(DEADLINE_S / 2)
        s.sendall(get("/stream", close=True))
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200") and b"chunk2" in got and b"ok " in got, got


def test_body_in_parts_then_a_long_stream_is_not_cut(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nconnection: close\r\n"
                  b"content-length: 6\r\n\r\nabc")
        time.sleep(DEADLINE_S / 3)
        s.sendall(b"def")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200") and b"chunk2" in got and b"ok abcdef" in got, got
