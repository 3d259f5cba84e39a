"""The measured pull-or-recompute decision (engine/cost_model.py, kv/link_model.py,
kv/pull_decision.py): its parts on known numbers, then real P and D workers (TCP, float32,
greedy) whose decisions follow the model and whose outputs equal reuse off either way."""

from __future__ import annotations

import pytest
from workers import MISS, decode_leg, kv_config, prefill_leg, start_worker

from duplexkv.engine.cost_model import PrefillCostModel, Sample
from duplexkv.kv.config import KVConfigError, KVTransferConfig
from duplexkv.kv.link_model import LinkModel
from duplexkv.kv.pull_decision import COST_MODEL, DEFAULT_THRESHOLD, decide

ARGS = ("--num-kv-blocks", "160", "--max-model-len", "1024")


# the parts -----------------------------------------------------------------------------------
def test_cost_model_recovers_a_known_prefill_cost():
    def truth(n, c):
        return 3.0 + 0.2 * n + 2e-5 * n * (c + n / 2)

    cm = PrefillCostModel()
    assert cm.predict_ms(100, 0) is None
    for n, c in [(16, 0), (64, 0), (256, 0), (512, 512), (1024, 1024), (1024, 4096),
                 (2048, 8192), (128, 12000)]:
        cm.add(Sample(n, c, truth(n, c)))
    for n, c in [(100, 0), (2048, 14000), (300, 9000)]:
        assert cm.predict_ms(n, c) == pytest.approx(truth(n, c), rel=0.02)


def test_cost_model_follows_real_prefills():
    """Newer samples push out the calibration: a machine that became 3x slower is seen as such."""
    cm = PrefillCostModel(max_samples=32)
    for n in (16, 64, 256, 1024):
        cm.add(Sample(n, 0, 1.0 + 0.01 * n), real=False)
    for _ in range(8):
        for n in (32, 128, 512, 2048):
            cm.observe(n, 0, 3 * (1.0 + 0.01 * n))
    assert cm.predict_ms(1000, 0) == pytest.approx(3 * 11.0, rel=0.05)
    assert cm.observed == 32


def test_link_model_prior_then_best_recent_samples():
    link = LinkModel(prior_rtt_ms=1.0, prior_gbps=10.0)
    est = link.estimate("d")
    assert (est.rtt_ms, est.gbps, est.measured) == (1.0, 10.0, False)
    for ms in (3.0, 0.4, 2.0):
        link.observe_rtt("d", ms)
    link.observe_read("d", 10_000_000, 100.0)  # 0.8 Gbit/s (e.g. it finished during a step)
    link.observe_read("d", 10_000_000, 8.0)  # 10 Gbit/s
    est = link.estimate("d")
    assert est.rtt_ms == 0.4 and est.gbps == pytest.approx(10.0) and est.measured
    assert est.transfer_ms(12_500_000) == pytest.approx(0.4 + 10.0)
    slow = LinkModel(assumed_gbps=0.1)
    slow.observe_read("d", 10_000_000, 8.0)
    assert slow.estimate("d").gbps == 0.1


def _cost() -> PrefillCostModel:
    cm = PrefillCostModel()
    for n in (64, 256, 1024, 4096):
        cm.add(Sample(n, 0, 0.1 * n))  # 0.1 ms per token
    return cm


def test_decision_follows_the_model_and_an_explicit_threshold_overrides():
    cm, link = _cost(), LinkModel()
    # 1000 tokens: recompute ~100 ms; 64 MB over 100 Mbit/s ~5 s, over 10 Gbit/s ~51 ms
    slow = LinkModel(assumed_gbps=0.1).estimate("d")
    fast = LinkModel(assumed_gbps=10.0).estimate("d")
    d = decide(COST_MODEL, 1000, 0, 64_000_000, slow, cm)
    assert not d.pull and d.reason == "cost_model" and d.policy == "cost_model"
    assert d.predicted_transfer_ms > d.predicted_recompute_ms
    d = decide(COST_MODEL, 1000, 0, 64_000_000, fast, cm)
    assert d.pull and d.predicted_transfer_ms < d.predicted_recompute_ms
    # an explicit threshold decides, whatever the model predicts (both predictions reported)
    d = decide(0, 1000, 0, 64_000_000, slow, cm)
    assert d.pull and d.policy == "threshold" and d.predicted_recompute_ms is not None
    d = decide(2000, 1000, 0, 64_000_000, fast, cm)
    assert not d.pull and d.reason == "threshold"
    # before any sample: the fixed default rule
    d = decide(COST_MODEL, DEFAULT_THRESHOLD - 1, 0, 1000, link.estimate("d"),
               PrefillCostModel())
    assert not d.pull and d.policy == "threshold"


