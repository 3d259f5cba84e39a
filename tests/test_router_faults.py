"""Faults at the router's and workers' default settings (issue 30): a hung D, a D that dies
while it streams. Real processes on loopback; every answer is compared with an undisturbed
greedy float32 run of the same prompt (tests/conftest.py's oracle)."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_router import ARGS, OUT, SYSTEM, bidi, chat, conv, start_router, user
from workers import start_worker, stopping


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp):
    """One P, two D's and a router, all at their defaults (placement auto)."""
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(start_worker, tiny_model_dir, tmp / f"{n}.log", *ARGS, *extra,
                            kv=bidi())
                for n, extra in (("p", ("--no-enable-prefix-caching",)), ("d1", ()),
                                 ("d2", ()))]
        p, d1, d2 = (f.result() for f in futs)
    with stopping(p, d1, d2):
        r = start_router(tmp / "router.log", [p.url], [d1.url, d2.url], placement=None,
                         defaults=True)
        with stopping(r):
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
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        text, _ = chat(client, messages, conv_id, stream=stream)
        took = time.monotonic() - t0
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert text == oracle(messages, OUT).text
    print(f"hung D: healthy turn {healthy:.2f} s, fault turn {took:.2f} s")
    assert took <= healthy + 3.0, f"{took:.1f} s (healthy {healthy:.2f} s)"
    _wait_up(r)


def _wait_up(r, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = r.get("/health").json()
        if all(w["healthy"] for role in ("prefill", "decode") for w in h[role]):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not up again: {h}")
