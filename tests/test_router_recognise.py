"""Reuse for a client that sends no conversation id (router/conversation/recognise.py): a real
router (default settings, two client keys) in front of real P and D workers (TCP,
bidirectional, float32, greedy), driven by the `openai` client as it comes. Every answer equals
one engine computing the conversation from scratch (the oracle = reuse off), whether the content
matched a stored turn, matched one whose KV differs, or matched nothing."""

from __future__ import annotations

import pytest
from test_router import OUT, SYSTEM, chat, conv, start_router, user
from test_router import oracle, redis_url, tmp, workers  # noqa: F401 - the same fixtures
from workers import stopping

from duplexkv.model.tokenizer import Tokenizer

KA, KB = "recognise-key-a", "recognise-key-b"


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url], "--api-key", KA,
                               "--api-key", KB, placement=None)) as r:
        yield r


def opening(tag: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tag + " " +
                                                    "ls -la; " * 12}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_without_an_id_reuses_from_turn_2(router, workers, oracle, stream):
    """Turn 1 matches nothing; from turn 2 the router recognises the conversation and the
    conversation's D prefills only the new suffix over the history it kept."""
    p, d = workers
    client = router.client(KA)
    matched = router.metric("duplexkv_router_recognised_total", result="matched")
    reused = d.kv()["decode_local"]["reused"]
    messages = opening(f"{stream}-{conv()}")
    for t in range(3):
        text, stats = chat(client, messages, None, stream)
        assert text == oracle(messages), f"turn {t + 1} differs from reuse off"
        if t == 0:
            assert stats["recognised"] is False and stats["conversation"] == "miss", stats
        else:
            assert stats["recognised"] is True and stats["conversation"] == "hit", stats
            assert stats["placement"] == "decode_local", stats
            assert stats["decode"]["decode_local"]["outcome"] == "reused", stats
            assert stats["decode"]["decode_local"]["reused_tokens"] > 0
        messages += [{"role": "assistant", "content": text}, user(t)]
    assert router.metric("duplexkv_router_recognised_total", result="matched") == matched + 2
    assert d.kv()["decode_local"]["reused"] >= reused + 2
    d.assert_integrity()


def test_through_p_the_recognised_history_is_pulled_from_d(workers, tmp, oracle):
    """--placement prefill: P reads the recognised conversation's history from D (verified)."""
    p, d = workers
    with stopping(start_router(tmp / "router-prefill.log", [p.url], [d.url])) as r:
        messages = opening(conv())
        for t in range(3):
            text, stats = chat(r.client(), messages, None, stream=t == 1)
            assert text == oracle(messages)
            if t:
                assert stats["recognised"] is True, stats
                assert stats["prefill"]["pull_outcome"] == "pulled", stats
                assert stats["prefill"]["pulled_tokens"] > 0
            messages += [{"role": "assistant", "content": text}, user(t)]


def test_every_router_on_one_redis_recognises_the_conversation(workers, redis_url, tmp, oracle):
    p, d = workers
    ra = start_router(tmp / "router-redis-a.log", [p.url], [d.url], "--store", redis_url)
    rb = start_router(tmp / "router-redis-b.log", [p.url], [d.url], "--store", redis_url)
    with stopping(ra, rb):
        messages = opening(conv())
        for t, r in enumerate((ra, rb, ra)):  # turn 1 on A, turn 2 on B, turn 3 on A
            text, stats = chat(r.client(), messages, None, stream=t == 1)
            assert text == oracle(messages)
            assert stats["recognised"] is (t > 0), stats
            if t:
                assert stats["conversation"] == "hit" and stats["prefill"]["pulled_tokens"] > 0
            messages += [{"role": "assistant", "content": text}, user(t)]


def test_another_key_never_gets_the_conversation(router, oracle):
    a, b = router.client(KA), router.client(KB)
    messages = opening(conv())
    text, _ = chat(a, messages, None, stream=False)
    messages += [{"role": "assistant", "content": text}, user(0)]
    text_b, stats_b = chat(b, messages, None, stream=False)  # B sends A's exact history
    assert stats_b["recognised"] is False and stats_b["conversation"] == "miss", stats_b
    assert stats_b["placement"] == "prefill_recompute" and stats_b["prefill"]["pulled_tokens"] == 0
    text_a, stats_a = chat(a, messages, None, stream=False)  # still there for A
    assert stats_a["recognised"] is True and stats_a["conversation"] == "hit", stats_a
    assert text_a == text_b == oracle(messages)


