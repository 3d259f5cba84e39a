"""D-local suffix prefill (router/placement.py, kv/local_reuse.py) through a real router in front
of real P and D workers (TCP, bidirectional, float32, greedy). A turn placed on its conversation's
D must give exactly the tokens of reuse off (the oracle: one engine, no cache)."""

from __future__ import annotations

import json
import uuid

import pytest
from test_router import ARGS, OUT, SYSTEM, bidi, chat, start_router, user
from workers import start_p_and_d, stopping


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("placement")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())) as workers:
        yield workers


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    # no --placement: the router's default is to choose per turn (auto)
    with stopping(start_router(tmp / "router.log", [p.url], [d.url], placement=None)) as r:
        yield r


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    from duplexkv import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256,
              enable_prefix_caching=False)

    def run(messages):
        return llm.generate([messages], SamplingParams(max_tokens=OUT, temperature=0,
                                                       ignore_eos=True))[0].text
    return run


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_decode_local_turns_match_reuse_off(router, workers, oracle, stream):
    """Turn 1 runs through P; from turn 2 the conversation's D prefills only the new suffix over
    its own retained turn, verified token by token, and P is not involved at all."""
    p, d = workers
    client = router.client()
    conv_id = f"conv-{uuid.uuid4().hex[:8]}"
    before = router.metric("duplexkv_router_placement_total", kind="decode_local",
                           reason="history_on_decode")
    pulls_before = p.kv()["counters"]["pulls"]
    messages = [{"role": "system", "content": SYSTEM}]
    prev_tokens = 0  # the tokens of the previous turn's prompt and answer, in whole blocks
    for t in range(4):
        messages.append(user(t))
        text, stats = chat(client, messages, conv_id, stream)
        assert text == oracle(messages), f"turn {t + 1} differs from reuse off"
        if t == 0:
            assert stats["placement"] == "prefill_recompute", stats
            assert stats["placement_reason"] == "no_history"
        else:
            assert stats["placement"] == "decode_local", stats
            assert stats["placement_reason"] == "history_on_decode"
            assert stats["prefill"] is None  # no P leg
            local = stats["decode"]["decode_local"]
            assert local["outcome"] == "reused", stats
            # D verified the whole retained turn and started from it: only the suffix computed
            assert local["reused_tokens"] > 0
            assert stats["decode"]["local_hit_tokens"] == local["reused_tokens"]
            # everything up to the previous answer came from D's own retained turn
            assert local["reused_tokens"] >= prev_tokens, (local, prev_tokens)
            assert stats["suffix_estimate"] >= stats["decode"]["computed_tokens"] // 2
        messages.append({"role": "assistant", "content": text})
        prev_tokens = (stats["decode"]["local_hit_tokens"] + stats["decode"]["computed_tokens"]
                       + stats["decode"]["pulled_tokens"] + OUT - 1) // 16 * 16
    assert router.metric("duplexkv_router_placement_total", kind="decode_local",
                         reason="history_on_decode") == before + 3
    assert p.kv()["counters"]["pulls"] == pulls_before  # P never pulled for this conversation
    kv = d.kv()
    assert kv["decode_local"]["reused"] >= 3
    assert kv["retained"]["released"]["local"] >= 3  # each old turn freed once replaced
    d.assert_integrity()


def test_suffix_over_the_bound_takes_the_p_leg(workers, tmp, oracle):
    """A suffix estimated above --decode-local-max-tokens goes through P (which pulls)."""
    p, d = workers
    r = start_router(tmp / "router-bound.log", [p.url], [d.url], "--decode-local-max-tokens", "4",
                     placement="auto")
    try:
        client = r.client()
        conv_id = f"conv-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(2):
            messages.append(user(t))
            text, stats = chat(client, messages, conv_id, False)
            assert text == oracle(messages)
            messages.append({"role": "assistant", "content": text})
        assert stats["placement"] == "prefill_pull", json.dumps(stats["prefill"])
        assert stats["placement_reason"] == "suffix_over_bound"
        assert stats["suffix_estimate"] > 4
        assert r.metric("duplexkv_router_placement_total", kind="prefill_pull",
                        reason="suffix_over_bound") == 1
    finally:
        r.stop()


def test_decode_local_falls_back_to_p_when_its_decode_worker_is_gone(workers, tmp, oracle,
                                                                    tiny_model_dir):
    """The conversation's D died after turn 1: turn 2 runs through P (as a miss) on the other D,
    and its answer is still reuse off's."""
    from workers import start_worker

    p, d = workers
    d1 = start_worker(tiny_model_dir, tmp / "d1.log", *ARGS, kv=bidi())
    r = start_router(tmp / "router-gone.log", [p.url], [d1.url, d.url], "--health-interval", "30",
                     placement="auto")
    try:
        client = r.client()
        conv_id = f"conv-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": SYSTEM}, user(0)]
        text, stats = chat(client, messages, conv_id, False)
        d1.stop()
        messages += [{"role": "assistant", "content": text}, user(1)]
        text, stats = chat(client, messages, conv_id, False)
        assert text == oracle(messages)
        if stats["placement_reason"] == "decode_local_failed":  # D still looked healthy
            assert stats["conversation"] == "retried"
        else:  # the router already knew: no decode_local attempt
            assert stats["placement_reason"] == "decode_down"
        assert stats["placement"] == "prefill_recompute", stats
    finally:
        r.stop()
        d1.stop()


def test_decode_local_with_a_rewritten_answer_never_writes_into_a_cached_block(router, workers,
                                                                              oracle):
    """The client rewrites the previous answer: D's match stops inside a full block of its
    retained turn, a block in its prefix cache. D may start only from the full blocks before it
    (writing the new tokens into that block corrupted the cache and killed the engine: "block
    holds other tokens"); the answer is reuse off's and D stays up."""
    p, d = workers
    client = router.client()
    for k in range(3):  # the match stops at another offset each time
        conv_id = f"conv-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": SYSTEM}, user(k)]
        text, one = chat(client, messages, conv_id, False)
        d1 = one["decode"]
        kept = d1["local_hit_tokens"] + d1["pulled_tokens"] + d1["computed_tokens"] + OUT - 1
        messages += [{"role": "assistant", "content": text[: 4 * k] + " (edited)"},
                     user(k + 1)]
        text, stats = chat(client, messages, conv_id, False)
        assert text == oracle(messages)
        assert stats["placement"] == "decode_local", stats
        local = stats["decode"]["decode_local"]
        assert local["outcome"] == "reused"
        assert local["reused_tokens"] <= local["verified_tokens"]
        reused = local["reused_tokens"]
        # whole blocks, or up to the match inside the retained turn's own unfinished last block
        assert reused % 16 == 0 or reused // 16 == kept // 16, (reused, kept)
        assert reused >= local["verified_tokens"] // 16 * 16
    d.assert_integrity()
