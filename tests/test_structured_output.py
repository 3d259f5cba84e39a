"""Structured output on a real worker (tiny, default settings): `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` (json, regex, choice, grammar), JSON and streamed,
through HTTP and the `openai` SDK. Every answer that ends by itself ("stop") is valid against its
schema; a request with a grammar and one without run in the same engine steps, and the one without
answers token for token what it answers alone; bad schemas, grammars and combinations are 400s in
OpenAI's error shape.

The random-weight test model writes digits and string characters without end unless a schema
bounds them, so the schemas here bound their numbers and most strings (unbounded ones are valid
too, only long: an answer cut by max_tokens is "length", as in vLLM).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from workers import (decode_leg, kv_config, prefill_leg, sse_events, start_p_and_d,
                     start_worker, stopping)

openai = pytest.importorskip("openai")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -1000, "maximum": 1000},
     "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10,
                                            "multipleOf": 0.25},
                                      "y": {"type": "number", "minimum": 0, "maximum": 1.5,
                                            "multipleOf": 0.5},
                                      "unit": {"const": "m"}},
     "required": ["x", "y", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"type": "string", "enum": ["cat", "dog"]},
                                      "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                      "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["kind", "legs", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 999}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "maximum": 50, "minimum": 0},
               {"type": "object", "properties": {"v": {"type": "boolean"}},
                "required": ["v"], "additionalProperties": False}]},
]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with stopping(start_worker(tiny_model_dir, tmp_path_factory.mktemp("so") / "w.log")) as w:
        yield w


def chat(worker, **extra) -> dict:
    r = worker.post("/v1/chat/completions", {"model": worker.name, "messages": MESSAGES,
                                             "max_tokens": 400, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_answer_is_valid_against_its_schema(worker, i):
    schema = SCHEMAS[i]
    for seed in range(3):  # greedy and two samples
        sampling = {"temperature": 0} if seed == 0 else {"temperature": 1.0, "seed": seed}
        out = chat(worker, response_format=schema_format(schema), **sampling)["choices"][0]
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["message"]["content"]), schema)


def test_structured_outputs_json_regex_choice_grammar(worker):
    so = [({"json": SCHEMAS[1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])),
          ({"json": json.dumps(SCHEMAS[2])}, lambda t: jsonschema.validate(json.loads(t),
                                                                            SCHEMAS[2])),
          ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or 1 / 0),
          ({"regex": r"[0-9]{3}-[a-z]{2,4}"},
           lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or 1 / 0),
          ({"choice": ["yes", "no", "maybe later"]},
           lambda t: t in ("yes", "no", "maybe later") or 1 / 0),
          ({"grammar": 'start: "ab" NUM\nNUM: /[0-9]{2}/'},
           lambda t: re.fullmatch(r"ab[0-9]{2}", t) or 1 / 0)]
    for spec, check in so:
        out = chat(worker, structured_outputs=spec, temperature=0)["choices"][0]
        assert out["finish_reason"] == "stop", (spec, out)
        check(out["message"]["content"])
    r = worker.post("/v1/completions", {"model": worker.name, "prompt": "def f(x):",
                                        "max_tokens": 50, "temperature": 0,
                                        "structured_outputs": {"regex": "[a-z]{1,8} = [0-9]"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-z]{1,8} = [0-9]", r.json()["choices"][0]["text"])
    r = worker.post("/v1/completions", {"model": worker.name, "prompt": "x", "max_tokens": 400,
                                        "temperature": 0,
                                        "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


def test_the_grammar_wins_over_bans_that_leave_it_no_token(worker):
    """min_tokens bans eos and the stop token ids the grammar needs: the answer still follows
    the grammar and ends (200, never a failed request)."""
    stop_ids = worker.post("/tokenize", {"model": worker.name, "prompt": "yes"}).json()["tokens"]
    for extra in ({"min_tokens": 5}, {"min_tokens": 3, "stop_token_ids": stop_ids[:1]}):
        out = chat(worker, structured_outputs={"choice": ["yes", "no"]}, **extra)["choices"][0]
        assert out["finish_reason"] == "stop" and out["message"]["content"] in ("yes", "no")


def test_streamed_with_n_choices(worker):
    r = worker.post("/v1/chat/completions", {
        "model": worker.name, "messages": MESSAGES, "max_tokens": 400, "n": 2, "seed": 7,
        "stream": True, "response_format": schema_format(SCHEMAS[3])})
    assert r.status_code == 200, r.text
    text = {0: "", 1: ""}
    finish = {}
    for ev in sse_events(r):
        for c in ev["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert finish == {0: "stop", 1: "stop"}
    for t in text.values():
        jsonschema.validate(json.loads(t), SCHEMAS[3])


def test_a_grammar_beside_free_requests_changes_nothing_of_theirs(worker):
    """Requests with and without grammars batched in the same steps: the free ones answer, token
    for token, what they answer alone (greedy)."""
    free = {"model": worker.name, "prompt": "import os\n", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    alone = worker.post("/v1/completions", free).json()["choices"][0]["token_ids"]
    guided = {"model": worker.name, "messages": MESSAGES, "max_tokens": 400,
              "response_format": schema_format(SCHEMAS[0]), "temperature": 0}
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(worker.post, "/v1/completions", free) if i % 2 else
                pool.submit(worker.post, "/v1/chat/completions", guided) for i in range(6)]
        outs = [f.result() for f in futs]
    for i, r in enumerate(outs):
        assert r.status_code == 200, r.text
        if i % 2:
            assert r.json()["choices"][0]["token_ids"] == alone
        else:
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]),
                                SCHEMAS[0])


def test_openai_sdk_json_schema(worker):
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused")
    schema = SCHEMAS[5]
    out = client.chat.completions.create(model=worker.name, messages=MESSAGES, max_tokens=400,
                                         temperature=0, response_format=schema_format(schema))
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=worker.name, messages=MESSAGES,
                                            max_tokens=400, temperature=0, stream=True,
                                            response_format=schema_format(schema))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_p_to_d_with_a_grammar_equals_one_worker(worker, tiny_model_dir, tmp_path):
    """P samples the first token under the grammar, D takes it (computing no prompt token) and
    goes on from there with its own matcher: D's answer is the single worker's."""
    p, d = start_p_and_d(tiny_model_dir, tmp_path, kv=kv_config("TcpConnector"))
    with stopping(p, d):
        for extra in ({"response_format": schema_format(SCHEMAS[3])},
                      {"structured_outputs": {"choice": ["left", "right"]}}):
            body = {"model": worker.name, "messages": MESSAGES, "max_tokens": 400,
                    "temperature": 0, **extra}
            alone = chat(worker, **body)["choices"][0]["message"]["content"]
            pj = prefill_leg(p, "/v1/chat/completions", body)
            r = decode_leg(d, "/v1/chat/completions", body, pj["kv_transfer_params"])
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == alone
            assert r.json()["kv_stats"]["computed_tokens"] == 0  # P's first token taken


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
     "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_field(worker, extra, param):
    r = worker.post("/v1/chat/completions", {"model": worker.name, "messages": MESSAGES,
                                             "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == \
        "invalid_request_error", err
    assert worker.health()["status"] == "ok"
