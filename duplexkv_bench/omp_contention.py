"""Two workers on the same cores: libgomp's default (spin while waiting) vs OMP_WAIT_POLICY=PASSIVE.

Runs a prefill-heavy and a decode-heavy engine job (the `bench` model) as two processes, first
each alone, then both at once, under each policy; prints wall times and the contended/alone
ratio. `duplexkv up` and the benchmark's cluster start their workers with PASSIVE (see
duplexkv/launch/process.py) because of what this measures.

    .venv/bin/python duplexkv bench omp_contention [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.flags import Accumulate

JOB = r"""
import sys, time, torch
from duplexkv import LLM, SamplingParams
llm = LLM("bench", kv_cache_memory_gib=1.0)
g = torch.Generator().manual_seed(int(sys.argv[2]))
greedy = SamplingParams(max_tokens=1, temperature=0)
llm.generate([torch.randint(10, 30000, (500,)).tolist()], greedy)  # warm up
t = time.perf_counter()
if sys.argv[1] == "prefill":
    for _ in range(2):
        llm.generate([torch.randint(10, 30000, (6000,), generator=g).tolist()], greedy)
else:
    llm.generate([torch.randint(10, 30000, (8000,), generator=g).tolist()],
                 SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
print(time.perf_counter() - t)
"""


def run(jobs: list[str], setting: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting:
        key, value = setting.split("=", 1)
        env[key] = value
    procs = [subprocess.Popen([sys.executable, "-c", JOB, job, str(i)], env=env,
                              stdout=subprocess.PIPE, text=True) for i, job in enumerate(jobs)]
    return [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--settings", nargs="+", action=Accumulate,
                    default=["", "OMP_WAIT_POLICY=PASSIVE"],
                    help="environment settings to compare ('' = libgomp's default)")
    args = ap.parse_args(argv)
    print(f"{os.cpu_count()} CPUs, {describe_dtype(None)}; jobs: 2 x 6k-token prefill | 150 "
          "decode steps at 8k")
    print("| setting | prefill alone s | decode alone s | prefill with decode s | "
          "decode with prefill s | slow-down (both at once / alone) |")
    print("|---|---|---|---|---|---|")
    for policy in args.settings:
        alone_p = statistics.median(run(["prefill"], policy)[0] for _ in range(args.reps))
        alone_d = statistics.median(run(["decode"], policy)[0] for _ in range(args.reps))
        both = [run(["prefill", "decode"], policy) for _ in range(args.reps)]
        both_p = statistics.median(b[0] for b in both)
        both_d = statistics.median(b[1] for b in both)
        slow = (both_p + both_d) / (alone_p + alone_d)
        print(f"| {policy or 'default (spin)'} | {alone_p:.2f} | {alone_d:.2f} | {both_p:.2f} | "
              f"{both_d:.2f} | {slow:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
