"""The measured pull decision against the fixed 64-token rule, in one run: P's time for the next
turn of a conversation whose history is on D, with P deciding by its cost model and with P using
`kv_recompute_threshold: 64`, per history length.

    cost model   pull when verify RTT + bytes / bandwidth < predicted recompute of those tokens
    fixed-64     pull when the verified gain is at least 64 tokens

TTFT is the next turn's two legs as the client sees them: P's (pull or recompute the history,
compute the new tokens, its first token) and D's (READ P's new blocks, start from P's token).

Without URLs the benchmark launches D and the two Ps on this host (loopback). `--assumed-gbps G`
gives both Ps' link models a stand-in bandwidth (e.g. 0.1 = 100 Mbit/s) while the bytes still
move at loopback speed: the decisions are those of a slow link, the times are not.
`--multihost --rate 100mbit 1gbit 10gbit` (root; pull_cost_hosts.py) puts D and the two Ps
on hosts of their own with every link shaped to each rate in turn: the link model measures the
shaped link itself and the times are real. `--d-url --p-model-url --p-fixed-url` take running
workers instead (P model: default KV config; P fixed: `"kv_recompute_threshold": 64`; both
without prefix caching).

    .venv/bin/duplexkv bench pull_cost [--histories 32 64 256 1024 4096 16384] [--reps 3]
        [--assumed-gbps 0.1]
    .venv/bin/duplexkv bench pull_cost --multihost [--rate 100mbit 1gbit 10gbit]
        [--histories 1024 2048 4096 8192] [--reps 3]
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
from duplexkv.wire.kv_params import miss_params, replay_params

MISS = miss_params()
VOCAB = 4000  # ids valid for every preset
FIXED = 64  # the fixed rule compared against


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


def next_turn(client: httpx.Client, p: str, d: str, d_params: dict, prompt: list[int]) -> dict:
    """The next turn's two legs: P (pull or recompute the history, compute the new tokens, its
    first token) and D (READ what P computed, start from P's token). TTFT = the two legs."""
    dt, pj = _post(client, p, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                               "kv_transfer_params": replay_params(d_params)})
    d_dt, _ = _post(client, d, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "kv_transfer_params": pj["kv_transfer_params"]})
    s = pj["kv_stats"]
    dec = s.get("pull_decision") or {}
    return {"p_leg_ms": dt * 1e3, "ttft_ms": (dt + d_dt) * 1e3, "outcome": s["pull_outcome"],
            "pulled": s["pulled_tokens"], "transfer_ms": s["transfer_ms"] or None,
            "prefill_ms": s["prefill_ms"],
            "pred_transfer_ms": dec.get("predicted_transfer_ms"),
            "pred_recompute_ms": dec.get("predicted_recompute_ms"),
            "link_gbps": dec.get("link_gbps"), "link_measured": dec.get("link_measured")}


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _f(v: float | None, unit: str = " ms") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


KEYS = ("p_leg_ms", "ttft_ms", "pred_transfer_ms", "pred_recompute_ms", "transfer_ms",
        "prefill_ms", "link_gbps")


def measure(client: httpx.Client, d: str, p_model: str, p_fixed: str, histories: list[int],
            reps: int, new_tokens: int, label: str = "") -> list[dict]:
    """Per history: the same turns through the cost-model P and the fixed-64 P, alternating."""
    rows = []
    for n, hist in enumerate(histories):
        res: dict[str, list[dict]] = {"model": [], "fixed": []}
        for rep in range(reps + 1):  # rep 0 warms up (handshakes, link samples)
            base = [(7919 * (i + 1000 * rep + 97 * n)) % (VOCAB - 10) + 5
                    for i in range(max(hist - 17, 1))]
            new = [(31 * i + rep) % (VOCAB - 10) + 5 for i in range(new_tokens)]
            for policy in (("model", "fixed") if rep % 2 else ("fixed", "model")):
                p = p_model if policy == "model" else p_fixed
                d_params, history = history_on_d(client, p_fixed, d, base)
                r = next_turn(client, p, d, d_params, history + new)
                if rep:
                    res[policy].append(r)
        m, f = res["model"], res["fixed"]
        row = {"link": label, "history": hist, "new_tokens": new_tokens,
               "model_outcomes": sorted({r["outcome"] for r in m}),
               "fixed_outcomes": sorted({r["outcome"] for r in f}),
               "model_link_measured": all(r["link_measured"] for r in m),
               **{f"model_{k}": _med(m, k) for k in KEYS},
               **{f"fixed_{k}": _med(f, k) for k in KEYS}}
        row["model_vs_fixed"] = row["model_ttft_ms"] / row["fixed_ttft_ms"]
        rows.append(row)
        print(f"{label + ' ' if label else ''}history {hist:6d}: cost model "
              f"{decides(row['model_outcomes'])} TTFT {row['model_ttft_ms']:.1f} ms (predicted "
              f"transfer {_f(row['model_pred_transfer_ms'])}, recompute "
              f"{_f(row['model_pred_recompute_ms'])}); fixed-64 "
              f"{decides(row['fixed_outcomes'])} {row['fixed_ttft_ms']:.1f} ms; "
              f"model/fixed {row['model_vs_fixed']:.2f}x", flush=True)
    return rows


