"""API keys (`--api-key`, `DUPLEXKV_API_KEY`) on real workers and a real router on loopback.

P is started with `--api-key` twice, D with `DUPLEXKV_API_KEY="k1,k2"`; the routers in front of
them hold their own client keys and send the worker key on the legs (`--worker-api-key`)."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_router import MODEL, SYSTEM, bidi, chat, conv, start_router, user
from workers import start_p_and_d, stopping

W1, W2 = "sk-worker-one-7f3a", "sk-worker-two-91c4"  # the workers' keys; the router uses W2
R1, R2 = "sk-router-one-0b2e", "sk-router-two-5d8f"  # the router's client keys
ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024")
GUARDED = [("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
           ("POST", "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
           ("GET", "/v1/models", None)]


def call(url: str, method: str, path: str, body: dict | None, key: str | None = None,
         **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def assert_401(r: httpx.Response) -> dict:
    assert r.status_code == 401, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["code"] == 401, err
    assert r.headers["www-authenticate"] == "Bearer"
    return err


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("api_keys")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    # P by the flag (repeated), D by the environment variable (comma-separated)
    p, d = start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi(),
                         p_args=("--api-key", W1, "--api-key", W2),
                         d_env={"DUPLEXKV_API_KEY": f" {W1} , {W2} "})
    for w in (p, d):
        w.client.headers["authorization"] = f"Bearer {W2}"  # the helpers' own calls
    yield p, d
    for w in (p, d):
        w.stop()


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url], "--api-key", R1, "--api-key", R2,
                     "--worker-api-key", W2)) as r:
        yield r


@pytest.mark.parametrize("role", ["prefill_by_flag", "decode_by_env"])
def test_worker_refuses_a_missing_or_wrong_key_and_accepts_each_of_its_keys(workers, role):
    w = workers[0] if role == "prefill_by_flag" else workers[1]
    for method, path, body in GUARDED:
        for bad in (None, "wrong-key", R1, W1 + "x", W1[:-1]):
            assert_401(call(w.url, method, path, body, bad))
        assert_401(call(w.url, method, path, body, **{"authorization": W1}))  # no scheme
        assert_401(call(w.url, method, path, body, **{"x-api-key": W1}))  # Bearer only
        for good in (W1, W2):
            r = call(w.url, method, path, body, good)
            assert r.status_code == 200, r.text
    assert_401(call(w.url, "GET", "/debug/engine", None))
    assert_401(call(w.url, "GET", "/no/such/path", None))  # guarded before routing
    for path in ("/health", "/metrics"):  # open, as in vLLM
        assert httpx.get(w.url + path, timeout=30).status_code == 200


def test_worker_models_root_is_the_served_name_not_a_path(workers, tiny_model_dir):
    card = call(workers[0].url, "GET", "/v1/models", None, W1).json()["data"][0]
    assert card["root"] == card["id"] == tiny_model_dir.name
    assert str(tiny_model_dir) not in str(card)


def test_router_refuses_clients_without_a_router_key(router):
    for method, path, body in GUARDED:
        for bad in (None, "wrong-key", W2, W1):  # a worker key is not a router key
            assert_401(call(router.url, method, path, body, bad))
    for path in ("/health", "/metrics"):
        assert router.get(path).status_code == 200
    models = call(router.url, "GET", "/v1/models", None, R2)  # the router's GET sends W2
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_router_with_keys_reuses_across_turns(router):
    for key in (R1, R2):
        client = router.client(key)
        conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}]
        for t in range(2):
            messages.append(user(t))
            text, stats = chat(client, messages, conv_id, stream=t == 1)
            assert stats["conversation"] == ("miss" if t == 0 else "hit"), stats
            assert (stats["prefill"]["pulled_tokens"] > 0) == (t == 1), stats
            messages.append({"role": "assistant", "content": text})
    with pytest.raises(openai.AuthenticationError):
        router.client("wrong-key").chat.completions.create(model=MODEL, messages=messages,
                                                           max_tokens=2)


def test_two_router_keys_do_not_share_a_conversation(router):
    a, b = router.client(R1), router.client(R2)
    conv_id = conv()
    messages = [{"role": "system", "content": SYSTEM}, user(0)]
    text, _ = chat(a, messages, conv_id, stream=False)
    messages += [{"role": "assistant", "content": text}, user(1)]
    _, stats_b = chat(b, messages, conv_id, stream=False)  # R2 names R1's conversation
    assert stats_b["conversation"] == "miss" and stats_b["prefill"]["pulled_tokens"] == 0
    _, stats_a = chat(a, messages, conv_id, stream=False)  # still there for R1
    assert stats_a["conversation"] == "hit" and stats_a["prefill"]["pulled_tokens"] > 0


def test_router_keys_from_the_environment(workers, tmp):
    p, d = workers
    r = start_router(tmp / "router-env.log", [p.url], [d.url],
                     env={"DUPLEXKV_API_KEY": f"{R1},{R2}", "DUPLEXKV_WORKER_API_KEY": W1})
    try:
        for method, path, body in GUARDED:
            assert_401(call(r.url, method, path, body, None))
            assert_401(call(r.url, method, path, body, W1))
            for good in (R1, R2):
                resp = call(r.url, method, path, body, good)
                assert resp.status_code == 200, resp.text
    finally:
        r.stop()


def test_router_without_a_worker_key_forwards_no_key(workers, tmp):
    """No --worker-api-key: the router sends no Authorization, not even the client's own."""
    p, d = workers
    r = start_router(tmp / "router-nokey.log", [p.url], [d.url])
    try:
        _, path, body = GUARDED[1]
        resp = call(r.url, "POST", path, body, W1)  # a valid worker key, sent to the router
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
    finally:
        r.stop()


def test_no_key_is_ever_logged(router, workers, tmp):
    # runs last in this module: every key above went through these processes
    logs = [router.log, *(w.log for w in workers), *tmp.glob("router-*.log")]
    for log in logs:
        text = log.read_text(errors="replace")
        for key in (W1, W2, R1, R2):
            assert key not in text, f"{key} in {log}"