def test_link_model_forgets_old_read_samples():
    """Bandwidth comes only from pulls: a link once measured slow would be declined for good.
    Samples older than max_age_s stop counting as measurements; the newest one is then trusted
    less with its age (doubling per max_age_s up to the prior), so a later turn pulls and
    re-measures, without betting a READ on the prior right after the samples aged out."""
    now = [0.0]
    link = LinkModel(prior_gbps=10.0, max_age_s=60.0, clock=lambda: now[0])
    assert (link.estimate("d").gbps, link.estimate("d").measured) == (10.0, False)  # no sample
    link.observe_read("d", 1_000_000, 80.0)  # 0.1 Gbit/s
    now[0] = 59.0
    assert (link.estimate("d").gbps, link.estimate("d").measured) == (pytest.approx(0.1), True)
    link.observe_read("d", 1_000_000, 800.0)  # 0.01 Gbit/s, newer: the max is still 0.1
    now[0] = 61.0
    assert link.estimate("d").gbps == pytest.approx(0.01)  # the 0.1 sample aged out
    now[0] = 119.5  # every sample old: the newest (0.01 at t=59) doubled per 60 s of its age
    est = link.estimate("d")
    assert (est.gbps, est.measured) == (pytest.approx(0.01 * 2 ** (60.5 / 60)), False)
    assert est.gbps < 0.021  # not the 0.1 sample's, nor the prior
    now[0] = 239.0
    assert link.estimate("d").gbps == pytest.approx(0.08)
    now[0] = 59.0 + 60 * 20  # grown past the prior: capped by it
    assert link.estimate("d").gbps == 10.0
    link.observe_read("d", 1_000_000, 0.8)  # a fresh sample counts at once: 10 Gbit/s measured
    assert link.estimate("d").measured
    with pytest.raises(ValueError):
        LinkModel(max_age_s=0)


def test_a_timed_out_read_replaces_the_peers_samples():
    """A READ that ran into the read timeout bounds the link (bytes / time waited) and replaces
    the faster samples from before: the next decision declines instead of pulling again."""
    now = [0.0]
    link = LinkModel(prior_gbps=10.0, max_age_s=60.0, clock=lambda: now[0])
    link.observe_read("d", 1_000_000, 0.8)  # 10 Gbit/s a moment ago
    now[0] = 5.0
    link.observe_timed_out_read("d", 32 << 20, 10_000.0)  # 32 MiB not landed after 10 s
    est = link.estimate("d")
    assert est.measured and est.gbps == pytest.approx((32 << 20) * 8 / 10_000 / 1e6)
    assert est.transfer_ms(32 << 20) >= 10_000  # the same pull is now predicted to take as long


def test_config_threshold_is_the_cost_model_unless_set():
    assert KVTransferConfig.parse({}).kv_recompute_threshold is None
    cfg = KVTransferConfig.parse({"kv_connector_extra_config": {"kv_recompute_threshold": 0,
                                                                "kv_link_assumed_gbps": 1}})
    assert cfg.kv_recompute_threshold == 0 and cfg.kv_link_assumed_gbps == 1.0
    for bad in ({"kv_recompute_threshold": True}, {"kv_recompute_threshold": -1},
                {"kv_link_prior_gbps": 0}, {"kv_link_sample_max_age_s": 0}):
        with pytest.raises(KVConfigError):
            KVTransferConfig.parse({"kv_connector_extra_config": bad})


