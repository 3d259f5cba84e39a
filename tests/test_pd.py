"""P->D disaggregation between real worker processes, over both transports (float32, greedy):
the decode worker READs the prefill worker's blocks and must produce exactly what one worker
produces alone."""

from __future__ import annotations

import time

import pytest
from workers import decode_leg, kv_config, prefill_leg, sse_events, start_worker

from duplexkv import LLM, SamplingParams

CONNECTORS = ["TcpConnector", "NixlConnector"]
ARGS = ("--num-kv-blocks", "96", "--max-model-len", "1024")
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
          "fibonacci(n - 2)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n")


@pytest.fixture(scope="module", params=CONNECTORS)
def cluster(request, tiny_model_dir, tmp_path_factory):
    if request.param == "NixlConnector":
        pytest.importorskip("nixl", reason="NIXL is not installed (make install adds it)")
    tmp = tmp_path_factory.mktemp(request.param)
    kv = kv_config(request.param, kv_lease_duration=30)
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, kv=kv)
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=kv)
    yield request.param, p, d, tmp
    for w in (p, d):
        w.stop()


def body(prompt=PROMPT, **kw):
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **kw}


def test_p_to_d_matches_single_worker(cluster, oracle):
    _, p, d, _ = cluster
    pj = prefill_leg(p, "/v1/completions", body())
    params = pj["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] > 16
    assert pj["kv_stats"]["computed_tokens"] == params["remote_num_tokens"]
    r = decode_leg(d, "/v1/completions", body(), params)
    assert r.status_code == 200, r.text
    dj = r.json()
    want = oracle(PROMPT)
    assert dj["choices"][0]["text"] == want.text
    stats = dj["kv_stats"]
    assert stats["pulled_tokens"] > 0 and stats["pull_outcome"] == "pulled"
    # P's greedy first token came along: D READ every prompt token and computed none of them
    assert params["first_token_id"] == want.token_ids[0]
    assert stats["pulled_tokens"] + stats["local_hit_tokens"] == len(want.prompt_token_ids)
    assert stats["computed_tokens"] == 0
    assert dj["kv_transfer_params"] is None  # bidirectional is off
    # D's read released P's lease
    deadline = time.monotonic() + 5
    while p.kv()["retained"]["entries"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.kv()["retained"]["entries"] == 0
    assert p.kv()["retained"]["released"]["read"] >= 1
    p.assert_integrity()
    d.assert_integrity()


def test_p_to_d_streaming_and_chat(cluster, oracle):
    _, p, d, _ = cluster
    chat = {"messages": [{"role": "user", "content": "Write a sorting function."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    pj = prefill_leg(p, "/v1/chat/completions", chat)
    r = decode_leg(d, "/v1/chat/completions", {**chat, "stream": True}, pj["kv_transfer_params"])
    events = sse_events(r)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    want = oracle(chat["messages"], 12)
    assert text == want.text
    final = [e for e in events if e.get("kv_stats")]
    assert final and final[-1]["kv_stats"]["pulled_tokens"] > 0
    d.assert_integrity()


def test_first_token_from_p_only_when_both_legs_are_greedy(cluster, oracle, tiny_model_dir):
    _, p, d, _ = cluster
    taken = d.kv()["counters"]["prefill_first_tokens"]
    # a sampling P leg advertises no first token; D computes the last prompt token itself
    pj = prefill_leg(p, "/v1/completions", body(temperature=0.9, seed=3))
    assert "first_token_id" not in pj["kv_transfer_params"]
    r = decode_leg(d, "/v1/completions", body(), pj["kv_transfer_params"])
    stats = r.json()["kv_stats"]
    want = oracle(PROMPT)
    assert r.json()["choices"][0]["text"] == want.text
    assert stats["computed_tokens"] == 1
    # a greedy P leg, but D samples: D does not take P's token either (its first draw is its own)
    params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
    assert params["first_token_id"] == want.token_ids[0]
    sampled = body(temperature=0.9, seed=5, max_tokens=8)
    r = decode_leg(d, "/v1/completions", sampled, params)
    assert r.json()["kv_stats"]["computed_tokens"] == 1
    alone = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=96).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == alone.text  # seeded sampling as on one worker
    assert d.kv()["counters"]["prefill_first_tokens"] == taken
    # D's min_tokens bans P's token (as a stop token): D computes its own, masked, first token
    params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
    banned = params["first_token_id"]
    r = decode_leg(d, "/v1/completions", body(min_tokens=1, stop_token_ids=[banned],
                                              return_token_ids=True), params)
    assert r.json()["kv_stats"]["computed_tokens"] == 1
    assert r.json()["choices"][0]["token_ids"][0] != banned
    assert d.kv()["counters"]["prefill_first_tokens"] == taken
    # max_tokens=1 on D: the answer is P's token, and D computes nothing
    params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
    r = decode_leg(d, "/v1/completions", body(max_tokens=1), params)
    assert r.json()["choices"][0]["text"] == oracle(PROMPT, 1).text
    assert r.json()["kv_stats"]["computed_tokens"] == 0
    assert d.kv()["counters"]["prefill_first_tokens"] == taken + 1
    p.assert_integrity()
    d.assert_integrity()


def test_d_prefix_hit_shrinks_the_read(cluster, oracle):
    _, p, d, _ = cluster
    prompt = PROMPT * 3 + "# first\n"
    first = decode_leg(d, "/v1/completions", body(prompt),
                       prefill_leg(p, "/v1/completions", body(prompt))["kv_transfer_params"])
    longer = prompt + "def extra(x):\n    return x * 2\n"
    second = decode_leg(d, "/v1/completions", body(longer),
                        prefill_leg(p, "/v1/completions", body(longer))["kv_transfer_params"])
    s1, s2 = first.json()["kv_stats"], second.json()["kv_stats"]
    assert s2["local_hit_tokens"] >= 64  # D's own cache holds the shared prefix
    assert 0 < s2["pulled_tokens"] < s1["pulled_tokens"] + s1["local_hit_tokens"]
    assert second.json()["choices"][0]["text"] == oracle(longer).text


def test_lease_expires_when_d_never_comes(cluster, tiny_model_dir):
    name, _, _, tmp = cluster
    p = start_worker(tiny_model_dir, tmp / "p_lease.log", *ARGS,
                     kv=kv_config(name, kv_lease_duration=1))
    try:
        prefill_leg(p, "/v1/completions", body())
        assert p.kv()["retained"]["leases"] == 1
        time.sleep(1.6)
        kv = p.kv()
        assert kv["retained"]["entries"] == 0 and kv["retained"]["released"]["expired"] == 1
        p.assert_integrity()
        assert p.get("/debug/engine").json()["kv_blocks"]["in_use"] == 0
    finally:
        p.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_worker_killed_before_read(cluster, tiny_model_dir, oracle, policy):
    name, _, _, tmp = cluster
    p = start_worker(tiny_model_dir, tmp / f"p_kill_{policy}.log", *ARGS, kv=kv_config(name))
    d = start_worker(tiny_model_dir, tmp / f"d_{policy}.log", *ARGS,
                     kv=kv_config(name, policy=policy, read_timeout_s=3.0))
    try:
        params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
        p.kill()
        t0 = time.monotonic()
        r = decode_leg(d, "/v1/completions", body(), params)
        # the side channel's connect timeout (1 s) bounds it, not the 3 s read timeout
        assert time.monotonic() - t0 < 2.5, "a dead holder must not hold the reader"
        if policy == "recompute":
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == oracle(PROMPT).text
            assert r.json()["kv_stats"]["pull_outcome"] == "unreachable"
        else:
            assert 400 <= r.status_code < 600 and r.status_code != 200
            err = r.json()["error"]
            assert "KV transfer failed" in err["message"]
        d.assert_integrity()
        # the worker keeps serving
        assert d.post("/v1/completions", body(max_tokens=2)).status_code == 200
    finally:
        p.stop()
        d.stop()


def test_bad_kv_transfer_params_are_4xx(cluster):
    _, p, d, _ = cluster
    for bad in ["nope", {"remote_block_ids": "x", "do_remote_prefill": True},
                {"do_remote_prefill": True, "remote_port": "http"}]:
        r = d.post("/v1/completions", body(kv_transfer_params=bad))
        assert r.status_code == 400, r.text
        assert "kv_transfer_params" in r.json()["error"]["message"]
    assert d.post("/v1/completions", body(max_tokens=2)).status_code == 200
    d.assert_integrity()
