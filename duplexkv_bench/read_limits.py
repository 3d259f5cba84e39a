"""How fast this machine reads a decode step's bytes: plain reads and the engine's kernels beside
the floor's bandwidth, in one interleaved run.

`bench vs_vllm` states decode as a share of a bandwidth floor: the step's bytes (weights and KV)
over the rate of torch's sum of a 1 GiB tensor. This shows which part of that floor a kernel that
computes while it reads can reach here, and how near the engine's kernels come to it:

    sum                    torch's sum of a float32 tensor on huge pages (the floor's bandwidth,
                           machine_limits.Bandwidth)
    kv, hardware prefetch  the KV of a decode batch read in the attention's order (a sequence's
                           KV head at a time, key row j then value row j), plain loads and sums
                           (read_probe.c), the stream left to the hardware prefetcher
    kv, software prefetch  the same with the attention kernel's software prefetch (each row's
                           lines asked for `--ahead` rows before they are read)
    ... + N FMAs           either, with N vector FMAs (8 floats) a key row between its reads:
                           operands in registers (the arithmetic alone) or, "a load each", read
                           from L1 (arithmetic that also keeps the load ports busy, as kernels
                           with 16 vector registers must). N: the attention's own count a key (2 x
                           queries a KV head x head_dim / 8, 64 on bench) and twice it, which is
                           what 8-row products do per key's worth (512 bytes) of weights
    attention              the engine's decode attention (dkv_decode_attn) over the same KV
    weights x1, x8         the engine's linear (dkv_linear) over a decode step's weights (the
                           preset's shapes, LM head included, huge pages) at 1 and 8 rows

All in float32 (the bf16 kernels are not measured here).

KV buffers rotate through a working set larger than the caches; every row is the median of
`--rounds` rounds, each taking the rows in turn (the order reversed every other round). What the
session-57 run found (AMD EPYC Zen 2, 2 cores): plain reads reach ~1.2x the sum's rate when the
hardware prefetcher carries them and ~0.87x with software prefetch, a rate that arithmetic alone
hardly lowers but loads from L1 beside the stream do, and the kernels sit where their loads put
them (docs/engine.md, "What bounds a decode step on AVX2").
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from duplexkv.engine.dtype import read_cpu_flags
from duplexkv.layers import hugepages, native
from duplexkv.model.presets import PRESETS, get_preset
from duplexkv.paths import cache_dir
from duplexkv_bench.machine_limits import Bandwidth, cpu_line, in_worker_env, loadavg

PROBE = Path(__file__).with_name("read_probe.c")
PROBE_FLAGS = ["-O3", "-march=native", "-fPIC", "-pthread", "-std=gnu11"]  # no -ffast-math
# key rows the float32 decode attention asks for ahead: the one-pass kernel's FA_AHEAD
# (native_f32_attn_onepass.h) on AVX2 and on AVX-512 builds
AHEAD_AVX2, AHEAD_AVX512 = 12, 24


def probe_library() -> ctypes.CDLL:
    """read_probe.c, built once per source, compiler and CPU into the kernels' cache."""
    cc = native.compiler()
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on PATH: install one (e.g. apt install gcc)")
    key = hashlib.sha256(PROBE.read_bytes() + " ".join([cc, *PROBE_FLAGS]).encode()
                         + native.cpu_digest().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"read-probe-{key}.so"
    if not target.exists():
        native.build_library(target, PROBE, PROBE_FLAGS, native.LINK_FLAGS)
    lib = ctypes.CDLL(str(target))
    lib.probe_rows.restype = ctypes.c_double
    lib.probe_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 7,
                               ctypes.c_int]
    return lib


def i64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


