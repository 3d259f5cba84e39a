"""Issue 32's tenant and default-setup findings, replayed against real processes (docs/security.md,
"Threat model per setup"). The attacker is this test process: another local user's program.

(a) defaults, no secret: unsigned params sent straight to a hand-started D name a holder of the
    attacker's choosing; D used to pull 63 tokens of forged KV into its prefix cache
(b) defaults, no secret: D's side channel answered a verify token by token (26,986 requests read
    a user's turn); now it tells whole blocks or the whole entry, and a few misses end the entry
(c) keys: tenant B's `kv_stats.decode.local_hit_tokens` counted tenant A's cached prompt
(d) keys + worker key + Redis: A's signed params replayed to P by someone else read A's blocks
(e) `up` (Cluster): workers open to any local process, no KV secret
"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from duplexkv.engine.block_manager import hash_token_blocks, salt_tag
from duplexkv.engine.builder import model_fingerprint
from duplexkv.kv.retention import MAX_MISSES, RetentionTable
from duplexkv.launch import Cluster, ClusterSpec
from duplexkv.router.tenants import Salter
from duplexkv.wire.kv_params import replay_params
from test_router import start_router
from workers import decode_leg, kv_config, prefill_leg, start_worker, stopping

ARGS = ("--num-kv-blocks", "128", "--max-model-len", "1024")
PROMPT = list(range(500, 580))  # 80 tokens: 5 blocks of 16
KEY_A, KEY_B = "sk-tenant-a-4417", "sk-tenant-b-2f9e"
ROUTER_SECRET = "router-secret-for-the-tenant-tests-0123"


def body(prompt: list[int] = PROMPT, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tenants")


# units -------------------------------------------------------------------------------------
def test_router_salt_is_per_key_and_never_the_key() -> None:
    s = Salter(ROUTER_SECRET.encode())
    a, b = s.salt(KEY_A), s.salt(KEY_B)
    assert a != b and KEY_A not in a and s.salt(KEY_A) == a
    assert Salter(b"another-router-secret").salt(KEY_A) != a  # not derivable without the secret
    assert KEY_A not in repr(s) and ROUTER_SECRET not in repr(s)
    leg = {"cache_salt": "mine"}
    s.apply(leg, KEY_A)  # a client's salt partitions inside its key, never across keys
    assert leg["cache_salt"] not in ("mine", a) and leg["cache_salt"] == s.salt(KEY_A, "mine")
    leg = {}
    s.apply(leg, KEY_A)
    assert leg == {"cache_salt": a}
    for shared, key in ((Salter(share=True), KEY_A), (s, None)):  # --share-kv-cache; no keys
        leg = {"cache_salt": "c"}
        shared.apply(leg, key)
        assert leg == {"cache_salt": "c"}


def test_a_verify_tells_whole_blocks_only_and_a_few_misses_end_the_entry() -> None:
    seed = b"fingerprint-0123"
    held = list(range(100, 127))  # 27 tokens: a full block and 11 in the next
    tag, hashes = salt_tag(seed, None), hash_token_blocks(seed, held, 16)

    def fresh() -> RetentionTable:
        t = RetentionTable(16, seed)
        t.add("r", [0, 1], held, "ttl", 60, 600)
        return t

    assert fresh().verify_and_claim("r", hashes, held, 10, tag).matched_tokens == 27
    other = fresh()  # another cache_salt: nothing, not even the first block
    assert other.verify_and_claim("r", hashes, held, 10, salt_tag(seed, "b")).matched_tokens == 0
    t = fresh()
    for k in range(17, 27):  # right up to token k, wrong after: the block, never k
        r = t.verify_and_claim("r", hashes, held[:k] + [9] * (27 - k), 10, tag)
        assert r.matched_tokens == 16 or r.reason == "unknown", (k, r)
    r = t.verify_and_claim("r", hashes, held, 10, tag)  # the right guess, after the misses
    assert (r.matched_tokens, r.reason) == (0, "unknown")
    assert t.get("r").misses == MAX_MISSES and t.get("r").deleted


def test_cache_salt_isolates_one_engines_prefix_cache(tiny_model_dir, oracle):
    """vLLM's `cache_salt` on one engine: a request hits only blocks cached under its own salt,
    and the answer equals the engine without reuse either way."""
    from duplexkv import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    want = oracle(PROMPT, 4).token_ids

    def hit(salt: str | None) -> int:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True, cache_salt=salt))[0]
        assert out.token_ids == want
        return out.kv_stats.local_hit_tokens

    assert hit("tenant-a") == 0
    assert hit("tenant-b") == 0 and hit(None) == 0  # A's blocks count for no one else
    # each finds its own: 4 of the 5 blocks (the last holds the last prompt token, computed)
    assert hit("tenant-a") == 64 and hit(None) == 64
    for bad in ("", 7, "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


# (a), (b): workers started by hand without a secret -------------------------------------------
@pytest.fixture(scope="module")
def open_pd(tiny_model_dir, tmp):
    kv = kv_config("TcpConnector", bidirectional_kv_xfer=True)
    p = start_worker(tiny_model_dir, tmp / "open_p.log", *ARGS, "--no-enable-prefix-caching",
                     kv=kv, secret=None)
    d = start_worker(tiny_model_dir, tmp / "open_d.log", *ARGS, kv=kv, secret=None)
    with stopping(p, d):
        yield p, d


def test_without_a_secret_d_pulls_from_no_holder_named_in_params(open_pd, oracle):
    """Any local process can send D params naming a holder it runs (here a real P stands in for
    the attacker's fake one, which served 63 tokens of forged KV that D then cached for
    everyone): without a secret nothing authenticates them, so D pulls nothing and computes."""
    p, d = open_pd
    pj = prefill_leg(p, "/v1/completions", body())
    r = decode_leg(d, "/v1/completions", body(), pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    stats = r.json()["kv_stats"]
    assert stats["pulled_tokens"] == 0 and stats["pull_outcome"] == "untrusted", stats
    assert r.json()["choices"][0]["token_ids"] == oracle(PROMPT, 6).token_ids
    assert d.kv()["counters"]["declined"].get("untrusted", 0) >= 1


def _verify(addr: tuple[str, int], rid: str, tokens: list[int], seed: bytes) -> dict:
    """A plain ZMQ peer's verify (msgpack ["verify", id, hashes, tokens]: unsalted)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://{addr[0]}:{addr[1]}")
        sock.send(msgspec.msgpack.encode(
            ["verify", rid, hash_token_blocks(seed, tokens, 16), tokens]))
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close(0)


