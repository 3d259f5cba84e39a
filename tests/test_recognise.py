"""A conversation recognised from its content (router/conversation/recognise.py, answer.py), in
process: the canonical form, the prefix keys and their namespace, the answer D produced as the
router sees it, and the recall through the store. Through real workers: test_router_recognise.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from duplexkv.router.conversation.answer import StreamedAnswer, json_answer
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.conversation.recognise import MAX_LOOKUPS, canonical, recognition_of
from duplexkv.router.conversation.store import Entry, MemoryStore, conversation_key
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.placement import PlacementConfig
from duplexkv.router.request import ClientRequest, parse_client_request
from duplexkv.router.turn.plan import plan_turn

SYSTEM = {"role": "system", "content": "be brief"}


def chat(messages: list, api_key: str | None = "k1", model: str = "m", **body) -> ClientRequest:
    return ClientRequest("chat", {"model": model, "messages": messages, **body}, False, model,
                         None, api_key, None)


def turn(n: int) -> list[dict]:
    out = [SYSTEM]
    for t in range(n):
        out += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": f"a{t}"}]
    return out


def test_the_answer_key_of_a_turn_is_the_next_turns_newest_candidate():
    first = recognition_of(chat(turn(0) + [{"role": "user", "content": "q0"}]))
    assert first.candidates == ()  # no assistant message: nothing to look up
    key = first.answer_key({"role": "assistant", "content": "a0"})
    second = recognition_of(chat(turn(1) + [{"role": "user", "content": "q1"}]))
    assert second.candidates[0] == key
    # tool results after the answer: still the newest assistant prefix first
    calls = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    msg = {"role": "assistant", "content": None, "tool_calls": calls}
    r = recognition_of(chat(turn(1) + [{"role": "user", "content": "q1"}]))
    nxt = recognition_of(chat(turn(1) + [{"role": "user", "content": "q1"}, msg,
                                         {"role": "tool", "tool_call_id": "c1", "content": "x"},
                                         {"role": "tool", "tool_call_id": "c2", "content": "y"}]))
    assert nxt.candidates[0] == r.answer_key(msg) and nxt.candidates[1] == key


def test_lookups_are_bounded_newest_first():
    r = recognition_of(chat(turn(6) + [{"role": "user", "content": "q6"}]))
    assert len(r.candidates) == MAX_LOOKUPS
    prefixes = [recognition_of(chat(turn(t) + [{"role": "user", "content": "x"}]))
                for t in (6, 5, 4)]
    assert list(r.candidates) == [p.candidates[0] for p in prefixes]


def test_canonical_form_keeps_what_makes_the_prompt_and_drops_the_rest():
    plain = {"role": "assistant", "content": "a\nb"}
    same = [{"role": "assistant", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "a\nb", "reasoning_content": "hmm",
             "reasoning": "hmm", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": []}]
    for m in same:
        assert canonical(m) == canonical(plain), m
    assert canonical({"role": "assistant", "content": None}) == \
        canonical({"role": "assistant", "content": ""})
    differ = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "a b"},
              {**plain, "name": "bot"}, {**plain, "tool_call_id": "c"},
              {**plain, "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                "arguments": "{}"}}]}]
    assert len({canonical(m) for m in differ} | {canonical(plain)}) == len(differ) + 1
    # the hashing's inline plain case is canonical()'s
    extra = [{**m, "refusal": None} for m in turn(2)] + [{"role": "user", "content": "é"}]
    assert recognition_of(chat(extra)) == recognition_of(chat([
        {"role": m["role"], "content": m["content"]} for m in extra]))
    # self-delimiting: moving text across a message boundary changes the key
    a = recognition_of(chat([{"role": "user", "content": "ab"},
                             {"role": "assistant", "content": "c"}, SYSTEM]))
    b = recognition_of(chat([{"role": "user", "content": "a"},
                             {"role": "assistant", "content": "bc"}, SYSTEM]))
    assert a.candidates != b.candidates


def test_keys_are_namespaced_by_api_key_model_and_tools():
    msgs = turn(1) + [{"role": "user", "content": "q1"}]
    base = recognition_of(chat(msgs)).candidates
    assert recognition_of(chat(msgs)).candidates == base
    for other in (chat(msgs, api_key="k2"), chat(msgs, api_key=None), chat(msgs, model="m2"),
                  chat(msgs, tools=[{"type": "function", "function": {"name": "f"}}]),
                  chat(msgs, chat_template_kwargs={"enable_thinking": False})):
        assert recognition_of(other).candidates[0] != base[0]
    # an explicit id's store key lives in another domain
    assert base[0] != conversation_key("k1", base[0])


@pytest.mark.parametrize("raw, headers, recognised", [
    ({"messages": [{"role": "user", "content": "x"}]}, {}, True),
    ({"messages": [{"role": "user", "content": "x"}], "conversation_id": "c"}, {}, False),
    ({"messages": [{"role": "user", "content": "x"}]}, {"x-session-id": "c"}, False),
    ({"messages": [{"role": "user", "content": "x"}], "conversation_id": ""}, {}, False),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, {}, False),
])
def test_which_requests_are_recognised(raw, headers, recognised):
    req = parse_client_request(json.dumps({"model": "m", **raw}).encode(), headers, "chat")
    assert (recognition_of(req) is not None) == recognised
    comp = parse_client_request(json.dumps({"model": "m", "prompt": "x"}).encode(), {},
                                "completion")
    assert recognition_of(comp) is None  # raw prompts: not recognised (docs/router.md)


@pytest.mark.parametrize("messages", [
    [1, "x", None, {"role": 5, "content": {"a": [1]}}],
    [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "u"}}, 3],
      "tool_calls": "nope"}, {"role": "assistant", "tool_calls": [1, {"function": 2}]}],
    [{"role": "user", "content": "\ud800 lone surrogate"}],
])
def test_odd_messages_never_raise(messages):
    r = recognition_of(chat(messages))
    assert r is not None and len(r.own_key) == 40
    assert r.answer_key({"role": "assistant", "content": "\udfff"}) is not None


def test_streamed_answer_is_the_json_answer():
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "grep", "arguments": '{"p": "x"}'}}]
    message = {"role": "assistant", "content": "I will look.", "tool_calls": calls}
    assert json_answer({"choices": [{"index": 0, "message": message}]}) is message
    s = StreamedAnswer()
    for choice in (
            {"index": 0, "delta": {"role": "assistant", "content": ""}},
            {"index": 0, "delta": {"content": "I will "}},
            {"index": 1, "delta": {"content": "other choice"}},
            {"index": 0, "delta": {"content": "look."}},
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                   "function": {"name": "grep",
                                                                "arguments": ""}}]}},
            {"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                   "function": {"arguments": '{"p": '}}]}},
            {"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                   "function": {"arguments": '"x"}'}}]}},
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"}):
        s.feed(choice)
    assert canonical(s.message()) == canonical(message)
    broken = StreamedAnswer()
    broken.feed({"index": 0, "delta": {"tool_calls": [{"index": "x"}]}})
    assert broken.message() is None
    assert json_answer({"choices": []}) is None and json_answer({"choices": [3]}) is None


def test_recall_finds_the_newest_stored_prefix_and_an_explicit_id_wins():
    async def run():
        store, metrics = MemoryStore(60, 100), RouterMetrics()
        conv = Conversations(store, metrics)
        msgs = turn(2) + [{"role": "user", "content": "q2"}]
        r = recognition_of(chat(msgs))
        older, newest = r.candidates[1], r.candidates[0]
        await store.put(older, Entry({"remote_request_id": "old"}, "http://d", 0.0))
        got = await conv.recall("k1", None, "req", r)
        assert (got.key, got.state, got.recognised) == (older, "hit", True)
        assert got.entry.params["remote_request_id"] == "old" and await store.size() == 0
        await store.put(newest, Entry({"remote_request_id": "new"}, "http://d", 0.0))
        explicit = await conv.recall("k1", "conv-1", "req", r)  # an explicit id wins
        assert (explicit.state, explicit.recognised) == ("miss", None)
        assert await store.size() == 1  # the content's entry was not touched
        got = await conv.recall("k1", None, "req", r)
        assert got.entry.params["remote_request_id"] == "new"
        miss = await conv.recall("k1", None, "req", r)
        assert (miss.key, miss.state, miss.recognised) == (r.own_key, "miss", False)
        plan = plan_turn(chat(msgs), miss, None, PlacementConfig())
        assert plan.key == r.own_key and plan.decode_order(None, None).recognition is r
        answer = {"role": "assistant", "content": "a2"}
        assert plan.decode_order(None, None).next_key(lambda: answer) == r.answer_key(answer)
        assert plan.decode_order(None, None).next_key(lambda: None) is None
        assert metrics.recognised.labels("matched")._value.get() == 2
        assert metrics.recognised.labels("unmatched")._value.get() == 1
    asyncio.run(run())


def test_tool_call_arguments_match_by_their_value_not_their_spacing():
    """A client that re-serialises a call's arguments (an Anthropic client sends a call back as
    a tool_use `input` object) still finds the turn: only a hint, the tokens are verified."""
    def call(arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    compact, spaced = call('{"city":"Oslo","days":2}'), call('{"city": "Oslo", "days": 2}')
    assert canonical(compact) == canonical(spaced)
    for other in ('{"city": "Bergen", "days": 2}', '{"city": "Oslo"', "[1]", ""):
        assert canonical(call(other)) != canonical(spaced), other
