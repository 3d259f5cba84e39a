"""A conversation's D dies between turns: the next turn, through the router, starts recomputing
within the side channel's connect timeout and is decoded by the surviving D (it used to take 10 s,
and with two D's the client got a 503 although the other D was healthy)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_router import ARGS, OUT, SYSTEM, bidi, chat, conv, start_router, user
from workers import start_worker


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("failover")


def test_turn_after_its_d_died_recomputes_fast_on_the_other_d(tiny_model_dir, tmp, oracle):
    with ThreadPoolExecutor(3) as pool:
        p = pool.submit(start_worker, tiny_model_dir, tmp / "p.log", *ARGS,
                        "--no-enable-prefix-caching", kv=bidi())
        d1 = pool.submit(start_worker, tiny_model_dir, tmp / "d1.log", *ARGS, kv=bidi())
        d2 = pool.submit(start_worker, tiny_model_dir, tmp / "d2.log", *ARGS, kv=bidi())
        p, d1, d2 = p.result(), d1.result(), d2.result()
    # no periodic health checks: the failed calls themselves must steer the router
    r = start_router(tmp / "router.log", [p.url], [d1.url, d2.url], "--health-interval", "600")
    try:
        client, conv_id = r.client(), conv()
        messages = [{"role": "system", "content": SYSTEM}, user(3)]
        text, _ = chat(client, messages, conv_id, stream=False)
        holder = d1 if d1.kv()["retained"]["entries"] == 1 else d2
        other = d2 if holder is d1 else d1
        assert holder.kv()["retained"]["entries"] == 1
        holder.kill()
        messages += [{"role": "assistant", "content": text}, user(4)]
        t0 = time.monotonic()
        text, stats = chat(client, messages, conv_id, stream=True)
        took = time.monotonic() - t0
        assert text == oracle(messages, OUT).text
        assert stats["prefill"]["pull_outcome"] == "unreachable"
        assert stats["prefill"]["pulled_tokens"] == 0
        # P gave up on the dead D within its 1 s connect timeout (prefill_done_ms is when P's
        # answer reached the router, compute included)
        assert stats["prefill_done_ms"] < 1500 + 1000, stats
        assert took < 6, took
        assert other.kv()["retained"]["entries"] == 1  # the conversation now lives on `other`
        # and the next turn reuses it from there
        messages += [{"role": "assistant", "content": text}, user(5)]
        text, stats = chat(client, messages, conv_id, stream=False)
        assert text == oracle(messages, OUT).text and stats["prefill"]["pulled_tokens"] > 0
        other.assert_integrity()
        p.assert_integrity()
    finally:
        r.stop()
        for w in (p, d1, d2):
            w.stop()
