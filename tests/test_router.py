"""The router (`duplexkv router`, a real subprocess) in front of real P and D workers (TCP
transport, bidirectional, float32, greedy), driven by the `openai` client. Reuse must never change
an output: every text is compared with one engine computing the conversation from scratch with
no cache at all (the oracle = reuse off)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from workers import (
    kv_config,
    send_json,
    skip_or_fail,
    start_p_and_d,
    start_worker,
    stopping,
)

from duplexkv import LLM, SamplingParams
from duplexkv.launch import spawn, wait_ready
from duplexkv.launch.ports import free_port
from duplexkv.router.backends import BackendPool
from duplexkv.router.conversation.store import Entry, MemoryStore, RedisStore, conversation_key
from duplexkv.router.health import HealthChecker
from duplexkv.router.http_client import FastTransport
from duplexkv.router.legs import (
    TurnStats,
    decode_body,
    prefill_body,
    rewrite_remote_host,
)
from duplexkv.router.request import ClientRequest
from duplexkv.router.stream import StreamRelay
from duplexkv.wire.kv_params import replay_params

ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024")
MODEL = "tiny"
SYSTEM = "You are a careful coding agent. Read the tool output, then answer with the next command."
OUT = 16


def bidi(**kw) -> dict:
    return kv_config("TcpConnector", bidirectional_kv_xfer=True, **kw)


@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self, api_key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def post(self, path: str, body: dict | bytes, **kw) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body)
        return httpx.post(self.url + path, content=content, timeout=60,
                          headers={"content-type": "application/json", **kw})

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def metric(self, name: str, **labels) -> float:
        return metric(self.get("/metrics").text, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(log: Path, prefill: list[str], decode: list[str], *args: str,
                 env: dict | None = None, placement: str | None = "prefill",
                 defaults: bool = False) -> Router:
    """`env` adds to the environment (inherited API key variables are dropped unless given).
    The router tests are about the P leg (pulls from D, failover, leases): they pin
    `--placement prefill`; `placement=None` runs the router's default (auto, test_placement).
    `defaults`: no health-interval override either (what a user gets; the fault tests)."""
    fast_checks = () if defaults else ("--health-interval", "0.5")
    p = spawn(log.stem, ["router", "--prefill", *prefill, "--decode", *decode, "--port", "0",
                         *fast_checks, *(("--placement", placement) if placement else ()), *args],
              log.parent, env)
    try:
        wait_ready([p], timeout_s=30, probe=None)  # its workers may be down on purpose
    except BaseException:
        p.kill()
        raise
    return Router(p.url, p.proc, p.log)


def assert_no_address(body: str, model_dir: Path) -> None:
    """No worker host:port (every worker here listens on 127.0.0.1) and no model filesystem path
    in a body the router sends to a client."""
    assert "127.0.0.1" not in body and "localhost" not in body, body
    assert str(model_dir) not in body and str(Path(model_dir).resolve()) not in body, body


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"(?m)^" + pattern + "$", text)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256,
              enable_prefix_caching=False)

    def run(prompt, max_tokens=OUT, ids=False):
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=True))[0]
        return out.token_ids if ids else out.text
    return run


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    with stopping(*start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi())) as workers:
        yield workers


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url])) as r:
        yield r


def conv() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


def user(t: int) -> dict:
    return {"role": "user", "content": f"tool output {t}: " + "ok; " * (8 + 6 * t)}


def chat(client: openai.OpenAI, messages: list[dict], conv_id: str | None, stream: bool,
         via_header: bool | str = False) -> tuple[str, dict]:
    """One chat turn through the router -> (text, the combined kv_stats). `via_header` names the
    conversation by header (X-Session-ID, or the header given) instead of the body."""
    body = {"ignore_eos": True}
    headers = {}
    if conv_id is not None and via_header:
        headers[via_header if isinstance(via_header, str) else "X-Session-ID"] = conv_id
    elif conv_id is not None:
        body["conversation_id"] = conv_id
    kw = {"model": MODEL, "messages": messages, "max_tokens": OUT, "temperature": 0,
          "extra_body": body, "extra_headers": headers}
    if not stream:
        r = client.chat.completions.create(**kw)
        assert "kv_transfer_params" not in r.model_extra
        assert r.usage.completion_tokens == OUT
        return r.choices[0].message.content, r.model_extra["kv_stats"]
    parts, stats, usage = [], [], None
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        extra = chunk.model_extra or {}
        assert "kv_transfer_params" not in extra
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if extra.get("kv_stats"):
            stats.append(extra["kv_stats"])
        usage = chunk.usage or usage
    assert stats and usage is not None and usage.completion_tokens == OUT
    return "".join(parts), stats[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_multi_turn_chat_reuses_d_kv_and_matches_reuse_off(router, oracle, stream):
    client = router.client()
    conv_id = conv()
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(3):
        messages.append(user(t))
        text, stats = chat(client, messages, conv_id, stream, via_header=stream)
        assert text == oracle(messages), f"turn {t + 1} differs from reuse off"
        assert stats["decode"]["pulled_tokens"] > 0  # P -> D every turn
        assert stats["prefill_done_ms"] > 0
        if stream:
            assert 0 < stats["prefill_done_ms"] <= stats["first_token_ms"]
        if t == 0:
            assert stats["conversation"] == "miss" and stats["prefill"]["pulled_tokens"] == 0
        else:  # D -> P: P READs D's retained turn
            assert stats["conversation"] == "hit", stats
            assert stats["prefill"]["pulled_tokens"] > 0, stats
            assert stats["prefill"]["pull_outcome"] == "pulled"
        messages.append({"role": "assistant", "content": text})
    # the same conversation without an id: turns named by an id are not stored under their
    # content, so nothing is recognised; same text
    messages.append(user(3))
    text, stats = chat(client, messages, None, stream)
    assert text == oracle(messages)
    assert stats["conversation"] == "miss" and stats["recognised"] is False, stats
    assert stats["prefill"]["pulled_tokens"] == 0


def test_completions_endpoint_reuses_across_turns(router, oracle):
    client = router.client()
    conv_id = conv()
    prompt = list(range(100, 190))
    for t in range(2):
        extra = {"ignore_eos": True, "conversation_id": conv_id}
        if t == 0:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUT,
                                          temperature=0, extra_body=extra)
            text, stats = r.choices[0].text, r.model_extra["kv_stats"]
        else:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUT,
                                                    temperature=0, extra_body=extra,
                                                    stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            stats = [c.model_extra["kv_stats"] for c in chunks if c.model_extra.get("kv_stats")][-1]
            assert stats["prefill"]["pulled_tokens"] == 90 + OUT - 1  # prompt + answer, exactly
        assert text == oracle(prompt)
        prompt = prompt + oracle(prompt, ids=True) + list(range(400, 420))


def test_client_kv_transfer_params_are_ignored(router, workers, oracle):
    _, d = workers
    messages = [{"role": "system", "content": SYSTEM}, user(1)]
    forged = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "evil",
              "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 40}
    for bad in ("nope", [1], forged):  # a worker would 400 the first two
        body = {"model": MODEL, "messages": messages, "max_tokens": OUT, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": bad, "conversation_id": conv()}
        r = router.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        j = r.json()
        assert "kv_transfer_params" not in j
        assert j["choices"][0]["message"]["content"] == oracle(messages)
        assert j["kv_stats"]["decode"]["pull_outcome"] == "pulled"  # from P, not from "evil"
    assert d.post("/v1/chat/completions", {**body, "kv_transfer_params": "nope"}).status_code == 400


def test_without_router_keys_conversation_ids_are_shared(router, oracle):
    """No --api-key: a bearer token authenticates nothing, so it names no namespace either
    (docs/router.md says so); keyed routers namespace by key (test_api_keys.py)."""
    a, b = router.client("tenant-a"), router.client("tenant-b")
    conv_id = conv()
    messages = [{"role": "system", "content": SYSTEM}, user(0)]
    text, _ = chat(a, messages, conv_id, stream=False)
    messages += [{"role": "assistant", "content": text}, user(1)]
    # B names A's conversation (by the other header): the same entry, reused, same text
    text_b, stats_b = chat(b, messages, conv_id, stream=True, via_header="X-Conversation-ID")
    assert stats_b["conversation"] == "hit" and stats_b["prefill"]["pulled_tokens"] > 0
    assert text_b == oracle(messages)


def _race_turn(urls: list[str], oracle, conv_id: str | None = None) -> list[dict]:
    """Turn 1 through urls[0], then turn 2 sent at once through each URL: both must succeed with
    the right text, and only one of them may replay D's blocks."""
    conv_id = conv_id or conv()
    messages = [{"role": "system", "content": SYSTEM}, user(2)]
    first = openai.OpenAI(base_url=urls[0] + "/v1", api_key="key-a", max_retries=0)
    text, _ = chat(first, messages, conv_id, stream=False)
    messages += [{"role": "assistant", "content": text}, user(3)]

    async def both():
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="key-a", max_retries=0)
                   for u in urls]
        kw = {"model": MODEL, "messages": messages, "max_tokens": OUT, "temperature": 0,
              "extra_body": {"ignore_eos": True, "conversation_id": conv_id}}
        try:
            return await asyncio.gather(*(c.chat.completions.create(**kw) for c in clients))
        finally:
            for c in clients:
                await c.close()

    answers = asyncio.run(both())
    want = oracle(messages)
    stats = [r.model_extra["kv_stats"] for r in answers]
    assert [r.choices[0].message.content for r in answers] == [want, want]
    assert sorted(s["conversation"] for s in stats) == ["hit", "miss"], stats
    assert sum(s["prefill"]["pulled_tokens"] > 0 for s in stats) == 1, stats
    return stats


