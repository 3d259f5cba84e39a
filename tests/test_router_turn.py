"""The router's turn as data and steps (duplexkv/router/turn/), in process, without workers: the
pure plan, the retry policy's table, the in-flight count, and the legs against scripted workers,
where an exception or a cancellation at any point of a leg leaves every `outstanding` at zero."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from duplexkv.http.errors import APIError
from duplexkv.router.backends import Backend, BackendPool, BackendView, in_flight
from duplexkv.router.config import RouterConfig
from duplexkv.router.conversation.recall import Conversations, Recalled
from duplexkv.router.conversation.store import Entry, MemoryStore, conversation_key
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.placement import PROMPT_CHARS_KEY, Placement, PlacementConfig
from duplexkv.router.request import ClientRequest
from duplexkv.router.turn.calls import Relayed
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.plan import TurnPlan, plan_turn
from duplexkv.router.turn.retry import (
    ANSWER,
    MISMATCH,
    TRANSPORT,
    UNREACHABLE,
    Failure,
    Next,
    RetryPolicy,
)
from duplexkv.router.turn.runner import TurnRunner

D_URL = "http://127.0.0.1:8200"
D_PARAMS = {"remote_engine_id": "d", "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_request_id": "r1", "remote_num_tokens": 40,
            PROMPT_CHARS_KEY: 100}


def request(content: str = "x" * 110, conversation: str | None = "c1",
            stream: bool = False) -> ClientRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    return ClientRequest("chat", body, stream, "m", conversation, None, "req-1")


def ours(outstanding: int = 0, healthy: bool = True, kind: str | None = "duplexkv",
         url: str = D_URL) -> BackendView:
    return BackendView(url, "decode[0]", kind, healthy, outstanding)


# --- the plan: a pure function -------------------------------------------------------------
def test_a_request_without_a_conversation_is_plain_p_d():
    plan = plan_turn(request(conversation=None), Recalled(None, None, "none"), None,
                     PlacementConfig())
    assert plan == TurnPlan(None, None, "none")
    assert not plan.local and plan.placement is None


def test_a_small_suffix_on_our_healthy_d_is_prefilled_there_and_the_plan_is_pure():
    entry = Entry(copy.deepcopy(D_PARAMS), D_URL, 0.0)
    recalled, req = Recalled("k", entry, "hit"), request()
    before = (copy.deepcopy(req.body), copy.deepcopy(entry.params))
    plan = plan_turn(req, recalled, ours(), PlacementConfig())
    assert plan == plan_turn(req, recalled, ours(), PlacementConfig())  # same facts, same plan
    assert (req.body, entry.params) == before  # nothing it was given changed
    assert plan.local and plan.placement == Placement(True, "history_on_decode", 4)
    assert plan.key == "k" and plan.entry is entry and plan.conversation == "hit"
    assert plan.prompt_chars == 110
    assert plan.local_params["decode_local"] is True
    assert not any(k.startswith("_") for k in plan.local_params)


@pytest.mark.parametrize("cfg, holder, reason", [
    (PlacementConfig("prefill"), ours(), "placement_prefill"),
    (PlacementConfig(), None, "decode_unknown"),
    (PlacementConfig(), ours(kind="vllm"), "decode_not_duplexkv"),
    (PlacementConfig(), ours(healthy=False), "decode_down"),
    (PlacementConfig(), ours(outstanding=4), "decode_busy"),
    (PlacementConfig(max_suffix_tokens=3), ours(), "suffix_over_bound"),
])
def test_otherwise_the_turn_goes_through_p(cfg, holder, reason):
    entry = Entry(dict(D_PARAMS), D_URL, 0.0)
    plan = plan_turn(request(), Recalled("k", entry, "hit"), holder, cfg)
    assert not plan.local and plan.local_params is None
    assert plan.placement.reason == reason and plan.entry is entry
    order = plan.decode_order({"p": 1}, None)
    assert order.preferred_url == D_URL and order.only is None and order.key == "k"


def test_a_miss_has_no_history_to_place():
    plan = plan_turn(request(), Recalled("k", None, "expired"), None, PlacementConfig())
    assert plan.placement.reason == "no_history" and plan.conversation == "expired"
    assert plan.decode_order(None, None).preferred_url is None


def test_a_failed_decode_local_falls_back_to_a_miss_through_p():
    entry = Entry(dict(D_PARAMS), D_URL, 0.0)
    plan = plan_turn(request(), Recalled("k", entry, "hit"), ours(), PlacementConfig())
    holder = Backend(D_URL, "decode", "decode[0]")
    assert plan.local_order(holder).only is holder
    back = plan.fallen_back()
    assert back.entry is None and back.conversation == "retried" and not back.local
    assert back.placement == Placement(False, "decode_local_failed", 4)
    assert back.key == "k" and back.prompt_chars == plan.prompt_chars
    assert plan.local  # the plan itself is unchanged (frozen)


# --- the retry policy -----------------------------------------------------------------------
E = Next.ELSEWHERE


@pytest.mark.parametrize("failure, stored, step", [
    (Failure(UNREACHABLE, "x"), False, E), (Failure(UNREACHABLE, "x"), True, E),
    (Failure(TRANSPORT, "x"), False, E), (Failure(TRANSPORT, "x"), True, Next.AS_MISS),
    (Failure(ANSWER, "x", 400), False, Next.RELAY), (Failure(ANSWER, "x", 404), True,
                                                     Next.AS_MISS),
    (Failure(ANSWER, "x", 503), False, E), (Failure(ANSWER, "x", 500), False, E),
    (Failure(ANSWER, "x", 200), False, E), (Failure(ANSWER, "x", 503), True, Next.AS_MISS),
    (Failure(MISMATCH), True, Next.AS_MISS),
])
def test_prefill_retry_rules(failure, stored, step):
    assert RetryPolicy().prefill(failure, stored) is step


@pytest.mark.parametrize("failure, step", [
    (Failure(UNREACHABLE, "x"), E), (Failure(TRANSPORT, "x"), E), (Failure(ANSWER, "x", 503), E),
    (Failure(ANSWER, "x", 500), Next.RELAY), (Failure(ANSWER, "x", 400), Next.RELAY),
    (Failure(ANSWER, "x", 429), Next.RELAY),
])
def test_decode_retry_rules(failure, step):
    assert RetryPolicy().decode(failure) is step


def test_attempts_and_the_decode_local_fallback():
    policy = RetryPolicy()
    assert policy.prefill_attempts(2) == 3 and policy.decode_attempts(2) == 2
    assert policy.falls_back_to_prefill(APIError(503, "no D"))
    assert not policy.falls_back_to_prefill(APIError(400, "bad"))


# --- the in-flight count --------------------------------------------------------------------
def test_in_flight_gives_the_count_back_however_the_block_ends():
    b = Backend("http://w", "decode", "decode[0]")
    with in_flight(b):
        assert b.outstanding == 1
    assert b.outstanding == 0
    with pytest.raises(RuntimeError), in_flight(b):
        raise RuntimeError("mid-leg")
    assert b.outstanding == 0
    with in_flight(b) as count:
        kept = count.keep()  # a stream: the count outlives the block
    assert b.outstanding == 1
    kept.release()
    kept.release()  # once only
    assert b.outstanding == 0
    with pytest.raises(asyncio.CancelledError), in_flight(b) as count:
        count.keep()
        raise asyncio.CancelledError  # kept, but the block did not end normally
    assert b.outstanding == 0


# --- the legs against scripted workers ------------------------------------------------------
class Chunks(httpx.AsyncByteStream):
    """A streamed body: the chunks, then `error` (raised) if any."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks, self.error, self.closed = chunks, error, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


