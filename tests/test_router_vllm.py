"""The router (a real subprocess) in front of vLLM-shaped workers: loopback HTTP servers replaying
answers in the shapes vLLM's source produces (tests/vllm_recorded.py says where each comes from).
What is checked is the router's side: what it counts, reports, stores and replays."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from test_router import start_router
from vllm_recorded import D_PARAMS, MODEL, P_PARAMS, VllmStub

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the answer?"}],
        "max_tokens": 6, "temperature": 0}


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


def wait_for(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_stream_outcome_is_ok_once_done_reached_the_client(tmp):
    """D keeps its body open after `[DONE]`; the client reads `[DONE]` and leaves at once. It got
    its whole answer: the request counts `ok`, not `aborted` (D's body ending is not what
    matters)."""
    p, d = VllmStub("prefill"), VllmStub("decode", hold_after_done_s=3.0)
    r = start_router(tmp / "router.log", [p.url], [d.url], "--health-interval", "600")
    try:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json={**BODY, "stream": True},
                          timeout=30) as resp:
            assert resp.status_code == 200
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                if line == "data: [DONE]":
                    break
        assert "data: [DONE]" in lines

        def counted() -> float:
            return (r.metric("duplexkv_router_requests_total", endpoint="chat_completions", outcome="ok")
                    + r.metric("duplexkv_router_requests_total", endpoint="chat_completions",
                               outcome="aborted"))
        assert wait_for(lambda: counted() == 1)
        assert r.metric("duplexkv_router_requests_total", endpoint="chat_completions", outcome="ok") == 1
        assert r.metric("duplexkv_router_requests_total", endpoint="chat_completions",
                        outcome="aborted") == 0
    finally:
        r.stop()
        p.close()
        d.close()
