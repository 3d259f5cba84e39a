"""The measured pull decision against the fixed 64-token rule, in one run: P's time for the next
turn of a conversation whose history is on D, with P deciding by its cost model and with P using
`kv_recompute_threshold: 64`, per history length.

    cost model   pull when verify RTT + bytes / bandwidth < predicted recompute of those tokens
    fixed-64     pull when the verified gain is at least 64 tokens

Without URLs the benchmark launches D and the two Ps on this host (loopback). `--assumed-gbps G`
gives both Ps' link models a stand-in bandwidth (e.g. 0.1 = 100 Mbit/s) while the bytes still
move at loopback speed: the decisions are those of a slow link, the times are not. On the
multi-host harness (shaped links between P and D), start the workers there and pass
`--d-url --p-model-url --p-fixed-url` (P model: default KV config; P fixed: with
`"kv_recompute_threshold": 64`; both without prefix caching) and no --assumed-gbps: the link
model then measures the shaped link itself and the times are real.

    .venv/bin/duplexkv bench pull_cost [--histories 32 64 256 1024 4096 16384] [--reps 3]
        [--assumed-gbps 0.1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from duplexkv.launch import bidirectional_kv, spawn, wait_ready, worker_args

MISS = {"do_remote_decode": True, "do_remote_prefill": False}
VOCAB = 4000  # ids valid for every preset


def _post(client: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def history_on_d(client: httpx.Client, p: str, d: str, prompt: list[int]) -> tuple[dict, list]:
    """P computes `prompt`, D reads it and answers 17 tokens, then retains the turn."""
    _, pj = _post(client, p, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                              "kv_transfer_params": MISS})
    _, dj = _post(client, d, {"prompt": prompt, "max_tokens": 17, "temperature": 0,
                              "ignore_eos": True, "return_token_ids": True,
                              "kv_transfer_params": pj["kv_transfer_params"]})
    return dj["kv_transfer_params"], prompt + dj["choices"][0]["token_ids"]


def next_turn(client: httpx.Client, p: str, d_params: dict, prompt: list[int]) -> dict:
    dt, pj = _post(client, p, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                               "kv_transfer_params": {**d_params, **MISS}})
    s = pj["kv_stats"]
    dec = s.get("pull_decision") or {}
    return {"p_leg_ms": dt * 1e3, "outcome": s["pull_outcome"], "pulled": s["pulled_tokens"],
            "transfer_ms": s["transfer_ms"], "prefill_ms": s["prefill_ms"],
            "pred_transfer_ms": dec.get("predicted_transfer_ms"),
            "pred_recompute_ms": dec.get("predicted_recompute_ms"),
            "link_gbps": dec.get("link_gbps")}


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _f(v: float | None, unit: str = " ms") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--histories", type=int, nargs="+", default=[32, 64, 256, 1024, 4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--assumed-gbps", type=float, default=0.0,
                    help="stand-in link bandwidth for both Ps' link models (0: measured)")
    ap.add_argument("--connector", default="TcpConnector",
                    choices=["TcpConnector", "NixlConnector"])
    ap.add_argument("--d-url")
    ap.add_argument("--p-model-url")
    ap.add_argument("--p-fixed-url")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    given = (args.d_url, args.p_model_url, args.p_fixed_url)
    procs = []
    if not all(given):
        if any(given):
            raise SystemExit("give all of --d-url --p-model-url --p-fixed-url, or none")
        common = ["--max-model-len", str(max(max(args.histories) + args.new_tokens + 64, 4096)),
                  "--kv-cache-memory", "1.0"]
        extra = {"kv_link_assumed_gbps": args.assumed_gbps} if args.assumed_gbps else {}
        logs = Path(tempfile.mkdtemp(prefix="duplexkv-pull-cost-"))
        no_pc = "--no-enable-prefix-caching"
        procs = [spawn("d", worker_args(args.model, bidirectional_kv(args.connector), *common),
                       logs, {}),
                 spawn("p_model", worker_args(args.model, bidirectional_kv(args.connector,
                                                                           **extra),
                                              *common, no_pc), logs, {}),
                 spawn("p_fixed", worker_args(args.model, bidirectional_kv(
                     args.connector, kv_recompute_threshold=64, **extra), *common, no_pc),
                     logs, {})]
        wait_ready(procs)
        given = tuple(p.url for p in procs)
        print(f"workers up (logs in {logs}); link: "
              f"{f'assumed {args.assumed_gbps} Gbit/s' if args.assumed_gbps else 'measured'}")
    d, p_model, p_fixed = given
    rows = []
    try:
        client = httpx.Client(timeout=600)
        for n, hist in enumerate(args.histories):
            res: dict[str, list[dict]] = {"model": [], "fixed": []}
            for rep in range(args.reps + 1):  # rep 0 warms up (handshakes, link samples)
                base = [(7919 * (i + 1000 * rep + 97 * n)) % (VOCAB - 10) + 5
                        for i in range(max(hist - 17, 1))]
                new = [(31 * i + rep) % (VOCAB - 10) + 5 for i in range(args.new_tokens)]
                order = ("model", "fixed") if rep % 2 else ("fixed", "model")
                for policy in order:
                    p = p_model if policy == "model" else p_fixed
                    d_params, history = history_on_d(client, p_fixed, d, base)
                    r = next_turn(client, p, d_params, history + new)
                    if rep:
                        res[policy].append(r)
            m, f = res["model"], res["fixed"]
            row = {"history": hist, "new_tokens": args.new_tokens,
                   "model_outcomes": sorted({r["outcome"] for r in m}),
                   "fixed_outcomes": sorted({r["outcome"] for r in f}),
                   **{f"model_{k}": _med(m, k) for k in ("p_leg_ms", "pred_transfer_ms",
                                                         "pred_recompute_ms", "transfer_ms",
                                                         "prefill_ms", "link_gbps")},
                   "fixed_p_leg_ms": _med(f, "p_leg_ms")}
            row["model_vs_fixed"] = row["model_p_leg_ms"] / row["fixed_p_leg_ms"]
            rows.append(row)
            print(f"history {hist:6d}: cost model {'/'.join(row['model_outcomes'])} "
                  f"{row['model_p_leg_ms']:.1f} ms (predicted transfer "
                  f"{_f(row['model_pred_transfer_ms'])}, recompute "
                  f"{_f(row['model_pred_recompute_ms'])}); fixed-64 "
                  f"{'/'.join(row['fixed_outcomes'])} {row['fixed_p_leg_ms']:.1f} ms; "
                  f"model/fixed {row['model_vs_fixed']:.2f}x", flush=True)
        print("\n| history (+new) | cost model decides | predicted transfer | predicted recompute "
              "| actual transfer | P leg, cost model | fixed-64 decides | P leg, fixed-64 | "
              "cost model / fixed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['history']} (+{r['new_tokens']}) | {'/'.join(r['model_outcomes'])} | "
                  f"{_f(r['model_pred_transfer_ms'])} | {_f(r['model_pred_recompute_ms'])} | "
                  f"{_f(r['model_transfer_ms'])} | {_f(r['model_p_leg_ms'])} | "
                  f"{'/'.join(r['fixed_outcomes'])} | {_f(r['fixed_p_leg_ms'])} | "
                  f"{r['model_vs_fixed']:.2f}x |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        for x in procs:
            x.stop()
    return 0


if __name__ == "__main__":
    main()
