"""The Responses API through the router (issue 29): a real router (default settings) in front of
real P and D workers (TCP, bidirectional, float32, greedy) started with the tool-call and
reasoning parsers. `/v1/responses` runs as a chat turn through the turn runner, so an agent that
resends its whole input is recognised from its content, and a `previous_response_id` chain is
one conversation: both get verified reuse from turn 2, and every answer equals the same run with
reuse off. The OpenAI Agents SDK drives a streamed, tool-using agent through it; stored
responses live in the conversation store's backend, so a second router on the same Redis
continues a chain."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import pytest
from test_router import ARGS, bidi, start_router
from test_router import redis_url, tmp  # noqa: F401 - the same fixtures
from workers import start_worker, stopping

openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")
pydantic = pytest.importorskip("pydantic")

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
         "qwen3")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
TASK = ("You plan a trip. Check the weather of each city with the tool before answering. " +
        "Cities: Paris, Rome, Oslo. " * 6)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):  # noqa: F811 - test_router's fixture
    """P and D, a router at its defaults and one with --no-recognise (reuse off for clients
    without a conversation id)."""
    kv = bidi()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_worker, tiny_model_dir, tmp / f"{name}.log", *ARGS, *FLAGS,
                               *extra, kv=kv)
                   for name, extra in (("rp", ("--no-enable-prefix-caching",)), ("rd", ()))]
        p, d = (f.result() for f in futures)
    with stopping(p, d):
        on = start_router(tmp / "responses-router.log", [p.url], [d.url], placement=None)
        off = start_router(tmp / "responses-router-off.log", [p.url], [d.url], "--no-recognise",
                           placement=None)
        with stopping(on, off):
            yield p, d, on, off


def run_agent(url: str) -> tuple[list, list, str]:
    """A streamed agent whose every turn is a forced call of its one tool, stopped after three
    calls -> (the calls the tool ran, the model's response ids, the final output)."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner,
                        ToolsToFinalOutputResult, function_tool, set_tracing_disabled)

    set_tracing_disabled(True)
    ran: list = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"],
                    days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
        """The forecast of a city."""
        ran.append((city, days))
        return f"{city}: sunny for {days} days, 21 C"

    def stop_after_three(_ctx, results) -> ToolsToFinalOutputResult:
        done = len(ran) >= 3
        return ToolsToFinalOutputResult(is_final_output=done,
                                        final_output=results[-1].output if done else None)

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="planner", instructions="Use the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(temperature=0, tool_choice="required",
                                               max_tokens=64, parallel_tool_calls=False),
                  reset_tool_choice=False, tool_use_behavior=stop_after_three)

    async def go():
        result = Runner.run_streamed(agent, TASK, max_turns=6)
        async for _ in result.stream_events():
            pass
        await client.close()
        return [r.response_id for r in result.raw_responses], result.final_output

    ids, final = asyncio.run(go())
    return ran, ids, final


