"""pull_cost's measurement, shared by the run on this host (pull_cost.py) and across hosts
(pull_cost_hosts.py): a conversation's history put on D, the next turn through a P deciding by
its cost model and through a P with the fixed 64-token rule, alternating, and the table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

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


def common_args(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(max(max(args.histories) + args.new_tokens + 64, 4096)),
            "--kv-cache-memory", args.kv_cache_memory]


def finish(args: argparse.Namespace, rows: list[dict]) -> None:
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
