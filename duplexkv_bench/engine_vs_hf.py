"""Our engine vs HF transformers (SDPA) on the `bench` model, in one process and one run.

One-pass prefill at 2k/4k/8k/16k tokens (time to the first token, max_tokens=1, prefix caching
off) and the decode step at 8k context, for bfloat16 and float32; prints ours/HF ratios
(speed-up = HF time / our time: >= 1.0 means we are at least as fast).

Each measurement is taken `--samples` times (default 3) with the order alternating (ours first,
then HF first, ...) so that neither side always runs on a warmer or cooler machine; the table
gives the median and the spread (min-max) of each side, and the speed-up of the medians.

    .venv/bin/python duplexkv bench engine_vs_hf [--lengths 2048 4096 8192 16384] [--dtypes ...]
        [--samples 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from duplexkv import LLM, SamplingParams
from duplexkv.engine.dtype import cpu_bf16_status
from duplexkv.flags import Accumulate
from duplexkv.model.registry import resolve_model


def ours_prefill(llm: LLM, prompt: list[int]) -> float:
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def ours_decode(llm: LLM, prompt: list[int], steps: int) -> float:
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    eng.step()  # prefill
    times = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    out.logits.argmax(-1)
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_decode(model, prompt: list[int], steps: int) -> float:
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, past_key_values=pkv, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        pkv = out.past_key_values
    return statistics.median(times)


def measure(samples: int, ours, hf) -> dict:
    """`samples` runs of each side, alternating which goes first; medians and all samples."""
    o, h = [], []
    for i in range(samples):
        if i % 2 == 0:
            o.append(ours())
            h.append(hf())
        else:
            h.append(hf())
            o.append(ours())
        gc.collect()
    return {"ours_s": statistics.median(o), "hf_s": statistics.median(h), "ours": o, "hf": h}


def _spread(xs: list[float], k: float) -> str:
    return f"{statistics.median(xs) * k:.3g} ({min(xs) * k:.3g}-{max(xs) * k:.3g})"


def describe(r: dict, unit: str, k: float) -> str:
    return (f"ours {_spread(r['ours'], k)} {unit}  HF {_spread(r['hf'], k)} {unit}  "
            f"speed-up {r['hf_s'] / r['ours_s']:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate,
                    default=[2048, 4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", action=Accumulate, default=["bfloat16", "float32"])
    ap.add_argument("--decode-context", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--samples", type=int, default=3,
                    help="samples per measurement, order alternating between ours and HF")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import transformers

    model_dir = resolve_model(args.model)
    print(f"model {model_dir}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"CPU {cpu_bf16_status()}")
    g = torch.Generator().manual_seed(0)
    results = []
    for dtype in args.dtypes:
        tdtype = getattr(torch, dtype)
        max_len = max(args.lengths + [args.decode_context]) + args.decode_steps + 8
        llm = LLM(str(model_dir), dtype=dtype, enable_prefix_caching=False,
                  max_num_batched_tokens=max_len, num_kv_blocks=max_len // 16 + 8)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=tdtype, attn_implementation="sdpa").eval()
        vocab = llm.engine.model_config.vocab_size
        warm = torch.randint(3, vocab, (256,), generator=g).tolist()
        ours_prefill(llm, warm)
        hf_prefill(hf, warm)
        for n in args.lengths:
            prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
            r = measure(args.samples, lambda: ours_prefill(llm, prompt),
                        lambda: hf_prefill(hf, prompt))
            results.append({"dtype": dtype, "what": f"prefill {n}", **r})
            print(f"{dtype:9s} prefill {n:6d}: {describe(r, 's', 1.0)}", flush=True)
        prompt = torch.randint(3, vocab, (args.decode_context,), generator=g).tolist()
        r = measure(args.samples, lambda: ours_decode(llm, prompt, args.decode_steps),
                    lambda: hf_decode(hf, prompt, args.decode_steps))
        results.append({"dtype": dtype, "what": f"decode step @{args.decode_context}", **r})
        print(f"{dtype:9s} decode @{args.decode_context}: {describe(r, 'ms', 1e3)}", flush=True)
        llm = hf = None  # free both before the next dtype
        gc.collect()
    print(f"\n{args.samples} samples each, order alternating; median (min-max)\n")
    print("| dtype | measurement | ours | HF transformers (SDPA) | speed-up (HF / ours) |")
    print("|---|---|---|---|---|")
    for r in results:
        unit, k = ("ms", 1e3) if r["what"].startswith("decode") else ("s", 1.0)
        print(f"| {r['dtype']} | {r['what']} | {_spread(r['ours'], k)} {unit} | "
              f"{_spread(r['hf'], k)} {unit} | {r['hf_s'] / r['ours_s']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
