"""The OpenAI-compatible worker, black box: a real `duplexkv serve` subprocess on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from duplexkv import LLM, SamplingParams
from duplexkv.launch import spawn, wait_ready, worker_args

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 64
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]
DUPLEXKV = str(Path(sys.executable).parent / "duplexkv")


@dataclass
class Server:
    url: str
    name: str
    proc: subprocess.Popen
    log: Path

    def post(self, path: str, body: dict | str, **kw) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(self.url + path, content=content, timeout=60,
                          headers={"content-type": "application/json", **kw.pop("headers", {})},
                          **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    p = spawn("serve", worker_args(str(tiny_model_dir), None, "--dtype", "float32",
                                   "--num-kv-blocks", str(NUM_KV_BLOCKS),
                                   "--max-model-len", str(MAX_MODEL_LEN)),
              tmp_path_factory.mktemp("serve"))
    proc, log = p.proc, p.log
    try:
        wait_ready([p], timeout_s=90)
        # no --served-model-name: the name is the model argument as given (vLLM's default)
        yield Server(p.url, str(tiny_model_dir), proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert rc == 0, log.read_text()
    assert "engine stopped" in log.read_text()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def sse_events(resp: httpx.Response) -> list[dict | str]:
    """The `data:` payloads of an SSE response; the last one must be [DONE]."""
    events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]] + ["[DONE]"]


def stream(srv: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)[:-1]  # type: ignore[return-value]


def check_final_chunk(chunks: list[dict]) -> dict:
    """Exactly the chunk with finish_reason carries kv_stats and kv_transfer_params."""
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    for c in chunks:
        if c is not finals[0]:
            assert "kv_transfer_params" not in c
    assert "kv_transfer_params" in finals[0] and finals[0]["kv_transfer_params"] is None
    assert finals[0]["kv_stats"]["computed_tokens"] > 0
    return finals[0]


def health(srv: Server) -> dict:
    r = srv.get("/health")
    assert r.status_code == 200
    return r.json()


# happy paths

def test_models_and_health(server):
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.name]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    h = health(server)
    assert h["status"] == "ok" and h["kv_blocks"]["total"] == NUM_KV_BLOCKS


@pytest.mark.parametrize("stream_mode", [False, True])
def test_completion_matches_offline(server, offline, stream_mode):
    refs = offline.generate(PROMPTS, greedy(12))
    for prompt, ref in zip(PROMPTS, refs):
        body = {"model": server.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        if stream_mode:
            chunks = stream(server, "/v1/completions", body)
            assert all(c["object"] == "text_completion" for c in chunks)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            final = check_final_chunk(chunks)
            assert final["choices"][0]["finish_reason"] == ref.finish_reason
        else:
            r = server.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
            text = out["choices"][0]["text"]
            assert out["choices"][0]["finish_reason"] == ref.finish_reason
            n_prompt, n_out = len(ref.prompt_token_ids), len(ref.token_ids)
            assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                    "total_tokens": n_prompt + n_out,
                                    "prompt_tokens_details": out["usage"]["prompt_tokens_details"]}
            assert "kv_transfer_params" in out and out["kv_transfer_params"] is None
            assert out["kv_stats"]["computed_tokens"] > 0
        assert text == ref.text


@pytest.mark.parametrize("stream_mode", [False, True])
def test_chat_matches_offline(server, offline, stream_mode):
    ref = offline.chat(CHAT, greedy(10))
    body = {"model": server.name, "messages": CHAT, "max_completion_tokens": 10,
            "temperature": 0}
    if stream_mode:
        chunks = stream(server, "/v1/chat/completions", body)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["id"].startswith("chatcmpl-")
        assert all(c["id"] == chunks[0]["id"] for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        check_final_chunk(chunks)
    else:
        out = server.post("/v1/chat/completions", body).json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["choices"][0]["message"]["role"] == "assistant"
        text = out["choices"][0]["message"]["content"]
        assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert out["kv_transfer_params"] is None and "kv_stats" in out
    assert text == ref.text


def test_stream_include_usage(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = stream(server, "/v1/completions", body)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None for c in chunks[:-1])
    check_final_chunk(chunks[:-1])


def test_openai_client(server, offline):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ref = offline.generate(PROMPTS[1], greedy(8))[0]
    out = client.completions.create(model=server.name, prompt=PROMPTS[1], max_tokens=8,
                                    temperature=0)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    kv = out.model_extra["kv_stats"]
    assert kv["computed_tokens"] >= 1  # at least the last prompt token is always computed
    assert kv["computed_tokens"] + kv["local_hit_tokens"] == len(ref.prompt_token_ids)
    ref = offline.chat(CHAT, greedy(8))
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=server.name, messages=CHAT, max_tokens=8,
                                                temperature=0, stream=True, user="u1",
                                                extra_body={"conversation_id": "c1"}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == ref.text and finish in ("stop", "length")


def test_second_identical_request_hits_prefix_cache(server):
    prompt = list(range(100, 300))  # 200 token ids: 12 full blocks
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = server.post("/v1/completions", body).json()
    second = server.post("/v1/completions", body).json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 200
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached == second["kv_stats"]["local_hit_tokens"]
    assert second["kv_stats"]["computed_tokens"] < first["kv_stats"]["computed_tokens"]


def test_request_id_header_and_extra_fields(server):
    body = {"prompt": "hi", "max_tokens": 2, "user": "u", "conversation_id": "c",
            "session_id": "s", "kv_transfer_params": None}
    r = server.post("/v1/completions", body, headers={"X-Request-Id": "my-req-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-req-1" and r.json()["id"] == "cmpl-my-req-1"


def test_chat_with_tool_calls_and_reasoning(server, tiny_model_dir):
    """Content parts, tool calls, reasoning, tool and developer messages: the prompt the worker
    renders is, token for token, HF's apply_chat_template of the same messages."""
    transformers = pytest.importorskip("transformers")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in"},
                                     {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "use the tool",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    # the worker normalises two things before rendering: text content parts are joined with
    # "\n" (as vLLM does for string-content templates) and OpenAI's "developer" role becomes
    # "system"; everything else reaches the template as the client sent it
    as_rendered = [{**messages[0], "content": "Weather in\nParis?"}, *messages[1:3],
                   {"role": "system", "content": "be brief"}, messages[4]]
    ref = tok.apply_chat_template(as_rendered, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert r.json()["choices"][0]["prompt_token_ids"] == ref
    assert r.json()["usage"]["prompt_tokens"] == len(ref)
    assert r.json()["usage"]["completion_tokens"] >= 1


# errors: OpenAI's shape, 4xx, and the server keeps serving

ERRORS = [
    ("/v1/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "batched"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model",
     "The model `gpt-4` does not exist."),
    ("/v1/completions", {"prompt": [7] * 600, "max_tokens": 4}, 400, None,
     "maximum context length is 512"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, None, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "`n` must be an integer in [1, 128]"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "not supported"),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params",
     "object"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0]", "only text"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs", "supported"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "n": "3"}, 400, "n", "`n`"),
    ("/v1/nope", {}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, param, message", ERRORS,
                         ids=[f"{i}-{e[2]}" for i, e in enumerate(ERRORS)])
