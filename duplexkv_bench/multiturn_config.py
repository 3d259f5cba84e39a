"""What `duplexkv bench multiturn` and `duplexkv demo` run: the workload, the modes, the target
(a given router URL or a cluster launched here) and where the results go."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from duplexkv.router.placement import DEFAULT_MODE
from duplexkv_bench.report import MODES
from duplexkv_bench.workload import Sizes


@dataclass(frozen=True)
class BenchConfig:
    workload: str = "agentic"  # agentic | chat | a JSON file
    max_context: int = 16384
    conversations: int | None = None  # None: 1 generated, or all of a file's
    clients: int = 1
    idle_s: float = 0.0
    modes: tuple[str, ...] = MODES
    sizes: Sizes | None = None  # None: the workload's defaults
    seed: int = 0
    model: str = "bench"
    tokenizer: str | None = None  # default: the model's
    url: str | None = None  # a running router; None = launch a cluster
    ideal_url: str | None = None  # a running single worker for the ideal mode (with url)
    connector: str = "TcpConnector"
    placement: str = DEFAULT_MODE  # the launched router's --placement
    kv_recompute_threshold: int | None = None  # None: the workers' cost model decides
    dtype: str | None = None
    output_dir: Path = field(default_factory=lambda: Path("out") / time.strftime(
        "multiturn-%Y%m%d-%H%M%S"))
    warmup: bool = True
    reverse: bool = False  # run the modes ideal -> on -> off instead of off -> on -> ideal
    command: str = ""

    @property
    def worker_flags(self) -> tuple[str, ...]:
        return ("--dtype", self.dtype) if self.dtype else ()
