"""A fast guard against engine regressions: prefill and decode on `tiny` and `bench`, compared.

Per model (in-process, prefix caching off): prefill at a few lengths (add_request -> finished,
max_tokens=1) and the median decode step at one context; each row the median of `--reps`
samples after a warm-up. `--json FILE` writes the rows with what they were measured on (CPU
model and flags, dtype, torch version, threads, load average); `--compare FILE` prints each
row's ratio against such a file and flags rows slower by more than `--tolerance` (exit code 1);
with `--rows FILE2` it compares two files without measuring.
Committed baselines, one per CPU kind and dtype: docs/results/engine-guard-KIND-DTYPE.json, KIND
`amx` (AMX tiles), `avx512` (AVX-512 without AMX), `avx2` or `other` (`cpu_kind`); `--compare
baseline` picks the one for this CPU and `--dtype`. Compare a change in one session on one machine,
alternating: run it on main, on the change, on main again (see docs/engine.md).

    duplexkv bench engine_guard [--json out.json] [--compare baseline|FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from duplexkv import LLM
from duplexkv.engine.dtype import cpu_bf16_status, read_cpu_flags
from duplexkv.flags import Accumulate
from duplexkv_bench.engine_vs_hf import ours_decode, ours_prefill

BASELINES = Path(__file__).resolve().parent.parent / "docs" / "results"
# the flags that decide which kernels PyTorch runs on x86 (and so what a timing means)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine(dtype: str) -> dict:
    flags = read_cpu_flags() or frozenset()
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpus": os.cpu_count(), "kernel_flags": [f for f in KERNEL_FLAGS
                                                                   if f in flags],
            "bf16": cpu_bf16_status(flags), "dtype": dtype, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average": _loadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}


def cpu_kind(flags: frozenset[str]) -> str:
    """The CPU kind a baseline belongs to: what decides which kernels run (AMX tiles for bf16,
    AVX-512, AVX2)."""
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def baseline_path(dtype: str, flags: frozenset[str] | None = None) -> Path:
    """The committed baseline for this CPU kind and dtype (it may not exist yet)."""
    flags = (read_cpu_flags() or frozenset()) if flags is None else flags
    return BASELINES / f"engine-guard-{cpu_kind(flags)}-{dtype}.json"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def measure_model(model: str, args: argparse.Namespace) -> list[dict]:
    max_len = max([*args.prefill, args.decode_context]) + args.decode_steps + 8
    llm = LLM(model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=max_len,
              max_num_batched_tokens=max_len, num_kv_blocks=max_len // 16 + 8)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    ours_prefill(llm, rand(min(args.prefill)))  # warm up
    rows = []
    for n in args.prefill:
        xs = [ours_prefill(llm, rand(n)) for _ in range(args.reps)]
        rows.append(_row(model, f"prefill {n}", xs))
    xs = [ours_decode(llm, rand(args.decode_context), args.decode_steps)
          for _ in range(args.reps)]
    rows.append(_row(model, f"decode step @{args.decode_context}", xs))
    return rows


def _row(model: str, what: str, xs: list[float]) -> dict:
    row = {"model": model, "what": what, "median_s": statistics.median(xs), "samples_s": xs}
    print(f"{model:6s} {what:24s} {row['median_s'] * 1e3:9.2f} ms  "
          f"({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})", flush=True)
    return row


def compare(rows: list[dict], meta: dict, baseline_path: str, tolerance: float) -> int:
    """Print each row against the baseline's; 1 if any row is slower beyond `tolerance`."""
    base = json.loads(Path(baseline_path).read_text())
    differs = [k for k in ("cpu", "cpus", "kernel_flags", "dtype", "torch", "threads",
                           "omp_wait_policy")
               if base["machine"].get(k) != meta.get(k)]
    if differs:
        print("note: measured on a different " + ", ".join(
            f"{k} ({base['machine'].get(k)} there, {meta.get(k)} here)" for k in differs)
            + ": ratios compare machines, not only code")
    old = {(r["model"], r["what"]): r["median_s"] for r in base["rows"]}
    print(f"\nagainst {baseline_path} (load average there {base['machine'].get('load_average')}, "
          f"here {meta['load_average']}); ratio = here / there, flagged above "
          f"{1 + tolerance:.2f}\n")
    print("| model | measurement | baseline | now | ratio | |")
    print("|---|---|---|---|---|---|")
    slower = 0
    for r in rows:
        b = old.get((r["model"], r["what"]))
        if b is None:
            print(f"| {r['model']} | {r['what']} | - | {r['median_s'] * 1e3:.2f} ms | - | "
                  f"not in the baseline |")
            continue
        ratio = r["median_s"] / b
        flag = ratio > 1 + tolerance
        slower += flag
        print(f"| {r['model']} | {r['what']} | {b * 1e3:.2f} ms | {r['median_s'] * 1e3:.2f} ms | "
              f"{ratio:.3f} | {'SLOWER' if flag else 'ok'} |")
    print(f"\n{slower} row(s) slower than the baseline by more than {tolerance:.0%}")
    return 1 if slower else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", action=Accumulate, default=["tiny", "bench"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill", type=int, nargs="+", action=Accumulate, default=[512, 2048])
    ap.add_argument("--decode-context", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the rows and the machine here")
    ap.add_argument("--compare", metavar="FILE",
                    help="a result file to compare with, or `baseline`: the committed one for "
                         "this CPU kind and --dtype (docs/results/engine-guard-KIND-DTYPE.json)")
    ap.add_argument("--rows", metavar="FILE",
                    help="compare this result file's rows instead of measuring (with --compare)")
    ap.add_argument("--tolerance", type=float, default=0.10,
                    help="flag rows slower than the baseline by more than this share")
    args = ap.parse_args(argv)
    if min([*args.prefill, args.decode_context, args.decode_steps, args.reps]) < 1:
        ap.error("lengths, steps and reps must be >= 1")
    if args.compare == "baseline":
        path = baseline_path(args.dtype)
        if not path.is_file():
            ap.error(f"no committed baseline for this CPU kind and dtype ({path.name}); make one "
                     f"on a quiet machine: OMP_WAIT_POLICY=PASSIVE duplexkv bench engine_guard "
                     f"--dtype {args.dtype} --json {path}")
        args.compare = str(path)
    if args.rows:
        if not args.compare:
            ap.error("--rows goes with --compare")
        done = json.loads(Path(args.rows).read_text())
        return compare(done["rows"], done["machine"], args.compare, args.tolerance)
    meta = machine(args.dtype)
    print(f"{meta['cpu']}, {meta['cpus']} CPUs, {meta['bf16']}, dtype {args.dtype}, torch "
          f"{meta['torch']}, {meta['threads']} threads, load average {meta['load_average']}")
    rows = []
    for model in args.models:
        rows += measure_model(model, args)
        gc.collect()
    meta["load_average_end"] = _loadavg()
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": meta, "rows": rows}, indent=1) + "\n")
    return compare(rows, meta, args.compare, args.tolerance) if args.compare else 0


if __name__ == "__main__":
    sys.exit(main())
