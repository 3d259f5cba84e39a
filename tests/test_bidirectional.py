"""Bidirectional KV transfer between real workers (float32, greedy): D keeps each finished turn,
the next turn's P verifies and READs it. Reuse must never change an output: every case is
compared with one engine computing the same conversation from scratch (the oracle)."""

from __future__ import annotations

import time

import pytest

from workers import MISS, decode_leg, kv_config, prefill_leg, sse_events, start_worker

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


def turn(p, d, path, body, d_params, stream=False):
    """One P->D turn; returns (D's final JSON-ish dict, P's kv_stats, D's new params)."""
    pj = prefill_leg(p, path, body, to_p(d_params))
    if stream:
        events = sse_events(decode_leg(d, path, {**body, "stream": True},
                                       pj["kv_transfer_params"]))
        text = "".join((e["choices"][0].get("delta") or {}).get("content")
                       or e["choices"][0].get("text") or "" for e in events if e["choices"])
        params = [e["kv_transfer_params"] for e in events if e.get("kv_transfer_params")]
        return text, pj["kv_stats"], (params[-1] if params else None)
    r = decode_leg(d, path, body, pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    dj = r.json()
    c = dj["choices"][0]
    text = c["message"]["content"] if "message" in c else c["text"]
    return text, pj["kv_stats"], dj["kv_transfer_params"]


@pytest.mark.parametrize("stream", [False, True])
def test_four_turn_chat_equals_oracle_and_reuses_d(cluster, oracle, stream):
    _, p, d, _ = cluster
    messages = [{"role": "system", "content": SYSTEM}]
    d_params = None
    for t in range(4):
        messages.append({"role": "user", "content": f"tool output {t}: " + "ok; " * (8 + 6 * t)})
        body = {"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        text, p_stats, d_params = turn(p, d, "/v1/chat/completions", body, d_params, stream)
        assert text == oracle(messages, 24).text, f"turn {t + 1} differs"
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
        r = decode_leg(d, "/v1/completions", body, pj["kv_transfer_params"])
        want = oracle(prompt, 20)
        assert r.json()["choices"][0]["text"] == want.text
        if d_params is not None:
            assert pj["kv_stats"]["pulled_tokens"] == d_params["remote_num_tokens"]
            assert pj["kv_stats"]["computed_tokens"] == len(prompt) - d_params["remote_num_tokens"]
        d_params = r.json()["kv_transfer_params"]
        assert d_params["remote_num_tokens"] == len(prompt) + 20 - 1
        prompt = prompt + want.token_ids + list(range(300 + t * 40, 340 + t * 40))
    # P's reads of turns 1 and 2 freed them on D
    deadline = time.monotonic() + 5
    while d.kv()["retained"]["released"]["read"] < reads_before + 2:
        assert time.monotonic() < deadline, d.kv()
        time.sleep(0.05)


@pytest.mark.parametrize("retained, pulled", [(63, False), (64, True)])
def test_threshold_edge(cluster, oracle, retained, pulled):
    """Default kv_recompute_threshold is 64: a gain of 63 tokens recomputes, 64 pulls."""
    _, p, d, _ = cluster
    out_tokens = 4
    prompt = list(range(1000, 1000 + retained + 1 - out_tokens))
    body = {"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
    _, _, d_params = turn(p, d, "/v1/completions", body, None)
    assert d_params["remote_num_tokens"] == retained
    nxt = prompt + oracle(prompt, out_tokens).token_ids + list(range(2000, 2010))
    before = d.kv()["retained"]["released"]
    body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text, p_stats, _ = turn(p, d, "/v1/completions", body2, d_params)
    assert text == oracle(nxt, 8).text
    if pulled:
        assert p_stats["pulled_tokens"] == 64 and p_stats["pull_outcome"] == "pulled"
    else:
        assert p_stats["pulled_tokens"] == 0 and p_stats["pull_outcome"] == "threshold"
        # notify-only: D freed the turn at once instead of holding it for the TTL
        deadline = time.monotonic() + 5
        while d.kv()["retained"]["released"]["notified"] <= before["notified"]:
            assert time.monotonic() < deadline, d.kv()
            time.sleep(0.05)


def _two_turns(p, d, oracle, first, second, max_tokens=16):
    """Turn 1 with `first`, then turn 2 with `second` replaying turn 1's D params."""
    _, _, d_params = turn(p, d, "/v1/chat/completions",
                          {"messages": first, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}, None)
    text, p_stats, _ = turn(p, d, "/v1/chat/completions",
                            {"messages": second, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True}, d_params)
    assert text == oracle(second, max_tokens).text
    return p_stats


CASES = {
    # the client edits an earlier message: reuse stops at the edit
    "edited_history": lambda a: [a[0], {"role": "user", "content": "EDITED " + a[1]["content"]}],
    # the assistant's text is rewritten (e.g. a stripped reasoning trace)
    "rewritten_answer": lambda a: [*a[:2], {"role": "assistant", "content": "(omitted)"}],
    # another conversation's history under the same conversation id
    "other_conversation": lambda a: [{"role": "system", "content": "Different system prompt."},
                                     {"role": "user", "content": "Something else entirely."}],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_history_falls_back_to_the_matching_prefix(cluster, oracle, case):
    _, p, d, _ = cluster
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "tool output: " + "fail; " * 30}]
    answer = oracle(first, 16).text
    second = CASES[case](first + [{"role": "assistant", "content": answer}])
    second = second + [{"role": "user", "content": "next step?"}]
    stats = _two_turns(p, d, oracle, first, second)
    if case == "rewritten_answer":  # the system + first user message still match
        assert stats["pulled_tokens"] > 0
    if case == "other_conversation":
        assert stats["pulled_tokens"] == 0 and stats["pull_outcome"] in ("mismatch", "threshold")
    p.assert_integrity()
    d.assert_integrity()


def test_retokenised_answer_reuses_only_what_matches(cluster, oracle):
    """The answer's text re-tokenises differently from the generated ids: only verified blocks
    are pulled, and the output is still the oracle's."""
    _, p, d, _ = cluster
    prompt = list(range(500, 600))
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, _, d_params = turn(p, d, "/v1/completions", body, None)
    gen = oracle(prompt, 24).token_ids
    drifted = prompt + gen[:5] + [7, 7, 7] + gen[8:] + list(range(700, 720))
    body2 = {"prompt": drifted, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text, stats, _ = turn(p, d, "/v1/completions", body2, d_params)
    assert text == oracle(drifted, 8).text
    assert stats["pulled_tokens"] == len(prompt) + 5  # up to the first differing token


def test_ttl_expiry_between_turns(cluster, tiny_model_dir, oracle):
    name, p, _, tmp = cluster
    d = start_worker(tiny_model_dir, tmp / "d_ttl.log", *ARGS,
                     kv=bidi(name, decoder_kv_blocks_ttl=1))
    try:
        prompt = list(range(100, 200))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        _, _, d_params = turn(p, d, "/v1/completions", body, None)
        time.sleep(1.5)
        assert d.kv()["retained"]["released"]["expired"] == 1
        nxt = prompt + oracle(prompt, 8).token_ids + [5] * 10
        body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        text, stats, _ = turn(p, d, "/v1/completions", body2, d_params)
        assert text == oracle(nxt, 8).text
        assert stats["pulled_tokens"] == 0 and stats["pull_outcome"] in ("expired", "unknown")
        d.assert_integrity()
    finally:
        d.stop()


def test_d_killed_or_restarted_between_turns(cluster, tiny_model_dir, oracle):
    name, p, _, tmp = cluster
    port = 47311 if name == "TcpConnector" else 47312
    kv = bidi(name, side_channel_port=port, read_timeout_s=3.0)
    d = start_worker(tiny_model_dir, tmp / "d_a.log", *ARGS, kv=kv)
    prompt = list(range(200, 300))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, _, d_params = turn(p, d, "/v1/completions", body, None)
    d.kill()
    nxt = prompt + oracle(prompt, 8).token_ids + [9] * 20
    body2 = {"prompt": nxt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # D is gone: P's verify fails and P recomputes; no request fails
    pj = prefill_leg(p, "/v1/completions", body2, to_p(d_params))
    assert pj["kv_stats"]["pull_outcome"] == "failed" and pj["kv_stats"]["pulled_tokens"] == 0
    # D restarted at the same address: other engine id, block ids hold other data -> refused
    d2 = start_worker(tiny_model_dir, tmp / "d_b.log", *ARGS, kv=kv)
    try:
        text, stats, _ = turn(p, d2, "/v1/completions", body2, d_params)
        assert text == oracle(nxt, 8).text
        assert stats["pulled_tokens"] == 0 and stats["pull_outcome"] == "failed"
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
                                       "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == oracle(big, 8).text
        kv = d.kv()
        assert kv["retained"]["released"]["pressure"] >= 1
        assert kv["retained"]["entries"] < 3
        d.assert_integrity()
        assert "duplexkv_kv_retained_released_total" in d.get("/metrics").text
    finally:
        d.stop()
