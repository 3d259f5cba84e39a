"""Behaving like `vllm serve` where clients expect it (issue 15, points 3-5), on real P and D
workers and a real router on loopback, all with API keys:

- chat: `tools` and `chat_template_kwargs` reach the chat template (the prompt is, token for token,
  HF transformers' `apply_chat_template` with the same arguments); what cannot be honoured is a
  400 naming the field on the worker and on the router alike; unknown fields are logged once per
  name; `stop_reason` is the matched stop string or token id; error `code` is the HTTP status.
- endpoints: `/version` (open), `/tokenize` and `/detokenize` (keyed) in vLLM's shapes.
- metrics: vLLM's names with the `model_name` label, agreeing with our own counters; every metric
  the Grafana dashboard in deploy/grafana queries exists on a live worker or router.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_router import MODEL, SYSTEM, bidi, chat, conv, start_router, user
from workers import start_p_and_d, stopping

import duplexkv
from duplexkv.http.request_fields import UnknownFields
from duplexkv.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

WKEY, RKEY = "sk-vllm-compat-worker-1", "sk-vllm-compat-router-1"
ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024")
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "duplexkv.json"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_compat")


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp):
    p, d = start_p_and_d(tiny_model_dir, tmp, *ARGS, kv=bidi(), p_args=("--api-key", WKEY),
                         d_args=("--api-key", WKEY))
    for w in (p, d):
        w.client.headers["authorization"] = f"Bearer {WKEY}"
    yield p, d
    for w in (p, d):
        w.stop()


@pytest.fixture(scope="module")
def router(workers, tmp):
    p, d = workers
    with stopping(start_router(tmp / "router.log", [p.url], [d.url], "--api-key", RKEY,
                     "--worker-api-key", WKEY)) as r:
        yield r


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def post(url: str, path: str, body: dict, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def targets(workers, router) -> list[tuple[str, str, str]]:
    """(what, url, key): a worker directly and the router in front of both."""
    return [("worker", workers[1].url, WKEY), ("router", router.url, RKEY)]


def hf_ids(hf_tok, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                     tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# point 3: chat like vLLM

def test_tools_and_template_kwargs_render_as_in_transformers(tiny_model_dir, hf_tok):
    """The synthetic models' template lists tools and honours Qwen3's `enable_thinking`, exactly
    as transformers renders it."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    plain = tok.apply_chat_template(MESSAGES)
    ours = tok.apply_chat_template(MESSAGES, tools=TOOLS, enable_thinking=False)
    theirs = hf_tok.apply_chat_template(MESSAGES, tools=TOOLS, enable_thinking=False,
                                        tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "get_weather" not in plain
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(MESSAGES, enable_thinking=True) == plain


def test_tools_and_chat_template_kwargs_reach_the_template(workers, router, hf_tok):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "tools": TOOLS,
            "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": False},
            "return_token_ids": True}
    ref = hf_ids(hf_tok, MESSAGES, tools=TOOLS, enable_thinking=False)
    assert len(ref) > len(hf_ids(hf_tok, MESSAGES)) + 20  # the tools are in it
    for what, url, key in targets(workers, router):
        r = post(url, "/v1/chat/completions", body, key)
        assert r.status_code == 200, (what, r.text)
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == ref, what
        assert r.json()["usage"]["prompt_tokens"] == len(ref), what


# guided decoding: the workers honour these (tests/test_structured_output.py,
# tests/test_tool_calls.py) and the router passes them on to both legs (tests/test_router_tools.py)
GUIDED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
]
UNHONOURABLE = [
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: needs --tool-call-parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0].type"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
]


@pytest.mark.parametrize("extra, param", UNHONOURABLE, ids=[u[1] + f"-{i}" for i, u in
                                                            enumerate(UNHONOURABLE)])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(workers, router, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    for what, url, key in targets(workers, router):
        r = post(url, "/v1/chat/completions", body, key)
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == 400, (what, err)
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, param", GUIDED, ids=[g[1] + f"-{i}" for i, g in
                                                     enumerate(GUIDED)])
def test_guided_decoding_is_served_by_workers_and_router_alike(workers, router, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    for what, url, key in targets(workers, router):
        r = post(url, "/v1/chat/completions", body, key)
        assert r.status_code == 200, (what, param, r.text)


def test_no_op_values_of_unsupported_features_are_accepted(workers, router):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
            "response_format": {"type": "text"}, "tool_choice": "none", "use_beam_search": False,
            "skip_special_tokens": True, "include_stop_str_in_output": False,
            "parallel_tool_calls": True, "user": "u", "metadata": {"k": "v"}}
    for what, url, key in targets(workers, router):
        r = post(url, "/v1/chat/completions", body, key)
        assert r.status_code == 200, (what, r.text)
    for what, url, key in targets(workers, router):  # guided completions: passed on alike
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                          "response_format": {"type": "json_object"}}, key)
        assert r.status_code == 200, (what, r.text)