class KV:
    """`count` decode batches' KV in the mirror layout, [batch, K/V, kv_heads, context, head_dim]
    each, on huge pages, holding uniform [0, 1) floats."""

    def __init__(self, batch: int, context: int, kv_heads: int, head_dim: int,
                 count: int) -> None:
        self.batch, self.context, self.kv_heads, self.head_dim = batch, context, kv_heads, head_dim
        self.bufs = []
        for _ in range(count):
            buf = hugepages.zeros((batch, 2, kv_heads, context, head_dim), torch.float32)
            buf.uniform_()
            self.bufs.append(buf)
        self.nbytes = self.bufs[0].numel() * 4  # one batch's

    def units(self) -> tuple[ctypes.Array, ctypes.Array, int]:
        """Every buffer's runs of keys and of values, one per (sequence, KV head)."""
        k = [b[s, 0, h].data_ptr() for b in self.bufs for s in range(self.batch)
             for h in range(self.kv_heads)]
        v = [b[s, 1, h].data_ptr() for b in self.bufs for s in range(self.batch)
             for h in range(self.kv_heads)]
        return i64s(k), i64s(v), len(k)


def read_kv(lib: ctypes.CDLL, kv: KV, ahead: int, threads: int, fmas: int = 0,
            fma_loads: bool = False) -> float:
    """GB/s of one pass over every buffer by probe_rows (`fmas` vector FMAs a row, their
    operands in registers or, with `fma_loads`, each read from L1)."""
    k, v, units = kv.units()
    t0 = time.perf_counter()
    lib.probe_rows(k, v, units, kv.context, kv.head_dim, ahead, fmas, int(fma_loads), 1, threads)
    return kv.nbytes * len(kv.bufs) / (time.perf_counter() - t0) / 1e9