def test_racing_turns_on_one_conversation(router, oracle):
    _race_turn([router.url, router.url], oracle)


BAD = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": 1}),
    ("/v1/chat/completions", {"max_tokens": 4}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": ["hi"]}),
    ("/v1/completions", {"max_tokens": 4}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
]


def test_bad_input_gets_the_workers_4xx_without_touching_them(router, workers):
    p, d = workers
    before = metric(p.get("/metrics").text, "duplexkv_requests_total",
                    endpoint="chat_completions", outcome="bad_request")
    for path, body in BAD:
        mine, theirs = router.post(path, body), d.post(path, body if isinstance(body, dict)
                                                       else body.decode())
        assert mine.status_code == theirs.status_code and mine.status_code in (400, 404), path
        assert mine.json() == theirs.json(), (body, mine.json(), theirs.json())
    after = metric(p.get("/metrics").text, "duplexkv_requests_total",
                   endpoint="chat_completions", outcome="bad_request")
    assert after == before  # nothing reached P
    assert router.metric("duplexkv_router_requests_total", endpoint="chat_completions",
                         outcome="bad_request") >= 10
    # what only a worker can tell is relayed as the worker said it
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": -1}
    mine, theirs = router.post("/v1/chat/completions", body), d.post("/v1/chat/completions", body)
    assert mine.status_code == theirs.status_code == 400 and mine.json() == theirs.json()


def test_models_health_and_metrics(router, oracle):
    client = router.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    h = router.get("/health").json()
    assert h["status"] == "ok" and h["store"] == "memory"
    assert [b["healthy"] for b in h["prefill"] + h["decode"]] == [True, True]
    names = ("stored", "hit", "miss")
    before = {n: router.metric("duplexkv_router_conversations_total", event=n) for n in names}
    pulled = router.metric("duplexkv_router_reuse_total", outcome="pulled")
    ttft = router.metric("duplexkv_router_time_to_first_token_seconds_count")
    conv_id = conv()
    messages = [{"role": "system", "content": SYSTEM}, user(4)]
    text, _ = chat(client, messages, conv_id, stream=True)
    chat(client, messages + [{"role": "assistant", "content": text}, user(5)], conv_id, False)
    after = {n: router.metric("duplexkv_router_conversations_total", event=n) for n in names}
    assert {n: after[n] - before[n] for n in names} == {"stored": 2, "hit": 1, "miss": 1}
    assert router.metric("duplexkv_router_reuse_total", outcome="pulled") == pulled + 1
    assert router.metric("duplexkv_router_time_to_first_token_seconds_count") == ttft + 1
    text = router.get("/metrics").text
    for name in ("duplexkv_router_overhead_seconds_bucket", "duplexkv_router_backend_up",
                 "duplexkv_router_conversations_stored"):
        assert name in text


def test_client_disconnect_aborts_the_decode_leg(router, workers):
    """The client reads one event of a 600-token stream and leaves: the router must abort D's leg,
    so D counts one aborted request and never generates the 600 tokens (unaborted, D finishes
    them in ~2 s and counts an ok request)."""
    _, d = workers
    body = {"model": MODEL, "prompt": "long story:", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def counts() -> tuple[float, float, float]:
        text = d.get("/metrics").text
        return (metric(text, "duplexkv_requests_total", endpoint="completions", outcome="aborted"),
                metric(text, "duplexkv_requests_total", endpoint="completions", outcome="ok"),
                metric(text, "duplexkv_generation_tokens_total"))

    aborted, ok, generated = counts()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while counts()[0] == aborted or d.health()["in_flight_requests"]:
        assert time.monotonic() < deadline, ("D still generates for a client that left", counts())
        time.sleep(0.05)
    now = counts()
    assert now[0] == aborted + 1 and now[1] == ok, now
    assert now[2] - generated < 600, now


def test_workers_killed_mid_conversation(router, workers, tiny_model_dir, tmp, oracle):
    """D2 holds the conversation and dies: P2 (failure policy "fail") cannot read it, so the
    turn is retried as a miss and decoded on the surviving D. Then P2 dies too: no prefill worker
    is left, and the client gets a clear 503."""
    p, d = workers
    with ThreadPoolExecutor(2) as pool:  # start both at once
        p2 = pool.submit(start_worker, tiny_model_dir, tmp / "p2.log", *ARGS,
                         "--no-enable-prefix-caching", kv=bidi(policy="fail", read_timeout_s=2.0))
        d2 = pool.submit(start_worker, tiny_model_dir, tmp / "d2.log", *ARGS, kv=bidi())
        p2, d2 = p2.result(), d2.result()
    # no health checks after the first: the failed calls themselves must mark the workers down
    r2 = start_router(tmp / "router2.log", [p2.url], [d2.url, d.url], "--health-interval", "600")
    try:
        client, conv_id = r2.client(), conv()
        messages = [{"role": "system", "content": SYSTEM}, user(6)]
        text, _ = chat(client, messages, conv_id, stream=False)
        assert d2.kv()["retained"]["entries"] == 1  # the conversation lives on D2
        d2.kill()
        messages += [{"role": "assistant", "content": text}, user(7)]
        text, stats = chat(client, messages, conv_id, stream=True)
        assert text == oracle(messages)
        assert stats["conversation"] == "retried" and stats["prefill"]["pulled_tokens"] == 0
        assert r2.metric("duplexkv_router_reuse_total", outcome="retried") == 1
        messages += [{"role": "assistant", "content": text}, user(8)]
        text, stats = chat(client, messages, conv_id, stream=False)  # now held by D
        assert text == oracle(messages) and stats["prefill"]["pulled_tokens"] > 0
        health = r2.get("/health").json()
        assert [b["healthy"] for b in health["decode"]] == [False, True]
        p2.kill()
        with pytest.raises(openai.APIStatusError) as e:
            chat(client, messages, conv_id, stream=False)
        assert e.value.status_code == 503
        err = e.value.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"].startswith("No prefill worker could serve the request: prefill[0]")
        assert_no_address(e.value.response.text, tiny_model_dir)
        assert_no_address(r2.get("/health").text, tiny_model_dir)
        assert_no_address(r2.get("/metrics").text, tiny_model_dir)
    finally:
        r2.stop()
        p2.stop()
        d2.stop()
    # a dead URL among the prefill workers is skipped
    r3 = start_router(tmp / "router3.log", ["http://127.0.0.1:9", p.url], [d.url])
    try:
        messages = [{"role": "system", "content": SYSTEM}, user(9)]
        for _ in range(2):
            assert chat(r3.client(), messages, None, stream=False)[0] == oracle(messages)
        assert [b["healthy"] for b in r3.get("/health").json()["prefill"]] == [False, True]
    finally:
        r3.stop()


class _Answers503:
    """A worker whose engine has died, as the router sees one: /health still answered OK a moment
    ago, every generation request now gets 503 (the worker's error shape)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict) -> None:
                send_json(self, status, body)

            def do_GET(self):  # noqa: N802
                self._send(200, {"status": "ok"})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._send(503, {"error": {"message": "engine failed: RuntimeError('boom')",
                                           "type": "service_unavailable_error", "param": None,
                                           "code": 503}})

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_503_when_every_decode_worker_is_down_or_answers_503(workers, tiny_model_dir, tmp,
                                                              oracle):
    """Every D down (nothing listens) -> 503 naming decode[i]; a D answering 503 is marked down
    and the next D serves; when it is the only D, 503. No router body ever names a worker's
    address or the model's path."""
    p, d = workers
    dead = f"http://127.0.0.1:{free_port()}"
    stub = _Answers503()
    messages = [{"role": "system", "content": SYSTEM}, user(12)]
    body = {"model": MODEL, "messages": messages, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True}
    routers = []
    try:
        r = start_router(tmp / "router_d_down.log", [p.url], [dead], "--health-interval", "600")
        routers.append(r)
        for stream in (False, True):
            resp = r.post("/v1/chat/completions", {**body, "stream": stream})
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert err["message"].startswith("No decode worker could serve the request: decode[0]")
            assert err["code"] == 503 and err["type"] == "service_unavailable_error"
            assert_no_address(resp.text, tiny_model_dir)
        h = r.get("/health")
        assert h.status_code == 503 and [b["name"] for b in h.json()["decode"]] == ["decode[0]"]
        for resp in (h, r.get("/metrics"), r.get("/v1/models")):
            assert_no_address(resp.text, tiny_model_dir)
        assert 'worker="decode[0]"' in r.get("/metrics").text
        # a D that answers 503 is skipped for the next one
        r = start_router(tmp / "router_d_503.log", [p.url], [stub.url, d.url],
                         "--health-interval", "600")
        routers.append(r)
        resp = r.post("/v1/chat/completions", body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == oracle(messages)
        assert [b["healthy"] for b in r.get("/health").json()["decode"]] == [False, True]
        assert r.metric("duplexkv_router_upstream_errors_total", kind="http_5xx",
                        role="decode") == 1
        # ... and when it is the only D, the client gets 503 (not the worker's 503 body)
        r = start_router(tmp / "router_d_503_only.log", [p.url], [stub.url],
                         "--health-interval", "600")
        routers.append(r)
        resp = r.post("/v1/chat/completions", body)
        assert resp.status_code == 503
        assert resp.json()["error"]["message"] == (
            "No decode worker could serve the request: decode[0] answered HTTP 503")
        # a P that answers 503 is skipped too, and alone it is a 503 naming prefill[0]
        r = start_router(tmp / "router_p_503.log", [stub.url, p.url], [d.url],
                         "--health-interval", "600")
        routers.append(r)
        resp = r.post("/v1/chat/completions", body)
        assert resp.status_code == 200, resp.text
        r = start_router(tmp / "router_p_503_only.log", [stub.url], [d.url],
                         "--health-interval", "600")
        routers.append(r)
        resp = r.post("/v1/chat/completions", body)
        assert resp.status_code == 503
        assert resp.json()["error"]["message"] == (
            "No prefill worker could serve the request: prefill[0] answered HTTP 503")
        for r in routers:
            for resp in (r.get("/health"), r.get("/metrics"), r.get("/v1/models")):
                assert_no_address(resp.text, tiny_model_dir)
    finally:
        for r in routers:
            r.stop()
        stub.close()


def test_live_router_bodies_name_no_worker_address(router, tiny_model_dir):
    client = router.client()
    messages = [{"role": "system", "content": SYSTEM}, user(13)]
    conv_id = conv()
    r = router.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                              "max_tokens": 4, "conversation_id": conv_id})
    assert r.status_code == 200
    assert_no_address(r.text, tiny_model_dir)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}) as s:
        assert_no_address(s.read().decode(), tiny_model_dir)
    models = router.get("/v1/models")
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    for resp in (models, router.get("/health"), router.get("/metrics")):
        assert_no_address(resp.text, tiny_model_dir)
    assert [b["name"] for b in router.get("/health").json()["prefill"]] == ["prefill[0]"]
    assert client.models.list().data[0].id == MODEL


