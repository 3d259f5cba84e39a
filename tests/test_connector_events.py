"""The connector's events in one process: two real engines with real connectors (TCP transport,
loopback, no HTTP). A D leg whose READ of P's blocks lands emits P's first token at once: the step
that returns it runs no forward pass (it used to run one first, which tripled D's TTFT at 2k)."""

from __future__ import annotations

import time

from duplexkv import SamplingParams
from duplexkv.engine.config import EngineConfig
from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.engine.llm_engine import LLMEngine
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.connector import KVConnector
from workers import TEST_SECRET


def engine(model) -> tuple[LLMEngine, KVConnector]:
    eng = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64,
                                 max_model_len=512))
    conn = KVConnector(KVTransferConfig.parse({"kv_connector": "TcpConnector"}), eng)
    eng.attach_connector(conn)
    return eng, conn


def run_until_finished(eng: LLMEngine, rid: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out
        time.sleep(0.001)
    raise AssertionError("no answer in 60 s")


def test_landed_first_token_leaves_before_a_forward_pass(tiny_model_dir, monkeypatch):
    # a cluster secret, as every cluster has (`up` makes one): without it D pulls nothing
    monkeypatch.setenv("DUPLEXKV_KV_SECRET", TEST_SECRET)
    p, pc = engine(tiny_model_dir)
    d, dc = engine(tiny_model_dir)
    try:
        prompt = list(range(300, 380))
        p.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), "p1",
                      KVTransferParams(do_remote_decode=True))
        params = run_until_finished(p, "p1").kv_transfer_params
        assert params is not None and params.first_token_id is not None
        forward_passes = []
        real = d.runner.run
        d.runner.run = lambda batch: forward_passes.append(len(batch)) or real(batch)
        d.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "d1",
                      params)
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "D never answered"
            before = len(forward_passes)
            outs = d.step()
            if outs:
                break
            time.sleep(0.001)
        assert [o.token_ids for o in outs] == [[params.first_token_id]]
        assert outs[0].kv_stats.computed_tokens == 0 and outs[0].kv_stats.pull_outcome == "pulled"
        assert len(forward_passes) == before == 0, "a forward pass ran before the first token left"
        rest = run_until_finished(d, "d1")
        assert len(rest.token_ids) == 4
        d.check_integrity()
    finally:
        pc.close()
        dc.close()
