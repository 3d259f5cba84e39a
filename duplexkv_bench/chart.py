"""TTFT vs context length, one line per mode (per turn: p50 context, p50 TTFT) over every
request's point, like AWS's chart for bidirectional KV transfer."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from duplexkv_bench.client import Result
from duplexkv_bench.report import MODE_NAMES, pct

COLORS = {"off": "tab:red", "on": "tab:green", "ideal": "tab:blue"}


def plot(path: Path, results: list[Result], modes: list[str], title: str) -> Path:
    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.subplots()
    for m in modes:
        rs = [r for r in results if r.mode == m and r.error is None and r.ttft_ms is not None]
        if not rs:
            continue
        ax.scatter([r.context_tokens for r in rs], [r.ttft_ms for r in rs], s=12, alpha=0.3,
                   color=COLORS[m], linewidths=0)
        turns = sorted({r.turn for r in rs})
        xs = [pct((r.context_tokens for r in rs if r.turn == t), 50) for t in turns]
        ys = [pct((r.ttft_ms for r in rs if r.turn == t), 50) for t in turns]
        ax.plot(xs, ys, marker="o", color=COLORS[m], label=f"{MODE_NAMES[m]} (p50 per turn)")
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
