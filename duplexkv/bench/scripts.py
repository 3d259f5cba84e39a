"""The benchmark scripts `duplexkv bench NAME` runs; each parses its own arguments."""

from __future__ import annotations

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
}


def run_script(name: str, argv: list[str]) -> int:
    import importlib

    code = importlib.import_module(f"duplexkv.bench.{name}").main(argv)
    return code if isinstance(code, int) else 0
