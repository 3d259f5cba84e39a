"""The machine a benchmark runs on: its CPU line and load for the headers, and what it can do,
measured in the same run, with the share of it a server's figure reaches.

    GEMM rate      best of `reps` square torch matmuls (n = 2048) in the dtype, on this process's
                   threads: GFLOP/s. Prefill is matmul-bound, so a prefill's useful FLOPs over its
                   TTFT, divided by this rate, is how close it runs to the machine's limit.
    read bandwidth best of `reps` sums of a 1 GiB float32 tensor on huge pages, as the engine's
                   weights are (2 MiB pages read 5-20 % faster than 4 KiB ones here): GB/s.
                   A decode step must read every weight once and the KV of every sequence of
                   the batch, so those bytes over the step's time, divided by this bandwidth, is
                   how close decode runs to the bandwidth floor.

Useful work counts what the model needs, not what a kernel happens to do (a decoder with
grouped-query attention, the Qwen3/Llama shape of `config.json`):

    prefill FLOPs  2 x (the layers' linear weights) x tokens + causal attention
                   (4 x heads x head_dim x T(T+1)/2 per layer) + the LM head for the last token
    decode bytes   (the layers' linear weights + the LM head) x dtype bytes
                   + 2 (K and V) x layers x kv_heads x head_dim x context x batch x dtype bytes
    decode FLOPs   2 x (the layers' linear weights + the LM head) x batch
                   + 4 x layers x heads x head_dim x context x batch (scores and P . V)

A decode step's floor is its bytes over the read bandwidth; the table also shows the time its
FLOPs take at the GEMM rate (`decode_compute_ms`). Where that comes near the floor (float32 at
batch 8 on 2 cores: every weight float meets 8 rows, 4 FLOPs per byte), the floor is out of reach
for any kernel that does not hide all of its arithmetic under its memory reads.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from duplexkv.engine.dtype import cpu_bf16_status, read_cpu_flags

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes of a decoder that decide its FLOPs and bytes."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        heads = int(cfg["num_attention_heads"])
        return cls(int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), heads,
                   int(cfg.get("num_key_value_heads", heads)),
                   int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   int(cfg["intermediate_size"]), int(cfg["vocab_size"]))

    def layer_weights(self) -> int:
        """Elements of one layer's linear weights: q, k, v, o and the gated MLP."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv + 3 * self.hidden * self.intermediate

    def prefill_flops(self, tokens: int) -> float:
        linear = 2.0 * self.layers * self.layer_weights() * tokens
        attention = 4.0 * self.layers * self.heads * self.head_dim * tokens * (tokens + 1) / 2
        return linear + attention + 2.0 * self.hidden * self.vocab

    def decode_flops(self, context: int, batch: int) -> float:
        linear = 2.0 * (self.layers * self.layer_weights() + self.hidden * self.vocab) * batch
        return linear + 4.0 * self.layers * self.heads * self.head_dim * context * batch

    def decode_bytes(self, context: int, batch: int, dtype: str) -> float:
        size = DTYPE_BYTES[dtype]
        weights = (self.layers * self.layer_weights() + self.hidden * self.vocab) * size
        kv = 2.0 * self.layers * self.kv_heads * self.head_dim * context * batch * size
        return weights + kv