def stored(router, response_id: str) -> dict:
    r = router.get(f"/v1/responses/{response_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_an_agent_reuses_from_turn_2_and_answers_as_reuse_off(cluster):
    p, d, on, off = cluster
    ran_on, ids_on, final_on = run_agent(on.url)
    ran_off, ids_off, final_off = run_agent(off.url)
    assert len(ran_on) == 3 and len(ids_on) == 3, (ran_on, ids_on)
    assert (ran_on, final_on) == (ran_off, final_off)
    for t, (a, b) in enumerate(zip(ids_on, ids_off)):
        got, ref = stored(on, a), stored(off, b)
        calls = [(i["name"], i["arguments"]) for i in got["output"]
                 if i["type"] == "function_call"]
        assert calls and calls == [(i["name"], i["arguments"]) for i in ref["output"]
                                   if i["type"] == "function_call"]
        stats = got["kv_stats"]
        if t == 0:
            assert stats["recognised"] is False and stats["conversation"] == "miss", stats
        else:
            assert stats["recognised"] is True and stats["conversation"] == "hit", stats
            assert stats["placement"] == "decode_local", stats
            assert stats["decode"]["decode_local"]["reused_tokens"] > 0, stats
        assert "recognised" not in ref["kv_stats"] and ref["kv_stats"]["conversation"] == "none"
    d.assert_integrity()


def chain(router, reuse: bool = True, via: tuple = ()) -> list:
    """Three turns chained by previous_response_id: a forced tool call, its result (streamed), a
    question (`via`: the router of each turn, default `router`)."""
    routers = via or (router, router, router)
    extra = {} if reuse else {"conversation_id": ""}
    kw = dict(model="tiny", temperature=0, max_output_tokens=48, tools=TOOLS, extra_body=extra)
    first = routers[0].client().responses.create(input=TASK, tool_choice="required", **kw)
    call = next(i for i in first.output if i.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    events = list(routers[1].client().responses.create(  # streamed: its key is kept as well
        input=[result], previous_response_id=first.id, tool_choice="none", stream=True, **kw))
    assert events[-1].type in ("response.completed", "response.incomplete")
    second = events[-1].response
    third = routers[2].client().responses.create(
        input="And the next city?", previous_response_id=second.id, tool_choice="none", **kw)
    return [first, second, third]


def check_chain(got: list, ref: list) -> None:
    for t, (a, b) in enumerate(zip(got, ref)):
        assert [i.model_dump(exclude={"id", "call_id"}) for i in a.output] \
            == [i.model_dump(exclude={"id", "call_id"}) for i in b.output], t
        stats = a.model_extra["kv_stats"]
        if t:
            assert stats["conversation"] == "hit", stats
            assert stats["decode"]["decode_local"]["reused_tokens"] > 0, stats
        assert b.model_extra["kv_stats"]["conversation"] == "none"


def test_a_previous_response_id_chain_is_one_conversation(cluster):
    _p, _d, on, _off = cluster
    before = on.metric("duplexkv_router_requests_total", endpoint="responses", outcome="ok")
    check_chain(chain(on), chain(on, reuse=False))
    assert on.metric("duplexkv_router_requests_total", endpoint="responses",
                     outcome="ok") == before + 6


def test_a_chain_with_recognition_off_reuses_from_turn_3(cluster):
    """Nothing is recognised, so the chain names itself after its first response."""
    _p, _d, _on, off = cluster
    got, ref = chain(off), chain(off, reuse=False)
    assert got[1].model_extra["kv_stats"]["conversation"] == "miss"
    assert got[2].model_extra["kv_stats"]["conversation"] == "hit"
    assert [r.output_text for r in got] == [r.output_text for r in ref]


def test_a_second_router_on_one_redis_continues_the_chain(cluster, redis_url, tmp):  # noqa: F811
    p, d, on, _off = cluster
    ra = start_router(tmp / "responses-redis-a.log", [p.url], [d.url], "--store", redis_url,
                      placement=None)
    rb = start_router(tmp / "responses-redis-b.log", [p.url], [d.url], "--store", redis_url,
                      placement=None)
    with stopping(ra, rb):
        got = chain(ra, via=(ra, rb, ra))
        check_chain(got, chain(on, reuse=False))
        assert rb.get(f"/v1/responses/{got[0].id}").json()["id"] == got[0].id
        # the third link lists the chain's inputs and outputs then its own input, through Redis
        # from the router that did not make it, as the one that did
        listed = [it.id for it in rb.client().responses.input_items.list(got[2].id,
                                                                          order="asc")]
        made = [it.id for it in ra.client().responses.input_items.list(got[1].id, order="asc")]
        outputs = [[o.id for o in r.output] for r in got]
        assert listed[:len(made)] == made and made[-len(outputs[0]) - 1:-1] == outputs[0]
        assert listed[len(made):len(made) + len(outputs[1])] == outputs[1]
        assert len(listed) == len(made) + len(outputs[1]) + 1
        rb.client().responses.delete(got[2].id)
        assert ra.get(f"/v1/responses/{got[2].id}").status_code == 404


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_through_p_and_d_a_response_equals_one_worker(cluster, stream):
    """The router's answer (P leg + D leg) equals D's own answer to the same request: forced
    tool calls, text with a reasoning trace, a json_schema format (ids aside)."""
    _p, d, on, _off = cluster
    requests = [dict(input=TASK, tools=TOOLS, tool_choice="required"),
                dict(input="Think first, then say hello.", instructions="Be brief."),
                dict(input="Give the weather as JSON.", text={"format": {
                    "type": "json_schema", "name": "weather", "schema": WEATHER,
                    "strict": True}})]
    for kw in requests:
        got = []
        for url in (on.url, d.url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            if stream:
                events = list(client.responses.create(model="tiny", temperature=0,
                                                      max_output_tokens=48, stream=True, **kw))
                r = events[-1].response
                got.append([e.type for e in events])
            else:
                r = client.responses.create(model="tiny", temperature=0, max_output_tokens=48,
                                            **kw)
            got.append((r.status, [i.model_dump(exclude={"id", "call_id"}) for i in r.output]))
        half = len(got) // 2
        assert got[:half] == got[half:], kw


def test_errors_through_the_router(cluster):
    _p, _d, on, _off = cluster
    client = on.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    assert on.get(f"/v1/responses/{r.id}").status_code == 404
    for body, param in (({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0].type"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                        ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens")):
        resp = on.post("/v1/responses", {"model": "tiny", **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = on.post("/v1/responses", b'{"input": ' + b"[" * 200 + b"]" * 200 + b"}")
    assert resp.status_code == 400, resp.text
    resp = on.post("/v1/responses", {"model": "nope", "input": "hi"})
    assert resp.status_code == 404, resp.text
    # a stream's error before the first event is the worker's 4xx, relayed
    resp = on.post("/v1/responses", {"model": "tiny", "input": "hi", "stream": True,
                                     "temperature": -1})
    assert resp.status_code == 400, resp.text
    assert json.loads(resp.text)["error"]["type"] == "invalid_request_error"


def test_stored_responses_belong_to_their_api_key(cluster, tmp):  # noqa: F811
    p, d, _on, _off = cluster
    ka, kb = "responses-key-a", "responses-key-b"
    with stopping(start_router(tmp / "responses-keys.log", [p.url], [d.url], "--api-key", ka,
                               "--api-key", kb, placement=None)) as r:
        a, b = r.client(ka), r.client(kb)
        first = a.responses.create(model="tiny", input="hi", max_output_tokens=4)
        assert a.responses.retrieve(first.id).id == first.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model="tiny", input="more", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.input_items.list(first.id)
        assert [it.type for it in a.responses.input_items.list(first.id)] == ["message"]
        assert a.responses.create(model="tiny", input="more", max_output_tokens=4,
                                  previous_response_id=first.id).previous_response_id == first.id
        with pytest.raises(openai.AuthenticationError):
            r.client("wrong").responses.retrieve(first.id)
        big = b'{"model": "tiny", "input": "' + b"x" * (5 << 20) + b'"}'
        resp = r.post("/v1/responses", big, authorization=f"Bearer {ka}")
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"


# --- fuzz: whatever a client sends to /v1/responses is a 2xx or a 4xx, never a 5xx ----------
def _fuzz_strategies():
    from hypothesis import strategies as st
    from test_router_fuzz import FIELDS, headers, json_values, mangled, safe_text, text

    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                           "input_image", "refusal", "x"]),
                                  "text": st.one_of(safe_text, json_values)})
    content = st.one_of(safe_text, st.lists(part, max_size=2), json_values)
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                        "developer", "tool"]),
                               "content": content}),
        st.fixed_dictionaries({"type": st.just("function_call"),
                               "call_id": st.one_of(safe_text, json_values),
                               "name": st.sampled_from(["get_weather", "nope"]),
                               "arguments": st.one_of(st.just('{"city": "Rome", "days": 2}'),
                                                      json_values)}),
        st.fixed_dictionaries({"type": st.just("function_call_output"),
                               "call_id": st.one_of(safe_text, json_values),
                               "output": st.one_of(safe_text, json_values)}),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference",
                                                        "web_search_call"]),
                               "content": st.lists(part, max_size=2)}),
        json_values)
    fields = {
        "input": (st.one_of(safe_text.filter(bool), st.lists(item, min_size=1, max_size=4)),
                  json_values),
        "max_output_tokens": FIELDS["max_tokens"],
        "model": FIELDS["model"], "stream": FIELDS["stream"],
        "temperature": FIELDS["temperature"], "top_p": FIELDS["top_p"],
        "instructions": (safe_text, json_values),
        "store": (st.booleans(), json_values),
        "previous_response_id": (st.none(), st.one_of(st.just("resp_unknown"), json_values)),
        "tools": (st.just(TOOLS), st.one_of(st.lists(json_values, max_size=2), json_values)),
        "tool_choice": (st.just("none"), st.one_of(st.sampled_from([
            "required", "auto", {"type": "function", "name": "get_weather"}]), json_values)),
        "text": (st.sampled_from([{"format": {"type": "text"}},
                                  {"format": {"type": "json_object"}}]), json_values),
        "metadata": (st.dictionaries(st.text("abc", max_size=3), st.text("xyz", max_size=3),
                                     max_size=2), json_values),
        "parallel_tool_calls": (st.booleans(), json_values),
        "reasoning": (st.none(), json_values), "include": (st.just([]), json_values),
        "background": (st.just(False), json_values),
    }

    @st.composite
    def bodies(draw) -> dict:
        names = ["input", "max_output_tokens", "model"] + draw(
            st.lists(st.sampled_from(sorted(fields)[3:]), max_size=5, unique=True))
        mode = draw(st.integers(0, 99))
        bad = set() if mode < 20 else {draw(st.sampled_from(names))} if mode < 60 else set(names)
        body = {n: draw(fields[n][n in bad]) for n in names}
        if mode >= 60 and draw(st.integers(0, 9)) == 0:
            body[draw(text)] = draw(json_values)
        return body

    raw = st.one_of(bodies().map(lambda b: json.dumps(b).encode()),
                    mangled("chat").map(lambda b: b.replace(b'"messages"', b'"input"')))
    return raw, headers


