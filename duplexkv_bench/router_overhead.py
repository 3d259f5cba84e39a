"""Router overhead: the same non-streaming chat requests sent directly to a worker and through
`duplexkv router`, in one run.

Backends are stub OpenAI servers in this script (raw asyncio, a canned answer in ~20 us), so
what is measured is the router, not a model: a P stub answers the P leg with P-shaped
`kv_transfer_params`, a D stub answers with D-shaped ones (so the router stores and replays
conversations as it would in front of real workers). The load generator is a raw asyncio
keep-alive HTTP/1.1 client, equally cheap for both paths.

    latency     concurrency 1, direct and routed requests interleaved; p50/p90/p99 and the
                difference (the router does two upstream round trips: the P leg and the D leg)
    throughput  N concurrent clients through the router for a fixed number of requests

Targets (issue 5): router adds <= 2 ms at p50; >= 500 requests/s on one router process. The stub
process, the router and the load generator share this machine's cores: the req/s figure is a
lower bound on what the router does with a core of its own.

    .venv/bin/python duplexkv bench router_overhead [--requests 2000] [--concurrency 32]
        [--upstream-http fast|httpcore]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from duplexkv.launch import Proc, router_args, spawn, wait_ready

KV_STATS = {"local_hit_tokens": 0, "pulled_tokens": 0, "computed_tokens": 20,
            "transfer_bytes": 0, "transfer_ms": 0.0, "queue_ms": 0.1, "prefill_ms": 1.0,
            "preemptions": 0, "pull_outcome": ""}


def params(role: str) -> dict:
    p = role == "prefill"
    return {"do_remote_prefill": p, "do_remote_decode": not p, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": f"stub-{role}", "remote_request_id": "r-1",
            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "dcp_size": 1,
            "pp_size": 1, "remote_num_tokens": 40, "remote_blocks_expiry_time": None if p else
            1e9, "transfer_mode": "pull"}


def canned(role: str) -> bytes:
    body = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "message": {"role": "assistant",
                                                 "content": "Hello from the stub worker."},
                         "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47,
                      "prompt_tokens_details": {"cached_tokens": 0}},
            "kv_stats": KV_STATS, "kv_transfer_params": params(role)}
    return json.dumps(body, separators=(",", ":")).encode()


# --- stub worker (run in a child process: `--stub P_PORT D_PORT`) ---
class StubProtocol(asyncio.Protocol):
    def __init__(self, role: str) -> None:
        self.answer = canned(role)
        self.models = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}
                                 ).encode()
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1")
            m = re.search(r"(?im)^content-length:\s*(\d+)", head)
            size = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + size:
                return
            self.buf = self.buf[end + 4 + size:]
            path = head.split(" ", 2)[1]
            body = (self.answer if path.startswith("/v1/") and head.startswith("POST")
                    else self.models if path == "/v1/models" else b'{"status":"ok"}')
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))


async def run_stubs(p_port: int, d_port: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: StubProtocol("prefill"), "127.0.0.1", p_port)
    await loop.create_server(lambda: StubProtocol("decode"), "127.0.0.1", d_port)
    print("stubs ready", flush=True)
    await asyncio.Event().wait()


# --- load generator ---
class Conn:
    """One keep-alive HTTP/1.1 connection; answers must carry content-length."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, path: str, body: bytes, headers: str = "") -> tuple[int, bytes]:
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: "
                          f"application/json\r\n{headers}content-length: {len(body)}\r\n\r\n"
                          .encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?i)content-length:\s*(\d+)", head)
        data = await self.reader.readexactly(int(m.group(1)))
        return int(head.split(b" ", 2)[1]), data

    def close(self) -> None:
        self.writer.close()


def body(i: int) -> bytes:
    return json.dumps({"model": "stub", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": f"tool output {i}: " + "ok; " * 40}]}).encode()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def latency(direct: Conn, routed: Conn, n: int) -> tuple[list[float], list[float]]:
    d_times, r_times = [], []
    for i in range(n):
        for conn, times in ((direct, d_times), (routed, r_times)):
            t0 = time.perf_counter()
            status, _ = await conn.post("/v1/chat/completions", body(i),
                                        f"x-session-id: lat-{i % 50}\r\n")
            times.append((time.perf_counter() - t0) * 1e3)
            assert status == 200, status
    return d_times, r_times


async def throughput(host: str, port: int, concurrency: int, n: int, sessions: bool) -> float:
    conns = [await Conn(host, port).open() for _ in range(concurrency)]
    counter = iter(range(n))

    async def worker(c: Conn, k: int) -> None:
        for i in counter:
            h = f"x-session-id: tp-{k}\r\n" if sessions else ""
            status, _ = await c.post("/v1/chat/completions", body(i), h)
            assert status == 200, status

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c, k) for k, c in enumerate(conns)))
    dt = time.perf_counter() - t0
    for c in conns:
        c.close()
    return n / dt


