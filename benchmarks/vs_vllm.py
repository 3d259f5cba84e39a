"""vLLM-CPU vs our worker side by side: `duplexkv bench vs_vllm` (duplexkv/bench/vs_vllm.py).

    python benchmarks/vs_vllm.py [--setup] [ARGS...]   # the same arguments
"""

from duplexkv.bench.vs_vllm import main

if __name__ == "__main__":
    raise SystemExit(main())