@dataclass(frozen=True, slots=True)
class Limits:
    gemm_gflops: float  # in the benchmark's dtype
    read_gbs: float
    dtype: str

    def prefill_share(self, shape: Shape, tokens: int, ttft_s: float) -> float:
        return shape.prefill_flops(tokens) / ttft_s / (self.gemm_gflops * 1e9)

    def decode_share(self, shape: Shape, context: int, batch: int, tpot_s: float) -> float:
        return self.decode_floor_ms(shape, context, batch) / 1e3 / tpot_s

    def decode_floor_ms(self, shape: Shape, context: int, batch: int) -> float:
        return shape.decode_bytes(context, batch, self.dtype) / (self.read_gbs * 1e9) * 1e3

    def decode_compute_ms(self, shape: Shape, context: int, batch: int) -> float:
        return shape.decode_flops(context, batch) / (self.gemm_gflops * 1e9) * 1e3

    def describe(self) -> str:
        return (f"machine limits: {self.dtype} matmul {self.gemm_gflops:.0f} GFLOP/s, "
                f"read bandwidth {self.read_gbs:.1f} GB/s")

    def to_json(self) -> dict[str, float]:
        return {"gemm_gflops": self.gemm_gflops, "read_gbs": self.read_gbs}

    def with_read_gbs(self, read_gbs: float) -> Limits:
        """These limits with another bandwidth reading (one taken beside a decode row)."""
        return Limits(self.gemm_gflops, read_gbs, self.dtype)

    def best(self, other: Limits) -> Limits:
        """The higher of each limit in two readings of the same machine: on a shared VM the read
        bandwidth moved between 33 and 56 GB/s from one minute to the next, so a reading at one
        end of a run may catch a slow minute; the floor is what the machine showed it can do."""
        if other.dtype != self.dtype:
            raise ValueError(f"limits in {self.dtype} and {other.dtype} do not combine")
        return Limits(max(self.gemm_gflops, other.gemm_gflops), max(self.read_gbs, other.read_gbs),
                      self.dtype)


def gemm_gflops(dtype: str, n: int = 2048, reps: int = 5) -> float:
    import torch

    t = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(t), torch.randn(n, n).to(t)
    torch.matmul(a, b)  # warm-up (oneDNN's first call plans the kernel)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


class Bandwidth:
    """Reads the machine's read bandwidth again and again from one buffer of `nbytes` on huge
    pages, as the engine's weights are (layers/hugepages.py): the machine's best. A reading is
    the best of `reps` sums (GB/s)."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        import torch

        from duplexkv.layers import hugepages

        self.nbytes = nbytes
        self.buf = hugepages.zeros((nbytes // 4,), torch.float32)
        self.buf.fill_(1.0)  # written first: untouched pages would all read the one zero page
        self.buf.sum()

    def read(self, reps: int = 5) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            self.buf.sum()
            best = min(best, time.perf_counter() - t0)
        return self.nbytes / best / 1e9


def measure(dtype: str, bandwidth: Bandwidth | None = None) -> Limits:
    """Both limits; the bandwidth from `bandwidth`'s buffer when given (no second 1 GiB)."""
    return Limits(gemm_gflops(dtype), (bandwidth or Bandwidth()).read(), dtype)


def busy_fraction(seconds: float = 3.0) -> float:
    """Share of the machine's CPU time that was not idle over the next `seconds`."""
    def sample() -> tuple[int, int]:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def settle(busy_below: float = 0.1, window: float = 0.1, limit: float = 3.0) -> float:
    """Wait until the machine's CPU is idle (busy under `busy_below` over a `window`), at most
    `limit` seconds; returns the seconds waited. A server that keeps polling after its request
    (vLLM's engine core spins ~1 s after a step) would otherwise share the cores with the next
    server's timed request."""
    start = time.monotonic()
    while time.monotonic() - start < limit and busy_fraction(window) >= busy_below:
        pass
    return time.monotonic() - start


def in_worker_env(module: str, argv: list[str] | None) -> int | None:
    """None if this process runs with a worker's OpenMP wait policy; else `module` (a bench's)
    is run again with `argv` (None: this process's arguments) in a process started with the
    worker's environment, and its exit code returned. Without it torch's OpenMP threads spin
    after every torch call on the cores a measurement uses (plain reads at 0.64 of the sum's rate
    instead of 1.20, AMD EPYC Zen 2), and libgomp reads the policy only when it loads."""
    if "OMP_WAIT_POLICY" in os.environ:
        return None
    import subprocess
    import sys

    from duplexkv.engine.process_env import WORKER_ENV_DEFAULTS

    argv = sys.argv[1:] if argv is None else argv
    return subprocess.run([sys.executable, "-m", module, *argv],
                          env={**WORKER_ENV_DEFAULTS, **os.environ}, check=False).returncode


def cpu_line() -> str:
    flags = read_cpu_flags() or frozenset()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                  .splitlines() if ln.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"CPU {model}, {os.cpu_count()} cores, {' '.join(simd)}; {cpu_bf16_status(flags)}"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
