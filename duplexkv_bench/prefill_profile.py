"""Where a prefill step spends its time, part by part, on the engine (`LLM`, one process).

Each part's functions are wrapped for the run (the engine's code is not changed), and each part
gets its exclusive wall time (its children's time subtracted):

    matmuls       every nn.Linear but the LM head (qkv, o, gate_up, down)
    attention     the SDPA kernel calls
    attn glue     the rest of paged_attention: q/K/V layout copies, GQA expansion, the output copy
    KV writes     K/V into the pool and into the sequence's contiguous mirror
    norms         RMSNorm (the layers', the final and the q/k norms)
    RoPE          rotary embedding (tables and rotation)
    MLP act       SiLU and the gate multiply
    residual etc  what remains of each layer (residual adds, views) and the embedding
    logits        the LM head (last position of each sampling sequence only)
    engine        the step outside the model: scheduling, inputs, sampling

    duplexkv bench prefill_profile [--lengths 2048 4096 8192 16384] [--dtype float32]
        [--reps 2] [--aten]       # --aten: also torch.profiler's top aten ops, one run each
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from duplexkv import LLM, SamplingParams
from duplexkv.engine.dtype import describe
from duplexkv.flags import Accumulate
from duplexkv.layers import attention as attn_mod
from duplexkv.layers import native
from duplexkv.model import qwen3

PARTS = ["matmuls", "attention", "attn glue", "KV writes", "norms", "RoPE", "MLP act",
         "residual etc", "logits", "engine"]


class Timer:
    """Exclusive wall time per part for nested wrapped calls."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [part, start, child time]

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            self.stack.append([part, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, t0, child = self.stack.pop()
                dt = time.perf_counter() - t0
                self.total[name] += dt - child
                if self.stack:
                    self.stack[-1][2] += dt
        return timed


def instrument(llm: LLM, timer: Timer) -> None:
    """Wrap the engine's parts (on this process's classes and module globals)."""
    model = llm.engine.runner.model
    lm_head = model.lm_head
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = timer.wrap("logits" if mod is lm_head else "matmuls", mod.forward)
    wrap_attr = lambda obj, name, part: setattr(obj, name, timer.wrap(part, getattr(obj, name)))  # noqa: E731
    wrap_attr(qwen3, "paged_attention", "attn glue")
    for name in ("_FLASH_LSE",):
        if getattr(attn_mod, name) is not None:
            wrap_attr(attn_mod, name, "attention")
    attn_mod.F = _Proxy(F, scaled_dot_product_attention=timer.wrap(
        "attention", F.scaled_dot_product_attention))
    wrap_attr(attn_mod, "write_kv", "KV writes")
    wrap_attr(attn_mod, "append_mirrors", "KV writes")
    wrap_attr(attn_mod, "fill_from_pool", "KV writes")
    wrap_attr(attn_mod.amx, "attention", "attention")  # bf16 on AMX: native_amx_attn.h
    wrap_attr(attn_mod.causal_kernel, "f32_attention", "attention")  # float32: native_f32_prefill.h
    wrap_attr(native, "add_rmsnorm", "norms")  # the native element-wise kernels
    wrap_attr(native, "qk_norm_rope", "RoPE")
    wrap_attr(native, "silu_mul", "MLP act")
    qwen3.F = _Proxy(F, rms_norm=timer.wrap("norms", F.rms_norm),
                     silu=timer.wrap("MLP act", F.silu))
    wrap_attr(qwen3, "apply_rope", "RoPE")
    model.rotary.forward = timer.wrap("RoPE", model.rotary.forward)
    for layer in model.layers:
        layer.forward = timer.wrap("residual etc", layer.forward)
        layer.mlp.forward = timer.wrap("MLP act", layer.mlp.forward)
        layer.self_attn.forward = timer.wrap("residual etc", layer.self_attn.forward)
    model.forward = timer.wrap("residual etc", model.forward)
    runner = llm.engine.runner
    runner.run = timer.wrap("engine", runner.run)


class _Proxy:
    """A module stand-in with some attributes replaced."""

    def __init__(self, base, **over) -> None:
        self._base, self._over = base, over

    def __getattr__(self, name):
        return self._over.get(name) or getattr(self._base, name)


def prefill(llm: LLM, n: int, seed: int) -> float:
    rng = random.Random(seed)
    eng = llm.engine
    eng.add_request([rng.randrange(3, eng.model_config.vocab_size) for _ in range(n)],
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="duplexkv bench prefill_profile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate,
                    default=[2048, 4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=2, help="the fastest of this many runs counts")
    ap.add_argument("--aten", action="store_true")
    args = ap.parse_args(argv)
    mx = max(args.lengths) + 64
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_num_batched_tokens=mx, max_model_len=mx, num_kv_blocks=mx // 16 + 8)
    print(f"{describe(args.dtype)}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; one chunk per prompt")
    prefill(llm, 256, 0)  # warm-up
    rows = {}
    for n in args.lengths:
        if args.aten:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as p:
                prefill(llm, n, 99)
            print(f"--- {n} tokens, torch.profiler\n" + p.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
        best = None
        for r in range(args.reps):
            timer = Timer()
            saved = _save(llm)
            instrument(llm, timer)
            try:
                total = prefill(llm, n, r)
            finally:
                _restore(llm, saved)
            timer.total["engine"] += total - sum(timer.total.values())
            if best is None or total < best[0]:
                best = (total, dict(timer.total))
        rows[n] = best
        load = open("/proc/loadavg").read().split()[0]
        print(f"{n:6d} tokens: {best[0]:.3f} s (load {load})", flush=True)
    print("\n| part | " + " | ".join(f"{n:,} tokens" for n in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for part in PARTS:
        cells = [f"{t[part] * 1e3:.0f} ms ({100 * t[part] / total:.0f} %)"
                 for total, t in rows.values()]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print("| **total** | " + " | ".join(f"{total:.3f} s" for total, _ in rows.values()) + " |")


def _save(llm: LLM) -> dict:
    model = llm.engine.runner.model
    return {"qwen3": dict(vars(qwen3)), "attn": dict(vars(attn_mod)),
            "mods": [(m, m.__dict__.get("forward")) for m in model.modules()],
            "run": llm.engine.runner.__dict__.get("run")}


def _restore(llm: LLM, saved: dict) -> None:
    for mod, d in ((qwen3, saved["qwen3"]), (attn_mod, saved["attn"])):
        vars(mod).update(d)
    for m, fwd in saved["mods"]:
        if fwd is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = fwd
    if saved["run"] is None:
        llm.engine.runner.__dict__.pop("run", None)


if __name__ == "__main__":
    main()
