"""The retention simulation behind `duplexkv bench retention` (retention.py has the whole
story): a trace replayed against D's real retention code (`RetentionTable`) on a simulated clock,
per policy (oldest, value, belady), with the block pool as a counter."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

from duplexkv.kv.retention import RetentionTable
from duplexkv_bench.retention_trace import BLOCK, Trace, blocks, make_trace

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