class Workers:
    """The router's Upstream, answering from a script: url prefix -> a coroutine function."""

    def __init__(self, **script) -> None:
        self.script, self.calls = script, []
        # liveness probes (GET /health, through either client): every scripted worker is alive
        self.client = self.probe_client = self

    async def get(self, url: str, timeout: float | None = None) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    async def post(self, url: str, content: bytes, headers: dict, stream: bool = False):
        self.calls.append((url, json.loads(content)))
        for prefix, answer in self.script.items():
            if url.startswith(prefix):
                return await answer(url, json.loads(content), stream)
        raise AssertionError(f"no script for {url}")


P0, P1, D0 = "http://p0:1", "http://p1:1", "http://d0:1"
P_ANSWER = {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_host": "p0"}}
D_ANSWER = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}


def cluster(workers: Workers, prefill=(P0,), decode=(D0,)) -> tuple[TurnRunner, BackendPool]:
    cfg = RouterConfig(prefill=prefill, decode=decode, warmup_timeout_s=0)
    pool = BackendPool.from_urls(cfg.prefill, cfg.decode)
    metrics = RouterMetrics()
    conversations = Conversations(MemoryStore(60, 100), metrics)
    return TurnRunner(cfg, pool, conversations, metrics, workers), pool


def counts(pool: BackendPool) -> list[int]:
    return [b.outstanding for b in pool.all]


async def answer(status: int, body: dict):
    return httpx.Response(status, json=body)


async def forever(*_):
    await asyncio.Event().wait()


async def boom(*_):
    raise RuntimeError("unexpected")


