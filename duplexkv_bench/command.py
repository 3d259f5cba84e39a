"""`duplexkv bench NAME`: the command's parser. The `duplexkv` CLI finds it (and `demo`, in
demo.py) through the `duplexkv.commands` entry points of pyproject.toml; the runtime package
never imports this one.

`multiturn` is parsed here (multiturn.py's flags); every other benchmark is a script that parses
its own arguments: its words after the name reach its `main(argv)` untouched."""

from __future__ import annotations

import argparse
import importlib
import signal

from duplexkv import config_file
from duplexkv_bench import multiturn

SCRIPTS = {
    "reuse": "P's TTFT pulling history from D vs local hit vs recompute",
    "auth_cost": "what the cluster secret adds to a pull, part by part (params, verify, HELLO)",
    "pull_cost": "the measured pull decision vs the fixed 64-token rule, per history length",
    "first_token": "D's TTFT with P's first token vs recomputing the last prompt token",
    "transfer": "KV READ speed: NIXL and TCP vs memcpy and a raw socket (--multihost: across "
                "hosts over a shaped link)",
    "reuse_hosts": "TTFT with and without pulling history from D, across hosts on shaped links",
    "engine_vs_hf": "prefill and decode of the engine vs HF transformers",
    "engine_guard": "fast engine prefill/decode rows on tiny and bench, --compare with a file",
    "router_overhead": "time and throughput the router adds (stub workers)",
    "worker_overhead": "a prefill's TTFT through the HTTP worker vs the engine in-process",
    "omp_contention": "a prefill and a decode process sharing the cores",
    "retention": "pulled-hit rate under memory pressure: oldest-first vs by value vs Belady",
    "prefill_profile": "where an engine prefill spends its time, part by part, 2k-16k tokens",
    "engine_ab": "two source trees' engines alternated on the same prompts (before/after)",
    "vs_vllm": "vLLM-CPU vs our worker: TTFT 2k-16k and time per output token, same model, "
               "same run",
    "vllm_multiturn": "vLLM P/D multi-turn TTFT: one-way, vLLM's sample proxy and our router, "
                      "one interleaved run, answers against a single vLLM server",
    "soak": "conversations through router + P + D for a given time: RSS of every process",
    "sampler_cost": "one row's sampling per vocabulary size and setting (--old TREE beside it)",
    "read_limits": "how fast a decode step's bytes read here: plain reads (hardware / software "
                   "prefetch) and the kernels beside the floor's bandwidth",
    "decode_profile": "a decode step kernel by kernel: each part's time and its bytes' "
                      "share of the floor's bandwidth",
}


def run_script(name: str, argv: list[str]) -> int:
    # SIGTERM (kill, a job's timeout) as Ctrl-C, so the script's `finally` stops what it started
    # with Proc.stop (SIGTERM, then SIGKILL). The launcher's parent-death signal alone is one
    # SIGTERM: vLLM's servers (NIXL) were seen still running a minute after it
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    code = importlib.import_module(f"duplexkv_bench.{name}").main(argv)
    return code if isinstance(code, int) else 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: multiturn, " + ", ".join(SCRIPTS),
                       description="Every benchmark of the project. `duplexkv bench NAME --help` "
                                   "describes one; each prints its ratio against a baseline "
                                   "measured in the same run.")
    p.set_defaults(**{config_file.NOT_TAKEN: True})  # its benchmarks have flags of their own
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, what in SCRIPTS.items():
        # no prefix characters: every word after the name, `--help` included, is the script's
        s = bench.add_parser(name, help=what, add_help=False, prefix_chars="\0")
        s.add_argument("argv", nargs=argparse.REMAINDER)
        s.set_defaults(run=lambda args, name=name: run_script(name, args.argv))
    m = bench.add_parser("multiturn", help="TTFT vs history length, reuse off / on / ideal",
                         description=multiturn.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    multiturn.add_arguments(m)
