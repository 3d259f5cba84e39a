"""What sampling one row of logits costs, per vocabulary size and sampling setting, against greedy's
argmax on the same row; with `--old TREE`, that tree's sampler beside this one, interleaved.

    duplexkv bench sampler_cost [--vocab 32000 151936] [--rounds 6] [--old TREE] [--json F]

Logits are N(0, 3²) per token: top-p 0.9 after temperature 0.7 keeps 70 of 32,000 tokens and 407
of 151,936 (a peaky model's rows); top-p 0.95 at temperature 1 keeps 2,594 and 14,050, past the
first candidates of the nucleus search. Each round times 5 draws per sampler, the order alternating
per round; the figure is the median per row, and `/ greedy` divides it by the greedy row's (an
argmax of the same row: the baseline). A decode step of B sequences pays this B times.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from duplexkv.engine import sampler as this_sampler
from duplexkv.flags import Accumulate
from duplexkv.wire.sampling import SamplingParams

SETTINGS = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.0, "top_p": 0.95}, {"temperature": 0.7, "top_k": 20, "top_p": 0.8}]


def load_sampler(tree: str):
    """The sampler module of another source tree (its engine/sampler.py, loaded by path)."""
    path = Path(tree) / "duplexkv" / "engine" / "sampler.py"
    spec = importlib.util.spec_from_file_location("duplexkv_old_sampler", path)
    if spec is None or not path.is_file():
        raise SystemExit(f"sampler_cost: no sampler at {path} (--old names a source tree)")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def per_row(fn, logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> float:
    t = time.perf_counter()
    for _ in range(5):
        fn(logits.clone(), p, gen)
    return (time.perf_counter() - t) / 5


def measure(vocab: int, rounds: int, samplers: dict) -> list[dict]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 3
    rows = []
    for kw in SETTINGS:
        p = SamplingParams(**kw)
        times: dict[str, list[float]] = {name: [] for name in samplers}
        names = list(samplers)
        for fn in samplers.values():  # untimed: the first call of a setting pays one-off costs
            fn(logits.clone(), p, gen)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(per_row(samplers[name], logits, p, gen))
        rows.append({"vocab": vocab, "setting": kw,
                     **{name: statistics.median(v) * 1e3 for name, v in times.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duplexkv bench sampler_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", action=Accumulate, default=[32000, 151936])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--old", help="another source tree whose sampler runs beside this one")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.vocab) < 2:
        ap.error("--rounds and every --vocab must be at least 1 and 2")
    samplers = {"this": this_sampler.sample_row}
    if args.old:
        samplers = {"old": load_sampler(args.old).sample_row, **samplers}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per sampled row, "
          f"median of {args.rounds} rounds of 5")
    rows = [row for v in args.vocab for row in measure(v, args.rounds, samplers)]
    head = ("| vocab | setting | " + " | ".join(samplers) + " | this / greedy |"
            + (" this / old |" if args.old else ""))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    greedy = {r["vocab"]: r["this"] for r in rows if r["setting"] == SETTINGS[0]}
    for row in rows:
        ratio = f" {row['this'] / row['old']:.3f} |" if args.old else ""
        setting = ", ".join(f"{k} {v}" for k, v in row["setting"].items())
        print(f"| {row['vocab']:,} | {setting} | "
              + " | ".join(f"{row[n]:.3f}" for n in samplers)
              + f" | {row['this'] / greedy[row['vocab']]:.1f} |" + ratio)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
