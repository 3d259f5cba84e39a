"""Issue 32, defaults a user expects: max_tokens per endpoint as OpenAI and vLLM, and
max_completion_tokens validated and honoured on both endpoints, on a worker and through the router.

Measured on main before the change: /v1/completions without max_tokens generated to the end of
the context (4,095 tokens), and ignored max_completion_tokens even when it was `[1]` or "abc"."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_router import ARGS, bidi, start_router
from workers import start_p_and_d, stopping

from duplexkv.http.errors import APIError
from duplexkv.http.openai import COMPLETION_DEFAULT_MAX_TOKENS, parse_request

CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("value", [[1], "abc", 0, -3, 1.5, True, {"n": 1}])
def test_max_completion_tokens_is_validated(kind, value):
    body = {"prompt": "hi"} if kind == "completion" else {"messages": CHAT}
    with pytest.raises(APIError) as e:
        parse_request({**body, "max_completion_tokens": value}, kind)
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_max_completion_tokens_takes_precedence(kind):
    body = {"prompt": "hi"} if kind == "completion" else {"messages": CHAT}
    assert parse_request({**body, "max_completion_tokens": 3}, kind).max_tokens == 3
    assert parse_request({**body, "max_tokens": 5, "max_completion_tokens": 3},
                         kind).max_tokens == 3
    assert parse_request({**body, "max_tokens": 5, "max_completion_tokens": None},
                         kind).max_tokens == 5


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("request_defaults")
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())) as (p, d):
        with stopping(start_router(tmp / "router.log", [p.url], [d.url])) as r:
            yield d, r, Path(tiny_model_dir).name


def _post(cluster, target: str, path: str, body: dict):
    d, r, name = cluster
    body = {"model": name, "temperature": 0, "ignore_eos": True, **body}
    if target == "worker":
        return d.post(path, body)
    return r.post(path, body)


@pytest.mark.parametrize("target", ["worker", "router"])
def test_completions_default_to_16_tokens(cluster, target):
    got = _post(cluster, target, "/v1/completions", {"prompt": "hello"})
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] == COMPLETION_DEFAULT_MAX_TOKENS
    assert got.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_max_completion_tokens_honoured(cluster, target, path, body):
    got = _post(cluster, target, path, {**body, "max_completion_tokens": 3, "max_tokens": 7})
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] == 3
    for bad in ([1], "abc", 0):
        got = _post(cluster, target, path, {**body, "max_completion_tokens": bad})
        assert got.status_code == 400, got.text
        err = got.json()["error"]
        assert err["param"] == "max_completion_tokens" and err["code"] == 400, err


@pytest.mark.parametrize("target", ["worker", "router"])
def test_chat_defaults_to_more_than_16(cluster, target):
    """Chat without a limit fills the context, as vLLM (here: cut by the tiny model's EOS or the
    context; at least more than the completions default)."""
    got = _post(cluster, target, "/v1/chat/completions",
                {"messages": CHAT, "stop_token_ids": [], "max_tokens": None})
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] > COMPLETION_DEFAULT_MAX_TOKENS
