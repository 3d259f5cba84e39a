"""The side-by-side table of `bench vs_vllm` (vs_vllm.py): per measurement both sides' figures,
their ratio against its target and, given the machine's limits, each side's share of them and a
decode row's floor beside the time its FLOPs take (machine_limits.py)."""

from __future__ import annotations

from duplexkv_bench.machine_limits import Limits, Shape

TARGETS = {"ttft": 0.9, "tpot": 0.8}  # issue 18: ours / vLLM at most this


def parse(key: str) -> tuple[str, int, int]:
    """A measurement's key -> (kind, tokens or context, batch): "ttft 2048" -> ("ttft", 2048, 1),
    "tpot 4096 x8" -> ("tpot", 4096, 8)."""
    kind, *rest = key.split()
    return kind, int(rest[0]), int(rest[1][1:]) if kind == "tpot" else 1


def label(key: str) -> str:
    kind, n, batch = parse(key)
    if kind == "ttft":
        return f"TTFT, {n:,} tokens"
    return f"time per output token at {n:,} context, batch {batch}"


def share(key: str, seconds: float | None, limits: Limits, shape: Shape,
          beside: float | None = None) -> str:
    """A figure as a share of the machine's limit: prefill of its GEMM rate, decode of the
    bandwidth floor (machine_limits.py); with `beside` (the read bandwidth measured beside the
    decode row), "that share / the share of the run's limits"."""
    if not seconds:
        return "—"
    kind, n, batch = parse(key)
    if kind == "ttft":
        return f"{limits.prefill_share(shape, n, seconds):.0%}"
    run = f"{limits.decode_share(shape, n, batch, seconds):.0%}"
    if beside is None:
        return run
    return f"{limits.with_read_gbs(beside).decode_share(shape, n, batch, seconds):.0%} / {run}"


def floors(key: str, limits: Limits, shape: Shape) -> str:
    """A decode row's bandwidth floor and the time its FLOPs take at the GEMM rate."""
    kind, ctx, batch = parse(key)
    if kind == "ttft":
        return "—"
    return (f"{limits.decode_floor_ms(shape, ctx, batch):.3g} ms / "
            f"{limits.decode_compute_ms(shape, ctx, batch):.3g} ms")


def table(vllm: dict[str, float], ours: dict[str, float], limits: Limits | None = None,
          shape: Shape | None = None, beside: dict[str, dict[str, float]] | None = None) -> str:
    """Markdown: measurement | vLLM | duplexkv | ratio | target (ratio <= target?), and with
    `limits` each side's share of the machine's limit (prefill: of the GEMM rate; decode: of
    the bandwidth floor, with `beside` {side: {row: GB/s}} first of the bandwidth read beside
    the row, then of the run's) and, for decode, the floor beside the time of its FLOPs."""
    extra = limits is not None and shape is not None
    beside = beside or {}
    read = lambda side, key: beside.get(side, {}).get(key)  # noqa: E731
    of = " (decode: of the bandwidth beside the row / of the run's)" if any(beside.values()) \
        else ""
    rows = ["| | vLLM-CPU | duplexkv worker | ratio (duplexkv / vLLM) | target |" +
            (f" vLLM, of the limit{of} | duplexkv, of the limit{of} | decode floor / its FLOPs "
             "at the GEMM rate |" if extra else ""),
            "|---|---|---|---|---|" + ("---|---|---|" if extra else "")]
    for key in [k for k in vllm if k in ours] + [k for k in ours if k not in vllm]:
        kind = parse(key)[0]
        unit, k = ("s", 1.0) if kind == "ttft" else ("ms", 1e3)
        v, o = vllm.get(key), ours.get(key)
        cell = lambda x: "—" if x is None else f"{x * k:.3g} {unit}"  # noqa: E731
        if v and o:
            ratio = o / v
            ok = "met" if ratio <= TARGETS[kind] else "missed"
            r = f"{ratio:.3f}"
        else:
            r, ok = "—", "—"
        row = f"| {label(key)} | {cell(v)} | {cell(o)} | {r} | ≤ {TARGETS[kind]} ({ok}) |"
        if extra:
            row += (f" {share(key, v, limits, shape, read('vllm', key))} |"
                    f" {share(key, o, limits, shape, read('duplexkv', key))} |"
                    f" {floors(key, limits, shape)} |")
        rows.append(row)
    return "\n".join(rows)
