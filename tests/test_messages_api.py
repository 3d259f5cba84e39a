"""Anthropic's Messages API (`/v1/messages`, issue 29): the translation both ways
(duplexkv/wire/messages_api.py, messages_answer.py), checked against the `anthropic` SDK's own
types, the x-api-key middleware, and one real worker (`--enable-auto-tool-choice
--tool-call-parser hermes`, greedy) driven by the unmodified `anthropic` client, JSON and
streamed, whose answers equal the same conversation sent to /v1/chat/completions."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from workers import start_worker, stopping

from duplexkv.http.auth import APIKeyAuth
from duplexkv.wire.messages_answer import MessageStream, message_of
from duplexkv.wire.messages_api import FIELDS, MessagesError, chat_request

anthropic = pytest.importorskip("anthropic")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                "parameters": WEATHER,
                                                "description": "The forecast"}}]


# --- the request ------------------------------------------------------------------------------
def test_blocks_become_chat_messages():
    body = {"model": "tiny", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."},
                                                         {"type": "text", "text": "Use tools."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "s"},
                    {"type": "text", "text": "Checking.", "citations": None},
                    {"type": "tool_use", "id": "t1", "name": "get_weather",
                     "input": {"city": "Zürich", "days": 2}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "x"}}]}],
            "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "top_k": 5, "stream": True, "metadata": {"user_id": "u"},
            "thinking": {"type": "disabled"}}
    chat = chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "call it",
         "tool_calls": [{"id": "t1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: a\nb"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["tools"] == CHAT_TOOLS and chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["max_tokens"] == 9 and chat["top_k"] == 5 and "metadata" not in chat
    named = chat_request({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_request({**body, "tool_choice": {"type": "none"}})["tool_choice"] == "none"


BAD = [  # (what changes in a good body, the field the 400 names)
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": 3}]}]},
     "messages[0].content[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                      "name": "f", "input": "{}"}]}]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result",
                                                      "tool_use_id": "t"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": ["text"]}]}, "messages[0].content[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"system": 3}, "system"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_what_cannot_run_is_an_error_naming_the_field(change, param):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **change}
    with pytest.raises(MessagesError) as e:
        chat_request({k: v for k, v in body.items() if v is not None})
    assert e.value.param == param, e.value.message


KEYS = st.sampled_from(["type", "text", "role", "content", "tool_use_id", "id", "name", "input",
                        "is_error", "input_schema", "description", "thinking", "index", "delta",
                        "choices", "usage", "tool_calls", "function", "arguments", "reasoning",
                        "finish_reason", "stop_reason", "kv_stats", "error", "message"])
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 3) | st.sampled_from(
        ["", "user", "assistant", "text", "tool_use", "tool_result", "thinking", "image", "auto",
         "any", "tool", "none", "stop", "length", "tool_calls", "{", "{}", '{"a": 1}']),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=16)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(FIELDS)), VALUES, max_size=6), VALUES)
def test_no_body_and_no_chunk_breaks_the_translation(body, chunk):
    """Whatever the shapes: a request is a chat body or a MessagesError (a 400), and any chat
    answer or stream chunk makes a Message or events (never an exception: a 500)."""
    try:
        assert isinstance(chat_request(body), dict)
    except MessagesError:
        pass
    if isinstance(chunk, dict):
        Message.model_validate({**message_of(chunk), "model": "m"})
        s = MessageStream()
        s.feed(chunk)
        s.feed(chunk)
        assert s.done()[-1].startswith("event: message_stop")


# --- the answer -------------------------------------------------------------------------------
def chat_answer(message: dict, finish: str, stop_reason=None) -> dict:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "model": "tiny",
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
                      "prompt_tokens_details": {"cached_tokens": 16}},
            "kv_stats": {"local_hit_tokens": 16}}


def test_an_answer_becomes_a_message_the_sdk_parses():
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    m = Message.model_validate(message_of(chat_answer(
        {"role": "assistant", "content": "Sure.", "reasoning": "think", "tool_calls": [call]},
        "tool_calls")))
    assert m.id == "msg_abc" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "think" and m.content[1].text == "Sure."
    use = m.content[2]
    assert (use.id, use.name, use.input) == ("chatcmpl-tool-1", "get_weather",
                                             {"city": "Paris", "days": 2})
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens,
            m.usage.output_tokens) == (14, 16, 7)
    assert m.model_extra["kv_stats"] == {"local_hit_tokens": 16}
    # the tokens computed for the request, where kv_stats say: a worker's, the router's legs'
    for stats, want in (({"computed_tokens": 3}, (3, 27)),
                        ({"prefill": {"computed_tokens": 5}, "decode": {"computed_tokens": 1}},
                         (6, 24)),
                        ({"prefill": None, "decode": {"computed_tokens": 40}}, (30, 0))):
        usage = message_of({**chat_answer({"role": "assistant", "content": "x"}, "stop"),
                            "kv_stats": stats})["usage"]
        assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == want, stats
    for finish, stop, want in (("length", None, ("max_tokens", None)),
                               ("stop", "END", ("stop_sequence", "END")),
                               ("stop", None, ("end_turn", None)), ("stop", 2, ("end_turn", None))):
        got = message_of(chat_answer({"role": "assistant", "content": "x"}, finish, stop))
        assert (got["stop_reason"], got["stop_sequence"]) == want
    # a forced call cut by max_tokens: its text, not a broken tool_use
    cut = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}
    got = message_of(chat_answer({"role": "assistant", "content": "", "tool_calls": [cut]},
                                 "length"))
    assert got["content"] == [{"type": "text", "text": '{"city": "Pa'}]
    assert got["stop_reason"] == "max_tokens"


def chunk(delta: dict | None = None, finish=None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "tiny",
            "choices": choices, **extra}


def events(chunks: list[dict]) -> list[dict]:
    s = MessageStream()
    text = "".join(line for c in chunks for line in s.feed(c)) + "".join(s.done())
    out = []
    for raw in text.strip().split("\n\n"):
        kind, data = raw.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == kind[7:]
        out.append(TypeAdapter(RawMessageStreamEvent).validate_python(obj))
    return out


def test_a_chat_stream_becomes_anthropics_events_in_order():
    got = events([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "hm"}), chunk({"reasoning": "m"}),
        chunk({"content": "Let me "}), chunk({"content": "see."}),
        chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                               "function": {"name": "get_weather"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo", "days": 1}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{}"}}]},
              "tool_calls", kv_stats={"x": 1}),
        chunk(None, usage={"prompt_tokens": 10, "completion_tokens": 5})])
    assert [e.type for e in got] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    starts = [e for e in got if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [
        (0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert starts[2].content_block.id == "c0" and starts[2].content_block.name == "get_weather"
    deltas = [e.delta for e in got if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["thinking_delta"] * 2 + ["text_delta"] * 2 + \
        ["input_json_delta"] * 3
    assert "".join(d.partial_json for d in deltas[4:6]) == '{"city": "Oslo", "days": 1}'
    assert got[0].message.id == "msg_abc" and got[0].message.usage.output_tokens == 0
    end = got[-2]
    assert end.delta.stop_reason == "tool_use"
    assert (end.usage.input_tokens, end.usage.output_tokens) == (10, 5)
    assert end.model_extra["kv_stats"] == {"x": 1}


def test_an_empty_or_cut_stream_still_ends_as_a_message():
    got = events([chunk({"content": "ab"}, "length", stop_reason=None)])
    assert [e.type for e in got] == ["message_start", "content_block_start",
                                     "content_block_delta", "content_block_stop",
                                     "message_delta", "message_stop"]
    assert got[-2].delta.stop_reason == "max_tokens"
    assert [e.type for e in events([])] == ["message_start", "message_delta", "message_stop"]


def test_x_api_key_is_accepted_on_messages_only_and_its_401_is_anthropics():
    async def ok(_):
        return PlainTextResponse("ok")
    app = Starlette(routes=[Route("/v1/messages", ok, methods=["POST"]),
                            Route("/v1/chat/completions", ok, methods=["POST"])],
                    middleware=[Middleware(APIKeyAuth, keys=("k1",))])
    with TestClient(app) as c:
        assert c.post("/v1/messages", headers={"x-api-key": "k1"}).status_code == 200
        assert c.post("/v1/messages", headers={"authorization": "Bearer k1"}).status_code == 200
        bad = c.post("/v1/messages", headers={"x-api-key": "k2", "anthropic-version": "x"})
        assert bad.status_code == 401
        assert bad.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "Incorrect API key provided."}}
        chat = c.post("/v1/chat/completions", headers={"x-api-key": "k1"})  # Bearer only there
        assert chat.status_code == 401 and chat.json()["error"]["code"] == 401


# --- one worker -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("messages") / "messages-worker.log"
    with stopping(start_worker(tiny_model_dir, log, "--num-kv-blocks", "256",
                               "--max-model-len", "1024", "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes")) as w:
        yield w


MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
GREEDY = {"temperature": 0}  # the SDK has no `temperature` argument any more: extra_body


def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_forced_tool_call_equals_chat_completions(worker, stream):
    kw = dict(model=worker.name, max_tokens=80, messages=MESSAGES, tools=TOOLS,
              tool_choice={"type": "any"}, extra_body=GREEDY)
    if stream:
        with sdk(worker.url).messages.stream(**kw) as s:
            types = [e.type for e in s]
            m = s.get_final_message()
        assert types[0] == "message_start" and types[-1] == "message_stop"
    else:
        m = sdk(worker.url).messages.create(**kw)
    assert m.stop_reason == "tool_use" and m.id.startswith("msg_")
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(isinstance(u.input, dict) and u.name == "get_weather" for u in uses)
    chat = worker.post("/v1/chat/completions", {
        "model": worker.name, "max_tokens": 80, "messages": MESSAGES, "tools": CHAT_TOOLS,
        "tool_choice": "required", **GREEDY}).json()
    calls = chat["choices"][0]["message"]["tool_calls"]
    assert [(u.name, u.input) for u in uses] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == \
        chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_text_and_a_tool_result_equal_chat_completions(worker, stream):
    history = [*MESSAGES, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}]}]
    kw = dict(model=worker.name, max_tokens=12, messages=history, tools=TOOLS,
              tool_choice={"type": "none"}, stop_sequences=["zzzz"], extra_body=GREEDY)
    if stream:
        with sdk(worker.url).messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            m = s.get_final_message()
        assert text == m.content[0].text
    else:
        m = sdk(worker.url).messages.create(**kw)
    chat = worker.post("/v1/chat/completions", {"model": worker.name, **chat_request({
        "max_tokens": 12, "messages": history, "tools": TOOLS, "tool_choice": {"type": "none"},
        "stop_sequences": ["zzzz"]}), **GREEDY}).json()
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat["choices"][0]["finish_reason"]]


def test_bad_requests_are_anthropic_errors_never_a_5xx(worker):
    base = {"model": worker.name, "max_tokens": 4, "messages": MESSAGES}
    for change in ({"max_tokens": None}, {"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]},
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            {"temperature": -1}, {"model": "nope"}, {"tool_choice": {"type": "any"}}):
        body = {k: v for k, v in {**base, **change}.items() if v is not None}
        r = httpx.post(worker.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code in (400, 404), (change, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] in (
            "invalid_request_error", "not_found_error"), err
    for raw in (b"{", b"[]", b'{"max_tokens": 1e999}'):
        r = httpx.post(worker.url + "/v1/messages", content=raw, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
    r = httpx.get(worker.url + "/v1/messages", timeout=30)  # the app's own handlers too
    assert r.status_code == 405 and r.json()["type"] == "error", r.text
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        sdk(worker.url).messages.create(model=worker.name, max_tokens=0, messages=MESSAGES)


def test_count_tokens_counts_the_prompt_messages_renders(worker):
    kw = dict(model=worker.name, messages=MESSAGES, system="Be brief.", tools=TOOLS)
    counted = sdk(worker.url).messages.count_tokens(**kw)
    m = sdk(worker.url).messages.create(**kw, max_tokens=1, tool_choice={"type": "any"},
                                        extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    r = httpx.post(worker.url + "/v1/messages/count_tokens", timeout=30,
                   json={**kw, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_sequence_is_reported(worker, stream):
    kw = dict(model=worker.name, max_tokens=24, messages=MESSAGES, extra_body=GREEDY)
    full = sdk(worker.url).messages.create(**kw).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 4]
    if stream:
        with sdk(worker.url).messages.stream(**kw, stop_sequences=[stop]) as s:
            m = s.get_final_message()
    else:
        m = sdk(worker.url).messages.create(**kw, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert full.startswith(m.content[0].text) and stop not in m.content[0].text
