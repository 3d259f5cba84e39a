"""The Responses API's translation (duplexkv/http/responses_api), alone: a request's input items
become the chat messages a chat client would send, a chat completion becomes a Response and a
chat stream the Responses events, each checked by the `openai` SDK's own pydantic types (and its
stream accumulator); the stored-response store is bounded, expiring and namespaced by API key.
No process is started."""

from __future__ import annotations

import asyncio
import json

import pytest

from duplexkv.http.errors import APIError
from duplexkv.http.responses_api.events import ResponseEvents
from duplexkv.http.responses_api.input_items import ItemsQuery, chained, listed, page, parse_query
from duplexkv.http.responses_api.items import input_messages
from duplexkv.http.responses_api.output import ResponseShape
from duplexkv.http.responses_api.request import parse_responses_request
from duplexkv.http.responses_api.store import MemoryResponseStore, StoredResponse
from duplexkv.router.conversation.recognise import canonical

types = pytest.importorskip("openai.types.responses")
pydantic = pytest.importorskip("pydantic")
EVENT = pydantic.TypeAdapter(types.ResponseStreamEvent)

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_input_items_become_chat_messages():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    assert input_messages([{"type": "reasoning", "content": []}]) == []  # nothing to carry
    assert input_messages([{"type": "reasoning", "summary": [{"type": "summary_text",
                                                              "text": "s"}]},
                           {"role": "assistant", "content": "a"}]) \
        == [{"role": "assistant", "content": "a", "reasoning": "s"}]
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "let me check", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": "{}"},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me check", "reasoning": "think",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{}"}}]}]


@pytest.mark.parametrize("items,param", [
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
     "input[0].content[0]"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    (["text"], "input[0]"),
    ([{"type": "reasoning", "content": [], "summary": [{"type": "input_image"}]}],
     "input[0].summary[0]"),
])
def test_bad_items_name_the_field(items, param):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_a_request_becomes_a_chat_request():
    req = parse_responses_request({
        "model": "tiny", "input": "hi", "instructions": "be brief", "max_output_tokens": 9,
        "temperature": 0, "top_p": 0.5, "stream": True, "store": False, "metadata": {"a": "b"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"},
                            "strict": True}},
        "include": [], "seed": 3})
    assert req.store is False and req.stream is True
    body = req.chat_body([{"role": "user", "content": "before"},
                          {"role": "assistant", "content": "ok"}])
    assert body == {
        "model": "tiny", "seed": 3, "max_tokens": 9, "temperature": 0, "top_p": 0.5,
        "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object"}, "strict": True}},
        "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"), ({"conversation": "c"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"), ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"metadata": {"k": 1}}, "metadata"), ({"store": "yes"}, "store"), ({"nope": 1}, "nope"),
    ({"input": None}, "input"), ({"input": []}, "input"),
])
def test_what_cannot_be_honoured_is_a_400(extra, param):
    with pytest.raises(APIError) as e:
        parse_responses_request({"model": "tiny", "input": "hi", **extra})
    assert e.value.status == 400 and e.value.param == param


def shape() -> ResponseShape:
    req = parse_responses_request({"model": "tiny", "input": "hi", "instructions": "x",
                                   "tools": [{"type": "function", "name": "get_weather",
                                              "parameters": {"type": "object"}}]})
    return ResponseShape("resp_1", "tiny", req.echo, created_at=1)


USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
         "prompt_tokens_details": {"cached_tokens": 8}}


