"""The pull cost model on a really shaped link (duplexkv_bench/hosts: D and two Ps on hosts of their
own, every link limited by tc tbf), not the stand-in bandwidth of tests/test_cost_model.py: P's
link model measures the slow link from its own first READ and then declines the pull that the
fixed 64-token rule takes, whose real READ then costs more than the recompute it avoided. When
the link is fast again, the slow samples age out, the estimate grows from the last one toward the
prior, and the first turn whose pull pays at the grown estimate pulls and measures it afresh.
D's answers equal one float32 engine computing each prompt from scratch, every way. Needs root."""

from __future__ import annotations

import httpx
import pytest
from workers import wait_for

from duplexkv.engine.cost_model import Coefficients
from duplexkv_bench.hosts.netns import Network, can_build
from duplexkv.kv.link_model import LinkEstimate
from duplexkv.wire.kv_params import miss_params, replay_params

ok, why = can_build()
pytestmark = pytest.mark.skipif(not ok, reason=why)

RATE, RATE_GBPS = "8mbit", 0.008
HISTORY = 1000  # tiny model: 512 B of KV per token, ~0.5 MiB per history (~0.5 s at 8 Mbit/s)
ARGS = ("--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048")
MISS = miss_params()
MAX_AGE_S = 6.0  # P model's kv_link_sample_max_age_s: long enough for the slow-link turns


@pytest.fixture(scope="module")
def slow_link(tiny_model_dir, tmp_path_factory):
    from duplexkv_bench.hosts.cluster import HostCluster

    with Network(["d", "pm", "pf"]) as net:
        for h in net.names:
            net.shape(h, RATE)
        hc = HostCluster(net, str(tiny_model_dir), tmp_path_factory.mktemp("cost-hosts"))
        d = hc.worker("d", "d", *ARGS)
        pm = hc.worker("pm", "p_model", *ARGS, "--no-enable-prefix-caching",
                       kv_extra={"kv_link_sample_max_age_s": MAX_AGE_S})
        pf = hc.worker("pf", "p_fixed", *ARGS, "--no-enable-prefix-caching",
                       kv_extra={"kv_recompute_threshold": 64})
        hc.ready([d, pm, pf])
        with httpx.Client(timeout=60) as client:
            yield net, client, d.url, pm.url, pf.url


def _post(client, url: str, body: dict) -> dict:
    r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def second_turn(client, d: str, p_first: str, p: str, oracle, seed: int) -> dict:
    """Turn 1 through `p_first` -> D (D retains it); turn 2 through `p` with D's params, then
    D; D's answer is checked against reuse off. Returns P's kv_stats of turn 2."""
    prompt = [(7 * i + 13 * seed) % 500 + 10 for i in range(HISTORY)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    pj = _post(client, p_first, {**body, "max_tokens": 1, "kv_transfer_params": MISS})
    dj = _post(client, d, {**body, "kv_transfer_params": pj["kv_transfer_params"]})
    nxt = prompt + dj["choices"][0]["token_ids"] + list(range(40, 72))
    body2 = {**body, "prompt": nxt}
    pj2 = _post(client, p, {**body2, "max_tokens": 1,
                            "kv_transfer_params": replay_params(dj["kv_transfer_params"])})
    dj2 = _post(client, d, {**body2, "kv_transfer_params": pj2["kv_transfer_params"]})
    assert dj2["choices"][0]["token_ids"] == oracle(nxt, 8).token_ids
    return pj2["kv_stats"]


def pull_pays(client, p: str, gain: int, nbytes: float, margin: float) -> bool:
    """P's predicted READ of `nbytes` from its one peer costs less than 1/margin of its
    predicted recompute of `gain` tokens (no local prefix: prefix caching is off on P)."""
    kv = client.get(p + "/health").json()["kv_transfer"]
    est = next(iter(kv["links"]["peers"].values()))
    link_est = LinkEstimate(est["rtt_ms"], est["gbps"], est["measured"])
    recompute = Coefficients(**kv["cost_model"]["coefficients"]).predict(gain, 0)
    return margin * link_est.transfer_ms(int(nbytes)) < recompute


def link(client, p: str) -> dict:
    peers = client.get(p + "/health").json()["kv_transfer"]["links"]["peers"]
    assert len(peers) == 1, peers
    return next(iter(peers.values()))


def test_measured_slow_link_declines_the_pull_the_fixed_rule_takes(slow_link, oracle):
    net, client, d, pm, pf = slow_link
    # first pull from D: the link model has only its prior (10 Gbit/s) and pulls
    s = second_turn(client, d, pf, pm, oracle, 1)
    assert s["pull_outcome"] == "pulled" and s["pull_decision"]["link_measured"] is False, s
    # ... and that READ measured the shaped link
    est = link(client, pm)
    gbps = est["gbps"]
    assert est["measured"] and 0.3 * RATE_GBPS < gbps < 2 * RATE_GBPS, est  # tbf's burst
    # the same turn again: declined by the measured link, pulled by the fixed rule
    model = second_turn(client, d, pf, pm, oracle, 2)
    fixed = second_turn(client, d, pf, pf, oracle, 2)
    dec = model["pull_decision"]
    assert model["pull_outcome"] == "cost_model" and model["pulled_tokens"] == 0, model
    assert dec["link_measured"] is True and dec["link_gbps"] == pytest.approx(gbps, abs=1e-3)
    assert dec["predicted_transfer_ms"] > dec["predicted_recompute_ms"] > 0
    assert fixed["pull_outcome"] == "pulled" and fixed["pulled_tokens"] >= HISTORY, fixed
    # the pull the model declined really was dearer than the recompute it predicted
    actual = fixed["pull_decision"]["actual_transfer_ms"]
    assert actual > dec["predicted_recompute_ms"], (actual, dec)
    assert actual > 0.5 * dec["predicted_transfer_ms"], (actual, dec)

    # the link is fast again: once the slow samples are older than MAX_AGE_S they are trusted
    # less with their age (the estimate doubles per MAX_AGE_S); when it has grown past the
    # bandwidth at which the READ costs what the recompute does, the next turn pulls (a probe)
    # and measures the fast link
    for h in net.names:
        net.shape(h, None)
    pays = gbps * dec["predicted_transfer_ms"] / dec["predicted_recompute_ms"]
    wait_for(lambda: not link(client, pm)["measured"], MAX_AGE_S + 10, "slow samples aged out")
    assert link(client, pm)["gbps"] < 0.5 * pays  # not back on the 10 Gbit/s prior at once
    # grown until the READ costs at most 2/3 of the recompute as P would predict both now: its
    # prefill cost model has learned from the recomputes since `dec`, and the round trip counts
    nbytes = (dec["predicted_transfer_ms"] - dec["link_rtt_ms"]) * dec["link_gbps"] * 1e6 / 8
    wait_for(lambda: pull_pays(client, pm, dec["gain_tokens"], nbytes, 1.5),
             8 * MAX_AGE_S + 10, "estimate grown")
    probe = second_turn(client, d, pf, pm, oracle, 3)
    assert probe["pull_outcome"] == "pulled" and probe["pull_decision"]["link_measured"] is False
    again = second_turn(client, d, pf, pm, oracle, 4)
    dec = again["pull_decision"]
    assert again["pull_outcome"] == "pulled" and dec["link_measured"] is True, again
    assert dec["link_gbps"] > 20 * RATE_GBPS, dec
