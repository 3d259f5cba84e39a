"""Faults across hosts at the router's and workers' default settings (issue 30): every process in
a network namespace of its own (duplexkv_bench/hosts), started without any timeout or health-check
override. Each fault turn must be answered, equal to an undisturbed greedy float32 run, and at
most ~2 s slower than a healthy turn. Needs root (CI runs as root)."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from duplexkv_bench.hosts.netns import Network, can_build

ok, why = can_build()
pytestmark = pytest.mark.skipif(not ok, reason=why)

ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "1024")
SYSTEM = "You are a careful coding agent. Read the tool output, then answer with the next command."
OUT = 16
EXTRA_S = 2.5  # the bound: ~2 s beyond a healthy turn
CLUSTER: dict = {}  # the module's HostCluster ("hc"), for the tests that restart a worker


@pytest.fixture(scope="module")
def hosts(tiny_model_dir, tmp_path_factory):
    from duplexkv_bench.hosts.cluster import HostCluster

    with Network(["r", "s", "p0", "p1", "d0", "d1"]) as net:
        hc = HostCluster(net, str(tiny_model_dir), tmp_path_factory.mktemp("faults"))
        p = [hc.worker(h, f"prefill-{h}", *ARGS, "--no-enable-prefix-caching")
             for h in ("p0", "p1")]
        ds = [hc.worker(h, f"decode-{h}", *ARGS) for h in ("d0", "d1")]
        hc.ready([*p, *ds])
        r = hc.router("r", "router", p, ds)  # the defaults: no option at all
        # the P leg on every turn (auto places short turns on D): P's decline steers D's leg
        rp = hc.router("r", "router-prefill", p, ds, "--placement", "prefill", port=8001)
        # conversations in Redis on host s
        rs = hc.router("r", "router-redis", p, ds, store=hc.redis("s"), port=8002)
        hc.ready([r, rp, rs])
        CLUSTER["hc"] = hc
        yield net, p, ds, {"auto": r, "prefill": rp, "redis": rs}


def user(t: int) -> dict:
    return {"role": "user", "content": f"tool output {t}: " + "ok; " * (8 + 6 * t)}


def chat(url: str, messages: list[dict], conv: str) -> tuple[str, dict, float]:
    body = {"model": "tiny", "messages": messages, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True, "conversation_id": conv}
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    took = time.perf_counter() - t
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["kv_stats"], took


def decode_picks(r) -> list[int]:
    return [w["picks"] for w in httpx.get(r.url + "/health", timeout=5).json()["decode"]]


def next_p(r) -> str:
    """The P host the router picks next (least loaded, then least picked)."""
    ps = httpx.get(r.url + "/health", timeout=5).json()["prefill"]
    return ["p0", "p1"][min(range(2), key=lambda i: (ps[i]["outstanding"], ps[i]["picks"]))]


def streaming_d(r) -> str | None:
    """The D host with a leg in flight (the router's view), None when its leg is already over."""
    ds = httpx.get(r.url + "/health", timeout=5).json()["decode"]
    busy = [h for h, w in zip(("d0", "d1"), ds) if w["outstanding"] > 0]
    assert len(busy) <= 1, ds
    return busy[0] if busy else None


def wait_all_up(r, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = httpx.get(r.url + "/health", timeout=5).json()
        if all(w["healthy"] and not w["suspect"] for role in ("prefill", "decode")
               for w in h[role]):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not up again: {h}")


def two_turns(r, oracle, fault=None, heal=None) -> tuple[float, dict]:
    """A conversation's second turn, with `fault(d_host)` applied to its D's host between the
    turns -> (its time, its kv_stats)."""
    conv, messages = f"f-{uuid.uuid4().hex[:8]}", [{"role": "system", "content": SYSTEM},
                                                    user(1)]
    before = decode_picks(r)
    text, _, _ = chat(r.url, messages, conv)
    after = decode_picks(r)
    d = ["d0", "d1"][[a - b for a, b in zip(after, before)].index(1)]
    messages += [{"role": "assistant", "content": text}, user(2)]
    if fault:
        fault(d)
    try:
        text, stats, took = chat(r.url, messages, conv)
    finally:
        if heal:
            heal(d)
    assert text == oracle(messages, OUT).text, "the fault turn's answer differs"
    return took, stats


def healthy(r, oracle) -> float:
    return min(two_turns(r, oracle)[0] for _ in range(2))


def fault_turn(r, oracle, what: str, fault, heal, extra_s: float = EXTRA_S) -> dict:
    """A healthy turn, then a turn with `fault` between its turns: at most `extra_s` slower
    -> the fault turn's kv_stats."""
    base = healthy(r, oracle)
    took, stats = two_turns(r, oracle, fault, heal)
    print(f"{what}: healthy turn {base:.2f} s, fault turn {took:.2f} s")
    assert took <= base + extra_s, f"{took:.1f} s (healthy {base:.2f} s)"
    wait_all_up(r)
    return stats


def _cut_mid_read(net, p, r):
    """A conversation's second turn with its D's link at 1 Mbit/s, the P-D link cut once P's
    READ is seen in flight: (hosts cut, messages, text, kv_stats, turn seconds, seconds after
    the cut)."""
    conv = f"m-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "tool output 0: " + "ok; " * 200}]
    before = decode_picks(r)
    text, _, _ = chat(r.url, messages, conv)
    d = ["d0", "d1"][[a - b for a, b in zip(decode_picks(r), before)].index(1)]
    messages += [{"role": "assistant", "content": text}, user(1)]
    net.shape(d, "1mbit")
    cut: list[str] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(chat, r.url, messages, conv)
            deadline = time.monotonic() + 10
            while not cut and time.monotonic() < deadline and not turn.done():
                for h, w in zip(("p0", "p1"), p):
                    kv = httpx.get(w.url + "/health", timeout=5).json()["kv_transfer"]
                    if kv["pulls_in_flight"]:
                        time.sleep(0.3)  # inside the READ
                        net.partition(h, d)
                        t_cut = time.perf_counter()
                        cut.append(h)
                        break
                time.sleep(0.02)
            text, stats, took = turn.result()
            after_cut = time.perf_counter() - t_cut if cut else 0.0
    finally:
        for h in cut:
            net.heal(h, d)
        net.shape(d, None)
    return cut, messages, text, stats, took, after_cut


def test_p_d_link_cut_mid_read(hosts, oracle):
    """P pulls the conversation's history from its D and the P-D link is cut while the READ
    runs (D's link at 1 Mbit/s so that the READ lasts ~2 s): P's READ moves no byte for
    read_stall_s (1 s), fails, P recomputes, and its decline (`stalled`) sends the D leg to the
    other D. Before: P waited read_timeout_s (10 s), then D's pull of the new turn over the cut
    link cost its side channel's 1 s too. The module's first test: P's cost model decides each
    pull, and after the other faults' turns (slow or failed reads to these D's) it rightly
    recomputes this history instead of reading it — there would be no READ to cut."""
    net, p, ds, routers = hosts
    r = routers["prefill"]
    base = healthy(r, oracle)
    # P's cost model decides each pull: at this history's length (the harness' 1,024-token
    # context) the tiny model recomputes about as fast as a READ, so P sometimes declines and
    # there is no READ to cut (the turn took 0.16 s in CI). A new conversation then, at most 4.
    for _ in range(4):
        cut, messages, text, stats, took, after_cut = _cut_mid_read(net, p, r)
        if cut and stats["prefill"]["pull_outcome"] != "cost_model":
            break
    else:  # the READ itself is covered without a cost model by tests/test_kv_stall.py
        pytest.skip("P's cost model recomputed the history in 4 conversations: no READ to cut")
    print(f"P-D link cut mid-READ: healthy turn {base:.2f} s, fault turn {took:.2f} s, "
          f"{after_cut:.2f} s of it after the cut")
    assert cut, "P's READ was never seen in flight"
    assert text == oracle(messages, OUT).text
    assert stats["prefill"]["pull_outcome"] == "stalled", stats
    assert after_cut <= base + EXTRA_S, f"{after_cut:.1f} s after the cut (healthy {base:.2f} s)"
    wait_all_up(r)


@pytest.mark.parametrize("placement", ["auto", "prefill"])
def test_link_of_the_conversations_d_cut_between_turns(hosts, oracle, placement):
    """Finding (a): the next turn took 23.0 s at the defaults (P declined its pull in 1 s, then
    the router sent the D leg to the same black-holed D and waited for its health checks)."""
    net, p, ds, routers = hosts
    stats = fault_turn(routers[placement], oracle, f"D link cut ({placement})",
                       lambda d: net.link(d, up=False), lambda d: net.link(d, up=True))
    if placement == "prefill":  # P said it could not reach D: the D leg went elsewhere
        assert stats["prefill"]["pull_outcome"] in ("unreachable", "peer_down"), stats


def test_router_d_partition_between_turns(hosts, oracle):
    net, p, ds, routers = hosts
    fault_turn(routers["auto"], oracle, "router<->D partition",
               lambda d: net.partition("r", d), lambda d: net.heal("r", d))


def test_p_host_black_holed_between_turns(hosts, oracle):
    net, p, ds, routers = hosts
    r, cut = routers["prefill"], []

    def fault(_d):
        cut.append(next_p(r))
        net.link(cut[0], up=False)

    fault_turn(r, oracle, "P host black-holed", fault, lambda _d: net.link(cut[0], up=True))


def test_redis_host_black_holed_between_turns(hosts, oracle):
    """The store's calls time out (--store-timeout 0.5 s), then its breaker serves misses."""
    net, p, ds, routers = hosts
    fault_turn(routers["redis"], oracle, "Redis host black-holed",
               lambda _d: net.link("s", up=False), lambda _d: net.link("s", up=True))


def _mid_stream(r, oracle, fault, heal=None) -> float:
    from test_router_faults import LONG, MISSED, TRIES, stream_with_fault

    hit: list[str] = []

    def apply():
        d = streaming_d(r)
        if d is None:  # the router had relayed D's whole answer before the client read 4 events
            return MISSED
        hit.append(d)
        fault(d)
        return d

    for attempt in range(TRIES):  # a conversation of its own each: no KV of a missed one
        messages = [{"role": "system", "content": SYSTEM}, user(5 + attempt)]
        t = time.perf_counter()
        stream_with_fault(r, messages, lambda: True)  # undisturbed
        base = time.perf_counter() - t
        t = time.perf_counter()
        try:
            text, usage, _, errors = stream_with_fault(r, messages, apply)
        finally:
            if heal and hit:
                heal(hit[0])
        took = time.perf_counter() - t
        if hit:
            break
    assert hit, f"no fault landed mid-stream in {TRIES} conversations"
    assert not errors, errors
    assert usage["completion_tokens"] == LONG, usage
    assert text == oracle(messages, LONG).text  # token for token, as an undisturbed run
    print(f"mid-stream fault on {hit[0]}: the stream took {took:.2f} s, undisturbed {base:.2f} s")
    assert took <= base + EXTRA_S, f"{took:.1f} s (undisturbed {base:.2f} s)"
    return took


def test_d_link_cut_mid_stream(hosts, oracle):
    net, p, ds, routers = hosts
    r = routers["auto"]
    _mid_stream(r, oracle, lambda d: net.link(d, up=False), lambda d: net.link(d, up=True))
    wait_all_up(r)


def test_router_d_partition_mid_stream(hosts, oracle):
    net, p, ds, routers = hosts
    r = routers["auto"]
    _mid_stream(r, oracle, lambda d: net.partition("r", d), lambda d: net.heal("r", d))
    wait_all_up(r)


def test_d_link_at_1_mbit(hosts, oracle):
    """A slow link is not a fault: the turn is answered, its extra time is what the link costs.
    After the mid-stream cases: /health over this link is slow, and the router gives a worker
    that answered /health slowly a longer probe timeout for the next ~30 s (liveness.py)."""
    net, p, ds, routers = hosts
    fault_turn(routers["prefill"], oracle, "D link at 1 Mbit/s",
               lambda d: net.shape(d, "1mbit"), lambda d: net.shape(d, None), extra_s=5.0)


def test_d_host_killed_between_turns(hosts, oracle):
    """Every process of the conversation's D host SIGKILLed between turns (its kernel refuses
    connections, as a host that rebooted does): the next turn goes through P as a miss on the
    other D. The host's D is started again afterwards."""
    net, p, ds, routers = hosts
    hc = CLUSTER["hc"]

    def restart(d: str) -> None:  # after the fault turn (not timed)
        i = ["d0", "d1"].index(d)
        ds[i] = hc.worker(d, f"decode-{d}-again", *ARGS)
        hc.ready([ds[i]])

    fault_turn(routers["auto"], oracle, "D host killed", net.kill, restart)
    for r in routers.values():
        wait_all_up(r)


def test_an_unreachable_host_is_given_up_on_in_seconds_however_loaded_it_said_it_was(hosts):
    """A probe of a worker that last reported 16 requests queued waits 8 s for its /health
    (a loaded worker answers late, it is not hung), but connects afresh with its own 1 s
    bound: with the host black-holed the probe fails in ~1 s (it waited the 8 s before)."""
    import asyncio

    from duplexkv.router.backends import Backend
    from duplexkv.router.config import RouterConfig
    from duplexkv.router.liveness import Liveness
    from duplexkv.router.upstream import Upstream
    from duplexkv.router.worker_load import WorkerLoad

    net, p, ds, routers = hosts
    d = ds[0]

    async def probe() -> tuple[bool, float, float]:
        up = Upstream(RouterConfig((p[0].url,), (d.url,)))
        live = Liveness(up.probe_client, alternative=lambda b: True)
        b = Backend(d.url, "decode", "decode[0]")
        try:
            assert await live.probe(b)  # reachable: alive, and its report taken
            b.load = WorkerLoad(waiting=12, running=4, at=time.monotonic())
            timeout = live.timeout(b)
            net.link("d0", up=False)
            t = time.perf_counter()
            alive = await live.probe(b)
            return alive, time.perf_counter() - t, timeout
        finally:
            net.link("d0", up=True)
            await up.aclose()

    alive, took, timeout = asyncio.run(probe())
    print(f"probe of a black-holed host reported loaded: {took:.2f} s (timeout {timeout} s)")
    assert timeout == 8.0 and not alive
    assert took < 2.0, f"{took:.2f} s"
    for r in routers.values():
        wait_all_up(r)


def test_d_host_killed_mid_stream(hosts, oracle):
    """Last: the killed D stays down for the rest of the module."""
    net, p, ds, routers = hosts
    r = routers["auto"]
    _mid_stream(r, oracle, lambda d: ds[["d0", "d1"].index(d)].proc.kill())
