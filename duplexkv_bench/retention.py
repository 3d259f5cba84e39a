"""Retention under memory pressure: of the turns that could reuse D's retained history, how many
do (pulled-hit rate), with D's pool smaller than the histories it is asked to keep.

    oldest   the policy before issue 14: release the oldest retained turn first
    value    eviction by value (kv/eviction.py): tokens saved x chance of reuse before expiry,
             per block-second held
    belady   the offline optimum's rule on the same trace: release the turn whose next use is
             furthest in the future (never used again: first)

One trace, replayed against D's real retention code (`RetentionTable`: entries, leases, renewals,
expiry, deletion, the release bookkeeping, the value model with its lineage and population
estimates, the policy's choice) on a simulated clock; the block pool is a counter (a retained
turn holds its history's blocks, the running turn its own; no sharing between conversations).
Turns take no time: only the gaps between them count.

The trace: `--slots` conversations at once; one that ends is followed by a new one after 5-60 s.
A conversation has a 200-token system prompt and geometric turns (mean `--turns`) adding 64-512
tokens each. It has its own pace (an agent's tool latency, a person's reading speed: log-normal
across conversations, median `--pace-median` 10 s, sigma `--pace-sigma` 1.0); each gap is that
pace jittered (log-normal, sigma `--jitter` 0.3). Its client keeps it alive between turns
(`--keepalive-share`: the router renews its lease) and deletes it at the end (`--delete-share`),
or not. Lease 60 s, TTL 480 s, renewals every 10 s (the defaults). D's pool is sized so that the
histories that will be reused (and can be: within the lease, or kept alive), averaged over
time, are `--oversubscription` times it.

    duplexkv bench retention [--oversubscription 2 3 4] [--slots 32] [--seeds 0 1 2 3 4]

`--real` replays a trace through a real router, P and D (tiny model) once per policy
(`decoder_kv_eviction`), reading the hit rate from the router's kv_stats (retention_real.py).
"""

from __future__ import annotations

import argparse
import json

from duplexkv.flags import Accumulate
from duplexkv_bench import retention_real
from duplexkv_bench.retention_sim import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duplexkv bench retention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oversubscription", type=float, nargs="+", action=Accumulate,
                    default=[2.0, 3.0, 4.0],
                    help="histories to keep / D's pool (sets the pool per trace)")
    ap.add_argument("--slots", type=int, default=32, help="conversations at once")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, nargs="+", action=Accumulate, default=[0, 1, 2, 3, 4])
    ap.add_argument("--turns", type=float, default=8.0, help="mean turns per conversation")
    ap.add_argument("--pace-median", type=float, default=10.0,
                    help="median of the conversations' own paces (seconds between turns)")
    ap.add_argument("--pace-sigma", type=float, default=1.0,
                    help="spread of the paces across conversations (log-normal sigma)")
    ap.add_argument("--jitter", type=float, default=0.3,
                    help="spread of one conversation's gaps around its pace (log-normal sigma)")
    ap.add_argument("--delete-share", type=float, default=0.5,
                    help="conversations whose client deletes them at the end")
    ap.add_argument("--keepalive-share", type=float, default=0.5,
                    help="conversations whose client keeps them alive between turns")
    ap.add_argument("--lease", type=float, default=60.0, help="decoder_kv_lease_duration")
    ap.add_argument("--ttl", type=float, default=480.0, help="decoder_kv_blocks_ttl")
    ap.add_argument("--json", action="store_true", help="one JSON line per row")
    ap.add_argument("--real", action="store_true",
                    help="replay a short trace through a real router, P and D per policy")
    argv = list(argv or [])
    if "--real" in argv:  # its own arguments (retention_real.py)
        return retention_real.main([a for a in argv if a != "--real"])
    args = ap.parse_args(argv)
    rows = run(args.oversubscription, args.slots, args.minutes, args.seeds,
               mean_turns=args.turns, pace_median_s=args.pace_median, pace_sigma=args.pace_sigma,
               jitter=args.jitter, delete_share=args.delete_share,
               keepalive_share=args.keepalive_share, lease_s=args.lease, ttl_s=args.ttl)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{args.slots} conversations at once, {args.minutes:g} min traces, seeds "
          f"{' '.join(map(str, args.seeds))}; pulled-hit rate = share of turns after the first "
          f"that pulled D's retained history (mean over the seeds)")
    print(f"{'over':>5} {'oldest':>7} {'value':>7} {'belady':>7} {'value/belady':>12} "
          f"{'value/oldest':>12} {'tokens: value/belady':>20}")
    for r in rows:
        print(f"{r['oversubscription']:>5.1f} {r['oldest']:>7.1%} {r['value']:>7.1%} "
              f"{r['belady']:>7.1%} {r['value_vs_belady']:>12.2f} {r['value_vs_oldest']:>12.2f} "
              f"{r['value_vs_belady_tokens']:>20.2f}")
    return 0
