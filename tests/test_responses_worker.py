"""The Responses API on a worker (issue 29): `POST /v1/responses` runs through the worker's own
chat path, so a Response's output equals the chat completion of the same conversation (greedy,
float32), JSON and streamed, driven by the `openai` SDK (its pydantic types parse every object
and event). Tools with a forced `tool_choice` give `function_call` items; a chain continues
through `previous_response_id` and equals the same conversation sent as full input; stored
responses can be read and deleted, `store: false` ones cannot; mistakes are 4xx in OpenAI's
shape."""

from __future__ import annotations

import json

import httpx
import pytest
from test_router import ARGS
from test_router import tmp  # noqa: F401 - the same fixture
from workers import start_worker, stopping

openai = pytest.importorskip("openai")

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
         "qwen3")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast",
          "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                "description": "the forecast",
                                                "parameters": WEATHER, "strict": True}}]
Q = "What is the weather in Paris for the next three days? Answer briefly."


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp):  # noqa: F811 - test_router's fixture
    w = start_worker(tiny_model_dir, tmp / "responses-worker.log", *ARGS, *FLAGS)
    with stopping(w):
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def chat_message(client, messages, max_tokens=16, **kw) -> dict:
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                       max_tokens=max_tokens, **kw)
    return r.choices[0].message.model_dump()


def test_create_equals_chat_json_and_stream(client):
    r = client.responses.create(model="tiny", input=Q, temperature=0, max_output_tokens=16)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    msg = chat_message(client, [{"role": "user", "content": Q}])
    assert r.output_text == (msg["content"] or "")
    assert (r.output[0].content[0].text if r.output[0].type == "reasoning" else None) \
        == msg.get("reasoning")
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16
    # cut by max_output_tokens: `response.incomplete` ends the stream, as OpenAI's (the SDK's
    # `responses.stream` helper waits for `response.completed` only, so the raw events here)
    events = list(client.responses.create(model="tiny", input=Q, temperature=0,
                                          max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == r.output_text
    assert [i.type for i in final.output] == [i.type for i in r.output]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text


def test_forced_tool_call(client):
    kw = dict(model="tiny", input=Q, tools=TOOLS, tool_choice="required", temperature=0,
              max_output_tokens=64)
    r = client.responses.create(**kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), r.output
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "days"}
    msg = chat_message(client, [{"role": "user", "content": Q}], tools=CHAT_TOOLS,
                       tool_choice="required", max_tokens=64)
    assert [c.arguments for c in calls] == [c["function"]["arguments"]
                                           for c in msg["tool_calls"]]
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds.index("response.function_call_arguments.done") \
        < kinds.index("response.output_item.done", kinds.index(
            "response.function_call_arguments.done"))
    assert [c.arguments for c in final.output if c.type == "function_call"] \
        == [c.arguments for c in calls]
    # the tool's result back, as the SDK's agents send it: by the chain and as full input
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "sunny, 21 C"}
    chained = client.responses.create(model="tiny", previous_response_id=r.id,
                                      input=[result], temperature=0, max_output_tokens=16)
    full = client.responses.create(
        model="tiny", temperature=0, max_output_tokens=16,
        input=[{"role": "user", "content": Q}, *[i.model_dump(exclude_none=True)
                                                  for i in r.output], result])
    msgs = [{"role": "user", "content": Q},
            {"role": "assistant", "content": "", "tool_calls": msg["tool_calls"]},
            {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
             "content": "sunny, 21 C"}]
    assert chained.output_text == full.output_text == (chat_message(client, msgs)["content"]
                                                        or "")
    assert chained.previous_response_id == r.id


def test_previous_response_id_chain(client):
    first = client.responses.create(model="tiny", input="Hello there.", temperature=0,
                                    max_output_tokens=12, instructions="Be terse.")
    second = client.responses.create(model="tiny", input="And then?", temperature=0,
                                     max_output_tokens=12, previous_response_id=first.id)
    # the instructions are not carried over (OpenAI's rule)
    msgs = [{"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]
    assert second.output_text == (chat_message(client, msgs, max_tokens=12)["content"] or "")
    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.previous_response_id == first.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_input_items_list_what_each_response_was_generated_from(client, worker):
    """`client.responses.input_items.list`: a chained response lists the chain's inputs and
    outputs, then its own input (instructions aside), newest first by default; the SDK's
    auto-paging walks pages of one by `after`; unknown ids are a 404, bad queries a 400."""
    first = client.responses.create(model="tiny", input="Name a colour.", temperature=0,
                                    max_output_tokens=8, instructions="Be terse.")
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                      temperature=0, max_output_tokens=8,
                                      input=[{"role": "user", "content": "And a fruit?"}])
    walked = list(client.responses.input_items.list(second.id, order="asc", limit=1))
    assert [it.type for it in walked] == ["message", *(o.type for o in first.output),
                                          "message"]
    assert walked[0].role == "user" and walked[0].content[0].text == "Name a colour."
    assert [it.id for it in walked[1:-1]] == [o.id for o in first.output]  # its output items
    assert walked[-1].content[0].text == "And a fruit?"
    newest = client.responses.input_items.list(second.id)
    assert [it.id for it in newest.data] == [it.id for it in reversed(walked)]
    assert not newest.has_more and newest.first_id == walked[-1].id
    assert [it.id for it in client.responses.input_items.list(first.id).data] == [walked[0].id]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")):
        r = httpx.get(f"{worker.url}/v1/responses/{second.id}/input_items?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)


def test_store_false_and_unknown_ids(client, worker):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_nope")


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0]"),
    ({"input": "hi", "made_up": 1}, "made_up"),
    ({"input": 3}, "input"),
    ({}, "input"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
])
def test_bad_requests_are_400s(worker, body, param):
    r = httpx.post(worker.url + "/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_bodies_are_bounded(worker):
    r = httpx.post(worker.url + "/v1/responses", content=b"{" * 100)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = json.dumps({"model": "tiny", "input": "x" * (64 << 20)})
    r = httpx.post(worker.url + "/v1/responses", content=big)
    assert r.status_code == 413, r.text


def test_every_object_and_event_validates_strictly(worker):
    """The SDK's client builds its objects without validating them: here the worker's JSON and
    every streamed event are validated by the SDK's pydantic types, field by field."""
    types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    body = {"model": "tiny", "input": Q, "tools": TOOLS, "tool_choice": "required",
            "max_output_tokens": 64, "temperature": 0}
    r = httpx.post(worker.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    types.Response.model_validate(r.json())
    adapter = TypeAdapter(types.ResponseStreamEvent)
    with httpx.stream("POST", worker.url + "/v1/responses", json={**body, "stream": True},
                      timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        text = "".join(s.iter_text())
    events = [e for e in text.split("\n\n") if e.strip()]
    kinds = []
    for event in events:
        head, data = event.split("\n")
        kinds.append(adapter.validate_python(json.loads(data[len("data: "):])).type)
        assert head == f"event: {kinds[-1]}"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
