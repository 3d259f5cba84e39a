"""What the HTTP worker adds to a prefill: TTFT through `duplexkv serve` vs the engine in-process.

The same prompt (random token ids) is prefilled by an in-process engine (`LLM`, this process:
add_request -> first token) and streamed through a worker's OpenAI endpoint (`max_tokens=1`,
request sent -> first streamed token), order alternating per rep, after one warm-up each. Per
length the table gives the medians, the worker's own engine time (`kv_stats.prefill_ms`), the
ratios, and per request the process's minor page faults and voluntary context switches (an
OpenMP thread that sleeps between parallel regions switches once per region). `--worker SPEC`
(repeatable) starts workers of other source trees or environments side by side in one run:
`NAME[,tree=DIR][,VAR=VALUE...]` runs DIR's code (on PYTHONPATH) with those environment
variables (an empty VALUE unsets one). Idle workers are checked to use no CPU (a worker's
start-up calibration must have ended before anything is timed).

    duplexkv bench worker_overhead [--lengths 2048 4096 8192] [--reps 5]
        [--worker main,tree=../main] [--worker passive,OMP_WAIT_POLICY=PASSIVE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from duplexkv import LLM, SamplingParams
from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.flags import Accumulate
from duplexkv.launch import Proc, bidirectional_kv, spawn, stop_all, wait_ready, worker_args

CPU_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Counters:
    """A process's totals from /proc: CPU seconds, minor page faults, voluntary switches."""

    cpu_s: float
    faults: int
    switches: int

    @staticmethod
    def read(pid: int) -> Counters:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        switches = 0
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:  # the thread ended meanwhile
                continue
            m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M)
            switches += int(m.group(1)) if m else 0
        return Counters((int(stat[11]) + int(stat[12])) * CPU_TICK_S, int(stat[7]), switches)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.cpu_s - other.cpu_s, self.faults - other.faults,
                        self.switches - other.switches)


@dataclass
class Side:
    name: str
    proc: Proc | None = None  # None: the in-process engine
    ttft: dict[int, list[float]] = field(default_factory=dict)
    engine_ms: dict[int, list[float]] = field(default_factory=dict)  # its engine's prefill_ms
    counters: dict[int, list[Counters]] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.proc.pid if self.proc else os.getpid()

    def record(self, n: int, ttft: float, engine_ms: float, c: Counters) -> None:
        self.ttft.setdefault(n, []).append(ttft)
        self.engine_ms.setdefault(n, []).append(engine_ms)
        self.counters.setdefault(n, []).append(c)


