"""Anthropic's Messages API through the router (issue 29): a real router (default settings, a
client API key) in front of real P and D workers (TCP, bidirectional, float32, greedy) started
with `--enable-auto-tool-choice --tool-call-parser hermes`, driven by the unmodified `anthropic`
SDK. The router runs each /v1/messages request as a chat turn (P leg + D leg) and answers in
Anthropic's shapes; its clients send no conversation id, so a tool-using session is recognised
from its messages and reuses from turn 2. The oracle (reuse off) is one worker without KV
transfer nor prefix cache answering the same /v1/messages requests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from test_router import ARGS, MODEL, Router, bidi, metric, start_router
from test_router import tmp  # noqa: F401 - the same fixture
from workers import Worker, start_worker, stopping

anthropic = pytest.importorskip("anthropic")

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
KEY = "messages-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}  # the SDK has no `temperature` argument any more: extra_body


@dataclass(frozen=True)
class Cluster:
    router: Router
    one: Worker  # the oracle: a single worker with the same flags, no reuse at all
    p: Worker
    d: Worker


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):  # noqa: F811 - test_router's fixture
    kv = bidi()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_worker, tiny_model_dir, tmp / f"{name}.log", *ARGS, *FLAGS,
                               *extra, kv=kv if name != "mone" else None)
                   for name, extra in (("mp", ()), ("md", ()),
                                       ("mone", ("--no-enable-prefix-caching",)))]
        p, d, one = (f.result() for f in futures)
    with stopping(p, d, one):
        with stopping(start_router(tmp / "messages-router.log", [p.url], [d.url],
                                   "--api-key", KEY, placement=None)) as r:
            yield Cluster(r, one, p, d)


def sdk(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def ask(url: str, stream: bool, **kw):
    """One request by the SDK -> (its message, the router's kv_stats): a stream's final message
    (`get_final_message`) and the kv_stats of its message_delta event."""
    if not stream:
        m = sdk(url).messages.create(**kw)
        return m, (m.model_extra or {}).get("kv_stats")
    stats = None
    with sdk(url).messages.stream(**kw) as s:
        for e in s:
            if e.type == "message_delta":
                stats = (e.model_extra or {}).get("kv_stats")
        return s.get_final_message(), stats


def blocks(m) -> list[dict]:
    """A message's content, tool_use ids blanked (each is a fresh random id)."""
    return [{**b.model_dump(exclude_none=True, exclude={"parsed_output"}),
             **({"id": "<id>"} if b.type == "tool_use" else {})} for b in m.content]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_tool_using_session_without_an_id_reuses_from_turn_2(cluster, stream):
    """tool_use -> tool_result -> ...: from turn 2 the router recognises the session (the SDK's
    own content blocks sent back) and D reuses its KV; every answer equals reuse off."""
    d = cluster.d
    reused = d.kv()["decode_local"]["reused"]
    system = f"You call tools ({stream}). " + "ok; " * 20
    messages: list = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    # a named call's input comes back re-spaced (json.dumps), while D kept the grammar's text:
    # still recognised (arguments match by value), the reuse verified up to the difference
    choices = [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "any"},
               {"type": "none"}, {"type": "any"}]
    for t, choice in enumerate(choices):
        kw = dict(model=MODEL, max_tokens=60, system=system, messages=messages, tools=TOOLS,
                  tool_choice=choice, extra_body=GREEDY)
        got, stats = ask(cluster.router.url, stream, **kw)
        want = sdk(cluster.one.url).messages.create(**kw)  # reuse off, JSON
        assert blocks(got) == blocks(want), f"turn {t + 1} differs from reuse off"
        assert got.stop_reason == want.stop_reason
        assert got.usage.output_tokens == want.usage.output_tokens
        assert got.usage.input_tokens + got.usage.cache_read_input_tokens == \
            want.usage.input_tokens + want.usage.cache_read_input_tokens
        assert stats is not None, "the router's kv_stats ride on the message (message_delta)"
        if t == 0:
            assert stats["recognised"] is False and stats["conversation"] == "miss", stats
        else:
            assert stats["recognised"] is True and stats["conversation"] == "hit", stats
            assert stats["placement"] == "decode_local", stats
            assert stats["decode"]["decode_local"]["outcome"] == "reused", stats
            assert stats["decode"]["decode_local"]["reused_tokens"] > 0
            assert got.usage.cache_read_input_tokens > 0
        uses = [b for b in got.content if b.type == "tool_use"]
        if choice["type"] == "any":
            assert got.stop_reason == "tool_use" and uses, got
            assert all(isinstance(u.input, dict) and u.name == "get_weather" for u in uses)
        messages.append({"role": "assistant", "content": got.content})  # the SDK's own blocks
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"sunny {t}"}
                for u in uses]})
        else:
            messages.append({"role": "user", "content": f"and then {t}?"})
    assert d.kv()["decode_local"]["reused"] >= reused + 4
    d.assert_integrity()


