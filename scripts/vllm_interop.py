"""The conversation half of scripts/vllm_interop.sh: multi-turn chats through the router (vLLM P and
D with bidirectional KV transfer behind it), then the same messages to a single vLLM server, the
checks. Two phases, so that the reference server does not share the 2 cores with P and D (vLLM's D
steps its engine every millisecond while it retains a turn, and NIXL's progress thread polls
without sleeping: a third server beside them starved them into P's lease running out):

    --router --prefill --decode --record F    the conversations; P/D checks; turns to F
    --single --record F                       every turn of F to the single server; verdict

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
import os
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
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"  # P's blocks D did not read within P's lease
BAD = ("vllm:nixl_num_failed_transfers_total", EXPIRED,
       "vllm:nixl_num_failed_notifications_total")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:  # a starved server
        text = r.read().decode()
    out = dict.fromkeys((READS, *BAD), 0.0)
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def ask(client: OpenAI, model: str, max_tokens: int, messages: list, stream: bool,
        cid: str | None) -> tuple[str, dict | None]:
    body = {"conversation_id": cid} if cid is not None else {}
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
              extra_body=body)
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


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def conversation(args: argparse.Namespace, name: str, turns: int, stream: bool,
                 edit_at: int | None = None, strip_at: int | None = None,
                 on_turn=None) -> list[dict]:
    """One conversation through the router; each row keeps the exact messages it sent."""
    router = client(args.router)
    cid, rows = f"{name}-{uuid.uuid4().hex[:8]}", []
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        if edit_at is not None and t == edit_at:
            messages[1] = {"role": "user", "content": messages[1]["content"] + " Use Python 3."}
        messages.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
        before = on_turn() if on_turn else None
        t0 = time.monotonic()
        text, stats = ask(router, args.model, args.max_tokens, messages, stream, cid)
        row = {"conversation": name, "turn": t + 1, "edited": edit_at == t,
               "stripped": strip_at is not None and t == strip_at + 1, "text": text,
               "stats": stats or {}, "seconds": time.monotonic() - t0,
               "messages": [dict(m) for m in messages]}
        if on_turn:
            after = on_turn()
            row["reads"] = after[READS] - before[READS]
            row["p_expired"] = after[EXPIRED] - before[EXPIRED]
        row["load"] = os.getloadavg()[0]  # a starved machine shows here first
        if strip_at is not None and t == strip_at:  # the client drops the answer's start
            text = text[len(text) // 3:]
        messages.append({"role": "assistant", "content": text})
        rows.append(row)
    return rows


def drive(args: argparse.Namespace) -> int:
    """Phase 1: the conversations through the router, the checks that need P and D up; the
    turns and those failures go to --record."""
    started = time.monotonic()
    at_start = {role: metrics(url) for role, url in (("prefill", args.prefill),
                                                     ("decode", args.decode))}

    def p_reads():
        return metrics(args.prefill)

    rows = []
    rows += conversation(args, "json", args.turns, False, on_turn=p_reads)
    rows += conversation(args, "stream", args.turns, True, on_turn=p_reads)
    rows += conversation(args, "edited", 3, False, edit_at=2, on_turn=p_reads)
    rows += conversation(args, "strip", 3, True, strip_at=1, on_turn=p_reads)
    before = p_reads()[READS]
    with ThreadPoolExecutor(2) as ex:
        both = [ex.submit(conversation, args, "pairjson", 3, False),
                ex.submit(conversation, args, "pairstream", 3, True)]
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
    # P's leases: none may run out, the first turn's (issue 27's cold-start finding, which the
    # router's warm-up fixes) included; they ran out mid-run on 2 cores while vLLM's engines ran
    # in their default process layout (scripts/vllm_interop.sh says why they do not now)
    for role, url in (("prefill", args.prefill), ("decode", args.decode)):
        m = metrics(url)
        for name in BAD:
            grew = m[name] - at_start[role][name]
            if grew and (role == "prefill" or short or "expired" not in name):
                first = f" (the first turn: {rows[0]['p_expired']:g})" \
                    if role == "prefill" and name == EXPIRED and rows[0].get("p_expired") else ""
                failures.append(f"{role}: {name} grew by {grew:g}{first}")
    with open(args.record, "w") as f:
        json.dump({"rows": rows, "failures": failures}, f)
    print(f"{len(rows)} turns through the router in {time.monotonic() - started:.0f} s; "
          f"{len(failures)} failures so far", flush=True)
    return 0


def check(args: argparse.Namespace) -> int:
    """Phase 2: each recorded turn's messages to the single vLLM server, alone on the
    machine; every answer must equal the router's. Prints the table and the verdict."""
    with open(args.record) as f:
        record = json.load(f)
    rows, failures = record["rows"], record["failures"]
    single = client(args.single)
    for r in rows:
        want, _ = ask(single, args.model, args.max_tokens, r["messages"], False, None)
        r["equal"] = r["text"] == want
        if not r["equal"]:
            failures.append(f"{r['conversation']} turn {r['turn']}: answer differs from the "
                            "single vLLM server's")
    print(f"{'conversation':<12} {'turn':>4} {'verify':<22} {'offered':>7} {'P reads':>7} "
          f"{'P done ms':>9} {'total s':>7} {'P expired':>9} {'load':>5} equal")
    for r in rows:
        p_done = (r["stats"] or {}).get("prefill_done_ms")
        print(f"{r['conversation']:<12} {r['turn']:>4} {r['verify']:<22} {r['offered']:>7} "
              f"{r.get('reads', '-'):>7} {p_done if p_done is not None else '-':>9} "
              f"{r['seconds']:>7.1f} {r.get('p_expired', '-'):>9} {r.get('load', 0):>5.1f} "
              f"{r['equal']}")
    for f in failures:
        print("FAIL:", f)
    print(json.dumps({"ok": not failures, "turns": len(rows), "failures": len(failures)}))
    return 0 if not failures else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router")
    ap.add_argument("--prefill")
    ap.add_argument("--decode")
    ap.add_argument("--single", help="phase 2: check the --record against this server")
    ap.add_argument("--record", required=True, help="the turns of phase 1 (JSON)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.single:
        return check(args)
    if not (args.router and args.prefill and args.decode):
        ap.error("phase 1 needs --router, --prefill and --decode")
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