def test_side_channel_answers_no_token_by_token_oracle(open_pd, tiny_model_dir):
    """D holds a user's turn; a local process that learnt its id (from Redis) asks D's side
    channel about guesses: it used to learn each right token (matched = the guess's right
    prefix, token by token); now whole blocks only, and after a few misses nothing at all."""
    p, d = open_pd
    pj = prefill_leg(p, "/v1/completions", body())
    r = decode_leg(d, "/v1/completions", body(), pj["kv_transfer_params"])
    dp = r.json()["kv_transfer_params"]
    n = dp["remote_num_tokens"]  # 85: the prompt and 5 of the 6 answer tokens
    held = (PROMPT + r.json()["choices"][0]["token_ids"])[:n]
    addr, rid = (dp["remote_host"], dp["remote_port"]), dp["remote_request_id"]
    seed = model_fingerprint(tiny_model_dir, "float32", 16)
    assert _verify(addr, rid, held, seed)["matched"] == n  # the attacker's hashes are right
    told = set()
    for k in range(81, 81 + MAX_MISSES):  # right up to token k, then a wrong one
        reply = _verify(addr, rid, held[:k] + [7] * (n - k), seed)
        told.add(reply["matched"])
    assert told <= {80, 0}, told  # the whole blocks, never the guess's k
    reply = _verify(addr, rid, held, seed)  # the right guess comes too late
    assert (reply["matched"], reply.get("reason")) == (0, "unknown"), reply


# (c), (d): workers with a secret, a router with two keys ---------------------------------------
@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp):
    kv = kv_config("TcpConnector", bidirectional_kv_xfer=True)
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, "--no-enable-prefix-caching", kv=kv)
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=kv)
    with stopping(p, d):
        router = start_router(tmp / "router.log", [p.url], [d.url], "--api-key", KEY_A,
                              "--api-key", KEY_B, env={"DUPLEXKV_ROUTER_SECRET": ROUTER_SECRET})
        with stopping(router):
            yield p, d, router