# --- Redis: several routers share conversations ---
@pytest.fixture(scope="module")
def redis_url(tmp):
    exe = shutil.which("redis-server")
    if exe is None:
        skip_or_fail("redis-server is not installed (apt-get install -y redis-server; "
                     ".ci/run installs it)")
    import redis

    port = free_port()
    with open(tmp / "redis.log", "wb") as fh:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=fh, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp / "redis.log"
                                                                          ).read_text()
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def test_two_routers_share_conversations_through_redis(workers, redis_url, tmp, oracle):
    p, d = workers
    ra = start_router(tmp / "router_a.log", [p.url], [d.url], "--store", redis_url)
    rb = start_router(tmp / "router_b.log", [p.url], [d.url], "--store", redis_url)
    try:
        assert ra.get("/health").json()["store"] == "redis"
        conv_id = conv()
        messages = [{"role": "system", "content": SYSTEM}, user(10)]
        for t, r in enumerate((ra, rb, ra)):  # turn 1 on A, turn 2 on B, turn 3 on A
            text, stats = chat(r.client(), messages, conv_id, stream=t == 1)
            assert text == oracle(messages)
            if t:
                assert stats["conversation"] == "hit" and stats["prefill"]["pulled_tokens"] > 0
            messages += [{"role": "assistant", "content": text}, user(11 + t)]
        # one entry, two routers racing for it: exactly one replays it
        _race_turn([ra.url, rb.url], oracle)
    finally:
        ra.stop()
        rb.stop()


