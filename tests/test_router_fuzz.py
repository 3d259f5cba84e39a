"""Property-based fuzzing of the router's HTTP API (issue 10): malformed and near-valid bodies and
headers for /v1/completions and /v1/chat/completions, through a real router in front of real P and
D workers (the tiny model, max_tokens kept small).

The property: every answer is a 2xx or a 4xx, never a 5xx (no dependency is stopped here, so not
even a 503), a 4xx is in OpenAI's error shape, a stream carries no internal error, and afterwards
the router and both workers are still healthy and answer a normal request.

`derandomize=True` keeps the examples the same from run to run (CI); set DUPLEXKV_FUZZ_EXAMPLES to
run more of them, and DUPLEXKV_FUZZ_RANDOM=1 to draw new ones.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router import ARGS, MODEL, bidi, start_router
from workers import start_p_and_d

EXAMPLES = int(os.environ.get("DUPLEXKV_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("DUPLEXKV_FUZZ_RANDOM"),
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router_fuzz")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp):
    p, d = start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())
    router = start_router(tmp / "router.log", [p.url], [d.url])
    client = httpx.Client(base_url=router.url, timeout=60)
    yield router, p, d, client
    client.close()
    router.stop()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda w: w.stop(), (p, d)))


# --- strategies -----------------------------------------------------------------------------
# any code point, lone surrogates included (json.dumps escapes them as \udXXX)
any_char = st.characters(codec=None, categories=None)
text = st.text(any_char, max_size=12)
safe_text = st.text(st.characters(codec="utf-8"), max_size=12)  # valid Unicode, any script
short_ascii = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
json_values = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(text, kids, max_size=3)), max_leaves=8)
vocab_ids = st.lists(st.integers(0, 255), min_size=1, max_size=8)

# field -> (a valid value, any value); a valid max_tokens is small and an invalid one is refused,
# so no example runs a long generation
FIELDS = {
    "model": (st.just(MODEL), st.one_of(text, json_values)),
    "max_tokens": (st.integers(1, 3), st.one_of(
        st.integers(-3, 0), st.integers(min_value=10_000), st.integers(max_value=-1),
        st.sampled_from(["2", 2.0, 2.5, True, [], {}]))),
    "stream": (st.booleans(), json_values),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "temperature": (st.floats(0, 2), st.one_of(st.floats(allow_nan=False), json_values)),
    "top_p": (st.floats(0.05, 1), json_values),
    "top_k": (st.integers(0, 50), st.one_of(st.integers(), json_values)),
    "seed": (st.integers(0, 2**31), st.one_of(st.integers(), json_values)),
    "stop": (st.one_of(safe_text, st.lists(safe_text, max_size=3)), st.one_of(
        text, st.lists(text, max_size=3), json_values)),
    "stop_token_ids": (st.lists(st.integers(0, 255), max_size=3),
                       st.lists(st.one_of(st.integers(), text, st.none()), max_size=4)),
    "ignore_eos": (st.booleans(), json_values),
    "min_tokens": (st.integers(0, 1), st.one_of(st.integers(), json_values)),
    "n": (st.just(1), st.one_of(st.integers(-1, 3), json_values)),
    "conversation_id": (st.one_of(short_ascii, safe_text), st.one_of(text, json_values)),
    "kv_transfer_params": (st.none(), json_values),  # the router drops whatever a client sends
    "return_token_ids": (st.booleans(), json_values),
}
prompts = (st.one_of(short_ascii.filter(bool), safe_text.filter(bool), vocab_ids),
           st.one_of(text, st.lists(st.one_of(st.integers(), text, st.none()), max_size=6),
                     st.lists(short_ascii, max_size=3), json_values))
content = st.one_of(short_ascii, text, st.none(), json_values,
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                    "text": st.one_of(text, json_values)}),
                             max_size=2))
wild_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool",
                                                    "developer"]), "content": content}),
    st.fixed_dictionaries({"role": st.one_of(text, json_values), "content": content}),
    st.dictionaries(text, json_values, max_size=3), json_values)
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": st.one_of(short_ascii, safe_text)})
messages = (st.lists(valid_message, min_size=1, max_size=3).map(
                lambda m: m + [{"role": "user", "content": "go"}]),
            st.one_of(st.lists(wild_message, min_size=1, max_size=3), json_values))


@st.composite
def bodies(draw, kind: str) -> dict:
    """Valid (15%), valid but for one field (40%), or anything in every field drawn (45%)."""
    main, (good_main, bad_main) = ("prompt", prompts) if kind == "completion" else \
        ("messages", messages)
    fields = {main: (good_main, bad_main), **FIELDS}
    if kind == "chat":
        fields["max_completion_tokens"] = FIELDS["max_tokens"]
        fields["add_generation_prompt"] = (st.booleans(), json_values)
    names = [main, "max_tokens"] + draw(st.lists(st.sampled_from(sorted(fields)[2:]),
                                                 max_size=5, unique=True))
    mode = draw(st.integers(0, 99))
    bad = set() if mode < 15 else {draw(st.sampled_from(names))} if mode < 55 else set(names)
    body = {n: draw(fields[n][n in bad]) for n in names}
    if mode >= 55 and draw(st.integers(0, 9)) == 0:
        body[draw(text)] = draw(json_values)  # an unknown (or invalid) key
    if mode >= 55 and draw(st.integers(0, 3)) == 0:
        del body[draw(st.sampled_from(sorted(body)))]  # a required field may go
        body.setdefault("max_tokens", 1)  # absent = fill the context: valid but slow
    return body


def encode(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate becomes "\\udXXX"


@st.composite
def mangled(draw, kind: str) -> bytes:
    """Near-valid bytes: a valid-looking body cut, spliced, deepened, or made non-standard."""
    raw = encode(draw(bodies(kind)))
    how = draw(st.sampled_from(["cut", "splice", "deep", "constant", "bytes", "utf8", "array"]))
    if how == "cut":
        return raw[:draw(st.integers(0, len(raw)))]
    if how == "splice":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(max_size=8)) + raw[at:]
    if how == "deep":
        depth = draw(st.sampled_from([63, 64, 65, 1000, 20_000]))
        return raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    if how == "constant":
        return raw[:-1] + b', "temperature": ' + draw(st.sampled_from(
            [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b"-0"])) + b"}"
    if how == "bytes":
        return draw(st.binary(max_size=40))
    if how == "utf8":  # invalid UTF-8 inside a string
        return raw[:-1] + b', "x": "' + draw(st.sampled_from(
            [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00"])) + b'"}'
    return b"[" + raw + b"]"


def payloads(kind: str):
    return st.one_of(bodies(kind).map(encode), mangled(kind))


header_value = st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF), min_size=1,
                       max_size=300).map(lambda s: s.encode("latin-1"))
headers = st.fixed_dictionaries({}, optional={
    "x-request-id": header_value, "x-session-id": header_value,
    "authorization": header_value,
    "content-type": st.sampled_from([b"application/json", b"text/plain", b"", b"x/\xff"]),
})


def check(client: httpx.Client, path: str, content: bytes, extra: dict) -> int:
    h = {"content-type": "application/json", **extra}
    r = client.post(path, content=content, headers=h)
    ctx = f"{path} {content[:300]!r} {extra!r}: {r.status_code} {r.text[:500]}"
    assert r.status_code < 500, ctx
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, ctx
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "internal_server_error" not in r.text and "upstream_stream_error" not in r.text, ctx
        assert r.text.rstrip().endswith("data: [DONE]"), ctx
    else:
        assert "choices" in r.json(), ctx
    return r.status_code


def still_healthy(router, p, d, client: httpx.Client) -> None:
    for w in (p, d):
        assert w.get("/health").status_code == 200
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind,path", [("completion", "/v1/completions"),
                                       ("chat", "/v1/chat/completions")], ids=["completions",
                                                                                "chat"])
def test_fuzz_router_api(stack, kind, path):
    router, p, d, client = stack
    seen: Counter[int] = Counter()

    @FUZZ
    @given(content=payloads(kind), extra=headers)
    def run(content: bytes, extra: dict) -> None:
        seen[check(client, path, content, extra)] += 1

    run()
    print(f"{path}: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    # the fuzz reaches the workers too, not only the router's own checks
    assert seen[200] >= sum(seen.values()) // 10, seen
    still_healthy(router, p, d, client)