async def until(cond, timeout_s: float = 5.0) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_cancelled_leg_leaves_no_count(where):
    async def main():
        p = forever if where == "prefill" else (lambda *_: answer(200, P_ANSWER))
        runner, pool = cluster(Workers(**{P0: p, D0: forever}))
        task = asyncio.ensure_future(runner.run(Turn.start(request(), 0.0)))
        busy = pool.prefill[0] if where == "prefill" else pool.decode[0]
        await until(lambda: busy.outstanding == 1)
        assert sum(counts(pool)) == 1
        task.cancel()  # the client left while the leg was in flight
        with pytest.raises(asyncio.CancelledError):
            await task
        assert counts(pool) == [0, 0]
    asyncio.run(main())


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_an_unexpected_error_mid_leg_leaves_no_count(where):
    async def main():
        p = boom if where == "prefill" else (lambda *_: answer(200, P_ANSWER))
        runner, pool = cluster(Workers(**{P0: p, D0: boom}))
        with pytest.raises(RuntimeError):
            await runner.run(Turn.start(request(stream=True), 0.0))
        assert counts(pool) == [0, 0]
    asyncio.run(main())


def test_a_stream_holds_its_count_until_it_closes_however_it_ends():
    events = [b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n']

    async def one_stream(error: Exception | None, leave_after: int | None):
        body = Chunks(list(events), error)

        async def d(url, content, stream):
            assert stream
            return httpx.Response(200, stream=body)
        runner, pool = cluster(Workers(**{P0: lambda *_: answer(200, P_ANSWER), D0: d}))
        resp = await runner.run(Turn.start(request(stream=True), 0.0))
        assert counts(pool) == [0, 1]  # P's leg is over; D's lasts as long as its stream
        got = []
        async for event in resp.body_iterator:
            got.append(event)
            if leave_after is not None and len(got) == leave_after:
                break
        await resp.body_iterator.aclose()
        await resp.on_close()  # what SSEResponse runs last, whatever happened
        assert counts(pool) == [0, 0] and body.closed
        return got

    async def main():
        assert len(await one_stream(None, None)) == 1  # D ended its body
        broke = await one_stream(httpx.ReadError("reset"), None)  # D broke mid-stream
        assert b"stream broke" in broke[-1]
        await one_stream(None, 1)  # the client left after the first event

        async def d(url, content, stream):
            return httpx.Response(200, stream=Chunks(list(events)))
        runner, pool = cluster(Workers(**{P0: lambda *_: answer(200, P_ANSWER), D0: d}))
        resp = await runner.run(Turn.start(request(stream=True), 0.0))
        await resp.on_close()  # the client left before the first byte
        await resp.on_close()  # closed once
        assert counts(pool) == [0, 0]
    asyncio.run(main())


def test_an_unreachable_p_is_skipped_and_a_4xx_is_relayed():
    async def main():
        async def refused(*_):
            raise httpx.ConnectError("refused")
        d = Workers(**{P0: refused, P1: lambda *_: answer(200, P_ANSWER),
                       D0: lambda *_: answer(200, D_ANSWER)})
        runner, pool = cluster(d, prefill=(P0, P1))
        resp = await runner.run(Turn.start(request(), 0.0))
        assert resp.status_code == 200 and json.loads(resp.body)["kv_stats"]["conversation"] \
            == "miss"
        assert not pool.prefill[0].healthy and pool.prefill[0].errors == 1
        assert [u for u, _ in d.calls] == [P0 + "/v1/chat/completions",
                                           P1 + "/v1/chat/completions",
                                           D0 + "/v1/chat/completions"]
        assert counts(pool) == [0, 0, 0]

        bad = Workers(**{P0: lambda *_: answer(400, {"error": {"message": "no"}})})
        runner, pool = cluster(bad)
        with pytest.raises(Relayed) as e:
            await runner.run(Turn.start(request(), 0.0))
        assert e.value.status == 400 and counts(pool) == [0, 0]
    asyncio.run(main())


def test_a_failed_replay_runs_once_more_as_a_miss():
    async def main():
        sent = []

        async def p(url, body, stream):
            sent.append(body["kv_transfer_params"])
            return await answer(500 if len(sent) == 1 else 200, P_ANSWER)
        runner, pool = cluster(Workers(**{P0: p, D0: lambda *_: answer(200, D_ANSWER)}))
        for b in pool.all:
            b.kind = "duplexkv"  # P checks tokens itself: D's params go to it as stored
        await runner.conversations.store.put(conversation_key(None, "c1"),
                                             Entry(dict(D_PARAMS), D0, 0.0))
        # a suffix over --decode-local-max-tokens: through P, which fails the replay
        resp = await runner.run(Turn.start(request(content="y" * 11000), 0.0))
        stats = json.loads(resp.body)["kv_stats"]
        assert stats["conversation"] == "retried" and stats["placement"] == "prefill_recompute"
        assert stats["placement_reason"] == "suffix_over_bound"
        assert sent[0]["remote_engine_id"] == "d" and sent[1]["remote_engine_id"] is None
        assert counts(pool) == [0, 0]
    asyncio.run(main())