# --- the stores and the stream relay on their own ---
def test_memory_store_single_use_ttl_and_bound():
    now = [0.0]
    store = MemoryStore(ttl_s=10, max_entries=2, clock=lambda: now[0])
    e = Entry({"remote_engine_id": "d"}, "http://d", 0.0)

    async def run():
        assert (await store.put("a", e)).evicted == 0
        assert (await store.take("a")).entry == e
        assert (await store.take("a")).entry is None  # single use
        for k in "bcd":
            res = await store.put(k, e)
        assert res.evicted == 1 and (await store.take("b")).entry is None  # oldest out
        now[0] = 11
        taken = await store.take("c")
        assert taken.entry is None and taken.expired
        assert (await store.put("e", e)).expired == 1  # d swept
        assert await store.size() == 1

    asyncio.run(run())
    assert conversation_key("key-a", "c1") != conversation_key("key-b", "c1")
    assert conversation_key(None, "c1") != conversation_key("", "c1x")


def test_redis_store_single_use_ttl_and_bound(redis_url):
    async def run():
        # a TTL long enough that nothing expires during the puts on a loaded machine; expiry is
        # then awaited by polling Redis itself
        prefix = f"t{uuid.uuid4().hex}:"
        store = RedisStore(redis_url, ttl_s=2.0, max_entries=2, prefix=prefix)
        e = Entry({"remote_engine_id": "d", "remote_block_ids": [[1, 2]]}, "http://d", 1.0)
        try:
            await store.put("a", e)
            got = await asyncio.gather(store.take("a"), store.take("a"))
            assert sorted(g.entry is None for g in got) == [False, True]
            assert [g.entry for g in got if g.entry] == [e]
            for k in "bcd":
                res = await store.put(k, e)
            assert res.evicted == 1 and (await store.take("b")).entry is None
            assert await store.size() == 2
            deadline = time.monotonic() + 30
            while await store.redis.exists(prefix + "c", prefix + "d"):
                assert time.monotonic() < deadline, "Redis never expired the keys"
                await asyncio.sleep(0.05)
            taken = await store.take("c")
            assert taken.entry is None and taken.expired
            assert (await store.put("e", e)).expired == 1  # d
        finally:
            await store.close()

    asyncio.run(run())


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)


