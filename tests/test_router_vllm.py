"""The router (a real subprocess) in front of vLLM-shaped workers: loopback HTTP servers replaying
answers in the shapes vLLM's source produces (tests/vllm_recorded.py says where each comes from).
What is checked is the router's side: what it counts, reports, stores and replays."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from test_router import start_router
from vllm_recorded import D_PARAMS, MODEL, P_PARAMS, VllmStub

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the answer?"}],
        "max_tokens": 6, "temperature": 0}


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


def wait_for(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_stream_outcome_is_ok_once_done_reached_the_client(tmp):
    """D keeps its body open after `[DONE]`; the client reads `[DONE]` and leaves at once. It got
    its whole answer: the request counts `ok`, not `aborted` (D's body ending is not what
    matters)."""
    p, d = VllmStub("prefill"), VllmStub("decode", hold_after_done_s=3.0)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600")
    try:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json={**BODY, "stream": True},
                          timeout=30) as resp:
            assert resp.status_code == 200
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                if line == "data: [DONE]":
                    break
        assert "data: [DONE]" in lines

        def counted() -> float:
            return (r.metric("duplexkv_router_requests_total", endpoint="chat_completions", outcome="ok")
                    + r.metric("duplexkv_router_requests_total", endpoint="chat_completions",
                               outcome="aborted"))
        assert wait_for(lambda: counted() == 1)
        assert r.metric("duplexkv_router_requests_total", endpoint="chat_completions", outcome="ok") == 1
        assert r.metric("duplexkv_router_requests_total", endpoint="chat_completions",
                        outcome="aborted") == 0
    finally:
        r.stop()
        p.close()
        d.close()


def turn(r, conv_id: str, stream: bool) -> tuple[dict, list[dict]]:
    """One chat turn through the router -> (kv_stats the client got last, the JSON events)."""
    headers = {"x-conversation-id": conv_id}
    if not stream:
        resp = httpx.post(r.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=30)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert "kv_transfer_params" not in body
        return body["kv_stats"], [body]
    events = []
    with httpx.stream("POST", r.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={**BODY, "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert all("kv_transfer_params" not in e for e in events)
    with_stats = [e for e in events if "kv_stats" in e]
    assert with_stats and "usage" in events[-1] and "kv_stats" in events[-1]
    return with_stats[-1]["kv_stats"], events


@pytest.mark.parametrize("stream", [False, True])
def test_one_way_vllm_d_kv_stats_from_usage_and_not_retained(tmp, stream):
    """A vLLM D without bidirectional transfer returns `kv_transfer_params: null`: kv_stats
    still tell the token counts (from usage, source marked), the next turn says
    `not_retained` rather than a bare miss, counted, and the router logs why once per D."""
    p, d = VllmStub("prefill", cached=16), VllmStub("decode", bidirectional=False, cached=24)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600")
    try:
        conv_id = uuid.uuid4().hex
        states = []
        for _ in range(3):
            stats, _events = turn(r, conv_id, stream)
            states.append(stats["conversation"])
            assert stats["source"] == {"prefill": "usage", "decode": "usage"}
            assert stats["prefill"] == {"prompt_tokens": 40, "completion_tokens": 1,
                                        "cached_tokens": 16}
            assert stats["decode"] == {"prompt_tokens": 40, "completion_tokens": 6,
                                       "cached_tokens": 24}
            assert stats["retained"] is False
            assert stats["prefill_done_ms"] > 0
        assert states == ["miss", "not_retained", "not_retained"]
        assert all(s["kv_transfer_params"]["remote_engine_id"] is None for s in p.seen)
        assert r.metric("duplexkv_router_conversations_total", event="not_retained") == 3
        assert r.metric("duplexkv_router_conversations_total", event="stored") == 0
        assert r.log.read_text().count("returned no kv_transfer_params") == 1
    finally:
        r.stop()
        p.close()
        d.close()


def replayed(p: VllmStub) -> list[dict]:
    return [s["kv_transfer_params"] for s in p.seen]


@pytest.mark.parametrize("placement", ["prefill", None], ids=["prefill", "default"])
def test_bidirectional_vllm_params_are_stored_and_replayed_opaquely(tmp, placement):
    """A bidirectional vLLM D's params (non-stream answer, then a stream's finish chunk) reach
    the next turn's P leg as they were, every key kept (block ids per KV-cache group, D's
    expiry, tp_size, ...), only the two booleans set for a P request; P's params reach D as
    they were; clients never see either. Under the default placement (auto) too: a vLLM D
    cannot verify its own blocks for a decode_local turn, so every turn takes the P leg."""
    p, d = VllmStub("prefill"), VllmStub("decode", d_ttl_s=300.0)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600",
                     placement=placement)
    try:
        conv_id = uuid.uuid4().hex
        states = []
        for stream in (False, True, False):
            stats, _ = turn(r, conv_id, stream)
            states.append(stats["conversation"])
            assert stats["retained"] is True
            if states[-1] == "hit":
                assert stats["placement"] != "decode_local", stats
                assert stats["placement_reason"] == ("placement_prefill" if placement
                                                     else "decode_not_duplexkv"), stats
        assert states == ["miss", "hit", "hit"]
        sent = replayed(p)
        assert sent[0]["remote_engine_id"] is None  # the first turn is a miss
        for i, got in enumerate(sent[1:]):
            want = {**D_PARAMS, "do_remote_decode": True, "do_remote_prefill": False,
                    "remote_request_id": f"chatcmpl-d-{i + 1}"}
            want["remote_blocks_expiry_time"] = got["remote_blocks_expiry_time"]
            # this stub returns no token ids, so the router cannot verify D's sequence against
            # the next prompt (router/verify.py): P is told to read nothing (remote_num_tokens
            # 0), which still frees D's blocks at once
            want["remote_num_tokens"] = 0
            assert got == want
            assert isinstance(got["remote_blocks_expiry_time"], float)
        assert all(s["kv_transfer_params"] == P_PARAMS for s in d.seen)
        assert r.metric("duplexkv_router_conversations_total", event="stored") == 3
        assert r.metric("duplexkv_router_conversations_total", event="not_retained") == 0
    finally:
        r.stop()
        p.close()
        d.close()


def test_d_expiry_on_this_host_is_honoured(tmp):
    """D on this host says its blocks expire within the margin: the next turn does not replay
    them (`expired`, a plain miss on the P leg), although the router's own TTL has not run."""
    p, d = VllmStub("prefill"), VllmStub("decode", d_ttl_s=0.5)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600")
    try:
        conv_id = uuid.uuid4().hex
        states = [turn(r, conv_id, stream)[0]["conversation"] for stream in (False, True)]
        assert states == ["miss", "expired"]
        assert [s["remote_engine_id"] for s in replayed(p)] == [None, None]
        assert r.metric("duplexkv_router_conversations_total", event="expired") == 1
    finally:
        r.stop()
        p.close()
        d.close()


def test_mixed_p_and_d_servers_run_as_plain_pd_and_say_so(tmp):
    """A P that is not the same kind of server as the D holding the conversation (by
    /v1/models `owned_by`: one of ours beside a vLLM) cannot read that D's blocks: the turn
    runs as a miss (`mixed`), counted, and the router logs the pair once."""
    p, d = VllmStub("prefill", owned_by="duplexkv"), VllmStub("decode", d_ttl_s=300.0)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600")
    try:
        assert wait_for(lambda: r.get("/v1/models").status_code == 200)
        conv_id = uuid.uuid4().hex
        states = [turn(r, conv_id, stream)[0]["conversation"] for stream in (False, True, False)]
        assert states == ["miss", "mixed", "mixed"]
        assert [s["remote_engine_id"] for s in replayed(p)] == [None, None, None]
        assert r.metric("duplexkv_router_reuse_total", outcome="mixed") == 2
        assert r.log.read_text().count("cannot exchange KV") == 1
    finally:
        r.stop()
        p.close()
        d.close()
