"""Workers join and leave a running router through the Redis registry (`--discovery`).

Real processes and a real password-protected redis-server: a router that starts knowing no worker
learns P and D from the registry, a second D and a second P join while several multi-turn
conversations run, one P is killed (SIGKILL: no deregistration) and one D stops cleanly
(deregisters) — and no request fails, every answer equals the oracle (reuse off), /health and
/metrics show the joins and leaves by name, and the password appears in no log and no /health.
Also: forged and unsigned registrations never become workers, a registry that is down hurts
neither the worker nor the router, the CLI's start-up errors, and the membership rules.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from test_router import (
    ARGS,
    OUT,
    SYSTEM,
    Router,
    assert_no_address,
    bidi,
    chat,
    conv,
    metric,
    user,
)
from workers import DUPLEXKV, NO_KEYS, TEST_SECRET, skip_or_fail, start_worker, wait_for, worker_env

from duplexkv.discovery import record
from duplexkv.discovery.record import Capacity, DiscoveryURL, Registration, encode
from duplexkv.discovery.registrar import Registrar
from duplexkv.discovery.watcher import Snapshot, Watcher
from duplexkv.launch import spawn, wait_ready
from duplexkv.launch.ports import free_port
from duplexkv.router.backends import BackendPool
from duplexkv.router.membership import Membership
from duplexkv.router.metrics import RouterMetrics

PASSWORD = "disc-" + secrets.token_hex(8)
HEARTBEAT = 1.0  # the workers' heartbeat here; the router reads the registry every POLL
POLL = 0.25


def start_redis(tmp: Path, port: int) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        skip_or_fail("redis-server is not installed (apt-get install -y redis-server)")
    import redis

    with open(tmp / f"redis-{port}.log", "wb") as fh:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--requirepass", PASSWORD],
                                stdout=fh, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, password=PASSWORD)
    wait_for(lambda: _pings(client) or proc.poll() is not None, 10, "redis-server")
    assert proc.poll() is None
    return proc


def _pings(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def url_of(port: int) -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{port}/0"


def start_router(log: Path, *args: str, env: dict | None = None) -> Router:
    # the workers' cluster secret (start_worker's), which signs their discovery records: the
    # launcher would otherwise give the router its own random one
    env = {"DUPLEXKV_KV_SECRET": TEST_SECRET, **(env or {})}
    p = spawn(log.stem, ["router", "--port", "0", "--health-interval", "0.5",
                         "--discovery-interval", str(POLL), *args], log.parent, env)
    try:
        wait_ready([p], timeout_s=30, probe=None)  # its workers join later
    except BaseException:
        p.kill()
        raise
    return Router(p.url, p.proc, p.log)


def discovered(args_role: str, url: str, heartbeat: float = HEARTBEAT) -> dict:
    """start_worker keyword arguments for a worker registering with `url` (given through the
    environment: the password stays off the command line)."""
    return {"env": {"DUPLEXKV_DISCOVERY": url},
            "extra": ("--discovery", "--discovery-role", args_role, "--discovery-heartbeat",
                      str(heartbeat))}


def start(model, log: Path, role: str, url: str, *more: str, heartbeat: float = HEARTBEAT):
    spec = discovered(role, url, heartbeat)
    p_only = ("--no-enable-prefix-caching",) if role == "prefill" else ()
    return start_worker(model, log, *ARGS, *p_only, *spec["extra"], *more, kv=bidi(),
                        env=spec["env"])


def health(r: Router) -> dict:
    return r.get("/health").json()


def names(h: dict, role: str) -> list[str]:
    return [b["name"] for b in h[role]]


def backend(h: dict, name: str) -> dict | None:
    return next((b for role in ("prefill", "decode") for b in h[role] if b["name"] == name),
                None)


def event(h: dict, kind: str, worker: str) -> dict | None:
    return next((c for c in h["discovery"]["changes"]
                 if c["event"] == kind and c.get("worker") == worker), None)


def submit(pool: ThreadPoolExecutor, started: list, *call, **kw):
    """Start a worker in `pool`; once up it is put in `started` (to be stopped whatever fails)."""
    fut = pool.submit(*call, **kw)
    fut.add_done_callback(lambda f: f.exception() is None and started.append(f.result()))
    return fut


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("discovery")


class Traffic:
    """`n` threads, each running conversations of `turns` turns (streaming and not) through the
    router until stopped; every turn's messages and answer are kept for the oracle."""

    def __init__(self, router: Router, n: int = 3, turns: int = 3) -> None:
        self.router, self.turns = router, turns
        self.stop_flag = threading.Event()
        self.done: list[tuple[list[dict], str]] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(120)

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=self.router.url + "/v1", api_key="any", max_retries=0,
                               timeout=60)
        while not self.stop_flag.is_set():
            conv_id, messages = conv(), [{"role": "system", "content": SYSTEM}]
            for t in range(self.turns):
                messages = [*messages, user(t + i)]
                try:
                    text, _ = chat(client, messages, conv_id, stream=(t + i) % 2 == 0)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    self.failures.append(f"{type(e).__name__}: {e}")
                    break
                self.done.append((messages, text))
                messages = [*messages, {"role": "assistant", "content": text}]
                if self.stop_flag.is_set():
                    break


