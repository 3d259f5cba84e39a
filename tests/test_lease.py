"""D's renewable lease on a retained turn and the conversation lifecycle, on real processes: P, D
(TCP, bidirectional, float32, greedy) and a router with two client API keys in front of them.

D holds a finished turn for `decoder_kv_lease_duration` (3 s here) unless the router renews it
(every 0.3 s while the conversation is active), never past `decoder_kv_blocks_ttl` (the cap).
Every reused turn is compared with the oracle (the same engine, no cache)."""

from __future__ import annotations

import time

import httpx
import pytest
from test_router import SYSTEM, bidi, chat, conv, metric, start_router, user
from test_router import oracle  # noqa: F401,F811 - the fixture
from workers import start_p_and_d, start_worker, stopping, wait_for

from duplexkv.kv.config import KVTransferConfig

ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024")
LEASE, TTL = 3.0, 30.0
R1, R2 = "sk-lease-one-1c9e", "sk-lease-two-77b0"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("lease")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS,
                         kv=bidi(decoder_kv_lease_duration=LEASE, decoder_kv_blocks_ttl=TTL))) as workers:
        yield workers


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url], "--api-key", R1, "--api-key", R2,
                     "--lease-renew-period", "0.3", "--keepalive-seconds", "5")) as r:
        yield r


def lifecycle(router, method: str, conv_id: str, key: str | None, body: dict | None = None,
              what: str = "") -> httpx.Response:
    path = f"/v1/conversations/{conv_id}" + what
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, router.url + path, json=body, headers=headers, timeout=30)


def first_turn(router, key: str = R1) -> tuple[str, list[dict]]:
    conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}, user(0)]
    text, stats = chat(router.client(key), messages, conv_id, stream=False)
    assert stats["conversation"] == "miss"
    return conv_id, messages + [{"role": "assistant", "content": text}, user(1)]


def retained(d) -> dict:
    return d.kv()["retained"]


def test_lease_key_is_parsed_and_checked():
    cfg = KVTransferConfig.parse({"kv_connector_extra_config": {"decoder_kv_lease_duration": 5}})
    assert cfg.decoder_kv_lease_duration == 5.0 and cfg.decoder_kv_blocks_ttl == 480.0
    assert KVTransferConfig.parse({}).decoder_kv_lease_duration == 60.0
    with pytest.raises(ValueError):
        KVTransferConfig.parse({"kv_connector_extra_config": {"decoder_kv_lease_duration": 0}})


def test_kept_alive_conversation_pulls_after_the_base_lease(router, workers, oracle):
    """The client keeps the conversation alive for 7 s (an agent's long tool call): the router
    renews D's lease, so the next turn, 5 s later (past the 3 s lease), still pulls D's turn."""
    _, d = workers
    conv_id, messages = first_turn(router)
    r = lifecycle(router, "POST", conv_id, R1, {"seconds": 7}, "/keepalive")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["held"] is True and 0 < body["expires_in_s"] <= LEASE + 0.5, body
    renewals = retained(d)["renewals"]
    time.sleep(LEASE + 2)
    assert retained(d)["renewals"] > renewals + 3  # the router kept renewing
    text, stats = chat(router.client(R1), messages, conv_id, stream=True)
    assert stats["conversation"] == "hit", stats
    assert stats["prefill"]["pull_outcome"] == "pulled" and stats["prefill"]["pulled_tokens"] > 0
    assert text == oracle(messages)
    assert metric(d.get("/metrics").text, "duplexkv_kv_retained_renewals_total") > 0
    assert router.metric("duplexkv_router_lease_renewals_total", result="held") > 0
    d.assert_integrity()


def test_turn_not_kept_alive_expires_at_the_lease_and_the_router_stops_handing_it_out(
        router, workers, oracle):
    """Without keepalive D releases the turn at its lease (3 s), not its TTL (30 s); the router
    learns it from D's release notices and runs the next turn as a miss without P asking D
    (no verify round trip: P's "unknown" declines do not move)."""
    p, d = workers
    expired = retained(d)["released"]["expired"]
    conv_id, messages = first_turn(router)
    t0 = time.monotonic()
    wait_for(lambda: retained(d)["released"]["expired"] > expired, timeout_s=TTL,
             what="the lease to expire")
    assert time.monotonic() - t0 < TTL / 2
    invalidated = router.metric("duplexkv_router_entries_invalidated_total")
    unknown = metric(p.get("/metrics").text, "duplexkv_kv_pull_declined_total", reason="unknown")
    time.sleep(2.0)  # several renewal periods: the release notice reaches the router
    text, stats = chat(router.client(R1), messages, conv_id, stream=False)
    assert stats["conversation"] == "invalidated" and stats["prefill"]["pulled_tokens"] == 0
    assert text == oracle(messages)
    assert router.metric("duplexkv_router_entries_invalidated_total") == invalidated + 1
    assert metric(p.get("/metrics").text, "duplexkv_kv_pull_declined_total",
                  reason="unknown") == unknown
    d.assert_integrity()


