"""Bidirectional KV transfer between real workers (float32, greedy): D keeps each finished turn,
the next turn's P verifies and READs it. Reuse must never change an output: every case is
compared with one engine computing the same conversation from scratch (the oracle)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest
from workers import (
    MISS,
    decode_leg,
    free_port,
    kv_config,
    need_nixl,
    prefill_leg,
    sse_events,
    start_worker,
    wait_for,
)

CONNECTORS = ["TcpConnector", "NixlConnector"]
ARGS = ("--num-kv-blocks", "128", "--max-model-len", "1024")
SYSTEM = ("You are a careful coding agent. Read the tool output, then answer with the next "
          "command and one sentence of reasoning. Never invent file names.")


def bidi(connector, **kw):
    return kv_config(connector, bidirectional_kv_xfer=True, **kw)


@pytest.fixture(scope="module", params=CONNECTORS)
def cluster(request, tiny_model_dir, tmp_path_factory):
    if request.param == "NixlConnector":
        need_nixl()
    tmp = tmp_path_factory.mktemp(request.param)
    # P without a local prefix cache, as in the reference evaluation: every reused token is pulled
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, "--no-enable-prefix-caching",
                     kv=bidi(request.param))
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=bidi(request.param))
    yield request.param, p, d, tmp
    for w in (p, d):
        w.stop()


def to_p(d_params: dict | None) -> dict:
    """What the router sends P on turn N: D's params with the booleans forced (vLLM proxy)."""
    if d_params is None:
        return dict(MISS)
    return {**d_params, "do_remote_decode": True, "do_remote_prefill": False}


@dataclass
class Turn:
    text: str
    ids: list[int]  # generated token ids (what the tests compare)
    p_stats: dict  # P's kv_stats: what it pulled from D
    d_params: dict | None  # D's params for the next turn