def test_workers_join_and_leave_under_traffic_without_failures(tiny_model_dir, tmp, oracle):
    port = free_port()
    redis_proc = start_redis(tmp, port)
    url = url_of(port)
    workers, router = [], None
    try:
        with ThreadPoolExecutor(2) as pool:
            p1 = submit(pool, workers, start, tiny_model_dir, tmp / "p1.log", "prefill", url)
            d1 = submit(pool, workers, start, tiny_model_dir, tmp / "d1.log", "decode", url)
            p1, d1 = p1.result(), d1.result()
        # the router starts knowing no worker: everything comes from the registry
        router = start_router(tmp / "router.log", "--discovery",
                              env={"DUPLEXKV_DISCOVERY": url, "DUPLEXKV_KV_SECRET": TEST_SECRET})
        wait_for(lambda: health(router)["status"] == "ok", 10, "P and D joining")
        h = health(router)
        assert names(h, "prefill") == ["prefill[0]"] and names(h, "decode") == ["decode[0]"]
        assert h["discovery"]["verifies_signatures"] is True

        with Traffic(router) as traffic:
            wait_for(lambda: len(traffic.done) >= 3, 60, "traffic")
            # a second D and a second P join while traffic runs
            with ThreadPoolExecutor(2) as pool:
                d2 = submit(pool, workers, start, tiny_model_dir, tmp / "d2.log", "decode", url)
                p2 = submit(pool, workers, start, tiny_model_dir, tmp / "p2.log", "prefill", url)
                d2 = d2.result()
                wait_for(lambda: d2.health()["discovery"]["state"] == "registered", 10,
                         "d2 registered")
                t0 = time.monotonic()
                wait_for(lambda: backend(health(router), "decode[1]"), 10, "d2 joining",
                         interval_s=0.02)
                joined_s = time.monotonic() - t0
                wait_for(lambda: backend(health(router), "decode[1]")["picks"] > 0, 30,
                         "the router choosing d2", interval_s=0.02)
                first_pick_s = time.monotonic() - t0
                p2 = p2.result()
            wait_for(lambda: backend(health(router), "prefill[1]"), 10, "p2 joining")
            wait_for(lambda: backend(health(router), "prefill[1]")["picks"] > 0, 30,
                     "the router choosing p2")
            # the first P is killed (no deregistration: its heartbeats stop; its legs in flight
            # fail over to the other P)
            n_before_kill = len(traffic.done)
            p1.kill()
            t_kill = time.monotonic()
            wait_for(lambda: event(health(router), "lost", "prefill[0]"), 10,
                     "p1 leaving", interval_s=0.02)
            lost_s = time.monotonic() - t_kill
            # the first D stops cleanly: it deregisters first, then finishes its requests
            wait_for(lambda: len(traffic.done) >= n_before_kill + 6, 60, "traffic after kill")
            t_stop = time.monotonic()
            stopper = threading.Thread(target=d1.stop)
            stopper.start()
            wait_for(lambda: event(health(router), "left", "decode[0]"), 10, "d1 leaving",
                     interval_s=0.02)
            left_s = time.monotonic() - t_stop
            stopper.join(30)
            n_after = len(traffic.done)
            wait_for(lambda: len(traffic.done) >= n_after + 6, 60, "traffic after d1 left")
        print(f"\njoin seen {joined_s:.2f} s after registering, first D leg to it after "
              f"{first_pick_s:.2f} s; killed P gone after {lost_s:.2f} s; stopped D gone after "
              f"{left_s:.2f} s; {len(traffic.done)} turns, {len(traffic.failures)} failed")

        assert traffic.failures == [], traffic.failures[:5]
        assert joined_s <= 2 * HEARTBEAT, joined_s
        # two missed heartbeats, seen by polls (each up to POLL late), on a loaded machine
        assert lost_s <= 2 * HEARTBEAT + 4 * POLL + 1.0, lost_s
        assert left_s <= 2 * HEARTBEAT, left_s
        answers: dict[str, set[str]] = {}  # conversations repeat: one oracle call per prompt
        for messages, text in traffic.done:
            answers.setdefault(json.dumps(messages), set()).add(text)
        for messages, texts in answers.items():
            assert texts == {oracle(json.loads(messages), OUT).text}
        h = health(router)
        assert h["status"] == "ok"
        assert names(h, "prefill") == ["prefill[1]"] and names(h, "decode") == ["decode[1]"]
        assert backend(h, "decode[1]")["picks"] > 0 and backend(h, "prefill[1]")["picks"] > 0
        changes = [(c["event"], c["worker"]) for c in h["discovery"]["changes"]]
        assert sorted(changes[:2]) == [("joined", "decode[0]"), ("joined", "prefill[0]")]
        assert sorted(changes[2:4]) == [("joined", "decode[1]"), ("joined", "prefill[1]")]
        assert changes[4:] == [("lost", "prefill[0]"), ("left", "decode[0]")], changes
        assert {m["worker"] for m in h["discovery"]["members"]} == {"prefill[1]", "decode[1]"}
        assert h["discovery"]["members"][0]["capacity"]["kv_blocks"] == 256
        text = router.get("/metrics").text
        for role in ("prefill", "decode"):
            assert metric(text, "duplexkv_router_discovery_joins_total", role=role) == 2
            assert metric(text, "duplexkv_router_discovery_members", role=role) == 1
        assert metric(text, "duplexkv_router_discovery_leaves_total", reason="lost",
                      role="prefill") == 1
        assert metric(text, "duplexkv_router_discovery_leaves_total", reason="left",
                      role="decode") == 1
        assert 'worker="prefill[0]"' not in text  # a left worker's gauges are gone
        # no address on /health or /metrics, no password anywhere
        assert_no_address(json.dumps(h), tiny_model_dir)
        assert_no_address(text, tiny_model_dir)
        for w in (p2, d2):
            assert PASSWORD not in json.dumps(w.health())
            w.assert_integrity()
        for log in (router.log, *(w.log for w in workers)):
            assert PASSWORD not in log.read_text(errors="replace"), log
        assert "deregistered" in d1.log.read_text()
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        redis_proc.terminate()
        redis_proc.wait(10)


