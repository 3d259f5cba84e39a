"""The wire vocabulary (duplexkv/wire): the prefill leg's payloads, which the router sends (it has
no copy of its own), and the OpenAI layer reads the sampling knobs that SamplingParams declares."""

from __future__ import annotations

from dataclasses import fields

import pytest

from duplexkv.http.openai import parse_request
from duplexkv.router import warmup
from duplexkv.router.turn import prefill
from duplexkv.wire.kv_params import KVTransferParams, miss_params, replay_params
from duplexkv.wire.sampling import SamplingParams

D_PARAMS = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "d-1",
            "remote_block_ids": [[3, 4]], "remote_host": "10.0.0.2", "remote_port": 5600,
            "remote_request_id": "cmpl-9", "remote_num_tokens": 20, "tp_size": 1,
            "_remote_blocks_processed": True, "first_token_id": 7}


MISS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_the_router_sends_the_wire_payloads():
    for module in (prefill, warmup):
        assert module.miss_params is miss_params and module.replay_params is replay_params


def test_miss_params_are_vllms_miss():
    assert miss_params() == MISS
    a, b = miss_params(), miss_params()
    a["remote_host"] = "x"
    assert b == MISS, "each call returns a fresh dict"


@pytest.mark.parametrize("d", [D_PARAMS, {}, {"do_remote_decode": True, "x": 1}])
def test_replay_params_force_the_p_leg_booleans_and_drop_engine_keys(d):
    out = replay_params(d)
    assert out == {**{k: v for k, v in d.items() if not k.startswith("_")},
                   "do_remote_decode": True, "do_remote_prefill": False}
    assert "_remote_blocks_processed" not in out


def test_a_miss_parses_to_a_leg_with_nothing_to_pull():
    p = KVTransferParams.from_dict(miss_params())
    assert p.do_remote_decode and not p.do_remote_prefill and not p.has_remote_blocks


def test_every_sampling_knob_is_read_from_a_body():
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 0.5, "top_p": 0.9,
            "top_k": 4, "min_p": 0.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
            "repetition_penalty": 1.1, "logit_bias": {"5": 1.5}, "seed": 11, "stop": "x",
            "stop_token_ids": [9], "ignore_eos": True, "min_tokens": 1}
    kwargs = parse_request(body, "completion").sampling_kwargs(3)
    assert set(kwargs) == {f.name for f in fields(SamplingParams)}
    params = SamplingParams(**kwargs)
    assert params.logit_bias == {5: 1.5} and params.stop == ["x"] and params.n == 2
    assert SamplingParams(**parse_request({"prompt": "hi"}, "completion").sampling_kwargs(16)) \
        == SamplingParams()
