"""Reasoning parsers on real workers (tiny, default settings): `--reasoning-parser qwen3` (with
the Hermes tool-call parser, as Qwen3 agents are served) and `deepseek_r1` put the `<think>…
</think>` trace in vLLM 0.32's `reasoning` field, in the message and in stream deltas, and the
rest in `content`; Qwen3's `enable_thinking: false` turns it off; a JSON structured output has
no trace to look for.

The random-weight test model writes no think block by itself, so the tests make it write one
with a `structured_outputs` regex and check what the parser makes of the model's text.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from workers import sse_events, start_worker, stopping

from duplexkv.server.chat_output import ChoiceParser
from duplexkv.server.reasoning import make_splitter

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


def writes(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    with ThreadPoolExecutor(2) as pool:
        qwen = pool.submit(start_worker, tiny_model_dir, tmp / "qwen3.log", "--reasoning-parser",
                           "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
        r1 = pool.submit(start_worker, tiny_model_dir, tmp / "r1.log", "--reasoning-parser",
                         "deepseek_r1")
        with stopping(qwen.result(), r1.result()) as (q, d):
            yield {"qwen3": q, "deepseek_r1": d}


def chat(worker, stream: bool = False, **extra):
    body = {"model": worker.name, "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
            "stream": stream, **extra}
    r = worker.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()["choices"][0]
        return out["message"], out["finish_reason"]
    msg: dict = {"reasoning": "", "content": "", "tool_calls": []}
    finish = None
    for ev in sse_events(r):
        for c in ev["choices"]:
            for key in ("reasoning", "content"):
                msg[key] += c["delta"].get(key) or ""
            msg["tool_calls"] += c["delta"].get("tool_calls") or []
            finish = c["finish_reason"] or finish
            assert "reasoning_content" not in c["delta"]
    return msg, finish


CASES = [  # parser, what the model writes, reasoning, content
    ("qwen3", "<think>\nadd them\n</think>\n\nIt is 4.", "\nadd them\n", "\n\nIt is 4."),
    ("qwen3", "no tags at all", "no tags at all", None),
    ("deepseek_r1", "add them</think>It is 4.", "add them", "It is 4."),
    ("deepseek_r1", "<think>only thinking", "only thinking", None),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_trace_goes_to_reasoning_json_and_streamed(workers, parser, text, reasoning, content):
    msg, finish = chat(workers[parser], **writes(text))
    assert (msg["reasoning"], msg["content"], finish) == (reasoning, content, "stop")
    assert "reasoning_content" not in msg
    s, finish = chat(workers[parser], stream=True, **writes(text))
    assert (s["reasoning"], s["content"] or None) == (reasoning, content)


def test_qwen3_thinking_off_and_free_text(workers):
    q = workers["qwen3"]
    msg, _ = chat(q, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert msg["reasoning"] is None and msg["content"]
    msg, finish = chat(q, max_tokens=12)  # thinking on, no </think> yet: all of it is reasoning
    assert msg["content"] is None and msg["reasoning"] and finish == "length"


def test_qwen3_reasoning_then_a_tool_call(workers):
    q = workers["qwen3"]
    for text in ("<think>use add</think>\n\n" + CALL, CALL):  # a call also ends the thinking
        msg, finish = chat(q, tools=TOOLS, **writes(text))
        assert finish == "tool_calls"
        assert msg["reasoning"] == ("use add" if text != CALL else None)
        assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
        s, finish = chat(q, stream=True, tools=TOOLS, **writes(text))
        assert finish == "tool_calls" and s["reasoning"] == (msg["reasoning"] or "")


def test_json_output_has_no_trace(workers):
    schema = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0,
                                                       "maximum": 9}},
              "required": ["sum"], "additionalProperties": False}
    msg, finish = chat(workers["qwen3"], response_format={
        "type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})
    assert finish == "stop" and msg.get("reasoning") is None
    assert isinstance(json.loads(msg["content"])["sum"], int)


def test_openai_sdk_sees_reasoning(workers):
    client = openai.OpenAI(base_url=workers["qwen3"].url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=workers["qwen3"].name, messages=MESSAGES,
                                         max_tokens=100, temperature=0,
                                         extra_body=writes("<think>sum</think>4"))
    assert out.choices[0].message.model_extra["reasoning"] == "sum"
    assert out.choices[0].message.content == "4"


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>a</think>b", " <think>\nx\n</think>\n\ny " + CALL,
                                  "<thi", "plain</think", "t</think>u</think>v", ""])
def test_split_one_character_at_a_time_equals_the_whole(parser, text):
    whole = ChoiceParser("auto", None, make_splitter(parser, {})).message(text)
    p = ChoiceParser("auto", None, make_splitter(parser, {}))
    reasoning = content = ""
    for i in range(len(text) + 1):
        d = p.feed(text[i : i + 1], final=i == len(text))
        reasoning, content = reasoning + d.reasoning, content + d.content
    assert (reasoning or None) == whole["reasoning"]
    assert content == (whole["content"] or "")
