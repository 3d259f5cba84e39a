"""Tool calls, structured output and reasoning through the router (issue 29): a real router
(default settings) in front of real P and D workers (TCP, bidirectional, float32, greedy), both
started as vLLM's users start them (`--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3`), driven by the `openai` SDK. The oracle is one worker with the same
flags answering the same request: the router forwards `tools`, `tool_choice`, `response_format`
and `structured_outputs` unchanged to both legs, D parses the tool calls and the reasoning, and
the router passes D's answer on, so every message, tool call, finish_reason and stream delta is
equal to the single worker's (tool call ids aside: each is a fresh random id). A tool-using
conversation sent back without a conversation id is recognised from turn 2 on.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import jsonschema
import pytest
from test_router import ARGS, MODEL, Router, bidi, start_router
from test_router import tmp  # noqa: F401 - the same fixture
from workers import Worker, start_worker, stopping

openai = pytest.importorskip("openai")

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
         "qwen3")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@dataclass(frozen=True)
class Cluster:
    router: Router
    one: Worker  # the oracle: a single worker with the same flags
    p: Worker
    d: Worker


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):  # noqa: F811 - test_router's fixture
    """P and D behind a router (default settings) and a single worker, all with the same flags."""
    kv = bidi()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_worker, tiny_model_dir, tmp / f"{name}.log", *ARGS, *FLAGS,
                               *extra, kv=kv if name != "one" else None)
                   for name, extra in (("tp", ("--no-enable-prefix-caching",)), ("td", ()),
                                       ("one", ()))]
        p, d, one = (f.result() for f in futures)
    with stopping(p, d, one):
        with stopping(start_router(tmp / "tools-router.log", [p.url], [d.url],
                                   placement=None)) as r:
            yield Cluster(r, one, p, d)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def no_ids(obj):
    """`obj` with every tool call id blanked (each is a fresh random id)."""
    if isinstance(obj, dict):
        return {k: "<id>" if k == "id" and isinstance(v, str) and v.startswith("chatcmpl-tool")
                else no_ids(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_ids(v) for v in obj]
    return obj


def ask(url: str, messages: list[dict], stream: bool, **extra) -> tuple[dict, dict | None]:
    """One chat request by the SDK -> (the choice as JSON, or the stream's deltas gathered as
    {"deltas", "finish_reason"}; the router's kv_stats, if any)."""
    kw = {"model": MODEL, "messages": messages, "max_tokens": 120, "temperature": 0,
          "extra_body": extra}
    if not stream:
        r = client(url).chat.completions.create(**kw)
        assert (r.model_extra or {}).get("kv_transfer_params") is None
        return r.choices[0].model_dump(exclude_none=True), (r.model_extra or {}).get("kv_stats")
    deltas, finish, stats = [], None, None
    for chunk in client(url).chat.completions.create(**kw, stream=True):
        extra_fields = chunk.model_extra or {}
        assert extra_fields.get("kv_transfer_params") is None
        stats = extra_fields.get("kv_stats") or stats
        for c in chunk.choices:
            deltas.append(c.delta.model_dump(exclude_none=True))
            finish = c.finish_reason or finish
    return {"deltas": deltas, "finish_reason": finish}, stats


def gathered(streamed: dict) -> dict:
    """A stream's deltas folded into one message: content, reasoning and tool calls by index."""
    msg: dict = {"content": "", "reasoning": "", "tool_calls": {}}
    for d in streamed["deltas"]:
        msg["content"] += d.get("content") or ""
        msg["reasoning"] += d.get("reasoning") or ""
        for tc in d.get("tool_calls") or []:
            call = msg["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
            fn = tc.get("function") or {}
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return msg


def same(cluster: Cluster, messages: list[dict], stream: bool, **extra) -> tuple[dict, dict]:
    """The router's answer, asserted equal to the single worker's -> (it, kv_stats)."""
    got, stats = ask(cluster.router.url, messages, stream, **extra)
    want, _ = ask(cluster.one.url, messages, stream, **extra)
    assert no_ids(got) == no_ids(want)
    assert stats is not None
    return got, stats


MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_equal_one_worker(cluster, stream, choice):
    got, _ = same(cluster, MESSAGES, stream, tools=TOOLS, tool_choice=choice)
    # vLLM's finish_reason: "tool_calls" for "required", "stop" for a named function
    assert got["finish_reason"] == ("tool_calls" if choice == "required" else "stop")
    calls = (got["message"]["tool_calls"] if not stream
             else list(gathered(got)["tool_calls"].values()))
    assert calls
    for call in calls:
        fn = call.get("function", call)
        assert fn["name"] in ("get_weather", "get_time")
        if choice == NAMED:
            assert fn["name"] == "get_weather"
            jsonschema.validate(json.loads(fn["arguments"]), WEATHER)
    if stream:  # vLLM's shape: a header delta with index, id, type and name, then arguments
        heads = [tc for d in got["deltas"] for tc in d.get("tool_calls") or [] if "id" in tc]
        assert heads and all(h["type"] == "function" and h["function"]["name"] for h in heads)
        assert all(h["id"].startswith("chatcmpl-tool-") for h in heads)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_json_schema_output_equals_one_worker(cluster, stream):
    got, _ = same(cluster, MESSAGES, stream, response_format={
        "type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}})
    text = got["message"]["content"] if not stream else gathered(got)["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert got["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_reasoning_and_an_auto_tool_call_arrive_intact(cluster, stream):
    """tool_choice "auto" (parsed by D's hermes parser) after a think block (D's qwen3 parser);
    the random-weight model writes them because a regex makes it."""
    regex = re.escape("<think>use the clock</think>\n\n" + CALL)
    got, _ = same(cluster, MESSAGES, stream, tools=TOOLS,
                  structured_outputs={"regex": regex})
    assert got["finish_reason"] == "tool_calls"
    msg = got["message"] if not stream else gathered(got)
    assert msg["reasoning"] == "use the clock"
    calls = msg["tool_calls"] if not stream else list(msg["tool_calls"].values())
    fn = calls[0].get("function", calls[0])
    assert fn == {"name": "get_time", "arguments": '{"tz": "CET"}'}


def as_history(answer: dict, stream: bool) -> dict:
    """The assistant message a client sends back for `answer` (the SDK's own view of it)."""
    if not stream:
        msg = dict(answer["message"])
        msg.pop("reasoning", None)
        return msg
    heads = [tc for d in answer["deltas"] for tc in d.get("tool_calls") or [] if "id" in tc]
    folded = gathered(answer)
    calls = [{"id": h["id"], "type": "function",
              "function": folded["tool_calls"][h["index"]]} for h in heads]
    msg = {"role": "assistant", "content": folded["content"] or None}
    return {**msg, "tool_calls": calls} if calls else msg


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_using_conversation_reuses_from_turn_2(cluster, stream):
    """Calls and their results sent back, with no conversation id: from turn 2 the router
    recognises the conversation (D's answer rebuilt with its tool calls) and D reuses its KV;
    every answer equals the single worker's."""
    d = cluster.d
    reused = d.kv()["decode_local"]["reused"]
    messages = [{"role": "system", "content": f"You call tools. {stream} " + "ok; " * 20},
                *MESSAGES]
    choices = ["required", NAMED, "none"]
    for t, choice in enumerate(choices):
        got, stats = same(cluster, messages, stream, tools=TOOLS, tool_choice=choice)
        if t == 0:
            assert stats["recognised"] is False, stats
        else:
            assert stats["recognised"] is True and stats["conversation"] == "hit", stats
            assert stats["decode"]["decode_local"]["outcome"] == "reused", stats
            assert stats["decode"]["decode_local"]["reused_tokens"] > 0
        answer = as_history(got, stream)
        messages.append(answer)
        for call in answer.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": json.dumps({"result": f"sunny {t}"})})
        if not answer.get("tool_calls"):
            messages.append({"role": "user", "content": f"and then {t}?"})
    assert d.kv()["decode_local"]["reused"] >= reused + 2
    d.assert_integrity()


BAD = [  # (extra, the field the 400 names): the router's shape checks, the worker's own messages
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_guided_requests_are_the_workers_400_on_the_router(cluster, extra, param):
    router, one = cluster.router, cluster.one
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    for url in (router.url, one.url):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (url, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_a_schema_the_engine_cannot_compile_is_relayed_as_a_400(cluster):
    """Compiling a grammar needs the tokenizer: P's worker says no, the router relays it."""
    router, one = cluster.router, cluster.one
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
            "structured_outputs": {"grammar": "start: ???"}}
    answers = [httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
               for url in (router.url, one.url)]
    assert [a.status_code for a in answers] == [400, 400], [a.text for a in answers]
    assert answers[0].json()["error"]["param"] == answers[1].json()["error"]["param"]


ODD = [  # shapes the router lets through: what the workers make of them, never a 5xx
    {"structured_outputs": {"regex": "("}},
    {"structured_outputs": {"json": "{not json"}},
    {"structured_outputs": {"choice": []}},
    {"structured_outputs": {"grammar": ""}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
]


@pytest.mark.parametrize("extra", ODD, ids=[f"odd-{i}" for i in range(len(ODD))])
def test_odd_guided_requests_get_the_single_workers_status(cluster, extra):
    router, one = cluster.router, cluster.one
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    got, want = (httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
                 for url in (router.url, one.url))
    assert got.status_code == want.status_code and got.status_code < 500, (got.text, want.text)
    if got.status_code == 400:
        assert got.json()["error"]["param"] == want.json()["error"]["param"]


def test_through_p_a_tool_conversation_pulls_its_history(cluster, tmp):  # noqa: F811
    """--placement prefill: P reads the recognised history from D, then computes the first token
    under the forced tool choice; the answers still equal the single worker's."""
    with stopping(start_router(tmp / "tools-router-prefill.log", [cluster.p.url],
                               [cluster.d.url])) as r:
        messages = [{"role": "system", "content": "Pulled tools. " + "ok; " * 30}, *MESSAGES]
        for t, choice in enumerate(["required", NAMED]):
            prefilled = Cluster(r, cluster.one, cluster.p, cluster.d)
            got, stats = same(prefilled, messages, t == 1, tools=TOOLS, tool_choice=choice)
            if t:
                assert stats["recognised"] is True, stats
                assert stats["prefill"]["pull_outcome"] == "pulled", stats
            answer = as_history(got, t == 1)
            messages += [answer, *({"role": "tool", "tool_call_id": c["id"], "content": "ok"}
                                   for c in answer["tool_calls"])]