def test_client_errors(server, path, body, status, param, message):
    r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"]
    assert err["param"] == param
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_still_serving_after_errors(server):
    for path, body, *_ in ERRORS:
        server.post(path, body)
    r = server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert health(server)["kv_blocks"]["in_use"] == 0


# disconnects free KV blocks

def _aborted(srv: Server) -> float:
    return sum(s.value for f in text_string_to_metric_families(srv.get("/metrics").text)
               for s in f.samples if s.name == "duplexkv_requests_total"
               and s.labels.get("outcome") == "aborted")


def _wait_idle(srv: Server, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(srv)
        if h["kv_blocks"]["in_use"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"blocks not freed: {h}"
        time.sleep(0.05)


def test_stream_disconnect_frees_blocks(server):
    before = _aborted(server)
    body = {"prompt": "a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
        assert health(server)["kv_blocks"]["in_use"] > 0
    _wait_idle(server)
    assert _aborted(server) == before + 1


def test_non_stream_disconnect_frees_blocks(server):
    """A non-streaming client that closes its connection while its request is generating: the
    request is aborted and its blocks freed. The socket is closed only once the worker reports
    the request in flight, so no timing assumption about generation speed is involved."""
    import socket
    from urllib.parse import urlsplit

    before = _aborted(server)
    raw = json.dumps({"prompt": "a long story", "max_tokens": 480, "ignore_eos": True}).encode()
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(raw), raw))
        deadline = time.monotonic() + 30
        while not health(server)["in_flight_requests"]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    finally:
        sock.close()
    _wait_idle(server)
    assert _aborted(server) == before + 1
    dbg = server.get("/debug/engine").json()
    assert dbg["integrity"] == "ok" and dbg["kv_blocks"]["in_use"] == 0


# metrics

def test_metrics(server):
    def bad_requests() -> float:
        return sum(s.value for f in text_string_to_metric_families(server.get("/metrics").text)
                   for s in f.samples if s.name == "duplexkv_requests_total"
                   and s.labels == {"endpoint": "completions", "outcome": "bad_request"})

    bad = bad_requests()
    assert server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 0}
                       ).status_code == 400
    assert bad_requests() == bad + 1
    server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3})
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("duplexkv_requests_total",
                    (("endpoint", "completions"), ("outcome", "ok")))] >= 1
    assert samples[("duplexkv_prompt_tokens_total", ())] > 0
    assert samples[("duplexkv_generation_tokens_total", ())] >= 3
    assert samples[("duplexkv_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("duplexkv_e2e_request_latency_seconds_count", ())] >= 1
    assert samples[("duplexkv_num_requests_running", ())] == 0
    assert samples[("duplexkv_num_requests_waiting", ())] == 0
    blocks = {state: samples[("duplexkv_kv_blocks", (("state", state),))]
              for state in ("used", "free", "cached")}
    assert sum(blocks.values()) == NUM_KV_BLOCKS
    assert ("duplexkv_prefix_cache_hit_tokens_total", ()) in samples


# CLI

def test_bad_kv_transfer_config_is_a_clear_cli_error(tmp_path):
    r = subprocess.run([DUPLEXKV, "serve", str(tmp_path), "--kv-transfer-config", "{bad"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert "--kv-transfer-config" in r.stderr and "JSON" in r.stderr


def test_colliding_request_ids_are_suffixed(server):
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "dup"}) as r:
        assert r.headers["x-request-id"] == "dup"
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        r2 = server.post("/v1/completions", {"prompt": "y", "max_tokens": 2},
                         headers={"X-Request-Id": "dup"})
        assert r2.status_code == 200
        rid = r2.headers["x-request-id"]
        assert rid.startswith("dup-") and r2.json()["id"] == f"cmpl-{rid}"
    _wait_idle(server)


# in process: a dead engine, and two apps in one process

@pytest.fixture(scope="module")
def aeng(tiny_model_dir):
    from duplexkv.engine.async_engine import AsyncEngine
    from duplexkv.engine.config import EngineConfig
    from duplexkv.engine.llm_engine import LLMEngine

    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                             num_kv_blocks=16, max_model_len=128)))
    eng.start()
    yield eng
    eng.shutdown()