def test_forged_and_unsigned_records_never_become_workers(tmp):
    """With a secret, only records signed with it join; a canary named by the others sees no
    connection. The positive control (a correctly signed record for the same canary) joins and
    is health-checked, so the canary would have noticed."""
    import redis

    port = free_port()
    redis_proc = start_redis(tmp, port)
    canary = socket.socket()
    canary.bind(("127.0.0.1", 0))
    canary.listen(16)
    canary.settimeout(0.1)
    canary_url = f"http://127.0.0.1:{canary.getsockname()[1]}"
    router = start_router(tmp / "router_forged.log", "--discovery", url_of(port),
                          env={"DUPLEXKV_KV_SECRET": TEST_SECRET})
    r = redis.Redis(port=port, password=PASSWORD)
    try:
        def rec(**kw) -> Registration:
            base = dict(id=record.new_worker_id(), role="decode", url=canary_url, model="tiny",
                        capacity=Capacity(8, 64, 16, 1024), heartbeat_s=1.0, seq=1,
                        issued_at=time.time())
            return Registration(**{**base, **kw})

        wrong_key = b"k" * 32
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DUPLEXKV_KV_SECRET", TEST_SECRET)
            good_key = record.secret_key()
        def put(rid: str, value: bytes) -> None:  # as a worker writes it: the key and the index
            r.set(record.KEY_PREFIX + rid, value, px=60_000)
            r.zadd(record.INDEX_KEY, {rid: int(time.time() * 1000) + 60_000})

        unsigned, forged, copied, old = rec(), rec(), rec(), rec(issued_at=time.time() - 3600)
        put(unsigned.id, encode(unsigned, None))
        put(forged.id, encode(forged, wrong_key))
        put(record.new_worker_id(), encode(copied, good_key))
        put(old.id, encode(old, good_key))
        put("junk", b"\xff not json")
        wait_for(lambda: health(router)["discovery"]["rejected_records"] == 5, 10, "rejections")
        time.sleep(4 * POLL + 1.0)  # polls and health checks would have reached the canary
        with pytest.raises(TimeoutError):
            canary.accept()
        h = health(router)
        assert h["decode"] == [] and h["discovery"]["members"] == []
        text = router.get("/metrics").text
        for reason, n in (("unsigned", 1), ("bad_signature", 1), ("too_old", 1),
                          ("malformed", 2)):
            assert metric(text, "duplexkv_router_discovery_rejected_total", reason=reason) == n
        # the control: the same canary, signed with the cluster's key, joins and is checked
        good = rec()
        put(good.id, encode(good, good_key))
        wait_for(lambda: names(health(router), "decode") == ["decode[0]"], 10, "the good record")
        canary.settimeout(10)
        conn, _ = canary.accept()
        conn.close()
        assert PASSWORD not in router.log.read_text()
    finally:
        router.stop()
        canary.close()
        redis_proc.terminate()
        redis_proc.wait(10)