def turn(p, d, path, body, d_params, stream=False) -> Turn:
    """One P->D turn, with token ids returned."""
    body = {**body, "return_token_ids": True}
    pj = prefill_leg(p, path, body, to_p(d_params))
    if stream:
        events = sse_events(decode_leg(d, path, {**body, "stream": True},
                                       pj["kv_transfer_params"]))
        text = "".join((e["choices"][0].get("delta") or {}).get("content")
                       or e["choices"][0].get("text") or "" for e in events if e["choices"])
        ids = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []]
        params = [e["kv_transfer_params"] for e in events if e.get("kv_transfer_params")]
        return Turn(text, ids, pj["kv_stats"], params[-1] if params else None)
    r = decode_leg(d, path, body, pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    dj = r.json()
    c = dj["choices"][0]
    text = c["message"]["content"] if "message" in c else c["text"]
    return Turn(text, c["token_ids"], pj["kv_stats"], dj["kv_transfer_params"])


def declined(w, reason: str) -> float:
    """P's duplexkv_kv_pull_declined_total for one reason."""
    m = re.search(r'(?m)^duplexkv_kv_pull_declined_total\{reason="%s"\} (\S+)$' % reason,
                  w.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def expected_pull(retained: list[int], prompt: list[int], threshold: int = 64) -> tuple[int, str]:
    """What P (no local prefix cache) must pull from D's retained `retained` tokens for `prompt`:
    the true common prefix (all but P's last prompt token), if it reaches the threshold. The
    holder tells whole blocks of it unless it is all of `retained` (docs/security.md)."""
    common = 0
    for a, b in zip(retained, prompt):
        if a != b:
            break
        common += 1
    if common < len(retained):
        common -= common % 16
    usable = min(common, len(prompt) - 1)
    if common == 0:
        return 0, "mismatch"
    return (usable, "pulled") if usable >= threshold else (0, "threshold")


@pytest.mark.parametrize("stream", [False, True])
def test_four_turn_chat_equals_oracle_and_reuses_d(cluster, oracle, stream):
    _, p, d, _ = cluster
    messages = [{"role": "system", "content": SYSTEM}]
    d_params = None
    for t in range(4):
        messages.append({"role": "user", "content": f"tool output {t}: " + "ok; " * (8 + 6 * t)})
        body = {"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        out = turn(p, d, "/v1/chat/completions", body, d_params, stream)
        text, p_stats, d_params = out.text, out.p_stats, out.d_params
        want = oracle(messages, 24)
        assert out.ids == want.token_ids and text == want.text, f"turn {t + 1} differs"
        assert d_params is not None and d_params["do_remote_decode"] is True
        assert d_params["remote_blocks_expiry_time"] is not None
        if t == 0:
            assert p_stats["pulled_tokens"] == 0
        else:
            assert p_stats["pulled_tokens"] > 0, f"turn {t + 1}: {p_stats}"
            assert p_stats["pull_outcome"] == "pulled"
        messages.append({"role": "assistant", "content": text})
    p.assert_integrity()
    d.assert_integrity()


def test_token_history_reuses_prompt_and_answer(cluster, oracle):
    """An agent that keeps token ids: each prompt extends D's sequence exactly, so P pulls the
    whole previous prompt and answer (all but the last sampled token, which has no KV)."""
    _, p, d, _ = cluster
    prompt = list(range(100, 180))
    d_params = None
    reads_before = d.kv()["retained"]["released"]["read"]
    for t in range(3):
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        pj = prefill_leg(p, "/v1/completions", body, to_p(d_params))
        r = decode_leg(d, "/v1/completions", {**body, "return_token_ids": True},
                       pj["kv_transfer_params"])
        want = oracle(prompt, 20)
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        if d_params is not None:
            assert pj["kv_stats"]["pulled_tokens"] == d_params["remote_num_tokens"]
            assert pj["kv_stats"]["computed_tokens"] == len(prompt) - d_params["remote_num_tokens"]
        d_params = r.json()["kv_transfer_params"]
        assert d_params["remote_num_tokens"] == len(prompt) + 20 - 1
        prompt = prompt + want.token_ids + list(range(300 + t * 40, 340 + t * 40))
    # P's reads of turns 1 and 2 freed them on D
    wait_for(lambda: d.kv()["retained"]["released"]["read"] >= reads_before + 2,
             what="D to release the turns P read")


@pytest.mark.parametrize("retained, pulled", [(63, False), (64, True)])
def test_threshold_edge(cluster, oracle, retained, pulled):
    """kv_recompute_threshold 64 (kv_config's, set explicitly; the default is the cost model):
    a gain of 63 tokens recomputes, 64 pulls."""
    _, p, d, _ = cluster
    out_tokens = 4
    prompt = list(range(1000, 1000 + retained + 1 - out_tokens))
    body = {"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
    d_params = turn(p, d, "/v1/completions", body, None).d_params
    assert d_params["remote_num_tokens"] == retained
    nxt = prompt + oracle(prompt, out_tokens).token_ids + list(range(2000, 2010))
    before = d.kv()["retained"]["released"]
    declined_before = declined(p, "threshold")
    body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = turn(p, d, "/v1/completions", body2, d_params)
    assert out.ids == oracle(nxt, 8).token_ids
    p_stats = out.p_stats
    if pulled:
        assert p_stats["pulled_tokens"] == 64 and p_stats["pull_outcome"] == "pulled"
        assert declined(p, "threshold") == declined_before
    else:
        assert p_stats["pulled_tokens"] == 0 and p_stats["pull_outcome"] == "threshold"
        assert declined(p, "threshold") == declined_before + 1
        # notify-only: D freed the turn at once instead of holding it for the TTL
        wait_for(lambda: d.kv()["retained"]["released"]["notified"] > before["notified"],
                 what="D to free the declined turn")


def _two_turns(p, d, oracle, first, second, max_tokens=16):
    """Turn 1 with `first`, then turn 2 with `second` replaying turn 1's D params. Returns P's
    kv_stats of turn 2 and the tokens D retained after turn 1 (prompt + answer but the last)."""
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    one = turn(p, d, "/v1/chat/completions", {"messages": first, **params}, None)
    retained = oracle(first, max_tokens).prompt_token_ids + one.ids[:-1]
    assert one.d_params["remote_num_tokens"] == len(retained)
    two = turn(p, d, "/v1/chat/completions", {"messages": second, **params}, one.d_params)
    want = oracle(second, max_tokens)
    assert two.ids == want.token_ids
    return two.p_stats, retained, want.prompt_token_ids


CASES = {
    # the client edits the end of an earlier message: reuse stops at the edit
    "edited_history": lambda a: [a[0], {"role": "user",
                                        "content": a[1]["content"][:-12] + "pass; pass; "}],
    # the assistant's text is rewritten (e.g. a stripped reasoning trace)
    "rewritten_answer": lambda a: [*a[:2], {"role": "assistant", "content": "(omitted)"}],
    # another conversation's history under the same conversation id
    "other_conversation": lambda a: [{"role": "system", "content": "Different system prompt."},
                                     {"role": "user", "content": "Something else entirely."}],
}
# what each case must come to (checked against the computed common prefix as well)
CASE_OUTCOME = {"edited_history": "pulled", "rewritten_answer": "pulled",
                "other_conversation": "mismatch"}  # less than a block in common: told nothing


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_history_falls_back_to_the_matching_prefix(cluster, oracle, case):
    """P pulls exactly the true common prefix of D's retained tokens and its prompt (verified
    token by token, told in whole blocks), and reports exactly one outcome."""
    _, p, d, _ = cluster
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "tool output: " + "fail; " * 30}]
    answer = oracle(first, 16).text
    second = CASES[case](first + [{"role": "assistant", "content": answer}])
    second = second + [{"role": "user", "content": "next step?"}]
    before = declined(p, CASE_OUTCOME[case])
    stats, retained, prompt = _two_turns(p, d, oracle, first, second)
    pulled, outcome = expected_pull(retained, prompt)
    assert outcome == CASE_OUTCOME[case], (pulled, outcome)
    assert stats["pull_outcome"] == outcome and stats["pulled_tokens"] == pulled, stats
    assert stats["computed_tokens"] == len(prompt) - pulled
    if outcome == "pulled":
        assert 64 <= pulled < len(retained)  # reuse up to the edit, not beyond
    else:
        assert declined(p, outcome) == before + 1
    p.assert_integrity()
    d.assert_integrity()


def test_retokenised_answer_reuses_only_what_matches(cluster, oracle):
    """The answer's text re-tokenises differently from the generated ids: only verified blocks
    are pulled (whole blocks: a verify tells no count inside a block, docs/security.md), and
    the output is still the oracle's."""
    _, p, d, _ = cluster
    prompt = list(range(500, 600))
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    d_params = turn(p, d, "/v1/completions", body, None).d_params
    gen = oracle(prompt, 24).token_ids
    drifted = prompt + gen[:5] + [7, 7, 7] + gen[8:] + list(range(700, 720))
    body2 = {"prompt": drifted, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = turn(p, d, "/v1/completions", body2, d_params)
    assert out.ids == oracle(drifted, 8).token_ids
    # the whole blocks before the first differing token
    assert out.p_stats["pulled_tokens"] == (len(prompt) + 5) // 16 * 16
    assert out.p_stats["pull_outcome"] == "pulled"


def test_ttl_expiry_between_turns(cluster, tiny_model_dir, oracle):
    """D's retained turn expires (1 s TTL) and is released; the next turn's P finds nothing to
    verify (outcome "unknown", counted) and recomputes."""
    name, p, _, tmp = cluster
    d = start_worker(tiny_model_dir, tmp / "d_ttl.log", *ARGS,
                     kv=bidi(name, decoder_kv_blocks_ttl=1))
    try:
        prompt = list(range(100, 200))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        d_params = turn(p, d, "/v1/completions", body, None).d_params
        wait_for(lambda: d.kv()["retained"]["released"]["expired"] == 1, what="D's TTL expiry")
        assert d.kv()["retained"]["entries"] == 0
        nxt = prompt + oracle(prompt, 8).token_ids + [5] * 10
        body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = declined(p, "unknown")
        out = turn(p, d, "/v1/completions", body2, d_params)
        assert out.ids == oracle(nxt, 8).token_ids
        assert out.p_stats["pulled_tokens"] == 0 and out.p_stats["pull_outcome"] == "unknown"
        assert declined(p, "unknown") == before + 1
        d.assert_integrity()
    finally:
        d.stop()


def test_p_declines_blocks_that_expire_within_the_margin(cluster, tiny_model_dir, oracle):
    """P declines remote blocks that expire within 5 s (its expiry_margin_s), even though they
    are still there: D keeps turns for 4.5 s and extends a verified claim by only 1 s
    (read_timeout_s 1 + expiry_margin_s 0), so D's answered expiry is < 5 s away. P declines
    ("expired", counted) and notifies D, which frees the turn before its TTL."""
    name, p, _, tmp = cluster
    d = start_worker(tiny_model_dir, tmp / "d_margin.log", *ARGS,
                     kv=bidi(name, decoder_kv_blocks_ttl=4.5, read_timeout_s=1.0,
                             expiry_margin_s=0.0))
    try:
        prompt = list(range(600, 700))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        d_params = turn(p, d, "/v1/completions", body, None).d_params
        nxt = prompt + oracle(prompt, 8).token_ids + [6] * 10
        body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = declined(p, "expired")
        out = turn(p, d, "/v1/completions", body2, d_params)
        assert out.ids == oracle(nxt, 8).token_ids
        assert out.p_stats["pulled_tokens"] == 0 and out.p_stats["pull_outcome"] == "expired"
        assert declined(p, "expired") == before + 1
        # the blocks were alive: D freed them on P's notification, not by expiry
        wait_for(lambda: d.kv()["retained"]["released"]["notified"] == 1,
                 what="D to free the declined turn")
        assert d.kv()["retained"]["released"]["expired"] == 0
        d.assert_integrity()
    finally:
        d.stop()


def test_d_killed_or_restarted_between_turns(cluster, tiny_model_dir, oracle):
    name, p, _, tmp = cluster
    kv = bidi(name, side_channel_port=free_port(), read_timeout_s=3.0)
    d = start_worker(tiny_model_dir, tmp / "d_a.log", *ARGS, kv=kv)
    prompt = list(range(200, 300))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    d_params = turn(p, d, "/v1/completions", body, None).d_params
    d.kill()
    nxt = prompt + oracle(prompt, 8).token_ids + [9] * 20
    body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    unreachable = declined(p, "unreachable")
    # D is gone: P's verify fails within the connect timeout and P recomputes
    t0 = time.monotonic()
    pj = prefill_leg(p, "/v1/completions", body2, to_p(d_params))
    assert time.monotonic() - t0 < 2.5
    assert pj["kv_stats"]["pull_outcome"] == "unreachable"
    assert pj["kv_stats"]["pulled_tokens"] == 0
    assert declined(p, "unreachable") == unreachable + 1
    # D restarted at the same address: other engine id, block ids hold other data -> refused
    d2 = start_worker(tiny_model_dir, tmp / "d_b.log", *ARGS, kv=kv)
    try:
        addr = f"{d_params['remote_host']}:{d_params['remote_port']}"
        deadline = time.monotonic() + 30  # P skips the address while its breaker is open
        while p.kv()["peers"].get(addr, {}).get("open_for_s", 0) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        out = turn(p, d2, "/v1/completions", body2, d_params)
        assert out.ids == oracle(nxt, 8).token_ids
        assert out.p_stats["pulled_tokens"] == 0 and out.p_stats["pull_outcome"] == "failed"
        p.assert_integrity()
    finally:
        d2.stop()


def test_retained_blocks_yield_to_new_requests(cluster, tiny_model_dir, oracle):
    name, p, _, tmp = cluster
    d = start_worker(tiny_model_dir, tmp / "d_small.log", "--num-kv-blocks", "24",
                     "--max-model-len", "1024", kv=bidi(name))
    try:
        for i in range(3):  # three finished turns, ~7 blocks each, stay retained on D
            prompt = list(range(1000 + 200 * i, 1090 + 200 * i))
            turn(p, d, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                           "temperature": 0, "ignore_eos": True}, None)
        assert d.kv()["retained"]["entries"] == 3
        big = list(range(3000, 3200))  # needs 13+ blocks: only possible by releasing turns
        r = d.post("/v1/completions", {"prompt": big, "max_tokens": 8, "temperature": 0,
                                       "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == oracle(big, 8).token_ids
        kv = d.kv()
        assert kv["retained"]["released"]["pressure"] >= 1
        assert kv["retained"]["entries"] < 3
        d.assert_integrity()
        assert "duplexkv_kv_retained_released_total" in d.get("/metrics").text
    finally:
        d.stop()
