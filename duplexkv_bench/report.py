"""Benchmark results -> per-bucket and per-turn statistics, terminal tables, markdown, JSON.

A request's context bucket is the first edge >= its prompt tokens: "16k" holds 12k < context
<= 16k. Speed-up = p50 TTFT without reuse / p50 TTFT with reuse; on/ideal = p50 with reuse /
p50 of the single worker whose local prefix cache holds the history. Ceiling = p50 without reuse
/ p50 ideal: the speed-up a cache already resident on P would give, which no transfer can beat;
of ceiling = speed-up / ceiling (on/off / ideal/off, = ideal / on): the share of the possible
speed-up reuse reached (issue 14's target: >= 0.95 at 16k);
compute off/on = P's prefill compute time without / with reuse (p50), the pure compute ratio.
In the per-turn table the
token and time columns without a mode are reuse on's (P's leg: READ from D, computed, READ time,
compute time; then D's READ of the new tail from P).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
from rich.table import Table

from duplexkv_bench.client import Result

MODES = ("off", "on", "ideal")
MODE_NAMES = {"off": "reuse off", "on": "reuse on", "ideal": "ideal (local cache)"}
BUCKET_EDGES = (2048, 4096, 8192, 12288, 16384, 24576, 32768)


def bucket_of(tokens: int) -> int:
    for edge in BUCKET_EDGES:
        if tokens <= edge:
            return edge
    return math.ceil(tokens / 16384) * 16384


def label(edge: int) -> str:
    return f"{edge // 1024}k" if edge % 1024 == 0 else str(edge)


def pct(values: Iterable[float | None], q: float) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _stats(rs: list[Result]) -> dict:
    return {"n": len(rs), "ttft_p50": pct((r.ttft_ms for r in rs), 50),
            "ttft_p90": pct((r.ttft_ms for r in rs), 90),
            "tpot_p50": pct((r.tpot_ms for r in rs), 50),
            "context_p50": pct((r.context_tokens for r in rs), 50),
            "pulled_p50": pct((r.pulled_tokens for r in rs), 50),
            "recomputed_p50": pct((r.recomputed_tokens for r in rs), 50),
            "local_hit_p50": pct((r.local_hit_tokens for r in rs), 50),
            "d_to_p_ms_p50": pct((r.d_to_p_ms for r in rs), 50),
            "prefill_ms_p50": pct((r.prefill_ms for r in rs), 50),
            "p_to_d_ms_p50": pct((r.p_to_d_ms for r in rs), 50),
            "p_to_d_tokens_p50": pct((r.p_to_d_tokens for r in rs), 50),
            "p_leg_ms_p50": pct((r.p_leg_ms for r in rs), 50),
            "d_prefill_ms_p50": pct((r.d_prefill_ms for r in rs), 50)}


def _compare(row: dict) -> dict:
    off, on, ideal = (row.get(m, {}).get("ttft_p50") for m in MODES)
    compute_off, compute_on = (row.get(m, {}).get("prefill_ms_p50") for m in ("off", "on"))
    speedup, ceiling = ratio(off, on), ratio(off, ideal)
    return {"speedup_on_off": speedup, "on_vs_ideal": ratio(on, ideal),
            "ceiling_off_ideal": ceiling, "of_ceiling": ratio(speedup, ceiling),
            "compute_off_on": ratio(compute_off, compute_on)}


def summarize(results: list[Result], wall_s: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.error is None]
    modes = [m for m in MODES if any(r.mode == m for r in results)]
    groups: dict[tuple[str, str, int], list[Result]] = defaultdict(list)
    for r in ok:
        groups["bucket", r.mode, bucket_of(r.context_tokens)].append(r)
        groups["turn", r.mode, r.turn].append(r)
    out: dict = {"modes": modes, "by_bucket": [], "by_turn": [], "per_mode": {}}
    for kind in ("bucket", "turn"):
        keys = sorted({k for (g, _m, k) in groups if g == kind})
        for key in keys:
            row: dict = {kind: key}
            if kind == "bucket":
                row["label"] = label(key)
            for m in modes:
                if groups.get((kind, m, key)):
                    row[m] = _stats(groups[kind, m, key])
            row.update(_compare(row))
            out[f"by_{kind}"].append(row)
    for m in modes:
        rs = [r for r in results if r.mode == m]
        good = [r for r in rs if r.error is None]
        out["per_mode"][m] = {**_stats(good), "requests": len(rs),
                              "failed": len(rs) - len(good),
                              "tpot_p90": pct((r.tpot_ms for r in good), 90),
                              "wall_s": (wall_s or {}).get(m),
                              "errors": sorted({r.error for r in rs if r.error})[:5]}
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.1f}")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pp(row: dict, m: str) -> str:
    s = row.get(m)
    return "-" if not s else f"{_ms(s['ttft_p50'])} / {_ms(s['ttft_p90'])}"


def bucket_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    modes = summary["modes"]
    head = ["context", "requests", *(f"TTFT {m} p50/p90 ms" for m in modes)]
    head += [h for h, need in (("speed-up on/off", {"off", "on"}),
                               ("on / ideal", {"on", "ideal"}),
                               ("ceiling off/ideal", {"off", "ideal"}),
                               ("of ceiling", {"off", "on", "ideal"}),
                               ("P compute off/on", {"off", "on"})) if need <= set(modes)]
    rows = []
    for row in summary["by_bucket"]:
        n = "/".join(str(row.get(m, {}).get("n", 0)) for m in modes)
        cells = [f"<= {row['label']}", n, *(_pp(row, m) for m in modes)]
        if {"off", "on"} <= set(modes):
            cells.append(_x(row["speedup_on_off"]))
        if {"on", "ideal"} <= set(modes):
            cells.append(_x(row["on_vs_ideal"]))
        if {"off", "ideal"} <= set(modes):
            cells.append(_x(row["ceiling_off_ideal"]))
        if {"off", "on", "ideal"} <= set(modes):
            cells.append("-" if row["of_ceiling"] is None else f"{row['of_ceiling']:.2f}")
        if {"off", "on"} <= set(modes):
            cells.append(_x(row["compute_off_on"]))
        rows.append(cells)
    return head, rows


def turn_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    modes = set(summary["modes"])
    both = {"off", "on"} <= modes
    head = ["turn", "context", *(f"TTFT {m} ms" for m in summary["modes"])]
    head += ["speed-up"] * both
    if "on" in modes:
        head += ["pulled from D", "recomputed", "D->P ms", "P prefill ms", "P->D ms"]
    if "off" in modes:
        head += ["P prefill ms (off)"]
    rows = []
    for row in summary["by_turn"]:
        on, off = row.get("on") or {}, row.get("off") or {}
        ref = on or off or row.get("ideal") or {}
        cells = [str(row["turn"]), _n(ref.get("context_p50")),
                 *(_ms(row.get(m, {}).get("ttft_p50")) for m in summary["modes"])]
        cells += [_x(row["speedup_on_off"])] * both
        if "on" in modes:
            cells += [_n(on.get("pulled_p50")), _n(on.get("recomputed_p50")),
                      _ms(on.get("d_to_p_ms_p50")), _ms(on.get("prefill_ms_p50")),
                      _ms(on.get("p_to_d_ms_p50"))]
        if "off" in modes:
            cells += [_ms(off.get("prefill_ms_p50"))]
        rows.append(cells)
    return head, rows


def mode_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["mode", "requests", "failed", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms",
            "TPOT p90 ms", "wall s"]
    rows = [[MODE_NAMES[m], str(s["requests"]), str(s["failed"]), _ms(s["ttft_p50"]),
             _ms(s["ttft_p90"]), _ms(s["tpot_p50"]), _ms(s["tpot_p90"]),
             "-" if s["wall_s"] is None else f"{s['wall_s']:.0f}"]
            for m, s in summary["per_mode"].items()]
    return head, rows


def rich_table(title: str, head: list[str], rows: list[list[str]]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    return t


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


TABLES = (("TTFT by context bucket", bucket_rows), ("Per turn (p50 over conversations)",
                                                     turn_rows), ("Per mode", mode_rows))


def tables(summary: dict) -> list[Table]:
    return [rich_table(title, *fn(summary)) for title, fn in TABLES]


def markdown(summary: dict) -> str:
    return "\n\n".join(f"**{title}**\n\n{markdown_table(*fn(summary))}"
                       for title, fn in TABLES)