def test_registry_down_hurts_neither_worker_nor_router(tiny_model_dir, tmp, oracle):
    """The registry is down when a discovered D and a router (with a static P) start: both serve
    (the D directly, the router 503s for want of a D, as without discovery); once Redis is up the
    D registers and the router uses it."""
    port = free_port()
    url = url_of(port)
    started: list = []
    router = redis_proc = None
    try:
        with ThreadPoolExecutor(2) as pool:
            p = submit(pool, started, start_worker, tiny_model_dir, tmp / "p_static.log", *ARGS,
                       "--no-enable-prefix-caching", kv=bidi())
            d = submit(pool, started, start, tiny_model_dir, tmp / "d_late.log", "decode", url,
                       heartbeat=0.2)
            p, d = p.result(), d.result()
        messages = [{"role": "system", "content": SYSTEM}, user(2)]
        body = {"model": "tiny", "messages": messages, "max_tokens": OUT, "temperature": 0,
                "ignore_eos": True}
        r = d.post("/v1/chat/completions", body)
        assert r.status_code == 200 and d.health()["discovery"]["state"] == "retrying"
        router = start_router(tmp / "router_late.log", "--prefill", p.url, "--discovery", url)
        wait_for(lambda: health(router)["discovery"]["state"] == "degraded", 10, "degraded")
        assert router.post("/v1/chat/completions", body).status_code == 503
        redis_proc = start_redis(tmp, port)
        wait_for(lambda: names(health(router), "decode") == ["decode[0]"], 15, "d joining")
        client = router.client()
        text, stats = chat(client, messages, conv(), stream=True)
        assert text == oracle(messages, OUT).text and stats["decode"]["pulled_tokens"] > 0
        h = health(router)
        assert h["status"] == "ok" and h["discovery"]["state"] == "ok"
        assert names(h, "prefill") == ["prefill[0]"]  # the static P, untouched
        assert metric(router.get("/metrics").text,
                      "duplexkv_router_discovery_poll_errors_total") >= 1
        for log in (router.log, d.log):
            assert PASSWORD not in log.read_text(errors="replace")
        assert "retrying with backoff, still serving" in d.log.read_text()
    finally:
        if router is not None:
            router.stop()
        for w in started:
            w.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