def _via_router(router, key: str, prompt: list[int]) -> dict:
    r = httpx.post(router.url + "/v1/completions", json=body(prompt),
                   headers={"authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_another_tenants_cached_prompt_shows_in_no_count(keyed, oracle):
    """Tenant A's prompt sits in D's prefix cache; B sending the same prompt used to see
    `decode.local_hit_tokens` count it (a right guess of A's PIN: 64, a wrong one: 48)."""
    _, _, router = keyed
    secret = [42, 4, 4, 1, 7] * 3  # A's PIN, in the prompt's fourth block
    prompt = PROMPT[:48] + secret + PROMPT[63:]
    first = _via_router(router, KEY_A, prompt)
    b = _via_router(router, KEY_B, prompt)
    assert b["kv_stats"]["decode"]["local_hit_tokens"] == 0, b["kv_stats"]
    assert b["kv_stats"]["prefill"]["local_hit_tokens"] == 0, b["kv_stats"]
    again = _via_router(router, KEY_A, prompt)  # the cache still serves A
    assert again["kv_stats"]["decode"]["local_hit_tokens"] > 0, again["kv_stats"]
    want = oracle(prompt, 6).token_ids
    for r in (first, b, again):
        assert r["choices"][0]["token_ids"] == want


def _response_via_router(router, key: str, text: str) -> dict:
    r = httpx.post(router.url + "/v1/responses", json={
        "model": "tiny", "input": text, "max_output_tokens": 6, "temperature": 0,
        "store": False}, headers={"authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_responses_api_is_salted_per_tenant_too(keyed):
    """/v1/responses runs its own chat turn (router/responses.py): its legs carry the key's
    salt as chat's do, so B sees no count of A's cached prompt there either."""
    _, _, router = keyed
    text = "The deploy key for staging is 4417-swordfish; rotate it on Friday. " * 6
    _response_via_router(router, KEY_A, text)
    b = _response_via_router(router, KEY_B, text)
    assert b["kv_stats"]["decode"]["local_hit_tokens"] == 0, b["kv_stats"]
    again = _response_via_router(router, KEY_A, text)  # the cache still serves A
    assert again["kv_stats"]["decode"]["local_hit_tokens"] > 0, again["kv_stats"]


def test_params_from_the_store_read_no_blocks_for_another_tenant(keyed):
    """The router stores D's signed params (memory or Redis). Someone who reads them and holds
    the worker key replayed them to P and read A's turn; P's pull now presents the salt of the
    request's own tenant (set by the router from the authenticated key), and A's entry on D
    matches only A's salt."""
    p, d, _ = keyed
    salt_a = Salter(ROUTER_SECRET.encode()).salt(KEY_A)  # what the router puts on A's legs
    pj = prefill_leg(p, "/v1/completions", body(cache_salt=salt_a))
    r = decode_leg(d, "/v1/completions", body(cache_salt=salt_a), pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    stored = r.json()["kv_transfer_params"]  # what the router keeps for A's next turn
    history = (PROMPT + r.json()["choices"][0]["token_ids"]) + [9, 8, 7]
    for attacker in ({}, {"cache_salt": Salter(ROUTER_SECRET.encode()).salt(KEY_B)},
                     {"cache_salt": "guess"}):
        stolen = prefill_leg(p, "/v1/completions", body(history, **attacker),
                             replay_params(stored))
        assert stolen["kv_stats"]["pulled_tokens"] == 0, (attacker, stolen["kv_stats"])
    mine = prefill_leg(p, "/v1/completions", body(history, cache_salt=salt_a),
                       replay_params(stored))
    assert mine["kv_stats"]["pulled_tokens"] >= 64, mine["kv_stats"]  # A's own next turn


# (e) ---------------------------------------------------------------------------------------
def test_cluster_locks_workers_and_the_kv_plane_without_being_asked(tiny_model_dir, tmp_path):
    """`up`, `demo` and `bench` start through Cluster: with no key and no secret given, the
    workers still require a random key that only the router holds, and share a random KV
    secret; both travel by environment, never on a command line."""
    spec = ClusterSpec(model=str(tiny_model_dir), worker_args=("--dtype", "float32"),
                       log_dir=tmp_path)
    ask = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3,
           "temperature": 0}
    with Cluster(spec) as cluster:
        r = httpx.post(cluster.url + "/v1/chat/completions", json=ask, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["kv_stats"]["decode"]["pulled_tokens"] > 0  # signed pulls still work
        for w in cluster.workers:
            assert httpx.get(w.url + "/v1/models", timeout=30).status_code == 401
            assert httpx.get(w.url + "/debug/engine", headers=cluster.worker_headers(),
                             timeout=30).status_code == 200  # the benchmarks' own reads
            environ = Path(f"/proc/{w.proc.pid}/environ").read_bytes().split(b"\0")
            secret = [e for e in environ if e.startswith(b"DUPLEXKV_KV_SECRET=")]
            assert secret and len(secret[0]) > 40, "no KV secret in the worker's environment"
            assert secret[0].split(b"=", 1)[1] not in Path(
                f"/proc/{w.proc.pid}/cmdline").read_bytes()
            side = httpx.get(w.url + "/health", timeout=30).json()["kv_transfer"]["side_channel"]
            host, port = side.rsplit(":", 1)
            sock = zmq.Context.instance().socket(zmq.REQ)  # a peer without the secret
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 1500)
            try:
                sock.connect(f"tcp://{host}:{port}")
                sock.send(b"\x91\xa4meta")
                with pytest.raises(zmq.Again):
                    sock.recv()
            finally:
                sock.close(0)
