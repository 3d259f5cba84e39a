"""Cold start (router/warmup.py): the router opens each vLLM P<->D pair's NIXL channel with one
tiny exchange before the pair takes turns, so no first turn's D reads P's blocks after P's
lease. The router is a real subprocess with its default health checks; the workers are the
vLLM-shaped stubs of vllm_recorded.py (the real-vLLM run: test_vllm_interop.py, whose expired
counters stay 0)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from test_router import start_router
from test_router_vllm import BODY, wait_for
from vllm_recorded import D_PARAMS, P_PARAMS, VllmStub

DEFAULT_CHECKS = ("--health-interval", "2")  # what a user gets (start_router's tests use 0.5)


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


def chat(r, conv_id: str | None = None) -> dict:
    headers = {"x-conversation-id": conv_id} if conv_id else {}
    resp = httpx.post(r.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=90)
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_stats"]


def assert_exchange(p: VllmStub, d: VllmStub, p_calls: list[dict]) -> None:
    """P: a miss, then D's params reading nothing (streamed, closed early); D: P's params."""
    assert d.warmups and d.warmups[0]["kv_transfer_params"] == P_PARAMS
    first, release = p_calls
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["kv_transfer_params"]["remote_engine_id"] is None
    params = release["kv_transfer_params"]
    assert params["remote_engine_id"] == D_PARAMS["remote_engine_id"]
    assert params["remote_num_tokens"] == 0 and params["do_remote_decode"] is True
    assert release["stream"] is True and release["ignore_eos"] is True


def test_first_turn_after_start_waits_for_the_pair_warm_up(tmp):
    """The only pair's warm-up is slow (D takes 3 s to read P's block, as a slow first NIXL
    handshake): a turn sent the moment the router listens waits for it, says so in kv_stats,
    and reaches P and D only after their warm-up calls."""
    p, d = VllmStub("prefill"), VllmStub("decode", warmup_delay_s=3.0)
    r = start_router(tmp / "router.log", [p.url], [d.url], *DEFAULT_CHECKS)
    try:
        stats = chat(r, uuid.uuid4().hex)
        assert stats["warmup_wait_ms"] >= 1000, stats
        assert p.order[:2] == ["warmup", "warmup"] and "turn" in p.order[2:], p.order
        assert d.order == ["warmup", "turn"], d.order
        assert_exchange(p, d, p.warmups)
        assert r.metric("duplexkv_router_warmups_total", outcome="ok") == 1
        assert "warmup_wait_ms" not in chat(r, uuid.uuid4().hex)  # warm: no wait
        health = r.get("/health").json()
        assert health["prefill"][0]["warm"] and health["decode"][0]["warm"]
    finally:
        r.stop()
        p.close()
        d.close()


def test_a_warm_decode_worker_is_picked_while_another_still_warms(tmp):
    """Two D's, one slow to warm: turns go to the warm one at once instead of waiting; the slow
    one is warmed too, and each pair was warmed once."""
    p = VllmStub("prefill")
    fast, slow = VllmStub("decode"), VllmStub("decode", warmup_delay_s=4.0)
    r = start_router(tmp / "router.log", [p.url], [fast.url, slow.url], *DEFAULT_CHECKS)
    try:
        for _ in range(3):
            stats = chat(r)
            assert stats.get("warmup_wait_ms", 0) < 3000, stats
        assert fast.order[0] == "warmup" and fast.order.count("turn") == 3, fast.order
        assert slow.seen == [], "a cold D took a turn while a warm one was free"
        assert wait_for(lambda: r.metric("duplexkv_router_warmups_total", outcome="ok") == 2)
        assert len(fast.warmups) == len(slow.warmups) == 1
        assert len(p.warmups) == 4
    finally:
        r.stop()
        for s in (p, fast, slow):
            s.close()


def test_a_failed_warm_up_is_counted_and_the_pair_still_serves(tmp):
    p, d = VllmStub("prefill"), VllmStub("decode", warmup_status=500)
    r = start_router(tmp / "router.log", [p.url], [d.url], *DEFAULT_CHECKS)
    try:
        chat(r, uuid.uuid4().hex)
        assert r.metric("duplexkv_router_warmups_total", outcome="failed") == 1
        assert "warm-up of prefill[0] -> decode[0] failed" in r.log.read_text()
    finally:
        r.stop()
        p.close()
        d.close()


def test_our_own_workers_and_a_disabled_warm_up_get_no_warm_up_calls(tmp):
    """duplexkv workers open their KV plane per read (nothing to warm); --warmup-timeout 0
    turns the warm-up off for vLLM workers."""
    for kind, args in (("duplexkv", ()), ("vllm", ("--warmup-timeout", "0"))):
        p, d = VllmStub("prefill", owned_by=kind), VllmStub("decode", owned_by=kind)
        r = start_router(tmp / f"router-{kind}.log", [p.url], [d.url], *DEFAULT_CHECKS, *args)
        try:
            stats = chat(r, uuid.uuid4().hex)
            assert "warmup_wait_ms" not in stats
            assert p.warmups == d.warmups == []
        finally:
            r.stop()
            p.close()
            d.close()
