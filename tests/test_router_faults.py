"""Faults at the router's and workers' default settings (issue 30): a hung D, a D that dies
while it streams. Real processes on loopback; every answer is compared with an undisturbed
greedy float32 run of the same prompt (tests/conftest.py's oracle)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_router import ARGS, OUT, SYSTEM, bidi, chat, conv, start_router, user
from workers import start_worker, stopping


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):
    """Two P's, two D's and a router, all at their defaults (placement auto)."""
    nocache = ("--no-enable-prefix-caching",)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(start_worker, tiny_model_dir, tmp / f"{n}.log", *ARGS, *extra,
                            kv=bidi())
                for n, extra in (("p", nocache), ("p2", nocache), ("d1", ()), ("d2", ()))]
        p, p2, d1, d2 = (f.result() for f in futs)
    with stopping(p, p2, d1, d2):
        r = start_router(tmp / "router.log", [p.url, p2.url], [d1.url, d2.url],
                         placement=None, defaults=True)
        with stopping(r):
            r.prefill = (p, p2)
            yield p, d1, d2, r


def holder_of(ds):
    held = [d for d in ds if d.kv()["retained"]["entries"] > 0]
    assert held, "no D retains the conversation"
    return held[-1]


def healthy_turn(client, oracle) -> float:
    """The second turn of a fresh conversation, undisturbed: the baseline a fault turn is
    compared with."""
    conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}, user(1)]
    text, _ = chat(client, messages, conv_id, stream=True)
    messages += [{"role": "assistant", "content": text}, user(2)]
    t0 = time.monotonic()
    text, _ = chat(client, messages, conv_id, stream=True)
    took = time.monotonic() - t0
    assert text == oracle(messages, OUT).text
    return took


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_hung_d_costs_the_next_turn_seconds(cluster, oracle, stream):
    """Finding (b): with the conversation's D hung (SIGSTOP) and a healthy second D, the next
    turn took 23.5 s at the defaults (the D leg waited for two 10 s health checks)."""
    p, d1, d2, r = cluster
    client = r.client()
    healthy = healthy_turn(client, oracle)
    conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}, user(3)]
    before = {id(d): d.kv()["retained"]["entries"] for d in (d1, d2)}
    text, _ = chat(client, messages, conv_id, stream=stream)
    held = [d for d in (d1, d2) if d.kv()["retained"]["entries"] > before[id(d)]]
    hung = held[0] if held else holder_of((d1, d2))
    messages += [{"role": "assistant", "content": text}, user(4)]
    turn_while_hung(r, hung, "hung D", healthy, oracle, messages, conv_id, stream)


def test_hung_p_costs_a_turn_seconds(cluster, oracle):
    """The P leg waits on a hung P (SIGSTOP): the liveness watch gives it up, another P serves."""
    p, d1, d2, r = cluster
    client = r.client()
    healthy = healthy_turn(client, oracle)
    ps = r.get("/health").json()["prefill"]
    hung = r.prefill[min(range(2), key=lambda i: (ps[i]["outstanding"], ps[i]["picks"]))]
    messages = [{"role": "system", "content": SYSTEM}, user(6)]
    turn_while_hung(r, hung, "hung P", healthy, oracle, messages, conv(), True)


def test_the_only_p_slow_to_answer_health_is_waited_for(tiny_model_dir, tmp, oracle):
    """With one P there is nowhere else to go: a P that answers /health late (here stopped for
    3 s mid-turn; vLLM-CPU with NIXL on a busy 2-core host answered it in over 1 s while
    serving) must not be marked down by the liveness probe, which turned the turn into a 503."""
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(start_worker, tiny_model_dir, tmp / f"solo-{n}.log", *ARGS, kv=bidi())
                for n in ("p", "d")]
        p, d = (f.result() for f in futs)
    with stopping(p, d):
        r = start_router(tmp / "solo-router.log", [p.url], [d.url], placement=None,
                         defaults=True)
        with stopping(r):
            messages = [{"role": "system", "content": SYSTEM}, user(7)]
            p.proc.send_signal(signal.SIGSTOP)
            wake = threading.Timer(3.0, p.proc.send_signal, (signal.SIGCONT,))
            wake.start()
            try:
                text, _ = chat(r.client(), messages, conv(), stream=True)
            finally:
                wake.join()
                p.proc.send_signal(signal.SIGCONT)
            assert text == oracle(messages, OUT).text


def turn_while_hung(r, hung, what: str, healthy: float, oracle, messages, conv_id,
                    stream: bool) -> None:
    """One turn with `hung` SIGSTOPped: the same answer, at most 3 s beyond a healthy turn."""
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        text, _ = chat(r.client(), messages, conv_id, stream=stream)
        took = time.monotonic() - t0
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert text == oracle(messages, OUT).text
    print(f"{what}: healthy turn {healthy:.2f} s, fault turn {took:.2f} s")
    assert took <= healthy + 3.0, f"{took:.1f} s (healthy {healthy:.2f} s)"
    wait_up(r)


def wait_up(r, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = r.get("/health").json()
        if all(w["healthy"] for role in ("prefill", "decode") for w in h[role]):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not up again: {h}")


LONG = 240  # tokens: long enough that the fault lands while D streams


# what a fault returns when the leg it was for was already over: the router relays ahead of its
# client (a tiny D streams LONG tokens in ~0.2 s, all of it in the sockets' buffers), so a client
# slow to read its first events can find D done; its caller tries another conversation
MISSED = "missed"
TRIES = 3


def stream_with_fault(r, messages, fault, after: int = 4) -> tuple[str, dict, int, list]:
    """A streamed chat answer of LONG tokens; `fault(d)` is applied to the D streaming it once
    `after` content events have arrived -> (text, usage, events seen before the fault, errors)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parts, usage, errors, seen, faulted = [], None, [], 0, None
    with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                errors.append(obj)
                continue
            for c in obj.get("choices") or []:
                text = (c.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    seen += faulted is None
            usage = obj.get("usage") or usage
            if faulted is None and seen >= after:
                faulted = fault()
    return "".join(parts), usage, seen, errors


def streaming_d(r, ds):
    """The D with a leg in flight (the router's view), None when its leg is already over."""
    h = r.get("/health").json()["decode"]
    busy = [d for d, w in zip(ds, h) if w["outstanding"] > 0]
    assert len(busy) <= 1, h
    return busy[0] if busy else None


def _mid_stream(cluster, oracle, sig) -> None:
    p, d1, d2, r = cluster
    hit: list = []

    def fault():
        d = streaming_d(r, (d1, d2))
        if d is None:
            return MISSED
        d.proc.send_signal(sig)
        hit.append(d)
        return d

    for attempt in range(TRIES):  # a conversation of its own each: no KV of a missed one
        messages = [{"role": "system", "content": SYSTEM}, user(5 + attempt)]
        try:
            text, usage, seen, errors = stream_with_fault(r, messages, fault)
        finally:
            for d in hit:
                if sig == signal.SIGSTOP:
                    d.proc.send_signal(signal.SIGCONT)
        if hit:
            break
    assert hit, f"no fault landed mid-stream in {TRIES} conversations"
    assert not errors, errors
    assert seen < LONG
    assert usage["completion_tokens"] == LONG, usage
    assert text == oracle(messages, LONG).text  # token for token, as an undisturbed run
    assert r.metric("duplexkv_router_upstream_errors_total", kind="migrated",
                    role="decode") >= 1


def test_d_hung_mid_stream_is_continued_on_another_d(cluster, oracle):
    _mid_stream(cluster, oracle, signal.SIGSTOP)
    wait_up(cluster[3])


def test_d_killed_mid_stream_is_continued_on_another_d(cluster, oracle):
    """Finding (c): a D killed while streaming ended the client's stream with an error event
    (502) and [DONE]; the router knew the prompt and every token sent, yet nothing continued."""
    _mid_stream(cluster, oracle, signal.SIGKILL)
