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
import heapq
import json
import math
from collections import Counter
from dataclasses import dataclass, field

from duplexkv_bench.retention_trace import BLOCK, Trace, Turn, blocks, make_trace
from duplexkv.flags import Accumulate
from duplexkv.kv.retention import RetentionTable

__all__ = ["BLOCK", "Trace", "Turn", "blocks", "make_trace", "replay", "run", "main"]
RENEW_PERIOD_S = 10.0  # the router's --lease-renew-period
POLICIES = ("oldest", "value", "belady")


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Result:
    policy: str
    reusable: int = 0  # turns after the first (their history could have been retained)
    hits: int = 0
    hit_tokens: int = 0
    reusable_tokens: int = 0
    released: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.reusable, 1)

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / max(self.reusable_tokens, 1)


def replay(trace: Trace, pool_blocks: int, policy: str) -> Result:
    clock = Clock()
    table = RetentionTable(BLOCK, b"bench-seed", clock=clock, lease_s=trace.lease_s)
    held: dict[int, tuple[str, int]] = {}  # conversation -> (entry id, history tokens)
    next_use: dict[str, float] = {}  # entry id -> its next use (belady only)
    res = Result(policy)
    used = 0  # blocks held by retained entries
    deletions: list[tuple[float, int]] = []
    last_history: dict[int, int] = {}
    kept: dict[int, tuple[str, float]] = {}  # conversation kept alive -> (entry, last renewal)
    next_id = 0

    def release(entries) -> None:
        nonlocal used
        for e in entries:
            used -= len(e.block_ids)
            next_use.pop(e.request_id, None)

    def evict_one() -> bool:
        if policy == "belady":
            if not next_use:
                return False
            rid = max(next_use, key=next_use.__getitem__)
            e = table.pop(rid, "pressure")
        else:
            e = table.pop_for_pressure(policy)
        if e is None:
            return False
        release([e])
        return True

    for turn in trace.turns:
        clock.now = turn.t
        while deletions and deletions[0][0] <= turn.t:
            _, conv = heapq.heappop(deletions)
            if conv in held:
                table.mark_deleted([held[conv][0]])
        for conv, (rid, last) in list(kept.items()):  # the router's renewals, every period
            if turn.t - last >= RENEW_PERIOD_S:
                table.renew([rid])
                kept[conv] = (rid, turn.t)
        release(table.pop_expired())
        if turn.k > 0:
            res.reusable += 1
            prev = held.pop(turn.conv, None)
            kept.pop(turn.conv, None)
            res.reusable_tokens += last_history[turn.conv]
            if prev is not None:
                e = table.pop(prev[0], "read")
                if e is not None:
                    release([e])
                    res.hits += 1
                    res.hit_tokens += prev[1]
        last_history[turn.conv] = turn.history
        need = blocks(turn.history)
        while pool_blocks - used < need and evict_one():
            pass
        if pool_blocks - used < need:
            continue  # cannot even run (never happens with a sane pool)
        rid = f"c{turn.conv}-t{turn.k}-{next_id}"
        next_id += 1
        ids = list(range(need))  # the counter pool: ids are not shared
        table.add(rid, ids, trace.tokens[turn.conv][:turn.history], "ttl", trace.lease_s,
                  trace.ttl_s)
        used += need
        held[turn.conv] = (rid, turn.history)
        next_use[rid] = turn.next_t
        if turn.kept_alive:
            table.renew([rid])
            kept[turn.conv] = (rid, turn.t)
        if turn.deleted_at < math.inf:
            heapq.heappush(deletions, (turn.deleted_at, turn.conv))
    res.released = dict(table.released)
    return res


def run(oversubscription: list[float], slots: int, minutes: float, seeds: list[int],
        **kw) -> list[dict]:
    """Per over-subscription: every seed's trace with D's pool sized to it; hit rates averaged
    over the seeds (each policy on the same traces)."""
    traces = [make_trace(slots, minutes, seed, **kw) for seed in seeds]
    rows = []
    for over in oversubscription:
        per: dict[str, list[Result]] = {p: [] for p in POLICIES}
        pools = []
        for trace in traces:
            pool = max(64, round(trace.demand_blocks() / over))
            pools.append(pool)
            for p in POLICIES:
                per[p].append(replay(trace, pool, p))
        row = {"oversubscription": over, "pool_blocks": pools,
               "reusable": sum(r.reusable for r in per["value"])}
        for p, results in per.items():
            row[p] = round(sum(r.hit_rate for r in results) / len(results), 4)
            row[p + "_tokens"] = round(sum(r.token_rate for r in results) / len(results), 4)
            row[p + "_per_seed"] = [round(r.hit_rate, 4) for r in results]
        row["value_vs_belady"] = round(row["value"] / max(row["belady"], 1e-9), 3)
        row["value_vs_oldest"] = round(row["value"] / max(row["oldest"], 1e-9), 2)
        row["value_vs_belady_tokens"] = round(row["value_tokens"]
                                              / max(row["belady_tokens"], 1e-9), 3)
        row["released_value"] = dict(sum((Counter(r.released) for r in per["value"]),
                                         Counter()))
        rows.append(row)
    return rows


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
        from duplexkv_bench import retention_real

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