def test_stream_relay_captures_params_and_rewrites_only_what_it_must():
    stats = TurnStats(conversation="hit", prefill={"pulled_tokens": 7})
    relay = StreamRelay(stats, arrival=0.0, clock=lambda: 0.005)
    first = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    middle = {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": None}]}
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "kv_stats": {"pulled_tokens": 3}, "kv_transfer_params": {"remote_engine_id": "d1"}}
    trailer = {"choices": [], "kv_transfer_params": None}
    raw = _sse(first, middle, final, trailer) + b"data: [DONE]\n\n"
    out = []
    for i in range(0, len(raw), 7):  # events split across reads
        out += relay.feed(raw[i:i + 7])
    out += relay.flush()
    assert len(out) == 5 and relay.done
    assert out[1] == _sse(middle)  # passed through untouched
    got = [json.loads(e[6:]) for e in out[:4]]
    assert "kv_transfer_params" not in got[2] and "kv_transfer_params" not in got[3]
    assert got[2]["kv_stats"] == {"conversation": "hit", "prefill": {"pulled_tokens": 7},
                                  "decode": {"pulled_tokens": 3}, "prefill_done_ms": None,
                                  "first_token_ms": 5.0,
                                  "source": {"prefill": None, "decode": "kv_stats"},
                                  "retained": True}
    assert relay.params == {"remote_engine_id": "d1"}  # the last non-null value

    # a D without kv_stats (e.g. vLLM): the finish chunk still carries the combined stats
    relay = StreamRelay(TurnStats(), arrival=0.0)
    bare = {k: v for k, v in final.items() if k != "kv_stats"}
    events = relay.feed(_sse(first, bare).replace(b"\n\n", b"\r\n\r\n"))
    assert json.loads(events[1].strip()[6:])["kv_stats"]["conversation"] == "none"


