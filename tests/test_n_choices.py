"""`n > 1` on one worker (a real `duplexkv serve`, float32), with the prefix cache on and off (as
P runs): every choice equals a request of its own with n=1 and the choice's seed (seed + index,
as vLLM's parallel sampling), the prompt is computed once (choices 1.. take choice 0's full
prompt blocks and compute only the last partial block), streaming assembles to the non-stream
answer, a disconnect frees every choice's blocks, and a bad `n` is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import pytest
from test_router import metric
from workers import MISS, sse_events, start_worker, stopping, wait_for

ARGS = ("--num-kv-blocks", "160", "--max-model-len", "512")
PROMPT = list(range(100, 141))  # 41 tokens: two full blocks shared, 9 tokens left per choice
SHARED = 32
HOT = 3.0  # the tiny model's logits are sharp: at temperature 1 seeds rarely diverge


@pytest.fixture(scope="module", params=["prefix_cache", "no_prefix_cache"])
def worker(request, tiny_model_dir, tmp_path_factory):
    args = ARGS if request.param == "prefix_cache" else (*ARGS, "--no-enable-prefix-caching")
    log = tmp_path_factory.mktemp("n") / "w.log"
    with stopping(start_worker(tiny_model_dir, log, *args)) as w:
        yield w


def body(prompt=PROMPT, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
            **kw}


def ok(w, path: str, b: dict) -> dict:
    r = w.post(path, b)
    assert r.status_code == 200, r.text
    return r.json()


def test_seeded_choices_equal_single_requests_with_derived_seeds(worker):
    prompt = [7, *PROMPT]  # a prompt no other test sends: choice 0 computes all of it
    got = ok(worker, "/v1/completions", body(prompt, n=3, temperature=HOT, seed=11))
    choices = got["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for i, c in enumerate(choices):
        ref = ok(worker, "/v1/completions", body(prompt, temperature=HOT, seed=11 + i))
        assert c["token_ids"] == ref["choices"][0]["token_ids"], f"choice {i}"
        assert c["text"] == ref["choices"][0]["text"]
        assert c["finish_reason"] == "length" and c["stop_reason"] is None
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # the seeds do differ
    assert got["usage"]["prompt_tokens"] == len(prompt)  # once
    assert got["usage"]["completion_tokens"] == 3 * 12
    # the prompt was computed once: choices 1.. took its two full blocks from choice 0
    stats = got["kv_stats"]
    assert stats["computed_tokens"] == len(prompt) and stats["shared_tokens"] == 0
    for s in stats["choices"][1:]:
        assert s["shared_tokens"] == SHARED and s["local_hit_tokens"] == SHARED, stats
        assert s["computed_tokens"] == len(prompt) - SHARED
    worker.assert_integrity()


def test_greedy_choices_are_identical_and_equal_n1(worker, oracle):
    messages = [{"role": "user", "content": "Explain the stack data structure in two lines."}]
    chat = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    got = ok(worker, "/v1/chat/completions", {**chat, "n": 2})
    want = oracle(messages, 10)
    for c in got["choices"]:
        assert c["token_ids"] == want.token_ids and c["message"]["content"] == want.text
    single = ok(worker, "/v1/chat/completions", chat)
    assert single["choices"][0]["token_ids"] == want.token_ids
    assert [c["index"] for c in got["choices"]] == [0, 1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_assembles_to_the_non_stream_answer(worker, path):
    b = body(n=3, temperature=HOT, seed=5)
    if path.endswith("chat/completions"):
        b = {**b, "messages": [{"role": "user", "content": "Name three colours."}]}
        del b["prompt"]
    full = ok(worker, path, b)
    r = worker.post(path, {**b, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.count("data: [DONE]") == 1
    events = sse_events(r)
    text, ids, finish = {}, {}, {}
    for e in events:
        for c in e["choices"]:
            i = c["index"]
            piece = c.get("text") if "text" in c else (c["delta"].get("content") or "")
            text[i] = text.get(i, "") + piece
            ids.setdefault(i, []).extend(c.get("token_ids") or [])
            if c["finish_reason"] is not None:
                assert i not in finish, "one finish chunk per choice"
                finish[i] = (c["finish_reason"], c["stop_reason"])
    for c in full["choices"]:
        i = c["index"]
        assert ids[i] == c["token_ids"], f"choice {i}"
        assert text[i] == (c["text"] if "text" in c else c["message"]["content"])
        assert finish[i] == (c["finish_reason"], c["stop_reason"])
    usage = [e for e in events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached: the 2nd hits
    assert [usage[0]["usage"][k] for k in counts] == [full["usage"][k] for k in counts]
    if path.endswith("chat/completions"):  # the assistant role, once per choice, first
        roles = [e["choices"][0]["index"] for e in events[:3]]
        assert roles == [0, 1, 2] and all(e["choices"][0]["delta"]["role"] == "assistant"
                                          for e in events[:3])


def read(w, name: str, **labels) -> float:
    """A metric's value; vLLM's names carry the worker's model_name and engine (the exposition
    sorts label names)."""
    if name.startswith("vllm:"):
        labels.update(model_name=w.name, engine="0")
    return metric(w.get("/metrics").text, name, **dict(sorted(labels.items())))


def stream_until_every_choice_started(url: str, b: dict, then) -> None:
    """Stream `b`, read until each of its n choices has sent a chunk, call `then()` (the
    connection still open), then close it."""
    with httpx.stream("POST", url + "/v1/completions", json=b, timeout=60) as r:
        seen, lines = set(), r.iter_lines()  # kept: a closed iterator closes the response
        for line in lines:
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == b["n"]:
                break
        assert seen == set(range(b["n"])), seen
        then()


def test_disconnect_aborts_every_choice_and_frees_their_blocks(worker):
    aborted = read(worker, "vllm:request_success_total", finished_reason="abort")
    b = body(n=4, max_tokens=400, temperature=HOT, seed=1, stream=True)

    def in_flight():
        h = worker.health()
        assert h["running"] == 4, h  # every choice is in flight

    stream_until_every_choice_started(worker.url, b, in_flight)
    h = wait_for(lambda: (h := worker.get("/debug/engine").json())["running"] == 0
                 and h["waiting"] == 0 and h["kv_blocks"]["in_use"] == 0 and h,
                 what="every choice aborted and its blocks freed")
    assert h["integrity"] == "ok"
    # vLLM counts each choice (a child request there) as an aborted request
    assert read(worker, "vllm:request_success_total", finished_reason="abort") == aborted + 4


BAD_N = [0, -1, 1e9, "2", True, 129, 10**9, [2]]


@pytest.mark.parametrize("n", BAD_N, ids=[repr(v) for v in BAD_N])
def test_bad_n_is_a_400_naming_it(worker, n):
    r = worker.post("/v1/completions", {"prompt": "x", "n": n})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"


def test_what_n_makes_impossible_is_a_400_naming_the_field(worker):
    # choice i samples with seed + i: the last choice's seed must stay in range
    r = worker.post("/v1/completions", body(n=2, seed=2**64 - 1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert worker.post("/v1/completions", body(n=1, seed=2**64 - 1)).status_code == 200
    # a prefill leg computes the prompt once for D: n belongs on the decode leg
    r = worker.post("/v1/completions", body(n=2, kv_transfer_params=dict(MISS)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "decode leg" in r.json()["error"]["message"]
    # one choice beyond the pool can never be served, whatever n is
    r = worker.post("/v1/completions", body(n=2, max_tokens=512 - len(PROMPT) + 1))
    assert r.status_code == 400, r.text


def test_metrics_count_choices_as_vllm_and_requests_as_ours(worker):
    names = (("vllm:request_success_total", {"finished_reason": "length"}),
             ("vllm:request_params_n_count", {}), ("vllm:request_params_n_sum", {}),
             ("duplexkv_requests_total", {"endpoint": "completions", "outcome": "ok"}),
             ("duplexkv_generation_tokens_total", {}))
    before = [read(worker, name, **labels) for name, labels in names]
    ok(worker, "/v1/completions", body(n=3, temperature=HOT, seed=2))
    after = [read(worker, name, **labels) for name, labels in names]
    assert [a - b for a, b in zip(after, before)] == [3, 1, 3, 1, 36]
    assert after[1] > 0