async def _asgi_get_post(app, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        return [await client.request(m, path, json=body) for m, path, body in calls]


def test_two_apps_in_one_process(aeng):
    import asyncio

    from duplexkv.server.app import build_app

    apps = [build_app(aeng, "a"), build_app(aeng, "b", health_extra=lambda: {"kv": "x"})]
    for app, name in zip(apps, "ab", strict=True):
        r = asyncio.run(_asgi_get_post(app, [
            ("POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}),
            ("GET", "/metrics", None), ("GET", "/health", None)]))
        assert r[0].status_code == 200, r[0].text
        assert 'duplexkv_requests_total{endpoint="completions",outcome="ok"} 1.0' in r[1].text
        assert r[2].json()["status"] == "ok"
    assert r[2].json()["kv"] == "x"


def test_failing_steps_fail_their_requests_then_the_engine_is_dead(tiny_model_dir):
    """Every engine step raises (an injected fault in the model runner, in process): each request
    of a failed step gets a 500 naming the failure while the engine goes on; after three failed
    steps in a row the engine is dead and later requests and /health answer 503."""
    import asyncio

    from duplexkv.engine.async_engine import AsyncEngine
    from duplexkv.engine.config import EngineConfig
    from duplexkv.engine.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES, LLMEngine
    from duplexkv.server.app import build_app

    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                             num_kv_blocks=16, max_model_len=128)))

    def broken_run(batch):
        raise RuntimeError("boom: injected model runner fault")

    eng.engine.runner.run = broken_run
    dead: list[str] = []
    eng.on_dead = dead.append
    eng.start()
    try:
        app = build_app(eng, "m")
        calls = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})] * \
            MAX_CONSECUTIVE_STEP_FAILURES + [
            ("POST", "/v1/chat/completions", {"messages": CHAT}), ("GET", "/health", None)]
        r = asyncio.run(_asgi_get_post(app, calls))
    finally:
        eng.shutdown()
    assert eng.dead and "boom" in eng.dead and dead == [eng.dead]
    for resp in r[:MAX_CONSECUTIVE_STEP_FAILURES]:
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"]["code"] == 500
        assert "boom" in resp.json()["error"]["message"]
    for resp in r[MAX_CONSECUTIVE_STEP_FAILURES:]:
        assert resp.status_code == 503, resp.text
        assert "boom" in resp.json()["error"]["message"]