def test_unknown_fields_are_logged_once_per_name(workers, router):
    _, d = workers
    name = "zz_not_a_vllm_field_" + conv()[5:]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, name: 1}
    for _ in range(3):
        assert post(d.url, "/v1/completions", body, WKEY).status_code == 200
        assert post(router.url, "/v1/completions", body, RKEY).status_code == 200
    for log in (d.log, router.log):
        lines = [ln for ln in log.read_text().splitlines() if name in ln]
        assert len(lines) == 1 and "unknown request field" in lines[0], (log, lines)


def test_unknown_field_names_kept_are_bounded(caplog):
    """A client inventing field names can neither grow the set of logged names without bound nor
    flood the log."""
    seen = UnknownFields(limit=4)
    with caplog.at_level("WARNING", logger="duplexkv.http"):
        for i in range(50):
            seen.note({"prompt": "x", f"made_up_{i}": 1, f"other_{i}": 2}, "completion")
        seen.note({"prompt": "x", "made_up_0": 1}, "completion")
    assert len(seen.seen) <= 5 and len(caplog.records) <= 3, (seen.seen, caplog.records)
    assert "further unknown names are not logged" in caplog.records[-1].getMessage()
    # chat-only fields sent to /v1/completions are unknown there (as in vLLM), not silently used
    fresh = UnknownFields()
    fresh.note({"prompt": "x", "tools": [], "max_tokens": 1, "user": "u"}, "completion")
    assert fresh.seen == {"tools"}


def _greedy(url: str, key: str, extra: dict, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}
    if not stream:
        r = post(url, "/v1/completions", body, key)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      headers={"authorization": f"Bearer {key}"}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    return finals[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_reason_is_the_matched_stop_string_or_token_id(workers, router, stream):
    for what, url, key in targets(workers, router):
        free = _greedy(url, key, {}, stream)
        assert free["finish_reason"] == "length" and free["stop_reason"] is None, what
        if stream:
            continue
        ids, text = free["token_ids"], free["text"]
        word = text[len(text) // 2:][:2]
        stopped = _greedy(url, key, {"stop": ["\x00never", word]})
        assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == word, what
        assert stopped["text"] == text[:text.index(word)], what
        tok = ids[len(ids) // 2]
        by_id = _greedy(url, key, {"stop_token_ids": [tok]})
        assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == tok, what
        assert by_id["token_ids"] == ids[:ids.index(tok) + 1], what
    # and in a stream's finish chunk
    free = _greedy(workers[1].url, WKEY, {})
    tok = free["token_ids"][5]
    for what, url, key in targets(workers, router):
        last = _greedy(url, key, {"stop_token_ids": [tok]}, stream=True)
        assert last["finish_reason"] == "stop" and last["stop_reason"] == tok, what


def test_error_code_is_the_http_status(workers, router):
    for what, url, key in targets(workers, router):
        r = post(url, "/v1/completions", {"model": "no-such-model", "prompt": "x"}, key)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (what, r.text)
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, key)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (what, r.text)
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}, "wrong-key")
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, (what, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# point 4: endpoints

def test_version_on_workers_and_router_is_open(workers, router):
    for url in (workers[0].url, workers[1].url, router.url):
        r = httpx.get(url + "/version", timeout=30)  # no key: open, as in vLLM
        assert r.status_code == 200 and r.json() == {"version": duplexkv.__version__}


def test_tokenize_and_detokenize_in_vllms_shapes(workers, hf_tok):
    d = workers[1]
    text = "Héllo wörld, the capital of France is"
    r = post(d.url, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True},
             WKEY)
    assert r.status_code == 200, r.text
    body = r.json()
    ref = hf_tok.encode(text, add_special_tokens=True)
    assert body == {"count": len(ref), "max_model_len": 1024, "tokens": ref,
                    "token_strs": hf_tok.convert_ids_to_tokens(ref)}
    r = post(d.url, "/detokenize", {"model": MODEL, "tokens": ref}, WKEY)
    assert r.status_code == 200 and r.json() == {"prompt": text}
    # a chat: rendered with its tools and template kwargs, as /v1/chat/completions renders it
    chat_body = {"messages": MESSAGES, "tools": TOOLS,
                 "chat_template_kwargs": {"enable_thinking": False}}
    r = post(d.url, "/tokenize", chat_body, WKEY)
    assert r.status_code == 200, r.text
    ref = hf_ids(hf_tok, MESSAGES, tools=TOOLS, enable_thinking=False)
    assert r.json()["tokens"] == ref and r.json()["count"] == len(ref)
    assert r.json()["token_strs"] is None
    gen = post(d.url, "/v1/chat/completions", {**chat_body, "tool_choice": "none",
                                               "max_tokens": 1, "return_token_ids": True}, WKEY)
    assert gen.json()["choices"][0]["prompt_token_ids"] == ref
    r = post(d.url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, WKEY)
    assert r.json()["tokens"] == hf_ids(hf_tok, MESSAGES, add_generation_prompt=False)
    r = post(d.url, "/detokenize", {"tokens": ref}, WKEY)
    assert r.json()["prompt"] == hf_tok.decode(ref)  # special tokens kept, as vLLM's


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs.tools"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
])
def test_tokenize_errors(workers, path, body, status, param):
    r = post(workers[1].url, path, body, WKEY)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == status


