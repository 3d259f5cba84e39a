"""The one launcher of the project: `duplexkv up`, the demo, the benchmarks, the multi-host
harness (duplexkv_bench/hosts) and the tests start their processes here.

    process.py   start / spawn / wait_ready / stop_all: one process (any program, or
                 `duplexkv ARGS` in a worker's environment), its log, its readiness, its stop
    cluster.py   worker_args / router_args / bidirectional_kv, and Cluster(ClusterSpec): a router
                 in front of N prefill + N decode workers on localhost
    ports.py     free_port: a port to tell a program before it binds it (vLLM, NIXL side
                 channels, Redis), outside the kernel's ephemeral range
"""

from duplexkv.launch.cluster import (Cluster, ClusterSpec, bidirectional_kv, router_args,
                                     worker_args)
from duplexkv.launch.ports import free_port
from duplexkv.launch.process import (WORKER_ENV_DEFAULTS, LaunchError, Proc, spawn, start,
                                     stop_all, wait_ready, worker_env)

__all__ = ["Cluster", "ClusterSpec", "LaunchError", "Proc", "WORKER_ENV_DEFAULTS",
           "bidirectional_kv", "free_port", "router_args", "spawn", "start", "stop_all",
           "wait_ready", "worker_args", "worker_env"]
