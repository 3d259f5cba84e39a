"""What recognising a conversation from its content costs the router per request: hashing the
request's messages (duplexkv/router/conversation/recognise.py) and the store lookups, for a
history of about 100k tokens cut into few long or many short messages.

    .venv/bin/python -m duplexkv_bench.recognise_cost [--tokens 100000] [--reps 200]

The history is Python standard-library source (what the default `bench` model's tokenizer was
trained on), counted in that tokenizer's tokens; the last message is a new user message, so the
lookup is the router's usual one (the newest stored prefix, found in the memory store). The
median over `--reps` calls is printed per shape; the router's own overhead is 1.03 ms at p50
(docs/results/router-overhead.md).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time

from duplexkv.router.conversation import recall, store
from duplexkv.router.conversation.recognise import recognition_of
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.request import ClientRequest

SHAPES = ((50, "long turns"), (400, "agent: many tool calls"), (2000, "tiny messages"))


def corpus(tokens: int) -> tuple[str, float]:
    """Standard-library text of about `tokens` tokens, and its characters per token."""
    text, n = "", 0
    for mod in (asyncio, inspect, argparse, statistics):
        text += inspect.getsource(mod)
    try:
        from tokenizers import Tokenizer

        from duplexkv.model.registry import resolve_model

        tok = Tokenizer.from_file(str(resolve_model("bench") / "tokenizer.json"))
        n = len(tok.encode(text[:200_000]).ids)
        per = 200_000 / n
    except Exception:  # noqa: BLE001 - no tokenizer: the usual 4 characters per token
        per = 4.0
    need = int(tokens * per)
    while len(text) < need:
        text += text
    return text[:need], per


def history(text: str, messages: int) -> list[dict]:
    size = len(text) // messages
    out = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(messages):
        chunk = text[i * size:(i + 1) * size]
        if i % 2 == 0:
            out.append({"role": "user", "content": chunk})
        else:
            out.append({"role": "assistant", "content": chunk})
    if out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": "ok"})
    return out + [{"role": "user", "content": "next step?"}]


async def measure(messages: list[dict], reps: int) -> tuple[float, float]:
    """-> median ms of (hashing, hashing + the store lookup that finds the previous turn)."""
    req = ClientRequest("chat", {"model": "bench", "messages": messages}, False, "bench", None,
                        "client-key", None)
    conv = recall.Conversations(store.MemoryStore(450, 100_000), RouterMetrics())
    prev = recognition_of(ClientRequest("chat", {"model": "bench", "messages": messages[:-2]},
                                        False, "bench", None, "client-key", None))
    key = prev.answer_key(messages[-2])
    hashing, total = [], []
    for _ in range(reps):
        await conv.store.put(key, store.Entry({"remote_request_id": "r"}, "http://d", 0.0))
        t0 = time.perf_counter()
        rec = recognition_of(req)
        t1 = time.perf_counter()
        got = await conv.recall(None, None, "bench", rec)
        t2 = time.perf_counter()
        assert got.state == "hit" and got.key == key, got
        hashing.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(hashing), statistics.median(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    text, per = corpus(args.tokens)
    print(f"history: {args.tokens:,} tokens ({len(text):,} characters, {per:.2f} per token)")
    print("| messages | shape | hashing, median ms | hashing + lookup, median ms |")
    print("|---|---|---|---|")
    for n, shape in SHAPES:
        msgs = history(text, n)
        h, t = asyncio.run(measure(msgs, args.reps))
        print(f"| {len(msgs)} | {shape} | {h:.3f} | {t:.3f} |")


if __name__ == "__main__":
    main()
