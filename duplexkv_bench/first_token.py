"""D's time to its first token on the decode leg, with and without P's greedy first token.

One P and two D workers on the `bench` model: D "takes" (default, `use_prefill_first_token`)
emits P's first token as soon as its READ of P's blocks lands; D "computes" recomputes the last
prompt token first (vLLM's behaviour). For each prompt length P runs the prefill leg, then the
same P params go to one D, a fresh prefill leg to the other (order alternating per rep); the
client measures, streaming, the time to D's first token, and counts the reps where both D's
wrote the same first word and the same 8 tokens. In bfloat16 the two paths may differ: P's
KV of the last prompt token comes from a chunked prefill, D's recomputation from a one-token
step, and on these random-token prompts near-tied greedy choices can flip a few tokens later
(the float32 tests require exact equality).

    .venv/bin/python duplexkv bench first_token [--lengths 2048 8192 15360] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.flags import Accumulate
from duplexkv.launch import bidirectional_kv, spawn, wait_ready, worker_args
from duplexkv_bench.reuse import MISS, p_leg


def d_leg(client: httpx.Client, url: str, prompt: list[int], params: dict) -> tuple[float, str,
                                                                                    dict]:
    """(seconds to the first streamed text, the whole text, the final kv_stats)."""
    t0 = time.perf_counter()
    first, text, stats = None, [], {}
    with client.stream("POST", url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_transfer_params": params}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                first = first or time.perf_counter() - t0
                text.append(ev["choices"][0]["text"])
            stats = ev.get("kv_stats") or stats
    return first, "".join(text), stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate,
                    default=[2048, 8192, 15360])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--connector", default="TcpConnector",
                    choices=["TcpConnector", "NixlConnector"])
    args = ap.parse_args(argv)
    common = ["--max-model-len", str(max(max(args.lengths) + 64, 4096)),
              "--kv-cache-memory", "1.0", "--no-enable-prefix-caching"]
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-first-token-"))
    kv = bidirectional_kv(args.connector, enabled=False)
    procs = [spawn("p", worker_args(args.model, kv, *common), logs),
             spawn("d_takes", worker_args(args.model, kv, *common), logs),
             spawn("d_computes", worker_args(args.model, bidirectional_kv(
                 args.connector, enabled=False, use_prefill_first_token=False), *common), logs)]
    try:
        wait_ready(procs)
        p, takes, computes = (x.url for x in procs)
        client = httpx.Client(timeout=600)
        print(f"workers up (logs in {logs}); connector {args.connector}; "
              f"{describe_dtype(None)}")
        print("| prompt tokens | D TTFT, P's token | D TTFT, recomputing the last token | "
              "saved | D computed tokens (takes / computes) | same first word | same answer |")
        print("|---|---|---|---|---|---|---|")
        for n, length in enumerate(args.lengths):
            res: dict[str, list[float]] = {"takes": [], "computes": []}
            computed, same_first, same_all = {}, 0, 0
            for rep in range(args.reps + 1):  # rep 0 warms up
                prompt = [(7919 * (i + 1000 * rep + 97 * n)) % 3990 + 5 for i in range(length)]
                order = [("takes", takes), ("computes", computes)]
                texts = {}
                for name, url in (order if rep % 2 else order[::-1]):
                    params = p_leg(client, p, prompt, MISS)[1]["kv_transfer_params"]
                    ttft, texts[name], stats = d_leg(client, url, prompt, params)
                    computed[name] = stats.get("computed_tokens")
                    if rep:
                        res[name].append(ttft)
                if rep:
                    same_all += texts["takes"] == texts["computes"]
                    same_first += texts["takes"].split()[:1] == texts["computes"].split()[:1]
            a, b = statistics.median(res["takes"]), statistics.median(res["computes"])
            print(f"| {length} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {(b - a) * 1e3:.1f} ms | "
                  f"{computed['takes']} / {computed['computes']} | {same_first}/{args.reps} | "
                  f"{same_all}/{args.reps} |", flush=True)
    finally:
        for x in procs:
            x.stop()


if __name__ == "__main__":
    main()