def _check_answer(r, ctx: str) -> int:
    assert r.status_code < 500, ctx
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, ctx
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        last = [e for e in r.text.split("\n\n") if e.strip()][-1]
        assert last.split("\n")[0] in ("event: response.completed", "event: response.incomplete",
                                       "event: error"), ctx
        assert "internal_server_error" not in r.text, ctx
    else:
        assert r.json()["object"] == "response", ctx
    return r.status_code


@pytest.mark.parametrize("target", ["worker", "router"])
def test_fuzz_responses_never_5xx(cluster, target):
    import os
    from collections import Counter

    import httpx
    from hypothesis import HealthCheck, given, settings

    _p, d, on, _off = cluster
    url = d.url if target == "worker" else on.url
    raw, headers = _fuzz_strategies()
    seen: Counter[int] = Counter()
    with httpx.Client(base_url=url, timeout=60) as client:
        @settings(max_examples=int(os.environ.get("DUPLEXKV_FUZZ_EXAMPLES", "200")),
                  deadline=None, database=None,
                  derandomize=not os.environ.get("DUPLEXKV_FUZZ_RANDOM"),
                  suppress_health_check=list(HealthCheck))
        @given(content=raw, extra=headers)
        def run(content: bytes, extra: dict) -> None:
            h = {"content-type": "application/json", **extra}
            if target == "worker":
                h.pop("authorization", None)
            r = client.post("/v1/responses", content=content, headers=h)
            seen[_check_answer(r, f"{content[:300]!r} {extra!r}: {r.status_code} "
                                  f"{r.text[:500]}")] += 1

        run()
        print(f"{target}: {dict(sorted(seen.items()))}")
        assert seen[200] >= sum(seen.values()) // 20, seen  # the workers are reached too
        assert client.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                  "max_output_tokens": 2}).status_code == 200