def test_a_chat_completion_becomes_a_response():
    chat = {"model": "tiny", "usage": USAGE, "kv_stats": {"conversation": "hit"},
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "checking", "reasoning": "hmm",
                "tool_calls": [CALL]}}]}
    r = types.Response.model_validate(shape().from_chat(chat))
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "checking" and r.status == "completed"
    assert r.output[2].call_id == "call_1" and r.output[2].arguments == '{"city": "Paris"}'
    assert r.usage.input_tokens == 10 and r.usage.input_tokens_details.cached_tokens == 8
    assert r.instructions == "x" and r.tools[0].name == "get_weather"
    assert r.model_extra["kv_stats"] == {"conversation": "hit"}
    cut = shape().from_chat({"choices": [{"finish_reason": "length", "message": {
        "role": "assistant", "content": "abc"}}], "usage": USAGE})
    r = types.Response.model_validate(cut)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_output_continues_as_the_message_d_produced():
    """A stored response's output, sent back, hashes as the assistant message D answered with
    (router/conversation/recognise.py): the next turn is recognised."""
    for message in ({"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "assistant", "content": "text", "reasoning": "r"},
                    {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "assistant", "content": "a", "tool_calls": [CALL]}):
        out = shape().from_chat({"choices": [{"message": message, "finish_reason": "stop"}]})
        back = input_messages(out["output"])
        assert len(back) == 1 and canonical(back[0]) == canonical(message), (message, back)


def chat_stream() -> list[str]:
    """A chat stream as a worker sends it: role chunk, reasoning, content, a tool call in
    pieces, the finish chunk, the usage chunk, [DONE]."""
    def chunk(delta, finish=None, **kw):
        return {"id": "c", "object": "chat.completion.chunk", "model": "tiny",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **kw}
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "hm"}),
              chunk({"reasoning": "m"}), chunk({"content": "check"}), chunk({"content": "ing"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                    "tool_calls", kv_stats={"conversation": "miss"}),
              {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": USAGE}]
    return [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]


def test_a_chat_stream_becomes_the_responses_events():
    ev = ResponseEvents(shape())
    lines = ev.start()
    for event in chat_stream():
        lines += ev.feed_event(event)
    lines += ev.finish()
    events = []
    for line in lines:
        head, data = line.rstrip("\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        events.append(EVENT.validate_python(json.loads(data[6:])))
        assert events[-1].type == head[7:]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.output_text == "checking" and final.usage.output_tokens == 5
    assert final.output[2].arguments == '{"city": "Paris"}'
    assert final.model_extra["kv_stats"] == {"conversation": "miss"}
    # the SDK's own accumulator (client.responses.stream) builds the same response
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(e)
    assert state._completed_response.output_text == "checking"
    # the JSON answer of the same completion has the same items
    json_items = shape().from_chat({"usage": USAGE, "choices": [{
        "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "checking",
                                                   "reasoning": "hmm", "tool_calls": [CALL]}}]})
    strip = [{k: v for k, v in i.items() if k != "id"} for i in json_items["output"]]
    assert strip == [{k: v for k, v in i.model_dump(exclude_none=True).items() if k != "id"}
                     for i in final.output]


def test_an_error_event_ends_the_stream():
    ev = ResponseEvents(shape())
    ev.start()
    lines = ev.feed_event('data: {"error": {"message": "boom", "type": "x", "code": 500}}')
    assert ev.failed and ev.finish() == []
    event = EVENT.validate_python(json.loads(lines[-1].split("data: ", 1)[1]))
    assert event.type == "error" and event.message == "boom" and event.code == "500"


def test_the_store_is_bounded_expiring_and_per_key():
    now = [0.0]
    store = MemoryResponseStore(10.0, 3, max_bytes=10_000, max_entry_bytes=2_000,
                                clock=lambda: now[0])

    def entry(i: int, size: int = 0) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}", "pad": "x" * size}, [], None)

    async def go():
        assert await store.put("a", entry(1))
        assert (await store.get("a", "resp_1")).response["id"] == "resp_1"
        assert await store.get("b", "resp_1") is None  # another key's
        assert await store.get(None, "resp_1") is None
        assert not await store.put("a", entry(2, 5_000))  # larger than one entry may be
        for i in range(2, 6):
            await store.put("a", entry(i))
        assert store.held_here() == 3 and await store.get("a", "resp_2") is None
        for i in range(6, 12):
            await store.put("a", entry(i, 1_800))  # about 1.9 kB each: at most 5 in 10 kB
        assert store.bytes <= 10_000 and store.held_here() <= 5
        now[0] = 11.0
        assert await store.get("a", "resp_11") is None  # expired
        assert not await store.delete("a", "resp_11")
        await store.put("a", entry(20))
        assert await store.delete("a", "resp_20") and await store.get("a", "resp_20") is None

    asyncio.run(go())


ITEM = pydantic.TypeAdapter(types.ResponseItem)


def test_a_requests_input_is_listed_as_openai_normalises_it():
    [one] = listed("hi")
    assert one["id"].startswith("msg_") and one["type"] == "message" and one["role"] == "user"
    assert one["content"] == [{"type": "input_text", "text": "hi"}]
    items = listed([
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "assistant", "content": "earlier answer", "id": "msg_kept"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
         "extra": "dropped"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "and now?"}]}])
    assert [it["type"] for it in items] == ["message", "message", "reasoning", "function_call",
                                            "function_call_output", "message"]
    assert items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert items[1]["id"] == "msg_kept"  # a client's own id is kept
    assert items[1]["content"] == [{"type": "output_text", "text": "earlier answer",
                                    "annotations": [], "logprobs": []}]
    assert "extra" not in items[3] and items[3]["status"] == "completed"
    assert len({it["id"] for it in items}) == len(items)
    for it in items[1:5]:
        ITEM.validate_python(it)  # the SDK's own item types parse them
    ITEM.validate_python(one)


def test_chained_lists_keep_each_id_once():
    a = listed([{"type": "message", "role": "user", "content": "x", "id": "msg_1"}])
    b = listed([{"type": "message", "role": "assistant", "content": "y", "id": "msg_1"},
                {"type": "message", "role": "user", "content": "z", "id": "msg_2"}])
    got = chained(a, b)
    assert [it["content"][0]["text"] for it in got] == ["x", "y", "z"]
    assert got[0]["id"] == "msg_1" and got[1]["id"] != "msg_1" and got[2]["id"] == "msg_2"
    assert b[0]["id"] == "msg_1"  # the repeated item was copied, not changed