def test_tokenize_and_detokenize_need_a_key(workers):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        for key in (None, "wrong"):
            r = post(workers[0].url, path, body, key)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, r.text
        assert post(workers[0].url, path, body, WKEY).status_code == 200


# point 5: metrics like vLLM

def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_metric_names_agree_with_ours(workers, router):
    p, d = workers
    client = router.client(RKEY)
    conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}]
    for t in range(2):  # turn 2: P pulls the conversation's KV from D
        messages.append(user(t))
        text, stats = chat(client, messages, conv_id, stream=t == 1)
        messages.append({"role": "assistant", "content": text})
    assert stats["prefill"]["pulled_tokens"] > 0, stats
    lv = (("engine", "0"), ("model_name", MODEL))
    for w in (p, d):
        s = samples(w.url)

        def vllm(name: str, *extra: tuple[str, str]) -> float:
            return s[(name, tuple(sorted(lv + extra)))]

        assert vllm("vllm:prompt_tokens_total") == s[("duplexkv_prompt_tokens_total", ())] > 0
        assert vllm("vllm:generation_tokens_total") == \
            s[("duplexkv_generation_tokens_total", ())] > 0
        assert vllm("vllm:prefix_cache_queries_total") == vllm("vllm:prompt_tokens_total")
        assert vllm("vllm:prefix_cache_hits_total") == \
            s[("duplexkv_prefix_cache_hit_tokens_total", ())]
        assert vllm("vllm:external_prefix_cache_hits_total") == \
            s[("duplexkv_kv_pulled_tokens_total", ())]
        finished = sum(vllm("vllm:request_success_total", ("finished_reason", r))
                       for r in ("stop", "length"))
        ok = sum(v for (n, labels), v in s.items()
                 if n == "duplexkv_requests_total" and ("outcome", "ok") in labels)
        assert finished == ok > 0
        assert vllm("vllm:time_to_first_token_seconds_count") == ok
        assert vllm("vllm:e2e_request_latency_seconds_count") == ok
        assert vllm("vllm:num_requests_running") == 0 and vllm("vllm:num_requests_waiting") == 0
        used = s[("duplexkv_kv_blocks", (("state", "used"),))]
        assert vllm("vllm:kv_cache_usage_perc") == pytest.approx(used / 256)
        ttft_by_source = sum(v for (n, _), v in s.items()
                             if n == "duplexkv_time_to_first_token_by_source_seconds_count")
        assert ttft_by_source == ok
    # P pulled on turn 2: its external hits and its "pulled" TTFT are counted
    s = samples(p.url)
    assert s[("vllm:external_prefix_cache_hits_total", lv)] > 0
    assert s[("vllm:external_prefix_cache_queries_total", lv)] >= \
        s[("vllm:external_prefix_cache_hits_total", lv)]
    assert s[("duplexkv_time_to_first_token_by_source_seconds_count",
              (("source", "pulled"),))] >= 1
    # D decoded several tokens per request: inter-token latencies were observed
    assert samples(d.url)[("vllm:inter_token_latency_seconds_count", lv)] > 0


def dashboard_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in re.findall(r"\b(?:duplexkv_[a-z0-9_]+|vllm:[a-z0-9_:]+)", e)}


def test_every_metric_the_dashboard_queries_exists(workers, router):
    names = dashboard_metrics()
    assert len(names) >= 20 and any(n.startswith("vllm:") for n in names)
    for topic in ("ttft_by_source", "pulled_tokens", "computed_tokens", "retained",
                  "declined", "router_reuse"):
        assert any(topic in n.replace("time_to_first_token_by_source", "ttft_by_source")
                   for n in names), topic
    live: set[str] = set()
    for url in (workers[0].url, workers[1].url, router.url):
        live |= {name for name, _ in samples(url)}
    assert not names - live, sorted(names - live)
