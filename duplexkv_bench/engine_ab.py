"""Two source trees' engines, alternated on the same prompts in one run: before/after a change.

One process per tree (this file run as a script with `PYTHONPATH=TREE`: it imports the tree's
`duplexkv`, wherever that tree keeps its benchmarks), each with the `bench` model loaded once;
for every case and rep the two are asked in turn (the order alternating per rep), so neither
always runs on a warmer or quieter machine. Each answers its TTFT (max_tokens 1) or median decode step, and the
generated tokens, which must be the same for both trees.

    git worktree add /tmp/base main
    duplexkv bench engine_ab --old /tmp/base --new . [--dtype float32] [--reps 5]
        [--cases prefill:2048 prefill:8192 decode:8192x1 decode:8192x8]

With two dtypes (`--old . --new . --dtype float32 bfloat16`) the old side runs the first and the
new side the second: which dtype is faster for this engine on this CPU (what `--dtype auto`'s
rule rests on, duplexkv/engine/dtype.py); their tokens are not compared then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

from duplexkv.flags import Accumulate

def parse_case(text: str) -> tuple[str, int, int]:
    """prefill:N -> ("prefill", N, 1); decode:NxB -> ("decode", N, B)."""
    kind, _, size = text.partition(":")
    n, _, b = size.partition("x")
    if kind not in ("prefill", "decode") or not n.isdigit() or (b and not b.isdigit()):
        raise argparse.ArgumentTypeError(f"a case is prefill:N or decode:NxB, got {text!r}")
    return kind, int(n), int(b or 1)


def serve(max_len: int, dtype: str) -> None:
    """The per-tree side: read `kind n batch seed` lines, answer one JSON line each."""
    from duplexkv import LLM, SamplingParams

    llm = LLM("bench", dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=max_len,
              max_model_len=max_len, num_kv_blocks=8 * (max_len // 16 + 8))
    eng = llm.engine

    def run(kind: str, n: int, batch: int, seed: int) -> dict:
        rng = random.Random(seed)
        for _ in range(batch):
            eng.add_request([rng.randrange(3, eng.model_config.vocab_size) for _ in range(n)],
                            SamplingParams(max_tokens=1 if kind == "prefill" else 17,
                                           temperature=0, ignore_eos=True))
        t0, steps, first, tokens = time.perf_counter(), [], None, []
        sched = eng.scheduler
        while eng.has_unfinished():
            decoding = not sched.waiting and all(not s.in_prefill for s in sched.running)
            ts = time.perf_counter()
            outs = eng.step()
            if first is None:
                first = time.perf_counter() - t0
            if decoding:  # batch 8's steps while some still prefill are not decode steps
                steps.append(time.perf_counter() - ts)
            tokens += [o.token_ids for o in outs if o.finished]
        value = first if kind == "prefill" else statistics.median(steps)
        return {"s": value, "tokens": hashlib.sha256(str(sorted(tokens)).encode()).hexdigest()}

    run("prefill", 256, 1, 0)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        kind, n, batch, seed = line.split()
        print(json.dumps(run(kind, int(n), int(batch), int(seed))), flush=True)


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--serve":
        serve(int(argv[1]), argv[2])
        return 0
    ap = argparse.ArgumentParser(prog="duplexkv bench engine_ab",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the source tree before the change")
    ap.add_argument("--new", required=True, help="the source tree after it")
    ap.add_argument("--dtype", nargs="+", action=Accumulate, default=["float32"],
                    help="one dtype for both sides, or two: the old side's, then the new's")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", type=parse_case, nargs="+", action=Accumulate,
                    default=[parse_case(c) for c in (
        "prefill:2048", "prefill:4096", "prefill:8192", "prefill:16384", "decode:4096x1",
        "decode:8192x1", "decode:4096x8", "decode:8192x8")])
    args = ap.parse_args(argv)
    if len(args.dtype) > 2:
        ap.error("--dtype takes one dtype, or two (the old side's, then the new side's)")
    dtypes = {"old": args.dtype[0], "new": args.dtype[-1]}
    max_len = max(n for _, n, _ in args.cases) + 64
    procs = {}
    for name, tree in (("old", args.old), ("new", args.new)):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(max_len), dtypes[name]],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=os.path.abspath(tree))
    try:
        for p in procs.values():
            while (line := p.stdout.readline()) and line.strip() != "ready":
                pass
            if not line:
                raise RuntimeError("a tree's engine exited during start-up")
        print(f"dtype old {dtypes['old']}, new {dtypes['new']}; old {args.old}, new {args.new}; "
              f"best and median of {args.reps}, order alternating\n")
        print("| case | old | new | new / old (best) | new / old (median) | same tokens | load |")
        print("|---|---|---|---|---|---|---|")
        for kind, n, batch in args.cases:
            res: dict[str, list[float]] = {"old": [], "new": []}
            same, loads = True, []
            for rep in range(args.reps):
                answers = {}
                for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                    loads.append(open("/proc/loadavg").read().split()[0])
                    procs[name].stdin.write(f"{kind} {n} {batch} {rep}\n")
                    procs[name].stdin.flush()
                    answers[name] = json.loads(procs[name].stdout.readline())
                    res[name].append(answers[name]["s"])
                same &= answers["old"]["tokens"] == answers["new"]["tokens"]
            k, unit = (1.0, "s") if kind == "prefill" else (1e3, "ms")
            o, w = res["old"], res["new"]
            label = f"prefill {n}" if kind == "prefill" else f"decode step @{n} x{batch}"
            print(f"| {label} | {min(o) * k:.4g} {unit} | {min(w) * k:.4g} {unit} | "
                  f"{min(w) / min(o):.3f} | {statistics.median(w) / statistics.median(o):.3f} | "
                  f"{same if dtypes['old'] == dtypes['new'] else '- (dtypes differ)'} | "
                  f"{min(loads)}-{max(loads)} |", flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
