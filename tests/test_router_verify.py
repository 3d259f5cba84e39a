"""The router's token check for prefill workers that do not verify (vLLM): router/verify.py, the
stream relay's token collection, and the vLLM plugin's trailing chunk (issue 27)."""

from __future__ import annotations

import json

import pytest

from duplexkv.router.legs import TurnStats
from duplexkv.router.stream import StreamRelay
from duplexkv.router.verify import (
    block_size_from_metrics,
    held_sequence,
    prefix_holds,
    release_params,
    tokenize_body,
    verify,
)
from duplexkv.vllm_plugin import trailing_chunk

BS = 4


def d_params(n_tokens: int, n_blocks: int | None = None) -> dict:
    n_blocks = n_blocks if n_blocks is not None else -(-n_tokens // BS)
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d",
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_block_ids": [list(range(10, 10 + n_blocks))], "remote_num_tokens": n_tokens,
            "remote_blocks_expiry_time": 1.0, "tp_size": 1}


def test_a_prompt_that_extends_the_whole_held_sequence_is_a_hit_with_d_s_own_blocks():
    held = list(range(10))  # 10 tokens: 3 blocks, the last partial
    out, v = verify(d_params(10), held, held + [99, 98], BS, threshold=4)
    assert v.outcome == "hit" and v.offered_tokens == 10 and v.matched_tokens == 10
    assert out["remote_num_tokens"] == 10 and out["remote_block_ids"] == [[10, 11, 12]]


def test_a_divergence_cuts_to_whole_blocks_of_the_common_prefix():
    held = list(range(12))
    prompt = held[:9] + [77] + held[10:] + [5]
    out, v = verify(d_params(12), held, prompt, BS, threshold=4)
    assert (v.outcome, v.matched_tokens, v.offered_tokens) == ("partial", 9, 8)
    assert out["remote_num_tokens"] == 8 and out["remote_block_ids"] == [[10, 11]]
    # P is told nothing past the divergence: every offered token equals the prompt's
    assert held[:out["remote_num_tokens"]] == prompt[:out["remote_num_tokens"]]


@pytest.mark.parametrize("prompt, outcome, reason", [
    ([1, 2, 3], "mismatch", "diverged"),  # diverges inside the first block
    (None, "mismatch", "tokenize_failed"),
])
def test_no_whole_block_in_common_is_a_miss(prompt, outcome, reason):
    out, v = verify(d_params(8), [0, 9, 9, 9, 9, 9, 9, 9], prompt, BS, threshold=0)
    assert out is None and (v.outcome, v.reason) == (outcome, reason)


def test_below_the_threshold_nothing_is_handed_over():
    held = list(range(8))
    out, v = verify(d_params(8), held, held[:5] + [99], BS, threshold=8)
    assert out is None and v.outcome == "threshold"


def test_without_held_tokens_or_block_size_a_cut_is_impossible():
    assert verify(d_params(8), None, [1], BS, 0)[1].reason == "unverifiable"
    held = list(range(8))
    assert verify(d_params(8), held, held[:6] + [1], None, 0)[1].reason == "block_size_unknown"
    # the whole sequence needs no block size
    assert verify(d_params(8), held, held + [1], None, 0)[1].outcome == "hit"


def test_release_reads_nothing_and_keeps_d_s_blocks_named():
    r = release_params(d_params(8))
    assert r["remote_num_tokens"] == 0 and r["remote_block_ids"] == [[10, 11]]
    assert release_params({"remote_block_ids": "x"}) is None


def test_held_sequence_is_what_d_has_kv_for():
    params = d_params(5)
    assert held_sequence([1, 2, 3], [4, 5, 6], params) == [1, 2, 3, 4, 5]
    assert held_sequence([1, 2], [3], params) is None  # claims more than it returned
    assert held_sequence([1, "x"], [3], params) is None
    assert held_sequence([1, 2, 3], [4, 5, 6], {"remote_num_tokens": True}) is None


def test_the_p_leg_prompt_must_start_with_the_offered_prefix():
    held = [1, 2, 3, 4, 5]
    offered = {"remote_num_tokens": 4}
    assert prefix_holds({"prompt_token_ids": [1, 2, 3, 4, 9]}, offered, held)
    assert not prefix_holds({"prompt_token_ids": [1, 2, 0, 4, 9]}, offered, held)
    assert not prefix_holds({}, offered, held)


def test_tokenize_body_carries_what_changes_the_rendered_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0,
            "max_tokens": 3, "stream": True}
    assert tokenize_body(body, chat=True) == {
        "model": "m", "messages": body["messages"], "tools": [],
        "chat_template_kwargs": {"enable_thinking": False}}
    assert tokenize_body({"model": "m", "prompt": "x", "n": 2}, chat=False) == \
        {"model": "m", "prompt": "x"}


def test_block_size_from_vllm_metrics():
    text = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{_block_size_resolved="True",'
            'block_size="128",cache_dtype="auto"} 1.0\n')
    assert block_size_from_metrics(text) == 128
    assert block_size_from_metrics("vllm:other 1") is None


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_the_relay_collects_token_ids_and_hides_them_from_the_client():
    relay = StreamRelay(TurnStats(), 0.0, tokens=True, strip_tokens=True)
    events = b"".join([
        _sse({"id": "c", "prompt_token_ids": [1, 2], "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}),
        _sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [3]}]}),
        _sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [4],
                                      "finish_reason": "length"}]}),
        _sse({"id": "c", "choices": [], "kv_transfer_params": d_params(3)}),
        b"data: [DONE]\n\n"])
    out = b"".join(relay.feed(events))
    assert b"token_ids" not in out and b"kv_transfer_params" not in out
    assert relay.held(relay.params) == [1, 2, 3]


def test_the_relay_keeps_token_ids_a_client_asked_for():
    relay = StreamRelay(TurnStats(), 0.0, tokens=True, strip_tokens=False)
    out = b"".join(relay.feed(_sse({"choices": [{"index": 0, "delta": {"content": "a"},
                                                 "token_ids": [3]}]})))
    assert b'"token_ids"' in out


def test_the_plugin_s_trailing_chunk_carries_the_stream_s_identity():
    last = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m",' \
           '"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    chunk = trailing_chunk(last, {"remote_num_tokens": 3})
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    obj = json.loads(chunk[6:])
    assert obj == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                   "model": "m", "choices": [], "kv_transfer_params": {"remote_num_tokens": 3}}
    assert json.loads(trailing_chunk(None, {"a": 1})[6:]) == {"choices": [],
                                                             "kv_transfer_params": {"a": 1}}