def test_an_explicit_id_wins(router, oracle):
    client = router.client(KA)
    messages = opening(conv())
    text, _ = chat(client, messages, None, stream=False)  # stored under its content
    messages += [{"role": "assistant", "content": text}, user(0)]
    conv_id = conv()
    text_id, stats = chat(client, messages, conv_id, stream=False)  # a new id: its own miss
    assert stats["conversation"] == "miss" and "recognised" not in stats, stats
    assert text_id == oracle(messages)
    text2, stats = chat(client, messages, None, stream=True)  # the content's entry is intact
    assert stats["recognised"] is True and stats["conversation"] == "hit", stats
    assert text2 == text_id
    # the explicit conversation goes on under its id only
    messages += [{"role": "assistant", "content": text_id}, user(1)]
    text3, stats = chat(client, messages, conv_id, stream=False, via_header=True)
    assert stats["conversation"] == "hit" and "recognised" not in stats, stats
    assert text3 == oracle(messages)


def stop_across_two_tokens(tok: Tokenizer, full: str, ids: list[int]) -> tuple[str, str]:
    """A stop string made of the text of two whole answer tokens k and k + 1 (nearest the middle),
    first found where token k starts -> (stop, the answer before it). Only token k + 1 completes
    it, so D holds token k's KV while the cut answer lacks its text. (A stop string taken from the
    characters alone may lie inside the one token that completes it: then the answer covers all
    that D kept, which passed the assertion below only by chance.)"""
    texts = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    for k in sorted(range(1, len(ids) - 1), key=lambda k: abs(k - len(ids) // 2)):
        a, b, c = texts[k], texts[k + 1], texts[k + 2]
        if len(a) < len(b) < len(c) and full.startswith(c) and c.startswith(b) \
                and b.startswith(a) and full.find(c[len(a):]) == len(a):
            return c[len(a):], a
    raise AssertionError(f"no two answer tokens to cut at in {full!r}")


def test_shared_prefixes_and_edited_histories_answer_as_reuse_off(router, oracle,
                                                                  tiny_model_dir):
    """Two conversations with one opening, a client that edits an earlier message, and one whose
    answer was cut by a stop string (D kept the stop string's tokens, the client resends the
    text without them: a match whose KV differs, so the pull keeps only the verified prefix)."""
    client = router.client(KA)
    shared = opening(conv())
    text, _ = chat(client, shared, None, stream=False)
    x = shared + [{"role": "assistant", "content": text}, user(1)]
    y = shared + [{"role": "assistant", "content": text}, user(2)]
    for messages, found in ((x, True), (y, False)):  # y finds the shared turn taken: a miss
        got, stats = chat(client, messages, None, stream=False)
        assert stats["recognised"] is found and got == oracle(messages), stats
    edited = [*x[:1], {"role": "user", "content": x[1]["content"] + " (edited)"}, *x[2:]]
    got, stats = chat(client, edited, None, stream=False)
    assert stats["recognised"] is False and got == oracle(edited)
    # a stop string cuts the answer
    msgs = opening(conv())
    full, _ = chat(client, msgs, None, stream=False)
    stop, before = stop_across_two_tokens(Tokenizer.from_dir(tiny_model_dir), full,
                                          oracle(msgs, ids=True))
    cut = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=OUT,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    answer = cut.choices[0].message.content
    assert answer == before and len(answer) < len(full)
    msgs += [{"role": "assistant", "content": answer}, user(3)]
    got, stats = chat(client, msgs, None, stream=True)
    assert stats["recognised"] is True and got == oracle(msgs), stats
    held = cut.usage.prompt_tokens + cut.usage.completion_tokens - 1  # what D kept
    local = stats["decode"]["decode_local"]
    assert 0 < local["verified_tokens"] < held, (held, stats)  # D kept tokens the text lacks