# real workers --------------------------------------------------------------------------------
def bidi(**kw) -> dict:
    return kv_config("TcpConnector", bidirectional_kv_xfer=True, kv_recompute_threshold=None, **kw)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cost")
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=bidi())
    ps = {name: start_worker(tiny_model_dir, tmp / f"p_{name}.log", *ARGS,
                             "--no-enable-prefix-caching", kv=kv)
          for name, kv in (
              ("model", bidi()),
              # a link measured at 1 kbit/s (a stand-in for a shaped link: kv/link_model.py)
              ("slow", bidi(kv_link_assumed_gbps=1e-6)),
              ("slow_but_threshold", {**bidi(kv_link_assumed_gbps=1e-6),
                                      "kv_connector_extra_config": {
                                          "bidirectional_kv_xfer": True,
                                          "kv_link_assumed_gbps": 1e-6,
                                          "kv_recompute_threshold": 0}}))}
    yield d, ps
    for w in (d, *ps.values()):
        w.stop()


def _second_turn(p_first, p, d, oracle, history: int):
    """Turn 1 through `p_first` -> D (D retains it); turn 2 through `p` replaying D's params.
    Returns P's kv_stats of turn 2 (after checking D's answer against reuse off)."""
    prompt = [(7 * i + 3) % 500 + 10 for i in range(history)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    pj = prefill_leg(p_first, "/v1/completions", body, dict(MISS))
    r = decode_leg(d, "/v1/completions", body, pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    d_params = r.json()["kv_transfer_params"]
    nxt = prompt + r.json()["choices"][0]["token_ids"] + list(range(40, 72))
    body2 = {**body, "prompt": nxt}
    pj2 = prefill_leg(p, "/v1/completions", body2,
                      {**d_params, "do_remote_decode": True, "do_remote_prefill": False})
    r2 = decode_leg(d, "/v1/completions", body2, pj2["kv_transfer_params"])
    assert r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["token_ids"] == oracle(nxt, 8).token_ids
    return pj2["kv_stats"]


def test_slow_link_is_declined_with_both_predictions(cluster, oracle):
    d, ps = cluster
    s = _second_turn(ps["model"], ps["slow"], d, oracle, 600)
    dec = s["pull_decision"]
    assert s["pull_outcome"] == "cost_model" and s["pulled_tokens"] == 0, s
    assert dec["policy"] == "cost_model" and dec["pull"] is False
    assert dec["predicted_transfer_ms"] > dec["predicted_recompute_ms"] > 0
    assert dec["link_gbps"] == pytest.approx(1e-6)
    kv = ps["slow"].kv()
    assert kv["counters"]["decisions"].get("cost_model:decline", 0) >= 1
    assert kv["cost_model"]["coefficients"] is not None  # calibrated at start-up
    assert "duplexkv_kv_pull_decisions_total" in ps["slow"].get("/metrics").text


def test_explicit_threshold_overrides_the_model(cluster, oracle):
    d, ps = cluster
    s = _second_turn(ps["model"], ps["slow_but_threshold"], d, oracle, 600)
    dec = s["pull_decision"]
    assert s["pull_outcome"] == "pulled" and s["pulled_tokens"] > 600, s
    assert dec["policy"] == "threshold" and dec["pull"] is True
    assert dec["predicted_transfer_ms"] > dec["predicted_recompute_ms"]  # the model said no
    assert dec["actual_transfer_ms"] > 0


def test_measured_link_decision_matches_its_predictions(cluster, oracle):
    """The default policy on a measured loopback link: whichever way it decides, it is the way
    its own predictions point; with 900 tokens to gain (several ms to recompute even for the
    tiny model against a sub-millisecond READ) it pulls."""
    d, ps = cluster
    for _ in range(3):  # the link model learns the peer's RTT and bandwidth from these
        s = _second_turn(ps["model"], ps["model"], d, oracle, 900)
        dec = s["pull_decision"]
        assert dec["policy"] == "cost_model"
        assert dec["pull"] == (dec["predicted_transfer_ms"] < dec["predicted_recompute_ms"])
        assert (s["pull_outcome"] == "pulled") == dec["pull"]
    assert dec["link_measured"] is True
    assert s["pull_outcome"] == "pulled", s
