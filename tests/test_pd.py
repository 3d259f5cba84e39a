"""P->D disaggregation between real worker processes, over both transports (float32, greedy):
the decode worker READs the prefill worker's blocks and must produce exactly what one worker
produces alone."""

from __future__ import annotations

import time

import pytest
from workers import (
    TEST_SECRET,
    decode_leg,
    kv_config,
    need_nixl,
    prefill_leg,
    sse_events,
    start_worker,
    wait_for,
)

from duplexkv import LLM, SamplingParams
from duplexkv.kv import messages as m
from duplexkv.kv import side_channel
from duplexkv.kv.auth import KVAuth

CONNECTORS = ["TcpConnector", "NixlConnector"]
ARGS = ("--num-kv-blocks", "96", "--max-model-len", "1024")
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
          "fibonacci(n - 2)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n")


@pytest.fixture(scope="module", params=CONNECTORS)
def cluster(request, tiny_model_dir, tmp_path_factory):
    if request.param == "NixlConnector":
        need_nixl()
    tmp = tmp_path_factory.mktemp(request.param)
    kv = kv_config(request.param, kv_lease_duration=30)
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, kv=kv)
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=kv)
    yield request.param, p, d, tmp
    for w in (p, d):
        w.stop()


def body(prompt=PROMPT, **kw):
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def ids(r) -> list[int]:
    """Generated token ids of a JSON response (the correctness bar: ids, not text)."""
    j = r.json() if hasattr(r, "json") else r
    return j["choices"][0]["token_ids"]


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
    assert ids(dj) == want.token_ids and dj["choices"][0]["text"] == want.text
    assert dj["choices"][0]["prompt_token_ids"] == want.prompt_token_ids
    stats = dj["kv_stats"]
    assert stats["pulled_tokens"] > 0 and stats["pull_outcome"] == "pulled"
    # P's greedy first token came along: D READ every prompt token and computed none of them
    assert params["first_token_id"] == want.token_ids[0]
    assert stats["pulled_tokens"] + stats["local_hit_tokens"] == len(want.prompt_token_ids)
    assert stats["computed_tokens"] == 0
    assert dj["kv_transfer_params"] is None  # bidirectional is off
    # D's read released P's lease
    wait_for(lambda: p.kv()["retained"]["entries"] == 0, what="P to release the lease")
    assert p.kv()["retained"]["released"]["read"] >= 1
    p.assert_integrity()
    d.assert_integrity()


def test_p_to_d_streaming_and_chat(cluster, oracle):
    _, p, d, _ = cluster
    chat = {"messages": [{"role": "user", "content": "Write a sorting function."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    pj = prefill_leg(p, "/v1/chat/completions", chat)
    r = decode_leg(d, "/v1/chat/completions", {**chat, "stream": True}, pj["kv_transfer_params"])
    events = sse_events(r)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    got = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []]
    want = oracle(chat["messages"], 12)
    assert got == want.token_ids and text == want.text
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
    assert ids(r) == want.token_ids
    assert stats["computed_tokens"] == 1
    # a greedy P leg, but D samples: D does not take P's token either (its first draw is its own)
    params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
    assert params["first_token_id"] == want.token_ids[0]
    sampled = body(temperature=0.9, seed=5, max_tokens=8)
    r = decode_leg(d, "/v1/completions", sampled, params)
    assert r.json()["kv_stats"]["computed_tokens"] == 1
    alone = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=96).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True))[0]
    assert ids(r) == alone.token_ids  # seeded sampling as on one worker
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
    assert ids(r) == oracle(PROMPT, 1).token_ids
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
    assert ids(second) == oracle(longer).token_ids
    assert ids(first) == oracle(prompt).token_ids


