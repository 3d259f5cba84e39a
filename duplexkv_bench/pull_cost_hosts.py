"""`duplexkv bench pull_cost --multihost`: the cost model against the fixed 64-token rule with
P and D on hosts of their own (duplexkv_bench/hosts, needs root), every link shaped to each
`--rate`.

    duplexkv bench pull_cost --multihost [--rate 100mbit 1gbit 10gbit] [--histories ...]

Three hosts per rate, built afresh so that no link estimate carries over from the rate before:
D, P "pm" deciding by its cost model (no stand-in: its link model measures the shaped link from
its own READs; rep 0's pull on the 10 Gbit/s prior teaches it) and P "pf" with
`kv_recompute_threshold: 64`, both `--no-enable-prefix-caching`. The turns and their order are
pull_cost_measure.py's `measure`; every byte between a P and D crosses two shaped links (tc tbf,
both directions). The harness removes the namespaces on the way out, a failure or signal included.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv_bench.pull_cost_measure import FIXED, common_args, finish, measure


def run(args: argparse.Namespace) -> int:
    from duplexkv_bench.hosts.cluster import HostCluster
    from duplexkv_bench.hosts.netns import Network, can_build
    from duplexkv.model.registry import resolve_model

    ok, why = can_build()
    if not ok:
        raise SystemExit(f"pull_cost --multihost: {why}")
    if args.assumed_gbps or args.d_url:
        raise SystemExit("--multihost measures the shaped links: no --assumed-gbps or URLs")
    args.histories = args.histories or [1024, 2048, 4096, 8192]
    model = str(resolve_model(args.model))
    common = common_args(args)
    no_pc = "--no-enable-prefix-caching"
    rows = []
    for rate in args.rate:
        logs = Path(tempfile.mkdtemp(prefix=f"duplexkv-pull-cost-{rate}-"))
        with Network(["d", "pm", "pf"]) as net:
            for h in net.names:
                net.shape(h, None if rate == "unlimited" else rate)
            hc = HostCluster(net, model, logs, connector=args.connector, served_name=args.model)
            d = hc.worker("d", "d", *common)
            pm = hc.worker("pm", "p_model", *common, no_pc)
            pf = hc.worker("pf", "p_fixed", *common, no_pc,
                           kv_extra={"kv_recompute_threshold": FIXED})
            hc.ready([d, pm, pf], timeout_s=600)
            print(f"{rate}: hosts up (logs in {logs}); {args.connector}, {args.model} model, "
                  f"{describe_dtype(None)}", flush=True)
            with httpx.Client(timeout=600) as client:
                rows += measure(client, d.url, pm.url, pf.url, args.histories, args.reps,
                                args.new_tokens, rate)
    finish(args, rows)
    return 0
