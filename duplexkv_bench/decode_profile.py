"""Where a decode step's time goes, kernel by kernel, each beside the bytes it must read and the
floor's bandwidth, on the engine (`LLM`, one process).

`bench vs_vllm` gives a decode step as one share of its bandwidth floor (the step's weight and KV
bytes over the rate of a 1 GiB sum); `bench read_limits` shows what plain reads and the kernels
reach on their own. This splits a real step (the native decode stack, layers/decode_stack.py):
each kernel's wall time on the engine's thread (timed in C while profiling is on), the LM head
and the engine's Python around them, and for every part that reads weights or KV its GB/s as a
share of the sum's rate in the same run. A part at 1.00 reads as fast as the floor assumes; the
parts far below it are where a step loses to its floor.

    qkv, o, gate_up, down   the layers' products (dkv_linear; bytes: their weights)
    attention               decode attention over every sequence's mirror (bytes: K and V)
    norms, rope, silu,      the element-wise kernels and the step's K/V rows written to the
      kv writes             pool and the mirrors (no bytes counted: a few KB)
    stack other             the rest of the native call (the embedding rows, buffers)
    LM head                 the logits' product (bytes: the LM head's weight)
    engine                  the step outside both: scheduling, inputs, the stack's checks of
                            its arguments, sampling, outputs

The KV bytes count every sequence at the same length (its prompt, the warm-up steps and half the
measured ones); in a batch the first sequences decode while the last prefill, up to a few tokens
more.

`--dtype auto` (the default) profiles the dtype a worker's `--dtype auto` picks on this CPU
(engine/dtype.py; printed with its reason); float32 runs native_f32_decode.h's step, bfloat16
native_bf16_decode.h's on the packed bf16 kernel (AMX or AVX-512 BF16; refused where neither
runs). In bf16 every part reads half the bytes; its gate/up product computes SiLU x up as well
(the silu part stays 0).

    duplexkv bench decode_profile [--dtype auto] [--contexts 4096] [--batches 1 8]
        [--steps 100] [--preset bench] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from duplexkv import LLM, SamplingParams
from duplexkv.engine.dtype import read_cpu_flags, resolve_dtype
from duplexkv.flags import Accumulate
from duplexkv.layers import decode_stack, linear
from duplexkv.model.presets import PRESETS, get_preset
from duplexkv_bench.machine_limits import (
    DTYPE_BYTES,
    Bandwidth,
    Shape,
    cpu_line,
    in_worker_env,
    loadavg,
)

WARM_STEPS = 5


def preset_shape(preset: str) -> Shape:
    c = get_preset(preset)
    return Shape(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                 c.intermediate_size, c.vocab_size)


def part_bytes(shape: Shape, context: float, batch: int, dtype: str) -> dict[str, float]:
    """Bytes a step's parts must read in `dtype` (context: the sequences' mean length)."""
    s, f = shape, DTYPE_BYTES[dtype]
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return {"qkv": s.layers * qkv * s.hidden * f,
            "o": s.layers * s.hidden * s.heads * s.head_dim * f,
            "gate_up": s.layers * 2 * s.intermediate * s.hidden * f,
            "down": s.layers * s.hidden * s.intermediate * f,
            "attention": 2.0 * s.layers * s.kv_heads * s.head_dim * context * batch * f,
            "LM head": s.vocab * s.hidden * f}


def measure(llm: LLM, context: int, batch: int, steps: int, seed: int,
            vocab: int) -> dict[str, float]:
    """ms a step per part, over `steps` decode steps of `batch` sequences from `context` tokens."""
    engine = llm.engine
    model = engine.runner.model
    rng = random.Random(seed)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(context)],
                           # enough for the first to decode while the last ones prefill
                           SamplingParams(max_tokens=WARM_STEPS + steps + batch + 8,
                                          temperature=0, ignore_eos=True))
    head_s = [0.0]
    logits = model.logits

    def timed_logits(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return logits(*args, **kwargs)
        finally:
            head_s[0] += time.perf_counter() - t0

    warm = measured = 0
    wall = 0.0
    prof = None
    model.logits = timed_logits  # an attribute of the instance, over the class's method
    try:
        while engine.has_unfinished():
            running = engine.scheduler.running
            decoding = not engine.scheduler.waiting and len(running) == batch and all(
                not s.in_prefill for s in running)
            if not decoding or warm < WARM_STEPS or measured == steps:
                warm += decoding and warm < WARM_STEPS
                engine.step()
                continue
            if measured == 0:
                decode_stack.profile(True)
                head_s[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - t0
            measured += 1
            if measured == steps:
                prof = decode_stack.profile(False)
                head_ms = head_s[0] / steps * 1e3  # the steps after these still call the head
    finally:
        del model.logits
        decode_stack.profile(False)
    if prof is None or prof.steps != steps:
        raise RuntimeError(f"{context} x {batch}: {measured} of {steps} decode steps measured, "
                           f"{prof.steps if prof else 0} of them in the decode stack")
    step_ms = wall / steps * 1e3
    parts = dict(prof.part_ms)
    parts["stack other"] = prof.call_ms - sum(prof.part_ms.values())
    parts["LM head"] = head_ms
    parts["engine"] = step_ms - prof.call_ms - head_ms
    return {"step": step_ms, **parts}


def table(rows: dict[str, float], nbytes: dict[str, float], read_gbs: float) -> str:
    step = rows["step"]
    out = ["| part | ms a step | of the step | MB a step | GB/s | of the sum's rate |",
           "|---|---|---|---|---|---|"]
    for name, ms in rows.items():
        if name == "step":
            continue
        b = nbytes.get(name)
        rate = f"| {b / 1e6:.1f} | {b / ms / 1e6:.1f} | {b / ms / 1e6 / read_gbs:.2f} |" \
            if b and ms > 0 else "| | | |"
        out.append(f"| {name} | {ms:.3f} | {ms / step:.2f} {rate}")
    total = sum(nbytes.values())
    floor_ms = total / read_gbs / 1e6
    out.append(f"| **step** | **{step:.3f}** | 1.00 | {total / 1e6:.1f} | {total / step / 1e6:.1f} "
               f"| **{floor_ms / step:.2f}** (floor {floor_ms:.3f} ms) |")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="duplexkv bench decode_profile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: the dtype a worker's --dtype auto picks on this CPU")
    ap.add_argument("--contexts", type=int, nargs="+", action=Accumulate, default=[4096],
                    help="tokens of each sequence's prompt")
    ap.add_argument("--batches", type=int, nargs="+", action=Accumulate, default=[1, 8],
                    help="sequences decoding together (the native stack takes up to "
                         f"{linear.NATIVE_ROWS})")
    ap.add_argument("--steps", type=int, default=100, help="decode steps measured per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if min(args.contexts) < 1 or args.steps < 1 or not 1 <= min(args.batches) \
            or max(args.batches) > linear.NATIVE_ROWS:
        ap.error(f"--contexts and --steps must be >= 1, --batches 1 to {linear.NATIVE_ROWS}")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: {args.json.parent} is not a directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rerun = in_worker_env("duplexkv_bench.decode_profile", argv)
    if rerun is not None:
        return rerun
    choice = resolve_dtype(args.dtype, read_cpu_flags())
    dtype = choice.dtype
    if dtype not in ("float32", "bfloat16") or not decode_stack.DecodeStack.runs_here(
            getattr(torch, dtype)):
        print(f"the native {dtype} decode stack does not run here (DUPLEXKV_NATIVE=0, "
              "DUPLEXKV_DECODE_STACK=0, no C compiler, or bfloat16 without a packed bf16 "
              "kernel: AMX or avx512_bf16): nothing to profile", flush=True)
        return 2
    shape = preset_shape(args.preset)
    longest = max(args.contexts) + WARM_STEPS + args.steps + max(args.batches) + 8
    blocks = max(args.batches) * (longest // 16 + 2) + 16
    llm = LLM(args.preset, dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=longest, max_model_len=longest, num_kv_blocks=blocks)
    if llm.engine.runner.model.decode_stack is None:
        print(f"the {args.preset} model builds no {dtype} decode stack here: nothing to profile",
              flush=True)
        return 2
    bandwidth = Bandwidth()
    read_gbs = bandwidth.read(3)
    print(f"{cpu_line()}\n{args.preset}, {dtype} (--dtype {args.dtype}: {choice.reason}), "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; the sum reads "
          f"{read_gbs:.1f} GB/s; load {loadavg()}", flush=True)
    results = []
    for context in args.contexts:
        for batch in args.batches:
            rows = measure(llm, context, batch, args.steps, args.seed, shape.vocab)
            again = bandwidth.read(3)  # right after: the higher reading is the floor's
            read_gbs = max(read_gbs, again)
            nbytes = part_bytes(shape, context + WARM_STEPS + args.steps / 2, batch, dtype)
            print(f"\n{context} x {batch} ({args.steps} steps; the sum after them "
                  f"{again:.1f} GB/s)\n{table(rows, nbytes, read_gbs)}", flush=True)
            results.append({"context": context, "batch": batch, "ms": rows,
                            "bytes": nbytes, "read_gbs": read_gbs})
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "preset": args.preset,
                                         "dtype": dtype, "steps": args.steps,
                                         "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