def router_overhead_p50(metrics: str) -> tuple[float, int]:
    """Median of the router's own `duplexkv_router_overhead_seconds` (bucket upper bound)."""
    buckets = [(float(le), float(v)) for le, v in re.findall(
        r'duplexkv_router_overhead_seconds_bucket\{le="([^"]+)"\} (\S+)', metrics)]
    total = buckets[-1][1]
    for le, v in buckets:
        if v >= total / 2:
            return le * 1e3, int(total)
    return float("nan"), int(total)


def start_router(p_port: int, d_port: int, log_dir: Path, upstream_http: str) -> Proc:
    router = spawn("router_overhead_router", router_args(
        [f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"],
        "--upstream-http", upstream_http), log_dir)
    wait_ready([router], timeout_s=30, probe=None)
    return router


async def main_async(args, r_port: int, d_port: int) -> dict:
    direct = await Conn("127.0.0.1", d_port).open()
    routed = await Conn("127.0.0.1", r_port).open()
    await latency(direct, routed, 200)  # warm-up
    d_times, r_times = await latency(direct, routed, args.requests)
    direct.close()
    routed.close()
    rps_direct = await throughput("127.0.0.1", d_port, args.concurrency, args.requests, False)
    rps_router = await throughput("127.0.0.1", r_port, args.concurrency, args.requests, True)
    return {"d": d_times, "r": r_times, "rps_direct": rps_direct, "rps_router": rps_router}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--upstream-http", choices=("fast", "httpcore"), default="fast",
                    help="the router's client transport to the workers (default: fast)")
    ap.add_argument("--stub", nargs=2, type=int, metavar=("P_PORT", "D_PORT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stub:
        asyncio.run(run_stubs(*args.stub))
        return
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    p_port, d_port = ports
    stubs = subprocess.Popen([sys.executable, __file__, "--stub", str(p_port), str(d_port)],
                             stdout=subprocess.PIPE)
    assert stubs.stdout.readline().strip() == b"stubs ready"
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-router-overhead-"))
    router = start_router(p_port, d_port, logs, args.upstream_http)
    r_port = int(router.url.rsplit(":", 1)[1])
    try:
        time.sleep(0.5)  # first health checks
        res = asyncio.run(main_async(args, r_port, d_port))
        import httpx

        p50_self, n_self = router_overhead_p50(
            httpx.get(f"http://127.0.0.1:{r_port}/metrics").text)
    finally:
        router.stop(10)
        stubs.terminate()
        stubs.wait(10)
    d, r = res["d"], res["r"]
    print(f"router overhead (--upstream-http {args.upstream_http}), {args.requests} interleaved "
          f"non-streaming chat requests at concurrency 1 ({os.cpu_count()} cores shared by the "
          f"stubs, the router and the client)")
    print(f"  {'':<22}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for name, xs in (("direct (D stub)", d), ("through router (P+D)", r)):
        print(f"  {name:<22}{pct(xs, .5):9.3f}{pct(xs, .9):9.3f}{pct(xs, .99):9.3f}"
              f"{statistics.fmean(xs):9.3f}")
    added = pct(r, .5) - pct(d, .5)
    print(f"  added latency at p50: {added:.3f} ms (target <= 2 ms: "
          f"{'met' if added <= 2 else 'NOT met'}); p90: {pct(r, .9) - pct(d, .9):.3f} ms")
    print(f"  router's own overhead histogram: p50 <= {p50_self:.2f} ms over {n_self} requests")
    print(f"throughput, concurrency {args.concurrency}, {args.requests} requests: direct "
          f"{res['rps_direct']:.0f} req/s; through router {res['rps_router']:.0f} req/s "
          f"(target >= 500: {'met' if res['rps_router'] >= 500 else 'NOT met'}; "
          f"ratio {res['rps_router'] / res['rps_direct']:.2f})")


if __name__ == "__main__":
    main()