def test_leg_rewriting():
    req = ClientRequest("chat", {"messages": [], "stream": True, "max_tokens": 9,
                                 "max_completion_tokens": 9, "min_tokens": 2,
                                 "stream_options": {"include_usage": True}, "user": "u"},
                        True, None, "c1", "k", None)
    d_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_host": "127.0.0.1",
                "remote_port": 5601, "_remote_blocks_processed": True, "remote_block_ids": [[1]]}
    p_leg = prefill_body(req, replay_params({**d_params, "do_remote_decode": False}))
    assert p_leg == {"messages": [], "stream": False, "max_tokens": 1, "user": "u",
                     "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_host": "127.0.0.1", "remote_port": 5601,
                                            "remote_block_ids": [[1]]}}
    assert decode_body(req, {"x": 1}) == {**req.body, "kv_transfer_params": {"x": 1}}
    assert req.api_key == "k"
    # remote_host: only an empty/loopback one, and only with a routable worker URL
    assert rewrite_remote_host(d_params, "http://10.1.2.3:8000")["remote_host"] == "10.1.2.3"
    assert rewrite_remote_host(d_params, "http://127.0.0.1:8000") is d_params
    remote = {**d_params, "remote_host": "10.9.9.9"}
    assert rewrite_remote_host(remote, "http://10.1.2.3:8000") is remote


