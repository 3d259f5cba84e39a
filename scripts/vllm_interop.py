"""The conversation half of scripts/vllm_interop.sh: multi-turn chats through the router (vLLM P and
D with bidirectional KV transfer behind it), the same messages to a single vLLM server, the checks.

Conversations (temperature 0, the `openai` client, `conversation_id` in the body):
    json      TURNS turns, non-streaming
    stream    TURNS turns, streamed (D's params reach the router through duplexkv's vLLM plugin)
    edited    3 turns; before the third the client edits its first user message
    strip     3 turns; before the third the client drops the start of the second answer from
              its history, as clients drop a reasoning model's `<think>` block (the synthetic
              model writes none of its own, and the router, like our workers, refuses
              continue_final_message, which could have planted one)
    two at once: a JSON and a streamed conversation of 3 turns, turn by turn concurrently

Checks (exit 1 naming each failure): every turn answers and equals the single server's text
for the same messages; on every turn whose history extends D's prompt the router verified a
`hit`, or a `partial` prefix where the previous answer re-tokenizes differently (the synthetic
model's random text often does), and P's own D->P read counter
(`vllm:nixl_xfer_time_seconds_count`) grew; on the edited and the
stripped turn the router did not hand over D's whole sequence (verify outcome partial or
mismatch); no failed transfer on P or D and no expired lease on P (vLLM's counters do not grow;
D's expiry counter too when the run is shorter than D's 480 s TTL).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

USER_TURNS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Now make it iterative and explain why.",
    "Add type hints and a docstring.",
    "What is its time complexity?",
    "Write a test for it with pytest.",
    "Summarise the conversation in one sentence.",
]
# an agent's instructions: long enough (~500 tokens) that a history whose answer re-tokenizes
# differently (the synthetic model's random text often does) still shares whole 128-token
# blocks with D's sequence
SYSTEM = ("You are a careful coding assistant. Answer with short, correct Python code and one "
          "sentence of explanation. Follow PEP 8, prefer the standard library, add type hints, "
          "and say when a question is ambiguous. ") * 8
READS = "vllm:nixl_xfer_time_seconds_count"
BAD = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
       "vllm:nixl_num_failed_notifications_total")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys((READS, *BAD), 0.0)
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


class Chat:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.router = OpenAI(base_url=args.router + "/v1", api_key="none", max_retries=0,
                             timeout=600)
        self.single = OpenAI(base_url=args.single + "/v1", api_key="none", max_retries=0,
                             timeout=600)

    def ask(self, client: OpenAI, messages: list, stream: bool, cid: str | None,
            extra: dict | None = None) -> tuple[str, dict | None]:
        body = dict(extra or {})
        if cid is not None:
            body["conversation_id"] = cid
        kw = dict(model=self.args.model, messages=messages, temperature=0,
                  max_tokens=self.args.max_tokens, extra_body=body)
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content or "", (r.model_extra or {}).get("kv_stats")
        text, stats = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            extra_fields = chunk.model_extra or {}
            stats = extra_fields.get("kv_stats", stats)
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        return "".join(text), stats

    def turn(self, messages: list, stream: bool, cid: str, extra: dict | None = None) -> dict:
        got, stats = self.ask(self.router, messages, stream, cid, extra)
        want, _ = self.ask(self.single, messages, False, None, extra)
        return {"text": got, "equal": got == want, "stats": stats or {}}


def conversation(chat: Chat, name: str, turns: int, stream: bool, edit_at: int | None = None,
                 strip_at: int | None = None, on_turn=None) -> list[dict]:
    cid, rows = f"{name}-{uuid.uuid4().hex[:8]}", []
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        if edit_at is not None and t == edit_at:
            messages[1] = {"role": "user", "content": messages[1]["content"] + " Use Python 3."}
        messages.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
        before = on_turn() if on_turn else None
        row = chat.turn(messages, stream, cid)
        row.update(conversation=name, turn=t + 1, edited=edit_at == t,
                   stripped=strip_at is not None and t == strip_at + 1)
        if on_turn:
            row["reads"] = on_turn()[READS] - before[READS]
        text = row["text"]
        if strip_at is not None and t == strip_at:  # the client drops the answer's start
            text = text[len(text) // 3:]
        messages.append({"role": "assistant", "content": text})
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--single", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    chat = Chat(args)
    started = time.monotonic()
    at_start = {role: metrics(url) for role, url in (("prefill", args.prefill),
                                                     ("decode", args.decode))}

    def p_reads():
        return metrics(args.prefill)

    rows = []
    rows += conversation(chat, "json", args.turns, False, on_turn=p_reads)
    rows += conversation(chat, "stream", args.turns, True, on_turn=p_reads)
    rows += conversation(chat, "edited", 3, False, edit_at=2, on_turn=p_reads)
    rows += conversation(chat, "strip", 3, True, strip_at=1, on_turn=p_reads)
    before = p_reads()[READS]
    with ThreadPoolExecutor(2) as ex:
        both = [ex.submit(conversation, chat, "pairjson", 3, False),
                ex.submit(conversation, chat, "pairstream", 3, True)]
        pair = [r for f in both for r in f.result()]
    pair_reads = p_reads()[READS] - before
    rows += pair

    failures = []
    for r in rows:
        v = (r["stats"] or {}).get("verify") or {}
        r["verify"] = f"{v.get('outcome', '-')}" + (f"/{v['reason']}" if v.get("reason") else "")
        r["offered"] = v.get("offered_tokens", 0)
        where = f"{r['conversation']} turn {r['turn']}"
        if not r["text"]:
            failures.append(f"{where}: empty answer")
        if not r["equal"]:
            failures.append(f"{where}: answer differs from the single vLLM server's")
        if r["turn"] == 1 or r["conversation"].startswith("pair"):
            continue
        if r["edited"] or r["stripped"]:
            if v.get("outcome") == "hit":
                failures.append(f"{where}: the history changed, yet D's whole sequence was reused")
        elif v.get("outcome") not in ("hit", "partial"):
            failures.append(f"{where}: history extends D's prompt but verify said {r['verify']}")
        if v.get("outcome") in ("hit", "partial") and r.get("reads", 0) < 1:
            failures.append(f"{where}: P did not read D's KV (vllm:nixl_xfer_time_seconds_count)")
    reused_pair = sum(1 for r in pair if ((r["stats"] or {}).get("verify") or {}).get("outcome")
                      in ("hit", "partial"))
    if reused_pair < 4 or pair_reads < reused_pair:
        failures.append(f"two at once: {reused_pair} reused turns (want 4), P read {pair_reads}")
    # D keeps a conversation's last turn for decoder_kv_blocks_ttl (480 s) and then counts it
    # expired, by design: its expiry counter is checked only on a run shorter than that
    short = time.monotonic() - started < 470
    for role, url in (("prefill", args.prefill), ("decode", args.decode)):
        m = metrics(url)
        for name in BAD:
            grew = m[name] - at_start[role][name]
            if grew and (role == "prefill" or short or "expired" not in name):
                failures.append(f"{role}: {name} grew by {grew:g}")

    print(f"{'conversation':<12} {'turn':>4} {'verify':<22} {'offered':>7} {'P reads':>7} equal")
    for r in rows:
        print(f"{r['conversation']:<12} {r['turn']:>4} {r['verify']:<22} {r['offered']:>7} "
              f"{r.get('reads', '-'):>7} {r['equal']}")
    for f in failures:
        print("FAIL:", f)
    print(json.dumps({"ok": not failures, "turns": len(rows), "failures": len(failures)}))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
