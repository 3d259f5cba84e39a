"""Property-based fuzzing of a real worker's OpenAI endpoints (hypothesis).

Malformed and near-valid bodies, >= 1,000 per endpoint: every answer is a 200 or a 4xx in
OpenAI's error shape (never a 5xx, never a dropped connection), and afterwards the worker is
alive with its block pool intact. Hosts in generated `kv_transfer_params` are loopback or not
strings at all, so no generated request can make the worker reach outside this machine.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workers import kv_config, start_worker

EXAMPLES = 1000
ARGS = ("--num-kv-blocks", "96", "--max-model-len", "512")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8)


def near(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values, sometimes anything."""
    return st.one_of(valid, valid, valid, junk)


small_float = st.floats(-3, 3) | st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 1.0, 2.0, 100.0,
                                                  101.0, -1e-9, math.nan, math.inf])
token_ids = st.lists(st.integers(0, 4095), min_size=1, max_size=40) | st.lists(
    st.integers(-5, 5000), max_size=40)
text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60) | st.sampled_from(
    ["hello", "<|im_start|>user\nhi<|im_end|>", "\u0000\u200b\ufeff", "😀" * 10])
FIELDS = {
    "max_tokens": near(st.integers(0, 4)),
    "min_tokens": near(st.integers(0, 4)),
    "temperature": near(small_float),
    "top_p": near(small_float),
    "top_k": near(st.integers(-3, 5000)),
    "min_p": near(small_float),
    "presence_penalty": near(small_float),
    "frequency_penalty": near(small_float),
    "repetition_penalty": near(small_float),
    "seed": near(st.integers(-2**65, 2**65)),
    "stop": near(st.lists(text, max_size=3) | text),
    "stop_token_ids": near(token_ids),
    "logit_bias": near(st.dictionaries(st.integers(-3, 5000).map(str) | st.text(max_size=4),
                                       small_float, max_size=4)),
    "ignore_eos": near(st.booleans()),
    "stream": near(st.booleans()),
    "stream_options": near(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "return_token_ids": near(st.booleans()),
    "n": near(st.integers(0, 3)),
    "model": near(st.sampled_from(["tiny", "other"])),
    "kv_transfer_params": near(st.fixed_dictionaries({}, optional={
        "do_remote_prefill": near(st.booleans()), "do_remote_decode": near(st.booleans()),
        "remote_engine_id": near(st.text(max_size=8)),
        "remote_request_id": near(st.text(max_size=8)),
        "remote_block_ids": near(st.lists(st.integers(-2, 200), max_size=6)),
        "remote_host": st.sampled_from(["127.0.0.1", None, 5, [], ""]),
        "remote_port": near(st.integers(0, 70000)),
        "remote_num_tokens": near(st.integers(-2, 300)),
        "first_token_id": near(st.integers(-2, 5000))})),
}
messages = st.lists(st.fixed_dictionaries(
    {"role": near(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
     "content": near(text | st.lists(st.fixed_dictionaries(
         {"type": near(st.just("text")), "text": near(text)}), max_size=2))}),
    min_size=0, max_size=3)


@st.composite
def bodies(draw, kind: str) -> dict:
    """A valid request with 0-4 fields drawn near-valid: most bodies reach the engine."""
    if kind == "completion":
        body = {"prompt": draw(near(text | token_ids | st.lists(text, max_size=2)))}
    else:
        body = {"messages": draw(near(messages))}
    body["max_tokens"] = 2
    k = draw(st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3, 4]))  # mostly one field at a time
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=k, max_size=k,
                             unique=True)):
        body[key] = draw(FIELDS[key])
    return _bounded(body)


def _bounded(d: dict) -> dict:
    """Keep generation short: a missing, null or large max_tokens would fill the context."""
    mt = d.get("max_tokens")
    if mt is None or (isinstance(mt, int) and not isinstance(mt, bool) and mt > 4):
        d = {**d, "max_tokens": 2}
    return d


raw_bodies = st.one_of(st.binary(max_size=64), st.text(max_size=40).map(str.encode),
                       junk.map(lambda v: json.dumps(v, allow_nan=True).encode()),
                       st.integers(1, 200).map(lambda n: b"[" * n + b"]" * n),
                       st.just(b'{"prompt": "\\ud800", "max_tokens": 1}'))


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    w = start_worker(tiny_model_dir, tmp_path_factory.mktemp("fuzz") / "w.log", *ARGS,
                     kv=kv_config("TcpConnector", bidirectional_kv_xfer=True,
                                  connect_timeout_s=0.2))
    w.client = httpx.Client(timeout=30)
    yield w
    w.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert r.status_code in (400, 404, 413), r.text[:300]


# the same examples every run (CI); DUPLEXKV_FUZZ_RANDOM=1 draws new ones, as test_router_fuzz
DERANDOMIZE = not os.environ.get("DUPLEXKV_FUZZ_RANDOM")
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind,path", [("completion", "/v1/completions"),
                                       ("chat", "/v1/chat/completions")])
def test_fuzz_bodies_never_5xx(worker, kind, path):
    @SETTINGS
    @given(body=bodies(kind))
    def one(body):
        check(worker.client.post(worker.url + path, content=json.dumps(body, allow_nan=True),
                                 headers={"content-type": "application/json"}))

    one()
    assert worker.proc.poll() is None
    worker.assert_integrity()


def test_fuzz_raw_bytes_never_5xx(worker):
    @settings(max_examples=300, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def one(raw, path):
        check(worker.client.post(worker.url + path, content=raw,
                                 headers={"content-type": "application/json"}))

    one()
    worker.assert_integrity()
    h = worker.health()
    assert h["status"] == "ok" and h["num_failed_requests"] == 0 and h["num_failed_steps"] == 0
