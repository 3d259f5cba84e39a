"""KV READ between two processes: NIXL and TCP transports vs memcpy and a raw loopback socket.

    .venv/bin/python duplexkv bench transfer [--reps 9] [--tokens 2048 8192 16384]
    .venv/bin/duplexkv bench transfer --multihost --rate 1gbit 10gbit unlimited   (root; see
                                                                transfer_hosts.py)

The `bench` model's KV layout (8 layers, 2 KV heads, head_dim 64, block 16, bf16 = 64 KiB per
block). This process is the reader; a spawned holder process owns a pool with the same layout.
Every repetition reads a fresh random set of remote blocks into a fresh random set of local
blocks (as in real use), and the baselines run in the same rounds so they share the machine's
noise: `memcpy` = torch.index_select of the same scattered blocks (viewed as int64, torch's
fastest path) into a preallocated buffer in one process with torch's default threads, and
`memcpy1` the same on one thread (a CMA read is one thread's copy); `raw` = plain sendall /
recv_into of the same number of bytes (one contiguous buffer) between the same two processes.
Medians are reported.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

from duplexkv.flags import Accumulate

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from duplexkv.engine.dtype import cpu_bf16_status
from duplexkv.kv.transport import make_transport
from duplexkv_bench import transfer_hosts
from duplexkv_bench.transfer_timing import (BLOCK, BLOCK_TOKENS, CLAIM, raw_server, timed_raw,
                                           timed_read)


def _make(kind: str, engine_id: str, progress_ms: float, nixl_threads: int = 0):
    if kind == "nixl":
        return make_transport(kind, engine_id=engine_id, progress_thread_ms=progress_ms or None,
                              num_threads=nixl_threads)
    return make_transport(kind, engine_id=engine_id)


def holder(kinds: list[str], num_blocks: int, progress_ms: float, nixl_threads: int, q_out,
           stop) -> None:
    from duplexkv.kv.transport.tcp_wire import pool_view

    pool = torch.randn((num_blocks, *BLOCK)).to(torch.bfloat16)
    ts = {k: _make(k, f"holder-{k}", progress_ms, nixl_threads) for k in kinds}
    for t in ts.values():
        t.register(pool)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_server, args=(raw, pool_view(pool)), daemon=True).start()
    # one claim over the whole pool (NIXL READs need its grant; TCP has no authorizer here)
    grants = {k: t.expose(CLAIM, tuple(range(num_blocks))) for k, t in ts.items()}
    q_out.put(({k: t.metadata() for k, t in ts.items()}, grants, raw.getsockname()[1]))
    while not stop.is_set():  # the worker loop: take notifications
        for t in ts.values():
            t.get_notifs()
        time.sleep(0.001)
    for t in ts.values():
        t.close()


def ucx_proto_info() -> str:
    """Which UCX transports NIXL really uses for READs here (UCX_PROTO_INFO of a small run)."""
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    try:
        out = subprocess.run([sys.executable, __file__, "--tokens", "2048", "--reps", "1",
                              "--kinds", "nixl", "--no-proto-info"], check=False, env=env,
                             capture_output=True, text=True, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return "UCX_PROTO_INFO run timed out"
    found: dict[str, set[str]] = {}
    title = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and " by ucp_" in cells[0]:
            title = "READ (ucp_get)" if "ucp_get" in cells[0] else \
                "messages (ucp_am_send)" if "ucp_am_send" in cells[0] else None
        elif len(cells) == 3 and title and cells[0] != "Range":
            found.setdefault(title, set()).add(cells[2])
    return "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(found.items())) \
        or "no UCX protocol table seen"


def main(argv: list[str] | None = None) -> None:
    if "--multihost" in (sys.argv[1:] if argv is None else argv):  # two hosts, shaped link
        return transfer_hosts.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", action=Accumulate, default=[2048, 8192, 16384])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kinds", nargs="+", action=Accumulate, default=["nixl", "tcp"])
    ap.add_argument("--nixl-progress-ms", type=float, default=5.0,
                    help="poll timeout of NIXL's progress thread; 0 = no thread")
    ap.add_argument("--nixl-threads", type=int, default=0, help="NIXL UCX num_threads")
    ap.add_argument("--no-proto-info", action="store_true")
    args = ap.parse_args(argv)
    kinds = list(args.kinds)
    try:
        import nixl  # noqa: F401
    except ImportError:
        print("nixl not importable: skipping the NIXL transport")
        kinds = [k for k in kinds if k != "nixl"]
    max_blocks = max(args.tokens) // BLOCK_TOKENS
    num_blocks = 2 * max_blocks  # room to scatter
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=holder, args=(kinds, num_blocks, args.nixl_progress_ms, args.nixl_threads, q, stop), daemon=True)
    proc.start()
    metas, grants, raw_port = q.get(timeout=120)

    pool = torch.randn((num_blocks, *BLOCK)).to(torch.bfloat16)  # the reader's pool, touched
    # memcpy baseline: the same blocks gathered by torch.index_select over an int64 view
    # (bf16 index_select takes a slow element-wise path: about half the speed)
    src = torch.randn((num_blocks, *BLOCK)).to(torch.bfloat16).view(num_blocks, -1)
    src = src.view(torch.int64)
    gathered = torch.empty((max_blocks, src.shape[1]), dtype=torch.int64).fill_(1)
    raw_buf = bytearray(max_blocks * pool[0].numel() * 2)
    raw_view = memoryview(raw_buf)
    ts = {}
    for k in kinds:
        ts[k] = _make(k, f"reader-{k}", args.nixl_progress_ms, args.nixl_threads)
        ts[k].register(pool)
        ts[k].connect(f"holder-{k}", metas[k])
        timed_read(ts[k], f"holder-{k}", [0, 1], [2, 3], grants[k])  # warm up the connection
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block_bytes = pool[0].numel() * pool.element_size()
    g = torch.Generator().manual_seed(0)
    default_threads = torch.get_num_threads()

    rows = []
    for tokens in args.tokens:
        n = tokens // BLOCK_TOKENS
        times: dict[str, list[float]] = {m: [] for m in ["memcpy", "memcpy1", *kinds, "raw"]}
        timed_raw(raw, raw_view[: n * block_bytes])
        for _ in range(args.reps):
            local = torch.randperm(num_blocks, generator=g)[:n]
            remote = torch.randperm(num_blocks, generator=g)[:n]
            for name, threads in (("memcpy", default_threads), ("memcpy1", 1)):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                torch.index_select(src, 0, remote, out=gathered[:n])
                times[name].append(time.perf_counter() - t0)
            torch.set_num_threads(default_threads)
            for k, t in ts.items():
                times[k].append(timed_read(t, f"holder-{k}", local.tolist(), remote.tolist(),
                                           grants[k]))
            times["raw"].append(timed_raw(raw, raw_view[: n * block_bytes]))
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append((tokens, n * block_bytes, med))

    health = ts["nixl"].health() if "nixl" in ts else {}
    stop.set()
    proc.join(10)
    for t in ts.values():
        t.close()
    print(f"\nbench model KV, bf16 (CPU {cpu_bf16_status()}; a copy does not compute), "
          f"{block_bytes // 1024} KiB/block, scattered blocks, "
          f"median of {args.reps}; torch threads {torch.get_num_threads()}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    methods = ["memcpy", "memcpy1", *kinds, "raw"]
    head = f"{'tokens':>6} {'MiB':>4} " + " ".join(f"{m + ' ms':>10} {'GB/s':>5}" for m in methods)
    head += "".join(f" {k + '/memcpy':>12}" for k in kinds)
    head += " nixl/memcpy1" if "nixl" in kinds else ""
    head += " tcp/raw" if "tcp" in kinds else ""
    print(head)
    for tokens, nbytes, med in rows:
        line = f"{tokens:>6} {nbytes / 2**20:>4.0f} "
        line += " ".join(f"{med[m] * 1e3:>10.2f} {nbytes / med[m] / 1e9:>5.2f}" for m in methods)
        line += "".join(f" {med['memcpy'] / med[k]:>12.0%}" for k in kinds)
        line += f" {med['memcpy1'] / med['nixl']:>12.0%}" if "nixl" in kinds else ""
        line += f" {med['raw'] / med['tcp']:>7.0%}" if "tcp" in kinds else ""
        print(line)
    if "nixl" in kinds and not args.no_proto_info:
        print("NIXL health:", {k: v for k, v in health.items()
                               if k in ("progress", "ucx_cma", "peers", "warnings")})
        print("UCX protocols actually selected (UCX_PROTO_INFO):", ucx_proto_info())


if __name__ == "__main__":
    main()