def decides(outcomes: list[str]) -> str:
    """P's pull outcomes as decisions: `pull`, or `decline (reason)`."""
    return "/".join("pull" if o == "pulled" else f"decline ({o})" for o in outcomes)


def actual_recompute_ms(r: dict) -> float | None:
    """When exactly one policy pulled: its P compute subtracted from the other's (which also
    computed the history) is the history's actual recompute."""
    pulled = {p: r[f"{p}_outcomes"] == ["pulled"] for p in ("model", "fixed")}
    if pulled["model"] == pulled["fixed"]:
        return None
    pull, rec = ("model", "fixed") if pulled["model"] else ("fixed", "model")
    ms = r[f"{rec}_prefill_ms"] - r[f"{pull}_prefill_ms"]
    return ms if ms > 0 else None  # a few tokens' recompute is lost in the noise


def print_table(rows: list[dict]) -> None:
    print("\n| link | history (+new) | link measured by P | cost model decides | predicted "
          "transfer | predicted recompute | actual transfer | actual recompute | TTFT, cost model "
          "| fixed-64 decides | TTFT, fixed-64 | cost model / fixed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        transfer = r["model_transfer_ms"] or r["fixed_transfer_ms"]
        gbps = r["model_link_gbps"]
        seen = "-" if gbps is None else \
            f"{gbps:.3g} Gbit/s{'' if r['model_link_measured'] else ' (prior)'}"
        print(f"| {r['link'] or '-'} | {r['history']} (+{r['new_tokens']}) | {seen} | "
              f"{decides(r['model_outcomes'])} | {_f(r['model_pred_transfer_ms'])} | "
              f"{_f(r['model_pred_recompute_ms'])} | {_f(transfer)} | "
              f"{_f(actual_recompute_ms(r))} | {_f(r['model_ttft_ms'])} | "
              f"{decides(r['fixed_outcomes'])} | {_f(r['fixed_ttft_ms'])} | "
              f"{r['model_vs_fixed']:.2f}x |")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--histories", type=int, nargs="+", action=Accumulate, default=None,
                    help="default: 32 64 256 1024 4096 16384; --multihost: 1024 2048 4096 8192")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--assumed-gbps", type=float, default=0.0,
                    help="stand-in link bandwidth for both Ps' link models (0: measured)")
    ap.add_argument("--connector", default="TcpConnector",
                    choices=["TcpConnector", "NixlConnector"])
    ap.add_argument("--kv-cache-memory", default="1.0", help="GiB of KV pool per worker")
    ap.add_argument("--d-url")
    ap.add_argument("--p-model-url")
    ap.add_argument("--p-fixed-url")
    ap.add_argument("--multihost", action="store_true",
                    help="P, P and D on hosts of their own (root), links shaped to each --rate")
    ap.add_argument("--rate", nargs="+", action=Accumulate, default=["100mbit", "1gbit", "10gbit"],
                    help="with --multihost: link rates (tc tbf), or unlimited")
    ap.add_argument("--json", help="write the rows here")
    return ap


def common_args(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(max(max(args.histories) + args.new_tokens + 64, 4096)),
            "--kv-cache-memory", args.kv_cache_memory]


def finish(args: argparse.Namespace, rows: list[dict]) -> None:
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.multihost:
        from duplexkv_bench.pull_cost_hosts import run

        return run(args)
    args.histories = args.histories or [32, 64, 256, 1024, 4096, 16384]
    given = (args.d_url, args.p_model_url, args.p_fixed_url)
    procs = []
    if not all(given):
        if any(given):
            raise SystemExit("give all of --d-url --p-model-url --p-fixed-url, or none")
        common = common_args(args)
        extra = {"kv_link_assumed_gbps": args.assumed_gbps} if args.assumed_gbps else {}
        logs = Path(tempfile.mkdtemp(prefix="duplexkv-pull-cost-"))
        no_pc = "--no-enable-prefix-caching"
        procs = [spawn("d", worker_args(args.model, bidirectional_kv(args.connector), *common),
                       logs, {}),
                 spawn("p_model", worker_args(args.model, bidirectional_kv(args.connector,
                                                                           **extra),
                                              *common, no_pc), logs, {}),
                 spawn("p_fixed", worker_args(args.model, bidirectional_kv(
                     args.connector, kv_recompute_threshold=FIXED, **extra), *common, no_pc),
                     logs, {})]
        wait_ready(procs)
        given = tuple(p.url for p in procs)
        print(f"workers up (logs in {logs}); {describe_dtype(None)}; link: "
              f"{f'assumed {args.assumed_gbps} Gbit/s' if args.assumed_gbps else 'measured'}")
    try:
        label = f"assumed {args.assumed_gbps} Gbit/s" if args.assumed_gbps else "loopback"
        with httpx.Client(timeout=600) as client:
            rows = measure(client, *given, args.histories, args.reps, args.new_tokens, label)
        finish(args, rows)
    finally:
        for x in procs:
            x.stop()
    return 0


if __name__ == "__main__":
    main()