@pytest.mark.parametrize("args, env, message", [
    (("--host", "0.0.0.0", "--discovery", "redis://127.0.0.1:1/0", "--discovery-role", "decode"),
     {}, "give --advertise-url http://"),
    (("--discovery", "redis://127.0.0.1:1/0"), {}, "--discovery needs --discovery-role"),
    (("--discovery", f"http://:{PASSWORD}@127.0.0.1:1/0", "--discovery-role", "decode"), {},
     "must be a redis://"),
    (("--advertise-url", "http://10.0.0.1:8000"), {}, "--advertise-url needs --discovery"),
    (("--discovery", "--discovery-role", "decode", "--advertise-url", "http://h/x"),
     {"DUPLEXKV_DISCOVERY": "redis://127.0.0.1:1/0"}, "a worker URL is scheme://host:port only"),
    (("--discovery", "--discovery-role", "decode"), {},
     "--discovery without a URL reads $DUPLEXKV_DISCOVERY"),
], ids=["wildcard-host", "no-role", "not-redis", "advertise-alone", "advertise-path", "no-env"])
def test_worker_cli_errors_name_the_fix(args, env, message):
    """Checked before the engine loads: an immediate exit 2 with one line naming the fix (never
    the password)."""
    r = subprocess.run([DUPLEXKV, "serve", "tiny", "--port", "0", *args], capture_output=True,
                       text=True, timeout=60, env=worker_env({**NO_KEYS, **env}))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert PASSWORD not in r.stderr


# --- the membership rules, on real snapshots and a real pool (the clock is given) ---
def _reg(rid: str, role: str = "decode", url: str = "http://10.0.0.5:8000", seq: int = 1,
         heartbeat: float = 1.0) -> Registration:
    return Registration(id=rid, role=role, url=url, model="m", capacity=Capacity(8, 64, 16, 1024),
                        heartbeat_s=heartbeat, seq=seq, issued_at=time.time())


def test_membership_rules():
    now = [0.0]
    pool = BackendPool.from_urls(["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"])
    m = Membership(pool, RouterMetrics(), "redis://***@x/0", False, 0.25, clock=lambda: now[0])
    a, b, c = "a" * 32, "b" * 32, "c" * 32

    def apply(*regs: Registration, rejected: dict | None = None) -> None:
        m.apply(Snapshot({r.id: r for r in regs}, rejected or {}))

    # role both = one backend per pool, numbered after the static workers; a static URL is
    # kept once
    apply(_reg(a, "both", "http://10.0.0.3:8000"), _reg(b, "decode", "http://10.0.0.2:8000"))
    assert [x.name for x in pool.prefill] == ["prefill[0]", "prefill[1]"]
    assert [x.name for x in pool.decode] == ["decode[0]", "decode[1]"]
    assert pool.by_url[("decode", "http://10.0.0.2:8000")].name == "decode[0]"  # the static one
    # a record whose seq stops moving for two heartbeats is lost once its worker is marked down
    # (a worker that still answers stays: its key's TTL bounds that), and joins again once its
    # seq moves
    now[0] = 1.5
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=2), _reg(b, "decode", "http://10.0.0.2:8000"))
    now[0] = 3.6
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=2), _reg(b, "decode", "http://10.0.0.2:8000",
                                                                seq=2))
    assert [x.name for x in pool.prefill] == ["prefill[0]", "prefill[1]"]  # still answering
    for x in m.members[a].backends:
        x.mark_down("killed")
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=2), _reg(b, "decode", "http://10.0.0.2:8000",
                                                                seq=2))
    assert [x.name for x in pool.prefill] == ["prefill[0]"]  # a: seq 2 since t=1.5, down: lost
    now[0] = 3.8
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=2), _reg(b, "decode", "http://10.0.0.2:8000",
                                                                seq=3))
    assert [x.name for x in pool.prefill] == ["prefill[0]"]  # still not moving: stays out
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=3), _reg(b, "decode", "http://10.0.0.2:8000",
                                                                seq=3))
    assert [x.name for x in pool.prefill] == ["prefill[0]", "prefill[2]"]  # a new index
    # a failed poll changes nothing and restarts the staleness clock
    m.failed(ConnectionError("down"))
    now[0] = 30.0
    assert m.state()["state"] == "degraded"
    apply(_reg(a, "both", "http://10.0.0.3:8000", seq=3), _reg(b, "decode", "http://10.0.0.2:8000",
                                                                seq=3))
    assert len(pool.prefill) == 2 and m.state()["state"] == "ok"
    # the same address under a new id (a restarted worker) keeps its backend and name
    in_flight = pool.by_url[("prefill", "http://10.0.0.3:8000")]
    in_flight.outstanding = 1
    apply(_reg(c, "both", "http://10.0.0.3:8000"), _reg(b, "decode", "http://10.0.0.2:8000",
                                                        seq=4))
    assert pool.by_url[("prefill", "http://10.0.0.3:8000")] is in_flight
    assert [x.name for x in pool.decode] == ["decode[0]", "decode[2]"]
    # a record that disappears leaves at once ("left"); a leg in flight keeps its Backend
    apply(_reg(b, "decode", "http://10.0.0.2:8000", seq=5))
    assert [x.name for x in pool.prefill] == ["prefill[0]"] and in_flight.outstanding == 1
    assert [x.name for x in pool.decode] == ["decode[0]"]  # the static D is never removed
    events = [(e["event"], e.get("worker")) for e in m.state()["changes"]]
    assert events == [("joined", "prefill[1]"), ("joined", "decode[1]"), ("lost", "prefill[1]"),
                      ("lost", "decode[1]"), ("joined", "prefill[2]"), ("joined", "decode[2]"),
                      ("left", "prefill[2]"), ("left", "decode[2]")], events
    # a rejected record is counted once while it stays
    apply(rejected={"duplexkv:workers:x": "unsigned"})
    apply(rejected={"duplexkv:workers:x": "unsigned"})
    assert m.rejections.labels("unsigned")._value.get() == 1


