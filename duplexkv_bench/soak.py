"""Soak: multi-turn conversations through router + P + D for a fixed time; RSS of every process.

Starts its own cluster on 127.0.0.1 (router + 1 P + 1 D, TCP transport, bidirectional reuse on,
D with a small KV pool so that retained turns are released under pressure), runs `--clients`
conversations at once, each turn by turn with the model's real answers in the history and a new
conversation (new text) when one ends, until `--duration` seconds have passed; then lets the
turns in flight finish, checks each worker's block accounting (/debug/engine), stops the cluster
and prints the RSS of router, P and D over time with the slope over the second half (MB/min,
least squares).

Longer than 300 lines: the cluster, the conversation loop, the RSS sampler and the report of one
run belong together.

    .venv/bin/duplexkv bench soak --duration 600            # docs/results/soak.md
    .venv/bin/duplexkv bench soak --duration 150 --debug-memory 30 --json out/soak.json
    .venv/bin/duplexkv bench soak --duration 150 --env MALLOC_ARENA_MAX=  # unset a default
    .venv/bin/duplexkv bench soak --duration 600 --as-serve  # without the launcher's env

`--debug-memory S` starts the processes with DUPLEXKV_DEBUG_MEMORY=1 and records every S seconds
what GET /debug/memory?trim=1 says (maps' sizes, gc object counts, glibc heap state, resident
memory by kind of mapping, and the RSS before and after a `malloc_trim`): the RSS after the trim is
what the process retains, free of where the run stands in the workers' own trim period, and its
slope (the "retained" column) is the soak's measure of growth; `--tracemalloc N`
also traces allocations (N frames). `--env KEY=VALUE` sets a variable for all processes (an empty
VALUE removes it, also from the launcher's defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from duplexkv import launch
from duplexkv.engine.memory import OVERDUE, TRIM_INTERVAL_S
from duplexkv.engine.dtype import DTYPE_CHOICES, native_bf16_flag, read_cpu_flags
from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.engine.process_env import WORKER_ENV_DEFAULTS
from duplexkv.launch import Cluster, ClusterSpec
from duplexkv.model.registry import resolve_model
from duplexkv.model.tokenizer import Tokenizer
from duplexkv_bench.client import RequestFailed, Result, Target, chat_turn
from duplexkv_bench.targets import client_key
from duplexkv_bench.workload import Sizes, TextSource, materialise, plan

# what a worker sets itself when its environment lacks it (kept: --as-serve empties the
# launcher's copy)
WORKER_SETS = dict(WORKER_ENV_DEFAULTS)
# short turns over a few thousand tokens of history: many requests, retention under pressure
SOAK_SIZES = Sizes(256, (100, 400), (32, 96), max_turns=8, first_prefix=(500, 1500))


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in points) / var * 60


def native_bf16() -> bool:
    return native_bf16_flag(read_cpu_flags() or frozenset()) is not None


@dataclass
class Counts:
    requests: int = 0
    failed: int = 0
    conversations: int = 0
    errors: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)


class Load:
    """`clients` conversations at once until the deadline; each new conversation has new text."""

    def __init__(self, url: str, model: str, tok: Tokenizer, clients: int, max_context: int,
                 seed: int, timeout_s: float) -> None:
        self.url, self.model, self.clients = url, model, clients
        self.max_context, self.seed, self.timeout_s = max_context, seed, timeout_s
        self.source = TextSource(tok, 4 * max_context)
        self.counts = Counts()
        self._batch = 0
        self._queue: list = []

    def _next_conversation(self):
        if not self._queue:  # a batch shares one system prompt, like an agent's users
            b = self._batch = self._batch + 1
            convs = plan("chat", SOAK_SIZES, self.clients, self.max_context, self.seed + b)
            self._queue = [(f"soak-{self.seed}-{b}-{i}", c) for i, c in enumerate(
                materialise(convs, self.source, self.seed + b, "soak"))]
        return self._queue.pop(0)

    async def run(self, deadline: float) -> None:
        target = Target("on", self.url, self.model, True, "soak", client_key())
        limits = httpx.Limits(max_connections=self.clients + 4)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits,
                                     trust_env=False) as client:
            async def one_client() -> None:
                while time.monotonic() < deadline:
                    cid, conv = self._next_conversation()
                    self.counts.conversations += 1
                    messages = [{"role": "system", "content": conv.system}] if conv.system else []
                    for k, turn in enumerate(conv.turns):
                        if time.monotonic() >= deadline:
                            return
                        messages.append({"role": "user", "content": turn.text})
                        r = Result("on", cid, k + 1)
                        self.counts.requests += 1
                        try:
                            answer = await chat_turn(client, target, messages,
                                                     turn.answer_tokens, cid, r)
                        except (RequestFailed, httpx.HTTPError, ValueError) as e:
                            self.counts.failed += 1
                            self.counts.errors.append(f"{cid} turn {k + 1}: "
                                                      f"{type(e).__name__}: {e}"[:300])
                            break
                        o = r.pull_outcome or r.router_conversation or "none"
                        self.counts.outcomes[o] = self.counts.outcomes.get(o, 0) + 1
                        messages.append({"role": "assistant", "content": answer})

            await asyncio.gather(*(one_client() for _ in range(self.clients)))


AUTH: dict[str, str] = {}  # the cluster's worker key (its workers guard /debug/...)
ROUTER_AUTH: dict[str, str] = {}  # the router's client key (it guards its /debug/... too)


def get_json(url: str, timeout: float = 30, headers: dict[str, str] | None = None
             ) -> dict | None:
    try:
        r = httpx.get(url, timeout=timeout, trust_env=False,
                      headers=AUTH if headers is None else headers)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def sample_loop(procs: list[launch.Proc], t0: float, deadline: float, every_s: float,
                      debug_every_s: float, samples: list, debug: list, load: Load) -> None:
    next_debug = 0.0
    while True:
        t = time.monotonic() - t0
        row = {"t": round(t, 1), **{p.name: rss_mb(p.proc.pid) for p in procs},
               "requests": load.counts.requests, "failed": load.counts.failed}
        samples.append(row)
        rss = "  ".join(f"{p.name} {row[p.name] or 0:7.1f}" for p in procs)
        print(f"t={t:6.0f}s  RSS MB: {rss}   requests {row['requests']} failed {row['failed']}",
              flush=True)
        if debug_every_s and t >= next_debug:
            next_debug = t + debug_every_s
            snap = {"t": round(t, 1)}
            for p in procs:
                snap[p.name] = await asyncio.to_thread(debug_memory, p)
            debug.append(snap)
            for p in procs:
                d = snap[p.name] or {}
                print(f"    {p.name}: objects {d.get('gc', {}).get('objects')} "
                      f"tasks {d.get('asyncio_tasks')} threads {d.get('threads')} "
                      f"malloc {d.get('malloc')} {d.get('structures')}", flush=True)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(every_s, max(0.0, deadline - time.monotonic())))


def debug_memory(p: launch.Proc, trim: bool = True) -> dict | None:
    """GET /debug/memory of one process (the router's with its client key); `trim` asks it to
    give its free heap back first and report its RSS before and after."""
    headers = ROUTER_AUTH if p.name == "router" else AUTH
    return get_json(p.url + "/debug/memory" + ("?trim=1" if trim else ""), headers=headers)


def retained(debug: list[dict], name: str) -> list[tuple[float, float]]:
    """(t, RSS after the snapshot's trim) of one process, from the timed snapshots."""
    return [(s["t"], s[name]["rss_mb"]) for s in debug
            if isinstance(s.get("t"), (int, float)) and (s.get(name) or {}).get("trimmed")
            is not None]


def envelope(points: list[tuple[float, float]], window_s: float, pick=min
              ) -> list[tuple[float, float]]:
    """One point per `window_s` of `points`: the sample `pick` chooses (by MB). A busy worker
    returns its free heap every OVERDUE trim intervals (engine/memory.py), so its RSS is a
    sawtooth of that period (~90 MB on D, 40 conversations); a least-squares slope through it
    swings by several MB/min with the phase the run happens to end in, while the minimum of each
    period (RSS after a trim: what the process really holds) follows growth alone."""
    if not points:
        return []
    t0 = points[0][0]
    windows: dict[int, list[tuple[float, float]]] = {}
    for t, v in points:
        windows.setdefault(int((t - t0) // window_s), []).append((t, v))
    full = [w for w in windows.values() if w[-1][0] - w[0][0] >= window_s * 0.75]
    return [pick(w, key=lambda tv: tv[1]) for w in full]


def summarize(procs: list[launch.Proc], samples: list[dict], duration: float,
              warmup_s: float = 0.0, debug: list[dict] | None = None) -> list[dict]:
    """Per process: RSS start/end/max, and slopes over the measured part (after `warmup_s`):
    least squares through every sample, through the per-trim-period minima and maxima, and
    (with `debug` snapshots) through the RSS after each snapshot's trim."""
    rows = []
    half = duration / 2
    period = OVERDUE * TRIM_INTERVAL_S
    for p in procs:
        pts = [(s["t"], s[p.name]) for s in samples if s[p.name] is not None]
        if not pts:
            continue
        second = [(t, v) for t, v in pts if t >= half]
        measured = [(t, v) for t, v in pts if t >= warmup_s]
        rows.append({"process": p.name, "start_mb": round(pts[0][1], 1),
                     "end_mb": round(pts[-1][1], 1), "max_mb": round(max(v for _, v in pts), 1),
                     "slope_second_half_mb_per_min": round(slope_mb_per_min(second), 2),
                     "slope_all_mb_per_min": round(slope_mb_per_min(pts), 2),
                     "measured_from_s": warmup_s,
                     "slope_measured_mb_per_min": round(slope_mb_per_min(measured), 2),
                     "slope_floor_mb_per_min": round(slope_mb_per_min(
                         envelope(measured, period, min)), 2),
                     "slope_peak_mb_per_min": round(slope_mb_per_min(
                         envelope(measured, period, max)), 2)})
        kept = [(t, v) for t, v in retained(debug or [], p.name) if t >= warmup_s]
        rows[-1]["retained_points"] = len(kept)
        rows[-1]["slope_retained_mb_per_min"] = (
            round(slope_mb_per_min(kept), 2) if len(kept) >= 3 else None)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--clients", type=int, default=40, help="conversations at once")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--decode-kv-blocks", type=int, default=1024,
                    help="D's --num-kv-blocks (small: retention runs under pressure)")
    ap.add_argument("--prefill-kv-blocks", type=int, default=16384,
                    help="P's --num-kv-blocks: what 1 GiB holds for the bench model (tiny's 4 KiB "
                    "blocks would make the default 1 GiB pool 262k blocks, whose prefix-cache "
                    "index, ~0.7 KB of Python objects per cached block, fills for an hour)")
    ap.add_argument("--max-context", type=int, default=3072)
    ap.add_argument("--interval", type=float, default=10, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, default=300, metavar="S",
                    help="seconds before the measured part (pools and caches filling; "
                         "default 300: P reached its plateau at ~300 s)")
    ap.add_argument("--debug-memory", type=float, default=0, metavar="S",
                    help="query GET /debug/memory every S seconds (0: off)")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of every process (empty VALUE: unset)")
    ap.add_argument("--as-serve", action="store_true",
                    help="start the processes as a user's `duplexkv serve` and `duplexkv router` "
                         "by hand: without the launcher's environment defaults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="per-request timeout, seconds")
    ap.add_argument("--json", type=Path, default=None, help="write samples and summary here")
    args = ap.parse_args(argv)

    if args.as_serve:  # the launcher adds none of its defaults: each worker sets its own
        launch.WORKER_ENV_DEFAULTS.clear()
    for kv in args.env:
        key, _, value = kv.partition("=")
        if value:
            os.environ[key] = value
        elif key in WORKER_SETS:
            os.environ[key] = ""  # the worker then keeps the library's own default
        else:
            os.environ.pop(key, None)
    if args.debug_memory:
        os.environ["DUPLEXKV_DEBUG_MEMORY"] = "1"
    if args.tracemalloc:
        os.environ["DUPLEXKV_TRACEMALLOC"] = str(args.tracemalloc)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    resolve_model(args.model)
    tok = Tokenizer.from_dir(resolve_model(args.model))
    decode_args = ("--num-kv-blocks", str(args.decode_kv_blocks))
    prefill_args = ("--num-kv-blocks", str(args.prefill_kv_blocks))
    spec = ClusterSpec(model=args.model, connector="TcpConnector", bidirectional=True,
                       worker_args=("--dtype", args.dtype),
                       prefill_args=prefill_args, decode_args=decode_args,
                       api_keys=(client_key(),))
    env_note = {k: os.environ.get(k, launch.WORKER_ENV_DEFAULTS.get(
        k, f"{WORKER_SETS[k]} (set by the worker)" if k in WORKER_SETS else None)) for k in (
        "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "OMP_WAIT_POLICY",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    print(f"soak: {args.duration:.0f} s, {args.clients} conversations at once, model "
          f"{args.model} ({args.dtype}), pools P {args.prefill_kv_blocks} / D "
          f"{args.decode_kv_blocks} blocks, TCP, "
          f"bidirectional on; native bf16: {native_bf16()}; worker env {env_note}", flush=True)
    samples: list[dict] = []
    debug: list[dict] = []
    cluster = Cluster(spec, on_event=lambda m: print(m, flush=True))
    integrity: dict[str, str] = {}
    try:
        cluster.start()
        AUTH.update(cluster.worker_headers())
        ROUTER_AUTH.update({"Authorization": f"Bearer {client_key()}"})
        procs = [cluster.router, *cluster.prefill, *cluster.decode]
        names = {"prefill-0": "P", "decode-0": "D"}
        load = Load(cluster.url, args.model, tok, args.clients, args.max_context, args.seed,
                    args.timeout)
        t0 = time.monotonic()
        deadline = t0 + args.duration

        async def run() -> None:
            sampler = asyncio.create_task(sample_loop(procs, t0, deadline, args.interval,
                                                      args.debug_memory, samples, debug, load))
            await load.run(deadline)
            await sampler

        asyncio.run(run())
        drained = time.monotonic() - deadline
        for w in cluster.workers:
            d = get_json(w.url + "/debug/engine") or {}
            integrity[w.name] = d.get("integrity", "no answer")
        if args.debug_memory:  # after the load: what stays
            debug.append({"t": "end", **{p.name: debug_memory(p, trim=False) for p in procs}})
        dead = cluster.dead()
        if dead is not None:
            print(f"{dead.name} exited with {dead.proc.returncode}:\n{dead.tail()}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        cluster.stop()

    c = load.counts
    rows = summarize(procs, samples, args.duration, args.warmup, debug)
    print(f"\n{c.requests} requests in {c.conversations} conversations, {c.failed} failed "
          f"(in-flight turns finished {drained:.0f} s after the deadline); reuse outcomes "
          f"{dict(sorted(c.outcomes.items()))}; integrity {integrity}")
    for e in c.errors[:5]:
        print("  error:", e)
    print(f"\nslopes from {args.warmup:.0f} s on (MB/min): least squares through every sample, "
          f"and through the lowest / highest sample of each {OVERDUE * TRIM_INTERVAL_S:.0f} s "
          f"(a busy worker's heap-trim period), and through the RSS right after each "
          f"/debug/memory trim (retained; --debug-memory)")
    print("\n| process | RSS start MB | RSS end MB | RSS max MB | slope, all samples |"
          " slope, lowest | slope, peaks | slope, retained |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        kept = r["slope_retained_mb_per_min"]
        print(f"| {names.get(r['process'], r['process'])} | {r['start_mb']:,.1f} | "
              f"{r['end_mb']:,.1f} | {r['max_mb']:,.1f} | {r['slope_measured_mb_per_min']:+.2f} |"
              f" {r['slope_floor_mb_per_min']:+.2f} | {r['slope_peak_mb_per_min']:+.2f} | "
              f"{'n/a' if kept is None else f'{kept:+.2f}'} ({r['retained_points']} points) |")
    print(f"\nmodel {args.model}, {describe_dtype(args.dtype)}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "env": env_note,
            "requests": c.requests, "failed": c.failed, "conversations": c.conversations,
            "errors": c.errors, "outcomes": c.outcomes, "integrity": integrity,
            "summary": rows, "samples": samples, "debug_memory": debug,
            "native_bf16": native_bf16()}, indent=1))
        print(f"wrote {args.json}")
    ok = c.failed == 0 and all(v == "ok" for v in integrity.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