def test_pages_follow_order_limit_and_cursors():
    items = [{"id": f"i{n}", "type": "message"} for n in range(5)]
    ids = lambda p: [it["id"] for it in p["data"]]  # noqa: E731
    first = page(items, ItemsQuery())  # desc, 20
    assert ids(first) == ["i4", "i3", "i2", "i1", "i0"] and not first["has_more"]
    assert first["object"] == "list" and (first["first_id"], first["last_id"]) == ("i4", "i0")
    p1 = page(items, ItemsQuery(limit=2, order="asc"))
    assert ids(p1) == ["i0", "i1"] and p1["has_more"]
    p2 = page(items, ItemsQuery(limit=2, order="asc", after=p1["last_id"]))
    p3 = page(items, ItemsQuery(limit=2, order="asc", after=p2["last_id"]))
    assert ids(p2) == ["i2", "i3"] and p2["has_more"] and ids(p3) == ["i4"] \
        and not p3["has_more"]
    assert ids(page(items, ItemsQuery(limit=2, before="i1"))) == ["i3", "i2"]  # desc: next to it
    assert ids(page(items, ItemsQuery(after="i0"))) == []
    empty = page([], ItemsQuery())
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]
    with pytest.raises(APIError) as e:
        page(items, ItemsQuery(after="nope"))
    assert e.value.status == 400 and e.value.param == "after"


@pytest.mark.parametrize("params,param", [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                                          ({"limit": "x"}, "limit"), ({"order": "up"}, "order")])
def test_a_bad_query_is_a_400_naming_it(params, param):
    with pytest.raises(APIError) as e:
        parse_query(params)
    assert e.value.status == 400 and e.value.param == param


def test_a_stored_entry_from_before_items_were_kept_still_loads():
    old = json.dumps({"response": {"id": "resp_1", "output": [{"id": "msg_o"}]},
                      "history": [], "conversation_key": None})
    entry = StoredResponse.loads(old)
    assert entry.items is None and entry.chain_items() == [{"id": "msg_o"}]
    assert parse_query({"include": "x", "order": "asc"}) == ItemsQuery(order="asc")


@pytest.mark.parametrize("chat", [
    {}, {"choices": None}, {"choices": {"0": 1}}, {"choices": [None]},
    {"choices": [{"message": {"content": 5, "tool_calls": [None, {"function": 3}, "x"]}}],
     "usage": {"prompt_tokens": "3", "prompt_tokens_details": []}},
    {"choices": [{"message": {"tool_calls": {"a": 1}, "reasoning": ["x"]}}], "usage": 5},
])
def test_odd_chat_answers_still_make_a_valid_response(chat):
    """An upstream answer of an unexpected shape (a vLLM D, a proxy) never raises here."""
    types.Response.model_validate(shape().from_chat(chat))


def test_odd_chat_chunks_still_make_valid_events():
    ev = ResponseEvents(shape())
    lines = ev.start()
    for event in ('data: {"choices": 3}', "data: [1, 2]", "data: nope", ": comment",
                  'data: {"choices": [null, {"index": 0, "delta": 7}]}',
                  'data: {"choices": [{"index": 0, "delta": {"tool_calls": [1, {"index": 0, '
                  '"function": {"name": 4, "arguments": 5}}]}}], "usage": [], "model": 3}',
                  'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}'):
        lines += ev.feed_event(event)
    lines += ev.finish()
    for line in lines:
        EVENT.validate_python(json.loads(line.split("data: ", 1)[1]))
    assert EVENT.validate_python(json.loads(lines[-1].split("data: ", 1)[1])).type \
        == "response.completed"


def test_any_json_body_is_a_request_or_a_400():
    """No process: any JSON object, and item lists of any shape, parse or raise a 400."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    keys = st.sampled_from(["input", "tools", "tool_choice", "text", "instructions", "store",
                            "reasoning", "metadata", "max_output_tokens", "stream", "model",
                            "previous_response_id", "truncation", "background", "x"])
    values = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                  st.text(max_size=5), st.sampled_from(["function", "message", "reasoning",
                                                        "function_call", "input_text",
                                                        "json_schema", "user", "text"])),
        lambda kids: st.one_of(st.lists(kids, max_size=3),
                               st.dictionaries(st.sampled_from(
                                   ["type", "role", "content", "text", "name", "call_id",
                                    "arguments", "output", "summary", "format", "schema",
                                    "parameters"]), kids, max_size=4)), max_leaves=12)

    import os

    @settings(max_examples=int(os.environ.get("DUPLEXKV_FUZZ_EXAMPLES", "300")), deadline=None,
              database=None, derandomize=not os.environ.get("DUPLEXKV_FUZZ_RANDOM"),
              suppress_health_check=list(HealthCheck))
    @given(body=st.dictionaries(keys, values, max_size=6), items=st.lists(values, max_size=4))
    def run(body: dict, items: list) -> None:
        for call in (lambda: parse_responses_request(body).chat_body([]),
                     lambda: input_messages(items)):
            try:
                call()
            except APIError as e:
                assert e.status == 400

    run()
