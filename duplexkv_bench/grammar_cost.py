"""What a grammar costs per generated token: decode steps with and without a structured output, on
one engine (no HTTP), float32, greedy.

    .venv/bin/python -m duplexkv_bench.grammar_cost [--presets tiny bench] [--tokens 128] [--reps 5]

Per preset: one sequence decoding alone, with a JSON schema that keeps it writing (an array of
`--tokens`/8 small objects) and without a grammar for as many tokens (ignore_eos); then a batch of
4, two of each. ms
per token = the decode steps' wall time / the tokens they made (the prefill step excluded); the
median and the minimum over --reps interleaved runs. Also the grammar's own work replayed along a
real answer (llguidance's mask, applying it to a row of logits, consuming the token): what a
grammar adds to each step, free of the model's step time and of a busy machine's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from duplexkv.engine.config import EngineConfig
from duplexkv.flags import Accumulate
from duplexkv.engine.grammar import apply_mask, consume
from duplexkv.engine.llm_engine import LLMEngine
from duplexkv.wire.sampling import SamplingParams
from duplexkv.wire.structured import StructuredOutput


def schema(items: int) -> StructuredOutput:
    obj = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                   "maximum": 999},
                                            "ok": {"type": "boolean"},
                                            "tag": {"enum": ["alpha", "beta", "gamma"]}},
           "required": ["id", "ok", "tag"], "additionalProperties": False}
    return StructuredOutput("json", json.dumps({"type": "array", "items": obj,
                                                "minItems": items, "maxItems": items}))


def decode_ms_per_token(engine: LLMEngine, params: list[SamplingParams]) -> float:
    """Add one request per params, run the prefill step(s), then time the decode steps."""
    for i, p in enumerate(params):
        engine.add_request(f"def f{i}(x):\n    return", p)
    while any(len(s.seq.output_token_ids) == 0 for s in engine.requests.values()):
        engine.step()
    t0, total = time.perf_counter(), 0
    while engine.has_unfinished():
        total += sum(len(o.new_token_ids) for o in engine.step())
    return (time.perf_counter() - t0) * 1e3 / max(1, total)


def grammar_ms_per_token(engine: LLMEngine, so: StructuredOutput, params: SamplingParams
                         ) -> tuple[float, int]:
    """The grammar's own work along a real answer: mask, apply to a row, consume; per token."""
    seq = engine.add_request("def f(x):\n    return", params)
    while engine.has_unfinished():
        engine.step()
    tokens = seq.output_token_ids
    m, row = engine.grammars.matcher(so), torch.zeros(engine.model_config.vocab_size)
    t0 = time.perf_counter()
    for tok in tokens:
        apply_mask(row.clone(), m)
        consume(m, tok)
    return (time.perf_counter() - t0) * 1e3 / len(tokens), len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", action=Accumulate, default=["tiny", "bench"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    for preset in args.presets:
        engine = LLMEngine(EngineConfig(model=preset, dtype="float32", num_kv_blocks=256))
        so = schema(max(1, args.tokens // 8))
        guided = SamplingParams(max_tokens=8 * args.tokens, temperature=0, structured=so)
        own, n = grammar_ms_per_token(engine, so, guided)  # also the warm-up
        # as long as the guided answer (greedy: the same every time), so that a batch's rows
        # end together and no row's ms/token comes from a thinner batch
        free = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        rows = {"1 seq, no grammar": [free], "1 seq, grammar": [guided],
                "4 seqs, no grammar": [free] * 4, "4 seqs, 2 with a grammar": [free, guided] * 2}
        ms: dict[str, list[float]] = {what: [] for what in rows}
        for _ in range(args.reps):  # interleaved: a noisy neighbour hits every row alike
            for what, params in rows.items():
                ms[what].append(decode_ms_per_token(engine, params))
        for what, vals in ms.items():
            print(f"{preset:6s} {what:26s} median {statistics.median(vals):7.3f}  min "
                  f"{min(vals):7.3f} ms/token")
        print(f"{preset:6s} {'grammar work alone':26s} {own:7.3f} ms/token (over a {n}-token "
              "answer: mask, apply, consume)")


if __name__ == "__main__":
    main()