def attention(kv: KV, groups: int, threads: int) -> float:
    """GB/s of the engine's decode attention, one call per buffer (median call)."""
    lib = native.library()
    B, H, D = kv.batch, kv.kv_heads, kv.head_dim
    q = torch.randn(B, H * groups, D)
    out = torch.empty_like(q)
    strides = (i64s([kv.context * D] * B), i64s([D] * B), i64s([kv.context] * B))
    times = []
    for buf in kv.bufs:
        kb, vb = i64s([buf[b, 0].data_ptr() for b in range(B)]), \
            i64s([buf[b, 1].data_ptr() for b in range(B)])
        t0 = time.perf_counter()
        rc = lib.dkv_decode_attn(q.data_ptr(), out.data_ptr(), kb, vb, *strides, B, H, groups,
                                 D, 1.0 / math.sqrt(D), threads)
        times.append(time.perf_counter() - t0)
        if rc != 0:
            raise RuntimeError(f"dkv_decode_attn refused batch {B}, {H} KV heads, group "
                               f"{groups}, head size {D}")
    return kv.nbytes / statistics.median(times) / 1e9


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    """(rows, columns) of every weight a decode step reads, in order, LM head last."""
    c = get_preset(preset)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layer = [(qkv, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


class Weights:
    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        self.shapes = shapes
        total = sum(n * k for n, k in shapes)
        self.arena = hugepages.zeros((total,), torch.float32)
        self.arena.normal_()
        self.nbytes = total * 4
        self.x = torch.randn(8, max(k for _, k in shapes))
        self.y = torch.empty(8, max(n for n, _ in shapes))

    def read(self, rows: int, threads: int) -> float:
        """GB/s of dkv_linear over every weight at `rows` rows of x."""
        lib, at = native.library(), 0
        t0 = time.perf_counter()
        for n, k in self.shapes:
            lib.dkv_linear(self.x.data_ptr(), self.arena[at:].data_ptr(), self.y.data_ptr(), rows,
                           n, k, threads)
            at += n * k
        return self.nbytes / (time.perf_counter() - t0) / 1e9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="duplexkv bench read_limits",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS),
                    help="the model shapes (a preset's)")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the KV rows")
    ap.add_argument("--context", type=int, default=4096, help="tokens of each sequence's KV")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ahead", type=int, default=None,
                    help="rows ahead the software-prefetch row asks for (default: the "
                         f"attention's: {AHEAD_AVX512} on AVX-512, {AHEAD_AVX2} elsewhere)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--working-set-mib", type=int, default=192,
                    help="KV bytes the rows rotate through (more than the caches hold)")
    ap.add_argument("--sum-mib", type=int, default=1024, help="the sum's tensor")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if min(args.batch, args.context, args.rounds, args.threads, args.working_set_mib,
           args.sum_mib) < 1 or (args.ahead or 0) < 0:
        ap.error("sizes, --rounds and --threads must be >= 1, --ahead >= 0")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: {args.json.parent} is not a directory")
    if args.ahead is None:
        args.ahead = AHEAD_AVX512 if "avx512f" in (read_cpu_flags() or ()) else AHEAD_AVX2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rerun = in_worker_env("duplexkv_bench.read_limits", argv)
    if rerun is not None:
        return rerun
    if native.library() is None:
        print("the native kernels are not available (DUPLEXKV_NATIVE=0, or no C compiler): "
              "nothing to measure them by", flush=True)
        return 2
    c = get_preset(args.preset)
    probe = probe_library()
    batch_bytes = args.batch * 2 * c.num_kv_heads * args.context * c.head_dim * 4
    kv = KV(args.batch, args.context, c.num_kv_heads, c.head_dim,
            max(3, -(-(args.working_set_mib << 20) // batch_bytes)))
    weights = Weights(weight_shapes(args.preset))
    bandwidth = Bandwidth(args.sum_mib << 20)
    groups = c.num_heads // c.num_kv_heads
    fmas = 2 * groups * c.head_dim // 8  # the attention's vector FMAs a key (scores, P . V)
    rows = {
        "sum": lambda: bandwidth.read(1),
        "kv, hardware prefetch": lambda: read_kv(probe, kv, 0, args.threads),
        f"kv, hardware prefetch + {2 * fmas} FMAs": lambda: read_kv(probe, kv, 0, args.threads,
                                                                    2 * fmas),
        "kv, software prefetch": lambda: read_kv(probe, kv, args.ahead, args.threads),
        f"kv, software prefetch + {2 * fmas} FMAs": lambda: read_kv(probe, kv, args.ahead,
                                                                    args.threads, 2 * fmas),
        f"kv, software prefetch + {fmas} FMAs, a load each": lambda: read_kv(
            probe, kv, args.ahead, args.threads, fmas, fma_loads=True),
        f"kv, software prefetch + {2 * fmas} FMAs, a load each": lambda: read_kv(
            probe, kv, args.ahead, args.threads, 2 * fmas, fma_loads=True),
        "attention": lambda: attention(kv, groups, args.threads),
        "weights x1": lambda: weights.read(1, args.threads),
        "weights x8": lambda: weights.read(8, args.threads),
    }
    print(f"{cpu_line()}\n{args.preset} shapes: KV {args.batch} x {args.context} tokens "
          f"({batch_bytes / 1e6:.1f} MB a batch, {len(kv.bufs)} batches rotated), weights "
          f"{weights.nbytes / 1e6:.1f} MB; {args.threads} threads; software prefetch {args.ahead} "
          f"rows ahead; load {loadavg()}", flush=True)
    got: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(args.rounds):
        for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
            got[name].append(rows[name]())
    median = {name: statistics.median(v) for name, v in got.items()}
    print("\n| read | GB/s (median) | of the sum's rate |\n|---|---|---|")
    for name, v in median.items():
        print(f"| {name} | {v:.1f} | {v / median['sum']:.2f} |")
    print(f"\nattention / kv with software prefetch: "
          f"{median['attention'] / median['kv, software prefetch']:.2f}; load {loadavg()}")
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpu_line(), "preset": args.preset, "batch": args.batch,
            "context": args.context, "threads": args.threads, "ahead": args.ahead,
            "rows": {name: {"median_gbps": median[name], "samples_gbps": got[name]}
                     for name in rows}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
