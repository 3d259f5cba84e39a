"""The conversation half of scripts/vllm_interop.sh: one multi-turn chat through the router (vLLM P
and D behind it) and the same messages to a single vLLM server, then the checks and a summary.

Checks (exit 1 naming each failure): every turn answers; D's NIXL transfer count
(`vllm:nixl_xfer_time_seconds_count`) and the tokens it loaded from P
(`vllm:external_prefix_cache_hits_total`) grew on every turn; each turn's temperature-0 text
equals the single server's for the same messages.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
import uuid

from openai import OpenAI

USER_TURNS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Now make it iterative and explain why.",
    "Add type hints and a docstring.",
    "What is its time complexity?",
    "Write a test for it with pytest.",
    "Summarise the conversation in one sentence.",
]
D_METRICS = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum",
             "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total",
             "vllm:prefix_cache_hits_total", "vllm:nixl_num_failed_transfers_total")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(base_url: str) -> dict[str, float]:
    """Each sample name in D_METRICS summed over its labels (absent: 0)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(D_METRICS, 0.0)
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def metrics_after(base_url: str, before: dict[str, float], timeout: float = 15.0) -> dict[str, float]:
    """D's metrics once its NIXL stats for the turn are in (they are published with an engine
    step, so they can trail the answer), or as they are at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(base_url)
        keys = ("vllm:nixl_xfer_time_seconds_count", "vllm:external_prefix_cache_hits_total")
        if all(now[k] > before[k] for k in keys) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def chat(client: OpenAI, model: str, messages: list[dict], stream: bool, max_tokens: int,
         headers: dict[str, str]) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, kv_stats) of one temperature-0 chat turn."""
    args = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                extra_headers=headers)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content or "", r.choices[0].finish_reason, \
            (r.model_extra or {}).get("kv_stats")
    text, finish, kv_stats = [], None, None
    for chunk in client.chat.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}):
        kv_stats = (chunk.model_extra or {}).get("kv_stats") or kv_stats
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, kv_stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True, help="D's base URL (its /metrics)")
    ap.add_argument("--single", required=True, help="the reference vLLM server's base URL")
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=len(USER_TURNS))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    routed = OpenAI(base_url=args.router + "/v1", api_key="none", timeout=300, max_retries=0)
    single = OpenAI(base_url=args.single + "/v1", api_key="none", timeout=300, max_retries=0)
    conv = {"X-Conversation-ID": f"interop-{uuid.uuid4().hex[:12]}"}
    messages: list[dict] = [{"role": "system", "content": "You are a terse coding assistant."}]
    failures, rows = [], []
    started = time.monotonic()
    for turn in range(args.turns):
        messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
        stream = turn % 2 == 1
        before = metrics(args.decode)
        try:
            text, finish, kv = chat(routed, args.model, messages, stream, args.max_tokens, conv)
        except Exception as e:  # noqa: BLE001 - any failure of a turn is reported, then fatal
            failures.append(f"turn {turn + 1} through the router failed: {e!r}")
            break
        after = metrics_after(args.decode, before)
        ref, ref_finish, _ = chat(single, args.model, messages, stream, args.max_tokens, {})
        delta = {k: after[k] - before[k] for k in D_METRICS}
        rows.append({
            "turn": turn + 1, "stream": stream, "finish": finish,
            "equal": (text, finish) == (ref, ref_finish),
            "nixl_transfers": int(delta["vllm:nixl_xfer_time_seconds_count"]),
            "nixl_bytes": int(delta["vllm:nixl_bytes_transferred_sum"]),
            "d_prompt_tokens": int(delta["vllm:prompt_tokens_total"]),
            "d_loaded_from_p": int(delta["vllm:external_prefix_cache_hits_total"]),
            "d_local_hits": int(delta["vllm:prefix_cache_hits_total"]),
            "conversation": (kv or {}).get("conversation"),
        })
        row = rows[-1]
        if not text:
            failures.append(f"turn {turn + 1}: empty answer")
        if not row["equal"]:
            failures.append(f"turn {turn + 1}: router {text!r} ({finish}) != single vLLM "
                            f"{ref!r} ({ref_finish})")
        if row["nixl_transfers"] < 1 or row["d_loaded_from_p"] < 1:
            failures.append(f"turn {turn + 1}: D shows no NIXL transfer from P ({delta})")
        if delta["vllm:nixl_num_failed_transfers_total"]:
            failures.append(f"turn {turn + 1}: D counted failed NIXL transfers ({delta})")
        messages.append({"role": "assistant", "content": text})
    elapsed = time.monotonic() - started

    print(f"{'turn':>4} {'mode':>6} {'finish':>7} {'= single':>8} {'NIXL xfers':>10} "
          f"{'bytes':>8} {'D prompt':>8} {'from P':>6} {'D hits':>6}  conversation")
    for r in rows:
        print(f"{r['turn']:>4} {'stream' if r['stream'] else 'json':>6} {r['finish'] or '-':>7} "
              f"{'yes' if r['equal'] else 'NO':>8} {r['nixl_transfers']:>10} {r['nixl_bytes']:>8} "
              f"{r['d_prompt_tokens']:>8} {r['d_loaded_from_p']:>6} {r['d_local_hits']:>6}  "
              f"{r['conversation']}")
    summary = {"turns": len(rows), "turns_equal": sum(r["equal"] for r in rows),
               "nixl_transfers": sum(r["nixl_transfers"] for r in rows),
               "nixl_bytes": sum(r["nixl_bytes"] for r in rows),
               "tokens_loaded_from_p": sum(r["d_loaded_from_p"] for r in rows),
               "conversation_seconds": round(elapsed, 1), "ok": not failures}
    print("summary:", json.dumps(summary))
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