def test_deleted_conversation_frees_d_blocks_at_once(router, workers, oracle):
    _, d = workers
    conv_id, messages = first_turn(router)
    before = retained(d)
    assert before["entries"] >= 1
    r = lifecycle(router, "DELETE", conv_id, R1)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": conv_id, "object": "conversation.deleted", "deleted": True,
                        "released": True}
    after = retained(d)  # no waiting: released before the DELETE answered
    assert after["released"]["deleted"] == before["released"]["deleted"] + 1
    assert after["entries"] <= before["entries"] - 1  # (others may expire meanwhile)
    assert after["blocks"] < before["blocks"]
    assert metric(d.get("/metrics").text, "duplexkv_kv_retained_released_total",
                  why="deleted") == after["released"]["deleted"]
    d.assert_integrity()
    assert lifecycle(router, "DELETE", conv_id, R1).status_code == 404  # nothing left
    assert lifecycle(router, "POST", conv_id, R1, None, "/keepalive").status_code == 404
    text, stats = chat(router.client(R1), messages, conv_id, stream=False)
    assert stats["conversation"] == "miss" and text == oracle(messages)
    assert router.metric("duplexkv_router_conversation_calls_total", op="delete",
                         outcome="released") >= 1


def test_conversations_are_namespaced_by_the_api_key(router, workers):
    """Another key can neither keep alive nor delete a conversation, nor learn it exists."""
    _, d = workers
    conv_id, _ = first_turn(router, R1)
    for method, what in (("POST", "/keepalive"), ("DELETE", "")):
        r = lifecycle(router, method, conv_id, R2, None, what)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        assert lifecycle(router, method, conv_id, None, None, what).status_code == 401
        assert lifecycle(router, method, conv_id, "wrong", None, what).status_code == 401
    r = lifecycle(router, "POST", conv_id, R1, None, "/keepalive")  # still R1's
    assert r.status_code == 200 and r.json()["held"] is True
    bad = lifecycle(router, "POST", conv_id, R1, {"seconds": -1}, "/keepalive")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seconds"
    assert lifecycle(router, "DELETE", conv_id, R1).json()["released"] is True
    d.assert_integrity()


