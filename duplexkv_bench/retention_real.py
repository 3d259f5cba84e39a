"""`duplexkv bench retention --real`: the retention trace (retention.py) replayed through a real
router, P and D (TCP, bidirectional, float32), once per eviction policy of D
(`decoder_kv_eviction`: oldest, value), with the trace's clock compressed `--time-scale` times
(paces, lease, TTL and the router's renewal period alike) so that a run takes minutes.

Turns add 32-160 tokens (the simulation's default is 64-512) and histories stop at
`--max-history` tokens, so that D's pool stays well above one turn's blocks. Every turn is a
/v1/completions call naming its conversation; its prompt is the previous prompt,
the previous answer's token ids and the turn's new tokens. A turn after the first is a pulled hit
when P reports `pull_outcome: "pulled"` in the router's kv_stats. Clients keep alive and delete
their conversations as the trace says. D's pool (`--pool-blocks`) is sized so that the histories
to keep are `--oversubscription` times it, plus `--headroom` blocks for the turns D runs at once
(the simulation runs one at a time). Printed next to the runs: the simulation of the same
trace at the same pool (oldest, value, Belady), for the offline optimum.

    duplexkv bench retention --real [--slots 48] [--minutes 3] [--time-scale 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from duplexkv.flags import Accumulate
from duplexkv.launch import (bidirectional_kv, router_args, spawn, stop_all, wait_ready,
                             worker_args)
from duplexkv_bench import retention_sim as sim
from duplexkv_bench.retention_trace import Trace, Turn, blocks, make_trace

OUT_TOKENS = 8
MODEL = "tiny"


def build_trace(args) -> Trace:
    s = args.time_scale
    return make_trace(args.slots, args.minutes * s, args.seed, pace_median_s=10.0,
                          pace_sigma=args.pace_sigma, jitter=0.3, lease_s=60.0, ttl_s=480.0,
                          max_history=args.max_history, turn_tokens=(32, 160))


def scaled(trace: Trace, s: float) -> Trace:
    """The same trace on a clock `s` times faster."""
    turns = [Turn(t.t / s, t.conv, t.k, t.history, t.next_t / s, t.deleted_at / s,
                      t.kept_alive) for t in trace.turns]
    return Trace(turns, trace.tokens, trace.lease_s / s, trace.ttl_s / s)


async def conversation(client: httpx.AsyncClient, url: str, turns: list[Turn], t0: float,
                       seed: int, out: list[dict]) -> None:
    rng = random.Random(seed)
    prompt: list[int] = []
    cid = f"conv-{turns[0].conv}"
    for turn in turns:
        await asyncio.sleep(max(0.0, t0 + turn.t - time.monotonic()))
        want = turn.history - len(prompt)  # the trace's new tokens this turn (answer included)
        prompt = prompt + [rng.randrange(16, 4000) for _ in range(max(want - OUT_TOKENS, 8))]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "conversation_id": cid}
        try:
            r = await client.post(url + "/v1/completions", json=body)
            j = r.json()
            stats = j.get("kv_stats") or {}
            prompt = prompt + list(j["choices"][0]["token_ids"])
        except (httpx.HTTPError, KeyError, ValueError) as e:
            out.append({"k": turn.k, "error": repr(e)})
            return
        out.append({"k": turn.k, "conversation": stats.get("conversation"),
                    "outcome": (stats.get("prefill") or {}).get("pull_outcome"),
                    "pulled": (stats.get("prefill") or {}).get("pulled_tokens", 0)})
        if turn.kept_alive and turn.next_t < math.inf:
            await client.post(f"{url}/v1/conversations/{cid}/keepalive",
                              json={"seconds": max(1.0, turn.next_t - turn.t + 1.0)})
        if turn.deleted_at < math.inf:
            await asyncio.sleep(max(0.0, t0 + turn.deleted_at - time.monotonic()))
            await client.delete(f"{url}/v1/conversations/{cid}")


async def drive(url: str, trace: Trace, seed: int) -> list[dict]:
    by_conv: dict[int, list[Turn]] = defaultdict(list)
    for t in trace.turns:
        by_conv[t.conv].append(t)
    out: list[dict] = []
    t0 = time.monotonic() + 1.0
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(conversation(client, url, turns, t0, seed * 7919 + c, out)
                               for c, turns in by_conv.items()))
    return out


def metric_values(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'(?m)^%s\{why="(\w+)"\} (\S+)$' % re.escape(name), text):
        out[m.group(1)] = float(m.group(2))
    return out


def run_policy(policy: str, trace: Trace, args, log_dir: Path) -> dict:
    s = args.time_scale
    kv = bidirectional_kv("TcpConnector", decoder_kv_eviction=policy,
                          decoder_kv_lease_duration=60.0 / s, decoder_kv_blocks_ttl=480.0 / s)
    common = ("--dtype", "float32", "--max-model-len", "4096")
    p = spawn(f"prefill-{policy}", worker_args(MODEL, kv, *common, "--num-kv-blocks", "2048",
                                               "--no-enable-prefix-caching"), log_dir,
              die_with_parent=True)
    d = spawn(f"decode-{policy}", worker_args(MODEL, kv, *common, "--num-kv-blocks",
                                              str(args.pool_blocks + args.headroom)), log_dir,
              die_with_parent=True)
    procs = [p, d]
    try:
        wait_ready([p, d])
        router = spawn(f"router-{policy}", router_args(
            [p.url], [d.url], "--lease-renew-period", str(10.0 / s),
            "--placement", "prefill"),  # P pulls hits
            log_dir, die_with_parent=True)
        procs.append(router)
        wait_ready([router])
        turns = asyncio.run(drive(router.url, trace, args.seed))
        d_metrics = httpx.get(d.url + "/metrics", timeout=30).text
        r_metrics = httpx.get(router.url + "/metrics", timeout=30).text
        integrity = httpx.get(d.url + "/debug/engine", timeout=30).json()["integrity"]
        d_retained = httpx.get(d.url + "/health", timeout=30).json()["kv_transfer"]["retained"]
    finally:
        stop_all(procs)
    reusable = [t for t in turns if t.get("k", 0) > 0]
    outcomes = Counter(t.get("outcome") or t.get("error", "?")[:20] for t in reusable)
    states = Counter(t.get("conversation") for t in reusable)
    inval = re.search(r"(?m)^duplexkv_router_entries_invalidated_total (\S+)$", r_metrics)
    return {"policy": policy, "reusable": len(reusable), "pulled": outcomes.get("pulled", 0),
            "hit_rate": round(outcomes.get("pulled", 0) / max(len(reusable), 1), 4),
            "outcomes": dict(outcomes), "router_states": dict(states),
            "released": metric_values(d_metrics, "duplexkv_kv_retained_released_total"),
            "invalidated": float(inval.group(1)) if inval else 0.0,
            "errors": sum(1 for t in turns if "error" in t), "integrity": integrity,
            "d_retained": d_retained}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="duplexkv bench retention --real")
    ap.add_argument("--slots", type=int, default=48)
    ap.add_argument("--minutes", type=float, default=3.0, help="wall-clock length of the run")
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--oversubscription", type=float, default=3.0)
    ap.add_argument("--pool-blocks", type=int, default=0, help="D's pool (0: from the trace)")
    ap.add_argument("--headroom", type=int, default=0,
                    help="blocks D gets beyond the pool, for its running turns (0: one turn "
                         "of the longest history)")
    ap.add_argument("--pace-sigma", type=float, default=1.0)
    ap.add_argument("--max-history", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", action=Accumulate, default=["oldest", "value"])
    args = ap.parse_args(argv)
    from duplexkv.model.registry import resolve_model

    resolve_model(MODEL)  # made once here, not raced by the workers
    base = build_trace(args)
    trace = scaled(base, args.time_scale)
    demand = base.demand_blocks()
    if not args.pool_blocks:
        args.pool_blocks = max(64, int(demand / args.oversubscription))
    over = demand / args.pool_blocks
    if not args.headroom:
        args.headroom = blocks(args.max_history)
    print(f"trace: {args.slots} conversations at once, {len(trace.turns)} turns over "
          f"{args.minutes:g} min (clock x{args.time_scale:g}); D pool {args.pool_blocks} blocks "
          f"+ {args.headroom} for running turns; histories to keep {over:.2f}x the pool",
          flush=True)
    simulated = {p: sim.replay(base, args.pool_blocks, p) for p in sim.POLICIES}
    whole = {p: sim.replay(base, args.pool_blocks + args.headroom, p) for p in sim.POLICIES}
    log_dir = Path(tempfile.mkdtemp(prefix="duplexkv-retention-"))
    rows = [run_policy(p, trace, args, log_dir) for p in args.policies]
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"\n{'policy':>8} {'real hit rate':>14} {'sim, pool':>10} {'sim, pool+headroom':>19}")
    for r in rows:
        p = r["policy"]
        print(f"{p:>8} {r['hit_rate']:>14.1%} {simulated[p].hit_rate:>10.1%} "
              f"{whole[p].hit_rate:>19.1%}")
    print(f"{'belady':>8} {'':>14} {simulated['belady'].hit_rate:>10.1%} "
          f"{whole['belady'].hit_rate:>19.1%}")
    got = {r["policy"]: r["hit_rate"] for r in rows}
    if "value" in got and "oldest" in got:
        print(f"real value/oldest {got['value'] / max(got['oldest'], 1e-9):.2f}; real value / "
              f"simulated belady {got['value'] / max(simulated['belady'].hit_rate, 1e-9):.2f}; "
              f"logs in {log_dir}")
    return 0