def test_lease_renewed_by_heartbeats_and_expires_without_them(cluster, tiny_model_dir):
    """P keeps a finished prefill under a lease (3 s here). D's heartbeats (the side channel's
    "hb" message, sent here by hand every 0.3 s for 7 s) keep renewing it; once they stop, the
    lease expires, is counted, and P's blocks are free again."""
    name, _, _, tmp = cluster
    p = start_worker(tiny_model_dir, tmp / "p_lease.log", *ARGS,
                     kv=kv_config(name, kv_lease_duration=3))
    try:
        params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
        assert p.kv()["retained"]["leases"] == 1
        end = time.monotonic() + 7.0  # over twice the lease
        while time.monotonic() < end:
            reply = side_channel.request(params["remote_host"], params["remote_port"],
                                         m.Heartbeat([params["remote_request_id"]]),
                                         m.HeartbeatReply, 10.0, KVAuth(TEST_SECRET.encode()))
            assert reply.known == 1
            retained = p.kv()["retained"]
            assert retained["leases"] == 1 and retained["released"]["expired"] == 0, retained
            time.sleep(0.3)
        # D never comes back: the lease runs out
        wait_for(lambda: p.kv()["retained"]["released"]["expired"] == 1, what="lease expiry")
        kv = p.kv()
        assert kv["retained"]["entries"] == 0
        p.assert_integrity()
        assert p.get("/debug/engine").json()["kv_blocks"]["in_use"] == 0
    finally:
        p.stop()


def test_use_prefill_first_token_false_recomputes_the_last_prompt_token(cluster, tiny_model_dir,
                                                                        oracle):
    """`use_prefill_first_token: false` on D restores vLLM's behaviour: D READs all but the last
    prompt token, computes that one itself, and never emits P's token."""
    name, p, _, tmp = cluster
    d = start_worker(tiny_model_dir, tmp / "d_no_first.log", *ARGS,
                     kv=kv_config(name, use_prefill_first_token=False))
    try:
        params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
        want = oracle(PROMPT)
        assert params["first_token_id"] == want.token_ids[0]  # P offers it ...
        r = decode_leg(d, "/v1/completions", body(), params)
        stats = r.json()["kv_stats"]
        assert ids(r) == want.token_ids
        assert stats["computed_tokens"] == 1  # ... D does not take it
        assert stats["pulled_tokens"] + stats["local_hit_tokens"] == len(want.prompt_token_ids) - 1
        assert d.kv()["counters"]["prefill_first_tokens"] == 0
        d.assert_integrity()
    finally:
        d.stop()


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
            assert ids(r) == oracle(PROMPT).token_ids
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


def test_bfloat16_p_to_d_equals_one_worker(tiny_model_dir, tmp_path):
    """P/D in bfloat16 (the default where the CPU has native bf16; test_dtype.py covers the
    choice) gives the same greedy tokens as one bfloat16 engine, all 16 of them, on several
    prompts. This holds
    exactly, not just for a first few tokens: D READs P's prompt KV bit for bit and starts from
    P's first token (computed by the same one-pass prefill as the single engine's), so every
    later step runs the same kernels on the same numbers. (A D that recomputes the last prompt
    token instead, as with use_prefill_first_token false, may differ in the last bits; the
    first_token benchmark (docs/workers.md) reports how often that flips a near-tied choice.)"""
    name = "TcpConnector"  # the transport copies bytes: one connector covers the dtype
    p = start_worker(tiny_model_dir, tmp_path / "p16.log", *ARGS, kv=kv_config(name),
                     dtype="bfloat16")
    d = start_worker(tiny_model_dir, tmp_path / "d16.log", *ARGS, kv=kv_config(name),
                     dtype="bfloat16")
    try:
        assert p.get("/debug/engine").json()["dtype"] == "bfloat16"
        one = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=96,
                  enable_prefix_caching=False)
        assert one.engine.config.dtype == "bfloat16"
        for prompt in (PROMPT, PROMPT * 4, list(range(40, 240))):
            want = one.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                         ignore_eos=True))[0]
            params = prefill_leg(p, "/v1/completions", body(prompt))["kv_transfer_params"]
            r = decode_leg(d, "/v1/completions", body(prompt), params)
            assert r.json()["kv_stats"]["computed_tokens"] == 0
            assert ids(r) == want.token_ids
        p.assert_integrity()
        d.assert_integrity()
    finally:
        p.stop()
        d.stop()