def test_renewals_never_pass_the_ttl_cap(tiny_model_dir, tmp):
    """D renews a turn's 1 s lease for as long as it is asked, but releases it at its 3 s TTL
    ("capped"). Renewal calls straight to D's endpoint, as the router makes them."""
    d = start_worker(tiny_model_dir, tmp / "d_cap.log", *ARGS,
                     kv=bidi(decoder_kv_lease_duration=1.0, decoder_kv_blocks_ttl=3.0))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, user(0)]
        # the D leg's own params name the entry (the router keeps them from clients)
        leg = {"messages": msgs, "max_tokens": 4, "ignore_eos": True, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False}}
        j = d.post("/v1/chat/completions", leg).json()
        params = j["kv_transfer_params"]
        rid = params["remote_request_id"]
        t0 = time.monotonic()
        left = []
        while retained(d)["entries"] and time.monotonic() - t0 < 10:
            reply = d.post("/v1/kv/retention", {"renew": [rid]}).json()
            if rid in reply["held"]:
                left.append((time.monotonic() - t0, reply["held"][rid]))
            time.sleep(0.2)
        held_for = time.monotonic() - t0
        assert 2.0 < held_for < 6.0, held_for  # past the 1 s lease, not past the 3 s cap
        assert all(t + s <= 3.5 for t, s in left), left
        assert retained(d)["released"]["capped"] >= 1
        reply = d.post("/v1/kv/retention", {"renew": [rid], "since": -1}).json()
        assert reply["unknown"] == [rid] and rid in reply["released"]
        assert d.post("/v1/kv/retention", {"renew": "x"}).status_code == 400
        d.assert_integrity()
    finally:
        d.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _turns(table, clock, conv: int, times: list[float], tokens_per_turn: int = 64) -> str:
    """A conversation's turns at `times`: each turn's entry extends the previous one's tokens
    and the previous one is READ (released "read") when the next begins. -> the last entry."""
    stream = [conv * 10_000 + i for i in range(tokens_per_turn * (len(times) + 1))]
    rid = None
    for k, t in enumerate(times):
        clock.now = t
        if rid is not None:
            assert table.pop(rid, "read") is not None
        n = tokens_per_turn * (k + 1)
        rid = f"c{conv}-{k}"
        table.add(rid, list(range(conv * 1000 + k * 100, conv * 1000 + k * 100 + n // 16)),
                  stream[:n], "ttl", 60.0, 480.0)
    return rid


def test_pressure_releases_by_value_not_by_age():
    """D has learned two conversations' paces (A: a turn every 2 s, B: every 60 s). A's entry
    is older than B's, yet A's next turn is due in a second and B's in a minute: oldest-first
    would release A's; by value, B's goes. A deleted conversation goes before either, a claimed
    entry never, and a conversation kept alive outranks one that is merely recent."""
    from duplexkv.kv.retention import RetentionTable

    clock = Clock()
    t = RetentionTable(16, b"seed", clock=clock, lease_s=60.0)
    a = _turns(t, clock, 1, [0.0, 2.0, 4.0, 100.0, 102.0])
    b = _turns(t, clock, 2, [-20.0, 40.0, 100.5])
    clock.now = 103.0
    assert next(iter(t._entries)) == a  # a is the oldest: oldest-first would take it
    c = _turns(t, clock, 3, [103.0])
    t.mark_deleted([c])
    assert t.pop_for_pressure("value").request_id == c
    assert t.pop_for_pressure("value").request_id == b
    assert len(t) == 1 and t.released["pressure"] == 2
    # a claim protects; a kept-alive conversation outranks a recent one
    t.verify_and_claim(a, t.get(a).hashes, t.get(a).token_ids, 10.0)
    assert t.pop_for_pressure("value") is None
    d = _turns(t, clock, 4, [-50.0, 0.0, 50.0, 100.0])  # pace 50 s, due at 150 s
    e = _turns(t, clock, 5, [-50.0, 0.0, 50.0, 100.0])
    held, unknown = t.renew([e])
    assert e in held and unknown == []
    clock.now = 140.0
    t.verify_and_claim(a, t.get(a).hashes, t.get(a).token_ids, 10.0)  # a stays claimed
    assert t.pop_for_pressure("value").request_id == d
    # the release log: what the router learns
    log = t.released_since(-1)
    assert not log.reset and {c, b, d} <= set(log.request_ids)
    assert t.released_since(log.generation).request_ids == []


def test_renewal_is_capped_and_expiry_reasons():
    from duplexkv.kv.retention import RetentionTable

    clock = Clock()
    t = RetentionTable(16, b"seed", clock=clock, lease_s=10.0)
    t.add("x", [1, 2], list(range(32)), "ttl", 10.0, 25.0)
    t.add("y", [3, 4], list(range(100, 132)), "ttl", 10.0, 25.0)
    clock.now = 1008.0
    assert t.renew(["x"])[0] == {"x": 10.0}
    clock.now = 1009.0
    assert t.pop_expired() == []
    clock.now = 1010.5  # y was never renewed: gone at its lease, long before its cap
    assert [e.request_id for e in t.pop_expired()] == ["y"]
    for now in (1016.0, 1024.0):
        clock.now = now
        held, _ = t.renew(["x"])
        assert now + held["x"] == 1025.0  # renewed, never past the cap
    clock.now = 1025.5
    assert [e.request_id for e in t.pop_expired()] == ["x"]
    assert t.released["capped"] == 1 and t.released["expired"] == 1
    assert t.renew(["x"]) == ({}, ["x"])


def test_a_decode_without_the_retention_api_is_not_asked_every_period():
    """vLLM's D has no `/v1/kv/retention` (404): the router asked it every period anyway (the
    interop test's vLLM D logged a 404 every 10 s); now it asks again only after
    NO_API_RECHECK_S."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry

    from duplexkv.router.conversation.lifecycle import (NO_API_RECHECK_S, LeaseKeeper,
                                                        LifecycleMetrics)

    calls = []

    def vllm_decode(request: httpx.Request) -> httpx.Response:  # stands for vLLM's server
        calls.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(vllm_decode)) as client:
            keeper = LeaseKeeper(client, {}, 10, 600, LifecycleMetrics(CollectorRegistry()))
            keeper.decode_urls = lambda: ["http://vllm-d:1"]
            for _ in range(5):
                await keeper.sync_all()
            assert calls == ["/v1/kv/retention"]
            keeper.no_api["http://vllm-d:1"] -= NO_API_RECHECK_S  # the recheck time came
            await keeper.sync_all()
            assert len(calls) == 2

    asyncio.run(run())
