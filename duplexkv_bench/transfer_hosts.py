"""KV READ across hosts over a shaped link: NIXL (UCX over TCP) and TCP vs a raw socket.

    duplexkv bench transfer --multihost --rate 1gbit 10gbit unlimited [--reps 5]

Two hosts (duplexkv_bench/hosts, needs root): a holder and a reader, each a process in its own
network namespace, the holder's link limited to `--rate` in both directions by tc tbf (the rates
are applied one after the other to the same pair of processes). For each rate and token count the
reader READs the bench model's KV (64 KiB per 16-token block, bf16, scattered block ids) with
each transport, and a plain socket moves the same number of bytes over the same link in the same
rounds. Reported: medians, the READ's goodput against the link rate and against the raw socket.
Because the two hosts share one kernel, UCX would copy through CMA or shared memory; UCX_TLS=tcp
makes NIXL cross the link as it must between machines (UCX_NET_DEVICES=eth0, the link).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from duplexkv.flags import Accumulate
from duplexkv_bench.transfer_timing import (BLOCK, BLOCK_TOKENS, CLAIM, raw_server, timed_raw,
                                           timed_read)

RAW_PORT = 7100


def _transport(kind: str, addr: str, name: str):
    from duplexkv.kv.auth import KVAuth
    from duplexkv.kv.transport import make_transport

    auth = KVAuth(bytes.fromhex(os.environ["DKV_BENCH_SECRET"]))
    if kind == "nixl":
        return make_transport("nixl", engine_id=name, host=addr)
    return make_transport("tcp", engine_id=name, host=addr, auth=auth)


def _pool(num_blocks: int):
    import torch

    return torch.randn((num_blocks, *BLOCK)).to(torch.bfloat16)


def holder(addr: str, kinds: list[str], num_blocks: int) -> None:
    """Serve READs (and the raw socket) until stdin closes; first line out: each transport's
    metadata and the grant of the one claim over the whole pool (NIXL READs need it)."""
    from duplexkv.kv.transport.tcp_wire import pool_view

    pool = _pool(num_blocks)
    ts = {k: _transport(k, addr, f"holder-{k}") for k in kinds}
    for t in ts.values():
        t.register(pool)
    raw = socket.create_server((addr, RAW_PORT))
    threading.Thread(target=raw_server, args=(raw, pool_view(pool)), daemon=True).start()
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    print(json.dumps({k: [b64(t.metadata()), b64(t.expose(CLAIM, tuple(range(num_blocks))))]
                      for k, t in ts.items()}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        for t in ts.values():
            t.get_notifs()
        time.sleep(0.001)
    for t in ts.values():
        t.close()


def reader(addr: str, holder_addr: str, kinds: list[str], num_blocks: int, tokens: list[int],
           reps: int, metas: dict) -> None:
    """READ each size `reps` times per transport and over the raw socket; print JSON medians."""
    import torch

    pool = _pool(num_blocks)
    block_bytes = pool[0].numel() * pool.element_size()
    ts, grants = {}, {}
    for k in kinds:
        ts[k] = _transport(k, addr, f"reader-{k}")
        ts[k].register(pool)
        meta, grant = (base64.b64decode(x) for x in metas[k])
        grants[k] = grant
        ts[k].connect(f"holder-{k}", meta)
        timed_read(ts[k], f"holder-{k}", [0, 1], [2, 3], grant)
    raw = socket.create_connection((holder_addr, RAW_PORT))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max(tokens) // BLOCK_TOKENS * block_bytes))
    g = torch.Generator().manual_seed(0)
    out = []
    for n_tok in tokens:
        n = n_tok // BLOCK_TOKENS
        times: dict[str, list[float]] = {m: [] for m in [*kinds, "raw"]}
        timed_raw(raw, buf[: n * block_bytes])
        for _ in range(reps):
            local = torch.randperm(num_blocks, generator=g)[:n].tolist()
            remote = torch.randperm(num_blocks, generator=g)[:n].tolist()
            for k, t in ts.items():
                times[k].append(timed_read(t, f"holder-{k}", local, remote, grants[k]))
            times["raw"].append(timed_raw(raw, buf[: n * block_bytes]))
        out.append({"tokens": n_tok, "bytes": n * block_bytes,
                    "median_s": {m: statistics.median(v) for m, v in times.items()}})
    paths = {k: [p.get("data_path") for p in t.health()["peers"].values()]
             for k, t in ts.items() if k == "nixl"}
    for t in ts.values():
        t.close()
    print(json.dumps({"rows": out, "paths": paths}), flush=True)


def _bits(rate: str) -> float | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    return None if m is None else float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6,
                                                        "g": 1e9}[m.group(2)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--multihost", action="store_true")
    ap.add_argument("--rate", nargs="+", action=Accumulate,
                    default=["1gbit", "10gbit", "unlimited"])
    ap.add_argument("--tokens", type=int, nargs="+", action=Accumulate, default=[2048, 8192, 16384])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", action=Accumulate, default=["nixl", "tcp"])
    ap.add_argument("--role", choices=("holder", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--holder-addr", help=argparse.SUPPRESS)
    ap.add_argument("--metas", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    num_blocks = 2 * max(args.tokens) // BLOCK_TOKENS
    if args.role == "holder":
        return holder(args.addr, args.kinds, num_blocks)
    if args.role == "reader":
        return reader(args.addr, args.holder_addr, args.kinds, num_blocks, args.tokens,
                      args.reps, json.loads(Path(args.metas).read_text()))
    for r in args.rate:
        if r != "unlimited" and _bits(r) is None:
            ap.error(f"--rate {r!r}: use e.g. 1gbit, 10gbit, 500mbit or unlimited")
    kinds = list(args.kinds)
    try:
        import nixl  # noqa: F401
    except ImportError:
        print("nixl not importable: skipping the NIXL transport")
        kinds = [k for k in kinds if k != "nixl"]
    from duplexkv_bench.hosts.netns import Network, can_build

    ok, why = can_build()
    if not ok:
        raise SystemExit(f"--multihost: {why}")
    env = {**os.environ, "DKV_BENCH_SECRET": secrets.token_hex(32), "UCX_TLS": "tcp",
           "UCX_NET_DEVICES": "eth0", "NIXL_LOG_LEVEL": "WARN", "OMP_WAIT_POLICY": "PASSIVE"}
    me = [sys.executable, "-m", "duplexkv_bench.transfer_hosts", "--kinds", *kinds,
          "--tokens", *map(str, args.tokens), "--reps", str(args.reps)]
    results = []
    with Network(["hold", "read"]) as net, tempfile.TemporaryDirectory() as tmp:
        h = net.popen("hold", [*me, "--role", "holder", "--addr", net.addr("hold")], env=env,
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        metas = Path(tmp) / "metas.json"
        metas.write_text(h.stdout.readline())
        for rate in args.rate:
            for host in ("hold", "read"):
                net.shape(host, None if rate == "unlimited" else rate)
            out = subprocess.run([*net.prefix("read"), *me, "--role", "reader", "--addr",
                                  net.addr("read"), "--holder-addr", net.addr("hold"),
                                  "--metas", str(metas)], env=env, capture_output=True,
                                 text=True, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(f"reader failed at {rate}:\n{out.stderr[-3000:]}")
            results.append((rate, json.loads(out.stdout.strip().splitlines()[-1])))
        h.stdin.close()
    _report(results, kinds, args.reps)


def _report(results: list, kinds: list[str], reps: int) -> None:
    print(f"\nKV READ across two hosts (network namespaces, veth + bridge, tc tbf on both "
          f"links), bench model KV: bf16, 64 KiB per 16-token block, scattered ids; median of "
          f"{reps}; NIXL with UCX_TLS=tcp")
    head = (f"{'link':>9} {'tokens':>6} {'MiB':>4} "
            + " ".join(f"{m + ' ms':>10} {'Gbit/s':>6}" for m in [*kinds, "raw"])
            + "".join(f" {k + '/link':>10}" for k in kinds)
            + "".join(f" {k + '/raw':>9}" for k in kinds))
    print(head)
    for rate, res in results:
        bits = _bits(rate)
        for row in res["rows"]:
            med, nbytes = row["median_s"], row["bytes"]
            gbit = {m: nbytes * 8 / s / 1e9 for m, s in med.items()}
            line = f"{rate:>9} {row['tokens']:>6} {nbytes / 2**20:>4.0f} "
            line += " ".join(f"{med[m] * 1e3:>10.1f} {gbit[m]:>6.2f}" for m in [*kinds, "raw"])
            line += "".join(f" {gbit[k] * 1e9 / bits:>10.0%}" if bits else f" {'-':>10}"
                            for k in kinds)
            line += "".join(f" {med['raw'] / med[k]:>9.0%}" for k in kinds)
            print(line)
        if res.get("paths"):
            print(f"{'':>9} NIXL data path: {res['paths']}")


if __name__ == "__main__":
    main()
