"""`n > 1` through the router in front of real P and D workers (TCP, bidirectional, float32): the
P leg stays n=1 (P computes the prompt once), D pulls P's KV once and all its choices use it,
the answer (JSON or stream) equals one worker's n choices; D retains choice 0, and a client that
continues with another choice gets exactly the matching prefix pulled; `--placement auto` runs
n choices on the D that holds the history."""

from __future__ import annotations

import httpx
import pytest
from test_n_choices import HOT, stream_until_every_choice_started
from test_router import ARGS, bidi, start_router
from workers import sse_events, start_p_and_d, stopping, wait_for

SHARED = 80  # full blocks of a 90-token prompt before its last token


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("n_pd")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())) as workers:
        yield workers


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url])) as r:
        yield r


def prompt(first: int) -> list[int]:
    return [first, *range(200, 289)]  # 90 tokens, each test its own


def body(ids: list[int], **kw) -> dict:
    return {"prompt": ids, "max_tokens": 10, "ignore_eos": True, "return_token_ids": True, **kw}


def answer(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(resp: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(resp["choices"], key=lambda c: c["index"])]


def assembled(r: httpx.Response) -> tuple[list[list[int]], list[dict]]:
    """A stream's token ids per choice, and its events."""
    assert r.status_code == 200 and r.text.count("data: [DONE]") == 1, r.text[-300:]
    events = sse_events(r)
    ids: dict[int, list[int]] = {}
    for e in events:
        for c in e["choices"]:
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return [ids[i] for i in sorted(ids)], events


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_pd_n2_equals_one_worker(router, workers, stream):
    p, d = workers
    ids = prompt(1 + stream)
    b = body(ids, n=2, temperature=HOT, seed=21)
    # the reference: P alone as a plain worker (no KV params, no prefix cache)
    want = token_ids(answer(p.post("/v1/completions", b)))
    assert want[0] != want[1]
    r = router.post("/v1/completions", {**b, "stream": stream})
    if stream:
        got, events = assembled(r)
        stats = [e for e in events if e.get("kv_stats")][-1]["kv_stats"]
        finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1]  # every choice relayed with its own finish
    else:
        resp = answer(r)
        got, stats = token_ids(resp), resp["kv_stats"]
        assert resp["usage"]["prompt_tokens"] == len(ids)
        assert resp["usage"]["completion_tokens"] == 20
    assert got == want
    # P computed the prompt once, as one choice; D pulled it once and every choice used it
    assert stats["prefill"]["computed_tokens"] == len(ids) and "choices" not in stats["prefill"]
    dec = stats["decode"]
    assert dec["pull_outcome"] == "pulled" and dec["pulled_tokens"] >= SHARED, dec
    child = dec["choices"][1]
    assert child["pulled_tokens"] == 0 and child["shared_tokens"] == SHARED, dec
    assert child["computed_tokens"] == len(ids) - SHARED
    assert stats["retained"] is True
    for w in (p, d):
        w.assert_integrity()


def test_pd_greedy_n2_gives_two_choices_equal_to_the_oracle(router, workers, oracle):
    """Greedy: D's choice 0 emits P's first token (it READs every prompt token); choice 1
    computes its last block itself; both are the oracle's answer."""
    ids = prompt(6)
    resp = answer(router.post("/v1/completions", body(ids, n=2, temperature=0)))
    want = oracle(ids, 10).token_ids
    assert token_ids(resp) == [want, want]
    dec = resp["kv_stats"]["decode"]
    assert dec["computed_tokens"] == 0 and dec["pulled_tokens"] == len(ids), dec
    assert dec["choices"][1]["computed_tokens"] == len(ids) - SHARED, dec


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_continuing_with_another_choice_pulls_only_the_matching_prefix(router, workers,
                                                                       oracle):
    """D retains choice 0's sequence; a client that continues with choice 1 sends a prompt that
    matches it only up to where the two choices part: P's verify finds exactly that prefix."""
    p, d = workers
    conv = {"conversation_id": "n-other-choice"}
    ids = prompt(3)
    first = answer(router.post("/v1/completions",
                               body(ids, n=2, temperature=HOT, seed=8, **conv)))
    a, b = token_ids(first)
    assert first["kv_stats"]["retained"] is True
    retained = ids + a[:-1]  # the last sampled token has no KV
    matching = common(retained, ids + b)
    assert matching < len(retained)  # the choices differ, so not all of choice 0 matches
    nxt = ids + b + list(range(300, 310))
    second = answer(router.post("/v1/completions", body(nxt, temperature=0, **conv)))
    assert token_ids(second) == [oracle(nxt, 10).token_ids]
    stats = second["kv_stats"]
    assert stats["conversation"] == "hit", stats
    pre = stats["prefill"]
    assert pre["pull_outcome"] == "pulled", pre
    assert matching // 16 * 16 <= pre["pulled_tokens"] <= matching, (pre, matching)
    assert pre["pulled_tokens"] + pre["computed_tokens"] == len(nxt)
    for w in (p, d):
        w.assert_integrity()


def test_placement_auto_runs_n_choices_on_the_decode_worker(workers, tmp, oracle):
    p, d = workers
    with stopping(start_router(tmp / "auto.log", [p.url], [d.url], "--placement", "auto")) as r:
        conv = {"conversation_id": "n-auto"}
        ids = prompt(4)
        first = answer(r.post("/v1/completions", body(ids, temperature=0, **conv)))
        nxt = ids + token_ids(first)[0] + list(range(300, 320))
        second = answer(r.post("/v1/completions", body(nxt, n=2, temperature=0, **conv)))
    stats = second["kv_stats"]
    assert stats["placement"] == "decode_local", stats
    want = oracle(nxt, 10).token_ids
    assert token_ids(second) == [want, want]
    dec = stats["decode"]
    assert dec["decode_local"]["outcome"] == "reused" and dec["local_hit_tokens"] > 0, dec
    shared = (len(nxt) - 1) // 16 * 16
    assert dec["choices"][1]["shared_tokens"] == shared, dec
    d.assert_integrity()


def test_router_disconnect_aborts_every_choice_on_decode(router, workers):
    p, d = workers
    b = body(prompt(5), n=3, max_tokens=400, temperature=HOT, seed=3, stream=True)
    stream_until_every_choice_started(  # all in flight on D
        router.url, b, lambda: d.health()["running"] == 3 or pytest.fail(str(d.health())))
    # nothing left running, and every block reference is a retained turn's (integrity)
    wait_for(lambda: (h := d.get("/debug/engine").json())["running"] == 0
             and h["waiting"] == 0 and h["integrity"] == "ok",
             what="D to abort every choice and free its blocks")


@pytest.mark.parametrize("n", [0, -1, 1e9, "2", True])
def test_router_refuses_a_bad_n_naming_it(router, n):
    r = router.post("/v1/completions", {"prompt": "x", "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