def test_a_clean_stop_after_late_heartbeats_is_left_and_an_expired_key_lost(tmp):
    """A busy worker's heartbeats come late (its event loop shares the cores with its engine).
    The router used to class a record that vanished as "lost" once it had not seen its seq move
    for two heartbeats, so a worker that stopped cleanly after late heartbeats showed as lost
    (the join/leave test above waited for "left" in vain under CI's load). Now it reads the fact
    from Redis: a deregistration deletes the key and its index entry in one transaction (left);
    an expired key leaves its entry indexed (lost). Real redis-server, Registrar and Watcher."""
    port = free_port()
    redis_proc = start_redis(tmp, port)
    url = DiscoveryURL.parse(url_of(port))
    pool = BackendPool.from_urls([], [])
    m = Membership(pool, RouterMetrics(), "redis://***@x/0", False, POLL)
    urls = {"late": "http://10.0.0.7:8000", "dead": "http://10.0.0.8:8000"}

    async def run() -> dict[str, str]:
        watcher = Watcher(url, None, POLL, m.apply, m.failed)
        late, dead = (Registrar(url, _reg(c * 32, url=urls[who], heartbeat=HEARTBEAT), None)
                      for c, who in (("a", "late"), ("b", "dead")))
        try:
            assert await late.heartbeat() and await dead.heartbeat()
            await watcher.poll_once()
            names = {who: pool.by_url[("decode", u)].name for who, u in urls.items()}
            await asyncio.sleep(2.2 * HEARTBEAT)  # neither heartbeats for 2.2 beats (TTL: 3)
            await watcher.poll_once()
            assert len(pool.decode) == 2  # late, not gone: their keys live
            await late.stop()  # then one stops cleanly (deregisters)
            await watcher.poll_once()
            await asyncio.sleep(HEARTBEAT)  # the other's key expires
            await watcher.poll_once()
            return names
        finally:
            await watcher.stop()
            await dead.redis.aclose()

    try:
        names = asyncio.run(run())
    finally:
        redis_proc.kill()
        redis_proc.wait()
    events = [(e["event"], e.get("worker")) for e in m.state()["changes"]]
    assert sorted(events[:2]) == [("joined", "decode[0]"), ("joined", "decode[1]")]
    assert events[2:] == [("left", names["late"]), ("lost", names["dead"])], events
    assert not pool.decode