async def _http_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_fast_transport_framing_keep_alive_and_stale_connections():
    seen = []

    async def handler(reader, writer):
        seen.append(writer)
        drop_next = False
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            size = int(re.search(rb"content-length: (\d+)", head).group(1))
            body = await reader.readexactly(size)
            if drop_next:  # the server gave up on this connection as the request arrived
                writer.close()
                break
            if head.startswith(b"POST /chunked"):
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n")
            elif head.startswith(b"POST /close"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                writer.close()  # closes the idle keep-alive connection behind the client's back
                break
            else:
                drop_next = head.startswith(b"POST /drop-next")
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
            await writer.drain()

    async def run():
        server, port = await _http_server(handler)
        transport = FastTransport()
        client = httpx.AsyncClient(transport=transport)
        base = f"http://127.0.0.1:{port}"
        try:
            r = await client.post(base + "/echo", content=b"abc")
            assert (r.status_code, r.content) == (201, b"abc")
            async with client.stream("POST", base + "/chunked", content=b"") as r:
                assert [c async for c in r.aiter_raw()] == [b"hello", b", world"]
            assert len(seen) == 1  # one keep-alive connection so far
            assert (await client.post(base + "/close", content=b"")).text == "ok"
            await asyncio.sleep(0.05)
            r = await client.post(base + "/echo", content=b"again")  # closed while idle
            assert r.content == b"again" and len(seen) == 2
            await client.post(base + "/drop-next", content=b"")
            r = await client.post(base + "/echo", content=b"retry")  # dropped: sent anew
            assert r.content == b"retry" and len(seen) == 3
        finally:
            await client.aclose()
            server.close()
        with pytest.raises(httpx.ConnectError):
            await httpx.AsyncClient(transport=FastTransport()).post(base + "/echo", content=b"")

    asyncio.run(run())


def test_health_checks_mark_workers_down_and_up_and_the_choice_follows_load():
    state = {"mode": "ok"}

    def handler(request: httpx.Request) -> httpx.Response:
        if state["mode"] == "refused":
            raise httpx.ConnectError("refused", request=request)
        if state["mode"] == "dead":
            return httpx.Response(503, json={"error": {"message": "engine dead"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, json={"status": "ok"})

    pool = BackendPool.from_urls(["http://p1", "http://p2"], ["http://d1", "http://d2"],
                                 affinity_slack=2, unhealthy_after=2)
    p1, p2 = pool.prefill
    d1, d2 = pool.decode

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        checker = HealthChecker(pool, client, interval_s=1, timeout_s=1)
        await checker.check(p1)
        assert p1.healthy and p1.models == ("m",) and pool.models() == ["m"]
        state["mode"] = "dead"
        await checker.check(p1)
        assert p1.healthy  # one failed check is not enough ...
        await checker.check(p1)
        assert not p1.healthy  # ... two are
        state["mode"] = "refused"
        await checker.check(d1)
        assert not d1.healthy  # nothing listens: down at once
        state["mode"] = "ok"
        await checker.check(p1)
        await checker.check(d1)
        assert p1.healthy and d1.healthy  # up again
        await client.aclose()

    asyncio.run(run())
    # P: least outstanding, ties to the least picked (round robin when idle); down ones skipped
    p1.outstanding = 3
    assert pool.choose_prefill() is p2
    p2.healthy = False
    assert pool.choose_prefill() is p1  # all others down: a marked worker is still tried
    assert pool.choose_prefill({p1}) is p2
    # D: the conversation's D unless it is down or clearly busier than the least loaded
    d1.outstanding, d2.outstanding = 2, 0
    assert pool.choose_decode("http://d1") == (d1, True)
    d1.outstanding = 3
    assert pool.choose_decode("http://d1") == (d2, False)
    d1.outstanding, d1.healthy = 0, False
    assert pool.choose_decode("http://d1") == (d2, False)
    assert pool.choose_decode("http://unknown")[1] is False
