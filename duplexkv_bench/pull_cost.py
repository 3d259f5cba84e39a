"""The measured pull decision against the fixed 64-token rule, in one run: P's time for the next
turn of a conversation whose history is on D, with P deciding by its cost model and with P using
`kv_recompute_threshold: 64`, per history length.

    cost model   pull when verify RTT + bytes / bandwidth < predicted recompute of those tokens
    fixed-64     pull when the verified gain is at least 64 tokens

TTFT is the next turn's two legs as the client sees them: P's (pull or recompute the history,
compute the new tokens, its first token) and D's (READ P's new blocks, start from P's token).

Without URLs the benchmark launches D and the two Ps on this host (loopback). `--assumed-gbps G`
gives both Ps' link models a stand-in bandwidth (e.g. 0.1 = 100 Mbit/s) while the bytes still
move at loopback speed: the decisions are those of a slow link, the times are not.
`--multihost --rate 100mbit 1gbit 10gbit` (root; pull_cost_hosts.py) puts D and the two Ps
on hosts of their own with every link shaped to each rate in turn: the link model measures the
shaped link itself and the times are real. `--d-url --p-model-url --p-fixed-url` take running
workers instead (P model: default KV config; P fixed: `"kv_recompute_threshold": 64`; both
without prefix caching).

    .venv/bin/duplexkv bench pull_cost [--histories 32 64 256 1024 4096 16384] [--reps 3]
        [--assumed-gbps 0.1]
    .venv/bin/duplexkv bench pull_cost --multihost [--rate 100mbit 1gbit 10gbit]
        [--histories 1024 2048 4096 8192] [--reps 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.flags import Accumulate
from duplexkv.launch import bidirectional_kv, spawn, wait_ready, worker_args
from duplexkv_bench import pull_cost_hosts
from duplexkv_bench.pull_cost_measure import FIXED, common_args, finish, measure


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--histories", type=int, nargs="+", action=Accumulate, default=None,
                    help="default: 32 64 256 1024 4096 16384; --multihost: 1024 2048 4096 8192")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--assumed-gbps", type=float, default=0.0,
                    help="stand-in link bandwidth for both Ps' link models (0: measured)")
    ap.add_argument("--connector", default="TcpConnector",
                    choices=["TcpConnector", "NixlConnector"])
    ap.add_argument("--kv-cache-memory", default="1.0", help="GiB of KV pool per worker")
    ap.add_argument("--d-url")
    ap.add_argument("--p-model-url")
    ap.add_argument("--p-fixed-url")
    ap.add_argument("--multihost", action="store_true",
                    help="P, P and D on hosts of their own (root), links shaped to each --rate")
    ap.add_argument("--rate", nargs="+", action=Accumulate, default=["100mbit", "1gbit", "10gbit"],
                    help="with --multihost: link rates (tc tbf), or unlimited")
    ap.add_argument("--json", help="write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.multihost:
        return pull_cost_hosts.run(args)
    args.histories = args.histories or [32, 64, 256, 1024, 4096, 16384]
    given = (args.d_url, args.p_model_url, args.p_fixed_url)
    procs = []
    if not all(given):
        if any(given):
            raise SystemExit("give all of --d-url --p-model-url --p-fixed-url, or none")
        common = common_args(args)
        extra = {"kv_link_assumed_gbps": args.assumed_gbps} if args.assumed_gbps else {}
        logs = Path(tempfile.mkdtemp(prefix="duplexkv-pull-cost-"))
        no_pc = "--no-enable-prefix-caching"
        procs = [spawn("d", worker_args(args.model, bidirectional_kv(args.connector), *common),
                       logs, {}),
                 spawn("p_model", worker_args(args.model, bidirectional_kv(args.connector,
                                                                           **extra),
                                              *common, no_pc), logs, {}),
                 spawn("p_fixed", worker_args(args.model, bidirectional_kv(
                     args.connector, kv_recompute_threshold=FIXED, **extra), *common, no_pc),
                     logs, {})]
        wait_ready(procs)
        given = tuple(p.url for p in procs)
        print(f"workers up (logs in {logs}); {describe_dtype(None)}; link: "
              f"{f'assumed {args.assumed_gbps} Gbit/s' if args.assumed_gbps else 'measured'}")
    try:
        label = f"assumed {args.assumed_gbps} Gbit/s" if args.assumed_gbps else "loopback"
        with httpx.Client(timeout=600) as client:
            rows = measure(client, *given, args.histories, args.reps, args.new_tokens, label)
        finish(args, rows)
    finally:
        for x in procs:
            x.stop()
    return 0


if __name__ == "__main__":
    main()
