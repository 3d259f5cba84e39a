"""Offline multi-turn demo on one engine: each turn re-sends the whole history, and the local
prefix cache turns the history into hits. Prints per-turn context, hit, TTFT and tokens/s."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from duplexkv.engine.llm import LLM
from duplexkv.engine.sampling_params import SamplingParams

SYSTEM = ("You are a coding agent. You read tool output carefully and answer with the next "
          "command to run and a short reason.")


def tool_output(turn: int, lines: int) -> str:
    return "\n".join(f"[tool] step {turn}.{i}: ran tests in module_{(turn * 7 + i) % 13}.py, "
                     f"{(turn + i) % 5} failures, elapsed {0.1 * (i + 1):.1f}s"
                     for i in range(lines))


def run(model: str = "bench", turns: int = 5, lines_per_turn: int = 40, max_tokens: int = 48,
        dtype: str = "bfloat16") -> list[dict]:
    console = Console()
    console.print(f"loading [bold]{model}[/bold] ...")
    llm = LLM(model, dtype=dtype)
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for t in range(1, turns + 1):
        messages.append({"role": "user", "content": tool_output(t, lines_per_turn)})
        engine = llm.engine
        t0 = time.perf_counter()
        seq = engine.add_request(messages, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                          ignore_eos=True))
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.token_ids:
                    first = time.perf_counter()
                if out.finished:
                    final = out
        total = time.perf_counter() - t0
        decode_tps = (len(final.token_ids) - 1) / max(total - (first - t0), 1e-9)
        rows.append({"turn": t, "context": seq.num_prompt_tokens,
                     "cache_hit": final.kv_stats.local_hit_tokens,
                     "ttft_ms": (first - t0) * 1e3, "decode_tok_s": decode_tps,
                     "prefill_tok_s": final.kv_stats.computed_tokens / (first - t0)})
        messages.append({"role": "assistant", "content": final.text})
        console.print(f"turn {t}: {seq.num_prompt_tokens} tokens, "
                      f"{final.kv_stats.local_hit_tokens} from the prefix cache, "
                      f"TTFT {(first - t0) * 1e3:.0f} ms")
    table = Table(title="offline multi-turn (one engine, local prefix cache)")
    for col in ("turn", "context tokens", "prefix-cache hit", "TTFT ms", "prefill tok/s",
                "decode tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["turn"]), str(r["context"]), str(r["cache_hit"]),
                      f"{r['ttft_ms']:.0f}", f"{r['prefill_tok_s']:.0f}",
                      f"{r['decode_tok_s']:.1f}")
    console.print(table)
    return rows
