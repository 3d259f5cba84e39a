"""Tool calls on a real worker started as vLLM's users start it (`--enable-auto-tool-choice
--tool-call-parser hermes`, tiny, default settings): `tool_calls` in OpenAI's shape, JSON and
streamed (a header delta with index, id, type and name, then the arguments, as vLLM sends them),
finish_reason "tool_calls"; `tool_choice` "required" and a named function by guided decoding;
malformed calls left as content; a conversation that sends calls and results back; the openai
SDK reading all of it.

The random-weight test model never writes a tool call by itself, so the "auto" tests make it
write one with a `structured_outputs` regex: the parser then reads what the model wrote, as it
would any model's text.
"""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest
from workers import DUPLEXKV, sse_events, start_worker, stopping

from duplexkv.server.chat_output import ChoiceParser

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>")


def writes(text: str) -> dict:
    """Make the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "w.log"
    with stopping(start_worker(tiny_model_dir, log, "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes")) as w:
        yield w


def chat(worker, **extra) -> dict:
    body = {"model": worker.name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300,
            "temperature": 0, **extra}
    r = worker.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(worker, **extra) -> tuple[dict, list[dict]]:
    """The streamed answer put together as the openai SDK does; and the tool-call deltas."""
    r = worker.post("/v1/chat/completions", {
        "model": worker.name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300,
        "temperature": 0, "stream": True, **extra})
    assert r.status_code == 200, r.text
    content, calls, deltas, finish = "", {}, [], None
    for ev in sse_events(r):
        for c in ev["choices"]:
            content += c["delta"].get("content") or ""
            for tc in c["delta"].get("tool_calls") or []:
                deltas.append(tc)
                call = calls.setdefault(tc["index"], {"id": None, "type": None,
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                call["type"] = tc.get("type") or call["type"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            finish = c["finish_reason"] or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish}, deltas


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def test_auto_reads_the_models_call_json_and_streamed(worker):
    out = chat(worker, **writes("Let me check." + CALL))["choices"][0]
    msg = out["message"]
    assert out["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather",
                                "arguments": json.dumps({"city": "Paris", "days": 2})}
    s, deltas = streamed(worker, **writes("Let me check." + CALL))
    assert s["finish_reason"] == "tool_calls" and s["content"] == "Let me check."
    assert without_ids(s["tool_calls"]) == without_ids(msg["tool_calls"])
    assert deltas[0].keys() == {"index", "id", "type", "function"}  # vLLM's header delta
    assert deltas[0]["function"] == {"name": "get_weather"}
    assert deltas[1] == {"index": 0, "function": {"arguments": call["function"]["arguments"]}}


def test_two_calls_and_an_unclosed_one(worker):
    two = CALL + "\n" + CALL.replace("get_weather", "get_time").replace(
        '{"city": "Paris", "days": 2}', '{"tz": "UTC"}')
    out = chat(worker, **writes(two))["choices"][0]
    assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == \
        ["get_weather", "get_time"]
    assert out["message"]["content"] is None
    s, _ = streamed(worker, **writes(two))
    assert without_ids(s["tool_calls"]) == without_ids(out["message"]["tool_calls"])
    unclosed = chat(worker, **writes(CALL[: -len("\n</tool_call>")]))["choices"][0]
    assert unclosed["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("text", [
    'Hmm <tool_call>{"name": 5}</tool_call> ok',
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    "a <tool_ca",
])
def test_malformed_calls_are_content(worker, text):
    out = chat(worker, **writes(text))["choices"][0]
    assert out["message"]["content"] == text and "tool_calls" not in out["message"]
    assert out["finish_reason"] == "stop"
    s, deltas = streamed(worker, **writes(text))
    assert s["content"] == text and not deltas


def test_auto_without_a_call_is_plain_content(worker):
    out = chat(worker, max_tokens=20)["choices"][0]
    assert out["finish_reason"] == "length" and "tool_calls" not in out["message"]
    assert out["message"]["content"]


def test_required_forces_calls_valid_against_the_tools(worker):
    for extra in ({}, {"parallel_tool_calls": False}, {"temperature": 1.0, "seed": 3}):
        out = chat(worker, tool_choice="required", **extra)["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        calls = out["message"]["tool_calls"]
        assert calls and out["message"]["content"] == ""  # vLLM's, for forced calls
        if extra.get("parallel_tool_calls") is False:
            assert len(calls) == 1
        for c in calls:
            schema = next(t["function"]["parameters"] for t in TOOLS
                          if t["function"]["name"] == c["function"]["name"])
            jsonschema.validate(json.loads(c["function"]["arguments"]), schema)
    s, _ = streamed(worker, tool_choice="required")
    assert s["finish_reason"] == "tool_calls"
    assert without_ids(s["tool_calls"]) == without_ids(chat(worker, tool_choice="required")
                                                       ["choices"][0]["message"]["tool_calls"])


def test_named_function_forces_its_arguments(worker):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(worker, tool_choice=named)["choices"][0]
    assert out["finish_reason"] == "stop"  # vLLM: "stop" for a named call
    [call] = out["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    s, deltas = streamed(worker, tool_choice=named)
    assert without_ids(s["tool_calls"]) == without_ids([call])
    assert deltas[0]["function"]["name"] == "get_weather" and len(deltas) > 2  # args stream


def test_calls_and_results_sent_back_render_as_qwens(worker):
    first = chat(worker, **writes(CALL))["choices"][0]["message"]
    history = MESSAGES + [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                                  "content": '{"temp": 21}'}]
    r = worker.post("/v1/chat/completions", {"model": worker.name, "messages": history,
                                             "tools": TOOLS, "max_tokens": 4,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["prompt_token_ids"]
    prompt = worker.post("/detokenize", {"model": worker.name, "tokens": ids}).json()["prompt"]
    assert CALL + "<|im_end|>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_400s(worker, extra, param):
    body = {"model": worker.name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **extra}
    r = worker.post("/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400


def test_auto_tool_choice_without_a_parser_is_refused_at_start(tiny_model_dir):
    r = subprocess.run([DUPLEXKV, "serve", str(tiny_model_dir), "--enable-auto-tool-choice"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in r.stderr


def test_openai_sdk_reads_the_calls(worker):
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=worker.name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=300, temperature=0,
                                         extra_body=writes("On it." + CALL))
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    req = client.chat.completions.create(model=worker.name, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", max_tokens=300, temperature=0)
    assert req.choices[0].message.tool_calls
    stream = client.chat.completions.create(model=worker.name, messages=MESSAGES, tools=TOOLS,
                                            max_tokens=300, temperature=0, stream=True,
                                            extra_body=writes("On it." + CALL))
    args, names = "", ""
    for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += tc.function.name or ""
            args += tc.function.arguments or ""
    assert names == "get_weather" and json.loads(args) == {"city": "Paris", "days": 2}


@pytest.mark.parametrize("text", ["plain", "a" + CALL + "b" + CALL, CALL[:40], "x <tool_c",
                                  '<tool_call>{"name": "f"}</tool_call>',
                                  "<tool_call></tool_call>"])
def test_streamed_parse_equals_the_whole(text):
    """The parser fed one character at a time gives what it gives for the whole text."""
    whole = ChoiceParser("auto").message(text)
    p = ChoiceParser("auto")
    content, args = "", []
    for i, ch in enumerate(text + " "):
        d = p.feed(ch if i < len(text) else "", final=i == len(text))
        content += d.content
        args += [tc["function"]["arguments"] for tc in d.tool_calls if "arguments" in
                 tc["function"]]
    assert (content or None if whole.get("tool_calls") else content) == whole["content"]
    assert args == [c["function"]["arguments"] for c in whole.get("tool_calls", [])]