def test_a_json_answer_through_p_and_d_equals_one_worker(cluster):
    kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Oslo?"}],
              tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
              extra_body=GREEDY)
    got = sdk(cluster.router.url).messages.create(**kw)
    want = sdk(cluster.one.url).messages.create(**kw)
    assert blocks(got) == blocks(want) and got.stop_reason == want.stop_reason == "tool_use"
    assert got.model_extra["kv_stats"]["prefill"] is not None


def test_tools_without_a_tool_choice_are_auto_and_parsed_by_d(cluster):
    """The SDK's default with tools is "auto": D's hermes parser reads the answer (the random
    model writes text, no call), streamed equal to one worker's."""
    kw = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi?"}],
              tools=TOOLS, extra_body=GREEDY)
    got, _ = ask(cluster.router.url, True, **kw)
    want = sdk(cluster.one.url).messages.create(**kw)
    assert blocks(got) == blocks(want) and [b.type for b in got.content] == ["text"]
    assert got.stop_reason == want.stop_reason in ("max_tokens", "end_turn")


BAD = [  # (body change, HTTP status): Anthropic's error shape, never a 5xx
    ({"max_tokens": None}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [1]}]}]},
     400),
    ({"tool_choice": {"type": "any"}}, 400),  # without tools: the chat parser's 400
    ({"temperature": "hot"}, 400),
    ({"model": "nope"}, 404),
    ({"n": 2}, 400),
]


@pytest.mark.parametrize("change, status", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_requests_are_anthropic_errors(cluster, change, status):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **change}
    r = httpx.post(cluster.router.url + "/v1/messages", timeout=30, headers={"x-api-key": KEY},
                   json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
    assert err["error"]["type"] == ("not_found_error" if status == 404
                                    else "invalid_request_error")


def test_the_apps_own_errors_are_anthropic_shaped_on_messages_paths(cluster):
    r = httpx.get(cluster.router.url + "/v1/messages", timeout=30, headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error", r.text
    r = httpx.get(cluster.router.url + "/v1/chat/completions", timeout=30,
                  headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == 405, r.text  # ours elsewhere


def test_a_bad_key_is_a_401_the_sdk_understands(cluster):
    with pytest.raises(anthropic.AuthenticationError):
        sdk(cluster.router.url, "wrong-key").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(cluster.router.url + "/v1/messages", timeout=30,
                   json={"model": MODEL, "max_tokens": 4, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_count_tokens_is_a_workers_count(cluster):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count me."}], tools=TOOLS)
    got = sdk(cluster.router.url).messages.count_tokens(**kw)
    want = sdk(cluster.one.url).messages.count_tokens(**kw)
    assert got.input_tokens == want.input_tokens > 0
    r = httpx.post(cluster.router.url + "/v1/messages/count_tokens", timeout=30,
                   headers={"x-api-key": KEY}, json={**kw, "messages": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_a_stream_aborts_the_decode_leg(cluster):
    """The anthropic stream wraps D's: a client that reads one event and leaves still aborts D's
    leg (greedy, this prompt runs 600 tokens without an end of sequence)."""
    d = cluster.d

    def counts() -> tuple[float, float]:
        text = d.get("/metrics").text
        return tuple(metric(text, "duplexkv_requests_total", endpoint="chat_completions",
                            outcome=o) for o in ("aborted", "ok"))

    aborted, ok = counts()
    body = {"model": MODEL, "max_tokens": 600, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "A long story:"}]}
    with httpx.stream("POST", cluster.router.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()) == "event: message_start"
    deadline = time.monotonic() + 30
    while counts()[0] == aborted or d.health()["in_flight_requests"]:
        assert time.monotonic() < deadline, ("D still generates for a client that left", counts())
        time.sleep(0.05)
    assert counts() == (aborted + 1, ok)