def stream_first_token(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, dict]:
    """(seconds from sending to the first streamed token, the stream's kv_stats)."""
    t0 = time.perf_counter()
    first, stats = None, {}
    with client.stream("POST", url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices"):
                first = time.perf_counter() - t0
            stats = ev.get("kv_stats") or stats
    assert first is not None, "the stream ended without a token"
    return first, stats


def engine_first_token(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(seconds from add_request to the first token, the engine's prefill_ms)."""
    eng = llm.engine
    t0 = time.perf_counter()
    seq = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while not any(out.new_token_ids for out in eng.step()):
        pass
    dt = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    return dt, seq.stats.prefill_ms


def idle_cpu_share(sides: list[Side], window_s: float) -> dict[str, float]:
    """Each idle worker's CPU use over `window_s` (1.0 = one core busy)."""
    before = {s.name: Counters.read(s.pid) for s in sides}
    time.sleep(window_s)
    return {s.name: (Counters.read(s.pid) - before[s.name]).cpu_s / window_s for s in sides}


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate, default=[2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", action="append", default=[], metavar="SPEC",
                    help="NAME[,tree=DIR][,VAR=VALUE...]: a worker of DIR's code with those "
                         "environment variables, measured too (repeat; default: one worker of "
                         "this code as launched)")
    ap.add_argument("--no-default-worker", action="store_true",
                    help="measure only the --worker workers")
    ap.add_argument("--connector", default="none", choices=["none", "TcpConnector"],
                    help="start the workers with bidirectional KV transfer, as `duplexkv up`")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                    help="an extra `serve` flag for every worker (repeat; e.g. "
                         "--worker-arg=--cost-calibration-s=0)")
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def worker_spec(spec: str) -> tuple[str, dict]:
    """`NAME[,tree=DIR][,VAR=VALUE...]` -> (name, environment changes; None unsets)."""
    name, *items = spec.split(",")
    env: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--worker {spec!r}: {item!r} is not KEY=VALUE")
        if key == "tree":
            env["PYTHONPATH"] = str(Path(value).resolve())
        else:
            env[key] = value or None
    return name, env


def start_workers(args: argparse.Namespace, max_len: int) -> list[Side]:
    common = ["--dtype", args.dtype, "--max-model-len", str(max_len), *args.worker_arg]
    kv = None if args.connector == "none" else bidirectional_kv(args.connector, enabled=True)
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-worker-overhead-"))
    specs = ([] if args.no_default_worker else [("worker", {})]) + \
        [worker_spec(w) for w in args.worker]
    sides = [Side(name, spawn(name, worker_args(args.model, kv, *common), logs, env,
                              die_with_parent=True)) for name, env in specs]
    procs = [s.proc for s in sides if s.proc]
    try:
        wait_ready(procs)
    except BaseException:
        stop_all(procs)
        raise
    print(f"workers up: {', '.join(f'{n} {e or {}}' for n, e in specs)}; logs in {logs}")
    return sides


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    max_len = max(args.lengths) + 64
    print(f"model {args.model}, {describe_dtype(args.dtype)}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, in-process threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY here {os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"load average {loadavg()}")
    workers = start_workers(args, max_len)
    try:
        idle = idle_cpu_share(workers, 2.0)
        print("idle workers' CPU use (cores): " + ", ".join(f"{k} {v:.3f}"
                                                             for k, v in idle.items()))
        llm = LLM(args.model, dtype=args.dtype, max_model_len=max_len)
        everyone = [Side("engine"), *workers]
        client = httpx.Client(timeout=600)
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size
        for n in args.lengths:
            for rep in range(args.reps + 1):  # rep 0 warms every side up at this length
                prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
                for side in (everyone if rep % 2 else everyone[::-1]):
                    c0 = Counters.read(side.pid)
                    if side.proc is None:
                        t, ms = engine_first_token(llm, prompt)
                    else:
                        t, stats = stream_first_token(client, side.proc.url, prompt)
                        ms = stats.get("prefill_ms", float("nan"))
                    if rep:
                        side.record(n, t, ms, Counters.read(side.pid) - c0)
            base = med(everyone[0].ttft[n])
            print(f"{n:6d} tokens: engine {base:.3f} s; " + "; ".join(
                f"{s.name} {med(s.ttft[n]):.3f} s ({med(s.ttft[n]) / base:.3f}x)"
                for s in workers), flush=True)
        print_table(args, everyone)
        if args.json:
            write_json(args, everyone, idle)
    finally:
        stop_all([s.proc for s in workers if s.proc])
    return 0


def print_table(args: argparse.Namespace, everyone: list[Side]) -> None:
    base = everyone[0]
    print(f"\n{args.reps} reps per length, order alternating; medians; per request: page faults "
          f"/ voluntary context switches / CPU s; load average now {loadavg()}\n")
    print("| prompt tokens | side | first token | / engine in-process | engine's prefill_ms | "
          "faults | switches | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        for s in everyone:
            c = s.counters[n]
            print(f"| {n} | {s.name} | {med(s.ttft[n]):.3f} s | "
                  f"{med(s.ttft[n]) / med(base.ttft[n]):.3f}x | {med(s.engine_ms[n]):.0f} | "
                  f"{med([x.faults for x in c]):.0f} | {med([x.switches for x in c]):.0f} | "
                  f"{med([x.cpu_s for x in c]):.2f} |")


def write_json(args: argparse.Namespace, everyone: list[Side], idle: dict) -> None:
    out = {"model": args.model, "dtype": describe_dtype(args.dtype), "torch": torch.__version__,
           "cpus": os.cpu_count(), "load_average_end": loadavg(), "reps": args.reps,
           "workers": args.worker, "idle_worker_cpu": idle,
           "sides": {s.name: {"ttft_s": s.ttft, "engine_prefill_ms": s.engine_ms,
                              "counters": {n: [vars(c) for c in cs]
                                           for n, cs in s.counters.items()}}
                     for s in everyone}}
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
