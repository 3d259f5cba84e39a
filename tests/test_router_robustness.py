"""Issue 10, the router's side: no request and no store outage can kill or stall the router.

Each test is a regression test for one finding measured on the unchanged router: malformed input
(lone surrogates, 100k-deep JSON, oversized bodies and headers) must be a 4xx in OpenAI's error
shape, a long X-Request-Id that ends in a space once cut must get a normal answer, and a hung
Redis (SIGSTOP) must cost at most one store timeout per breaker period while /health says the
store is degraded, recovering by itself after SIGCONT — the Responses API's store too. The router
and the workers are real processes (the tiny model)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from test_router import ARGS, MODEL, bidi, start_router
from workers import start_p_and_d, stopping

from duplexkv.http.errors import APIError
from duplexkv.http.responses_api.store import (MemoryResponseStore, StoredResponse, StoreSkipped,
                                              response_key)
from duplexkv.launch.ports import free_port
from duplexkv.router.conversation.breaker import Breaker, BreakerOpen
from duplexkv.router.conversation.response_store import GuardedResponseStore
from duplexkv.router.config import RouterConfig
from duplexkv.router.conversation.store import GuardedStore, MemoryStore

STORE_TIMEOUT_S = 1.0  # well above a normal request's time, even on a loaded machine
BREAKER_PERIOD_S = 2.5
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router_robustness")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())) as workers:
        yield workers


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url])) as r:
        yield r


def post_raw(url: str, content: bytes, headers: dict | None = None,
             timeout: float = 60) -> httpx.Response:
    return httpx.post(url, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error", err
    return err


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2, "temperature": 0, **extra}


# --- invalid Unicode, JSON depth, sizes -----------------------------------------------------
# JSON text with a lone surrogate escape in one field; json.loads turns it into a str that
# cannot be encoded as UTF-8.
LONE = '"\\ud800 x"'
SURROGATES = [
    (COMPLETIONS, '{"model": %s, "prompt": "hi", "max_tokens": 2}' % LONE, "model"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "conversation_id": %s}' % LONE,
     "conversation_id"),
    (COMPLETIONS, '{"prompt": %s, "max_tokens": 2}' % LONE, "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "stop": [%s]}' % LONE, "stop[0]"),
    (CHAT, '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}' % LONE,
     "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], %s: 1}' % LONE, None),  # a key
]


@pytest.mark.parametrize("path,text,param", SURROGATES,
                         ids=["model", "conversation_id", "prompt", "stop", "messages", "key"])
def test_lone_surrogates_are_a_400(router, path, text, param):
    err = assert_openai_error(post_raw(router.url + path, text.encode()), 400)
    assert "Unicode" in err["message"] or "surrogate" in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_invalid_utf8_is_a_400(router):
    raw = b'{"prompt": "caf\xe9 \xff", "max_tokens": 2}'
    assert_openai_error(post_raw(router.url + COMPLETIONS, raw), 400)


@pytest.mark.parametrize("opening,closing", [("[", "]"), ('{"a":', "}")], ids=["list", "object"])
def test_deep_json_is_a_400(router, opening, closing):
    for depth in (100_000, 65):
        inner = opening * depth + "1" + closing * depth
        text = '{"prompt": "hi", "max_tokens": 2, "x": %s}' % inner
        err = assert_openai_error(post_raw(router.url + COMPLETIONS, text.encode()), 400)
        assert "nest" in err["message"], err
    # well within the bound: not the router's business (the worker ignores unknown fields)
    inner = opening * 8 + "1" + closing * 8
    r = post_raw(router.url + COMPLETIONS,
                 ('{"prompt": "hi", "max_tokens": 2, "x": %s}' % inner).encode())
    assert r.status_code == 200, r.text


def test_non_standard_json_constants_are_a_400(router):
    for const in ("NaN", "Infinity", "-Infinity", "1e999", "-1e400"):
        text = '{"prompt": "hi", "max_tokens": 2, "temperature": %s}' % const
        assert_openai_error(post_raw(router.url + COMPLETIONS, text.encode()), 400)
    huge_int = '{"prompt": "hi", "max_tokens": %s}' % ("9" * 5000)
    assert_openai_error(post_raw(router.url + COMPLETIONS, huge_int.encode()), 400)


def test_oversized_body_is_a_413(router):
    big = json.dumps({"prompt": "x" * (9 << 20), "max_tokens": 2}).encode()
    r = post_raw(router.url + COMPLETIONS, big)
    err = assert_openai_error(r, 413)
    assert "bytes" in err["message"], err
    # without a Content-Length (chunked): still bounded while reading

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + 1 << 20]
    r = httpx.post(router.url + COMPLETIONS, content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_oversized_headers_are_a_4xx(router):
    r = post_raw(router.url + CHAT, json.dumps(chat_body()).encode(),
                 headers={"x-padding": "a" * 40_000})
    assert_openai_error(r, 431)
    # far beyond any limit: the HTTP server itself refuses it (a 400, and it closes the
    # connection, so the client may see the reset first); the router goes on serving
    try:
        r = post_raw(router.url + CHAT, json.dumps(chat_body()).encode(),
                     headers={"x-padding": "a" * 200_000})
        assert 400 <= r.status_code < 500, r.status_code
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        pass
    assert post_raw(router.url + CHAT, json.dumps(chat_body()).encode()).status_code == 200


# --- request ids ----------------------------------------------------------------------------
LONG_ID = "a" * 199 + " " + "b" * 20  # the worker used to keep 200 characters: ends in a space


def test_long_request_id_ending_in_a_space_gets_a_normal_answer(router, workers):
    for path, body in ((CHAT, chat_body()), (COMPLETIONS, {"model": MODEL, "prompt": "hi",
                                                          "max_tokens": 2})):
        for stream in (False, True):
            r = post_raw(router.url + path, json.dumps({**body, "stream": stream}).encode(),
                         headers={"x-request-id": LONG_ID})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", rid), rid
    # the workers too, when called directly
    for w in workers:
        r = post_raw(w.url + COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                     headers={"x-request-id": LONG_ID})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", r.headers["x-request-id"])


def test_request_ids_are_sanitised_and_kept_when_safe(router):
    ok = "req-0123456789abcdef"
    r = post_raw(router.url + CHAT, json.dumps(chat_body()).encode(), headers={"x-request-id": ok})
    assert r.status_code == 200 and r.headers["x-request-id"] == ok
    r = post_raw(router.url + CHAT, json.dumps(chat_body()).encode(),
                 headers={"x-request-id": "a b\tc\u00e9;<script>".encode("latin-1")})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", r.headers["x-request-id"])


def test_non_ascii_authorization_is_never_forwarded(router):
    # found by the fuzz suite when the router forwarded it (a 503 naming the worker); now the
    # router sends the workers its own key or none, and without router keys ignores the header
    r = post_raw(router.url + CHAT, json.dumps(chat_body()).encode(),
                 headers={"authorization": "Bearer caf\u00e9".encode("latin-1")})
    assert r.status_code == 200, r.text


# --- the breaker on its own ---------------------------------------------------------------
def test_breaker_opens_probes_once_per_period_and_closes():
    now = [0.0]
    b = Breaker("store", period_s=5.0, clock=lambda: now[0])
    assert b.allow() and b.state == "closed"
    b.failure(TimeoutError("hung"))
    assert b.state == "open" and not b.allow()
    now[0] = 4.9
    assert not b.allow()
    now[0] = 5.0
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # one probe at a time
    b.failure(TimeoutError("still hung"))  # another period
    now[0] = 9.9
    assert not b.allow()
    now[0] = 10.0
    assert b.allow()
    b.abandon()  # a cancelled probe tells nothing: the next call probes
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.opened == 1

    class Failing(MemoryStore):
        fail = True

        async def take(self, key):
            if self.fail:
                raise ConnectionError("down")
            return await super().take(key)

    inner = Failing(10, 10)
    store = GuardedStore(inner, 5.0)
    store.breaker.clock = lambda: now[0]

    async def run():
        with pytest.raises(ConnectionError):
            await store.take("k")
        assert store.state() == "degraded"
        with pytest.raises(BreakerOpen):  # not called at all
            await store.take("k")
        inner.fail = False
        now[0] += 5.0
        assert (await store.take("k")).entry is None
        assert store.state() == "ok"

    asyncio.run(run())


def test_the_response_store_breaker_turns_failures_into_503s_and_skips_puts():
    now, calls = [0.0], []

    class Failing(MemoryResponseStore):
        fail = True

        async def get(self, api_key, response_id):
            calls.append("get")
            if self.fail:
                raise ConnectionError("down")
            return await super().get(api_key, response_id)

        async def put(self, api_key, entry):
            calls.append("put")
            return await super().put(api_key, entry)

    inner = Failing(60.0)
    store = GuardedResponseStore(inner, 5.0)
    store.breaker.clock = lambda: now[0]
    entry = StoredResponse({"id": "resp_1"}, [])

    async def run():
        with pytest.raises(APIError) as e:  # the failure itself: a 503
            await store.get(None, "resp_1")
        assert e.value.status == 503
        with pytest.raises(APIError):  # open: a 503 without calling the store
            await store.get(None, "resp_1")
        with pytest.raises(StoreSkipped):
            await store.put(None, entry)
        assert calls == ["get"]
        inner.fail = False
        now[0] += 5.0  # the period is over: the next call probes, and closes it
        assert await store.get(None, "resp_1") is None
        assert await store.put(None, entry) and (await store.get(None, "resp_1")) == entry
        assert store.breaker.state == "closed" and store.breaker.opened == 1

    asyncio.run(run())


# --- Redis hung (SIGSTOP): the breaker ------------------------------------------------------
@pytest.fixture
def redis_proc(tmp):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    import redis

    port = free_port()
    log = tmp / f"redis-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=fh, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
    yield proc, url
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


def _turn(router, conv_id: str, content: str) -> tuple[float, dict]:
    body = chat_body(messages=[{"role": "user", "content": content}], conversation_id=conv_id)
    t = time.monotonic()
    r = post_raw(router.url + CHAT, json.dumps(body).encode(), timeout=30)
    took = time.monotonic() - t
    assert r.status_code == 200, r.text
    return took, r.json()["kv_stats"]


def _health(router) -> tuple[float, dict]:
    took, r = _timed_get(router, "/health")
    assert r.status_code == 200, r.text
    return took, r.json()


def test_hung_redis_costs_at_most_one_timeout_per_breaker_period(workers, redis_proc, tmp):
    p, d = workers
    proc, url = redis_proc
    r = start_router(tmp / "router_redis.log", [p.url], [d.url], "--store", url,
                     "--store-timeout", str(STORE_TIMEOUT_S),
                     "--store-breaker-period", str(BREAKER_PERIOD_S))
    try:
        conv_id = f"conv-{uuid.uuid4().hex[:8]}"
        _turn(r, conv_id, "turn one")
        assert _turn(r, conv_id, "turn one, again")[1]["conversation"] == "hit"
        assert _health(r)[1]["store_state"] == "ok"

        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        times, states = [], []
        while time.monotonic() - started < 1.5 * BREAKER_PERIOD_S:
            took, stats = _turn(r, conv_id, f"hung {len(times)}")
            times.append(took)
            states.append(stats["conversation"])
        elapsed = time.monotonic() - started
        assert set(states) == {"miss"}, states  # served as plain P/D
        # calls that reached the hung store (each a timeout) are logged as warnings; skipped ones
        # only at debug level: the first request pays one timeout, then one probe per period
        timeouts = len(re.findall(r"WARNING .*conversation store (take|put) failed",
                                  r.log.read_text()))
        assert 1 <= timeouts <= 1 + int(elapsed / BREAKER_PERIOD_S), (timeouts, times)
        assert sum(t >= STORE_TIMEOUT_S for t in times) <= timeouts, times
        assert sorted(times)[len(times) // 2] < STORE_TIMEOUT_S / 2, times  # most are quick
        took, health = _health(r)
        assert health["store_state"] == "degraded" and health["status"] == "degraded", health
        assert took < STORE_TIMEOUT_S, took

        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + BREAKER_PERIOD_S + 10
        while _health(r)[1]["store_state"] != "ok":  # recovers by itself
            assert time.monotonic() < deadline, "the store never recovered"
            time.sleep(0.2)
        conv2 = f"conv-{uuid.uuid4().hex[:8]}"
        _turn(r, conv2, "after")
        took, stats = _turn(r, conv2, "after, again")
        assert stats["conversation"] == "hit"
        assert _health(r)[1]["status"] == "ok"
    finally:
        r.stop()


def _respond(router, **fields) -> tuple[float, httpx.Response]:
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 4, "temperature": 0,
            **fields}
    t = time.monotonic()
    r = post_raw(router.url + "/v1/responses", json.dumps(body).encode(), timeout=30)
    return time.monotonic() - t, r


def test_hung_redis_costs_the_responses_api_one_timeout_per_breaker_period(workers, redis_proc,
                                                                           tmp):
    """Finding (session 61): the Responses store had no breaker, so with Redis hung every
    `/v1/responses` call (stored by default) waited for the store's socket timeout, and every
    lookup (`previous_response_id`, GET) waited for it before its 503. At the router's defaults
    (0.5 s timeout, 5 s breaker period) a hung Redis now costs at most one timeout per period
    for each of the two stores, lookups are a 503 at once in between, and it recovers alone."""
    p, d = workers
    proc, url = redis_proc
    r = start_router(tmp / "router_responses_redis.log", [p.url], [d.url], "--store", url)
    defaults = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    timeout_s, period_s = defaults["store_timeout_s"], defaults["store_breaker_period_s"]
    try:
        took, first = _respond(r)
        assert first.status_code == 200, first.text
        kept = first.json()["id"]
        assert r.get(f"/v1/responses/{kept}").status_code == 200

        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        times = []
        while time.monotonic() - started < 1.5 * period_s:
            took, resp = _respond(r)
            assert resp.status_code == 200, resp.text  # answered, only not stored
            times.append(took)
        elapsed = time.monotonic() - started
        # each store: its first call and one probe a period wait for the timeout, no other
        periods = 1 + int(elapsed / period_s)
        assert sum(t >= timeout_s for t in times) <= 2 * periods, times
        assert sorted(times)[len(times) // 2] < timeout_s / 2, times  # most are quick
        for lookup in (lambda: _respond(r, previous_response_id=kept),
                       lambda: _timed_get(r, f"/v1/responses/{kept}"),
                       lambda: _timed_get(r, f"/v1/responses/{kept}/input_items")):
            took, resp = lookup()
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["type"] == "service_unavailable_error"
            assert took < timeout_s, took  # the breaker answers, not the socket timeout

        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + period_s + 10
        while _timed_get(r, f"/v1/responses/{kept}")[1].status_code != 200:  # recovers alone
            assert time.monotonic() < deadline, "the response store never recovered"
            time.sleep(0.2)
        took, resp = _respond(r, previous_response_id=kept)
        assert resp.status_code == 200, resp.text
        assert r.get(f"/v1/responses/{resp.json()['id']}").status_code == 200  # stored again
        # an entry that is not ours is absent (a 404), not a store failure: the next lookup
        # still reaches the store (no breaker opened by it)
        import redis

        redis.Redis.from_url(url).set("duplexkv:resp:" + response_key(None, kept), b"{not json")
        assert _timed_get(r, f"/v1/responses/{kept}")[1].status_code == 404
        assert _timed_get(r, f"/v1/responses/{resp.json()['id']}")[1].status_code == 200
    finally:
        proc.send_signal(signal.SIGCONT)
        r.stop()


def _timed_get(router, path: str) -> tuple[float, httpx.Response]:
    t = time.monotonic()
    resp = router.get(path)
    return time.monotonic() - t, resp
