"""The KV plane's security findings, replayed against real worker processes (docs/security.md;
docs/protocol.md, section 6). The attacker is this test process: a separate local process
that can reach the workers' side channel and transport ports.

(a) no secret: no engine id from the side channel, no block from the transport; a stolen engine
    id without a claim: no block; released blocks: unreadable; READ bounded by the claim; a
    `done:`/`skip:` without the reader's own claim releases nothing; NIXL: no byte without a
    claim or outside it, the claim's registration gone after release
(b)(c) forged, unsigned or edited params: declined as `untrusted`, output as without reuse
(d) params naming any host:port: no connection there
(e) 300 idle transport connections: not 300 threads; huge or unclaimed READs whose replies are
    never read: no memory growth
(f) the router's /health and /metrics: no Redis URL or password
and: without a secret, no non-loopback bind; the secret is never logged.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from duplexkv.kv.holder import notif
from workers import (
    TEST_SECRET,
    need_nixl,
    skip_or_fail,
    decode_leg,
    kv_config,
    prefill_leg,
    start_worker,
    wait_for,
)

ARGS = ("--num-kv-blocks", "128", "--max-model-len", "1024")
PROMPT = list(range(500, 580))  # 80 tokens: 5 blocks of 16


def named(port: int, text: str) -> bool:
    """Whether `text` holds `port` as a number of its own (metrics' timestamps hold any 5 digits)."""
    return re.search(rf"(?<![\d.]){port}(?!\d)", text) is not None


def body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp):
    kv = kv_config("TcpConnector", bidirectional_kv_xfer=True)
    p = start_worker(tiny_model_dir, tmp / "p.log", *ARGS, "--no-enable-prefix-caching", kv=kv)
    d = start_worker(tiny_model_dir, tmp / "d.log", *ARGS, kv=kv)
    yield p, d
    p.stop()
    d.stop()


def _turn(p, d) -> tuple[dict, dict]:
    """A real P leg and D leg: P's params, and D's response (D now holds the turn)."""
    pj = prefill_leg(p, "/v1/completions", body())
    r = decode_leg(d, "/v1/completions", body(), pj["kv_transfer_params"])
    assert r.status_code == 200, r.text
    return pj["kv_transfer_params"], r.json()


def _addr(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def _recv_all(s: socket.socket, timeout_s: float = 3.0) -> bytes:
    s.settimeout(timeout_s)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except OSError:
        pass
    return out


def _declined(w, reason: str) -> int:
    return w.kv()["counters"]["declined"].get(reason, 0)


# (a) ---------------------------------------------------------------------------------------
def test_side_channel_tells_a_peer_without_the_secret_nothing(pd):
    """A plain ZMQ client (no CURVE keys) asking D's side channel for `meta` gets no answer at
    all; it used to get the engine id and the transport's address."""
    _, d = pd
    host, port = _addr(d.kv()["side_channel"])
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(b"\x91\xa4meta")  # msgpack ["meta"]
        with pytest.raises(zmq.Again):
            sock.recv()
    finally:
        sock.close(0)


def test_transport_gives_no_block_and_no_engine_id_without_the_secret(pd):
    """Knowing D's engine id (stolen) is not enough: the HELLO needs the secret, the refusal
    names no engine, and a READ sent anyway returns no block data."""
    p, d = pd
    _turn(p, d)  # D holds a finished turn
    kv = d.kv()
    engine_id = kv["engine_id"]
    host, port = _addr(kv["transport"]["listen"])
    # a wrong engine id: the answer must not disclose the real one
    with socket.create_connection((host, port), timeout=5) as s:
        hello = json.dumps({"from": "x", "to": "guess", "nonce": "00" * 16}).encode()
        s.sendall(struct.pack(">BH", 1, len(hello)) + hello)
        s.sendall(struct.pack(">BH", 4, 32) + b"\0" * 32)
        got = _recv_all(s)
        assert engine_id.encode() not in got
    # the stolen id, then a READ of D's blocks without having authenticated
    with socket.create_connection((host, port), timeout=5) as s:
        hello = json.dumps({"from": "x", "to": engine_id, "nonce": "00" * 16}).encode()
        s.sendall(struct.pack(">BH", 1, len(hello)) + hello)
        time.sleep(0.2)
        ids = list(range(8))
        s.sendall(struct.pack(">BQII", 2, 1, len(ids), 0) + struct.pack(f">{len(ids)}I", *ids))
        got = _recv_all(s)
    assert len(got) < 1024, f"{len(got)} bytes came back: block data leaked"
    assert engine_id.encode() not in got


def _authenticated_reader(d):
    """A peer holding the cluster secret (an authenticated worker) but no claim."""
    from duplexkv.kv import side_channel
    from duplexkv.kv.auth import KVAuth
    from duplexkv.kv.transport.tcp import TcpTransport

    auth = KVAuth(TEST_SECRET.encode())
    host, port = _addr(d.kv()["side_channel"])
    info = side_channel.handshake(host, port, 5.0, auth=auth)
    t = TcpTransport("attacker", timeout_s=5.0, auth=auth)
    t.register(torch.zeros((8, info.handshake.block_bytes), dtype=torch.uint8))
    t.connect(info.handshake.engine_id, info.handshake.transport_metadata)
    return t, info, auth, (host, port)


def _read(t, peer: str, remote: list[int], token: bytes = b"", notif: bytes = b"x",
          grant: bytes = b""):
    from duplexkv.kv.transport import XferState

    h = t.read(peer, list(range(len(remote))), remote, notif, token, grant)
    wait_for(lambda: t.poll(h) is not XferState.PENDING, 10, "the READ")
    state = h.state
    t.release(h)
    return state, h.error


def test_no_claim_no_block_and_released_blocks_are_unreadable(pd):
    """Even an authenticated peer READs only under a live claim's token: not without one, not
    outside the claim's blocks, not after the entry was released."""
    from duplexkv.kv import messages as m
    from duplexkv.kv import side_channel
    from duplexkv.kv.transport import XferState

    p, d = pd
    _, dj = _turn(p, d)
    dparams = dj["kv_transfer_params"]
    blocks = dparams["remote_block_ids"][0]
    t, info, auth, (host, port) = _authenticated_reader(d)
    peer = info.handshake.engine_id
    try:
        state, err = _read(t, peer, blocks[:2])
        assert state is XferState.FAILED and "refused" in err, err
        # a verify over the first block's tokens (no hashes) claims exactly that block
        tokens = PROMPT + dj["choices"][0]["token_ids"]
        reply = side_channel.request(host, port, m.Verify(dparams["remote_request_id"], [],
                                                          tokens), m.VerifyReply, 5.0, auth)
        assert 0 < reply.matched <= 16 and len(reply.token) == 16
        state, err = _read(t, peer, blocks[1:2], reply.token)  # outside the claim
        assert state is XferState.FAILED and "refused" in err, err
        read_before = d.kv()["retained"]["released"]["read"]
        state, err = _read(t, peer, blocks[:1], reply.token,
                           notif("done", dparams["remote_request_id"], reply.token))
        assert state is XferState.DONE, err  # the claim's own block, then released
        wait_for(lambda: d.kv()["retained"]["released"]["read"] == read_before + 1, 10,
                 "the release")
        state, err = _read(t, peer, blocks[:1], reply.token)
        assert state is XferState.FAILED and "refused" in err, err
    finally:
        t.close()
    d.assert_integrity()


def test_done_or_skip_without_the_readers_claim_releases_nothing(pd):
    """An authenticated peer that is not an entry's reader cannot release it early: `done:` and
    `skip:` count only under the token of a claim on that very entry (they used to release any
    entry they named). The entry's real reader still pulls it afterwards."""
    from duplexkv.kv import messages as m
    from duplexkv.kv import side_channel

    p, d = pd
    _, vj = _turn(p, d)  # the victim's entry
    _, oj = _turn(p, d)  # an entry the attacker claims itself, for a real token
    victim, other = vj["kv_transfer_params"], oj["kv_transfer_params"]
    t, info, auth, (host, port) = _authenticated_reader(d)
    own = side_channel.request(host, port, m.Verify(other["remote_request_id"], [],
                                                    PROMPT + oj["choices"][0]["token_ids"]),
                               m.VerifyReply, 5.0, auth)
    assert own.matched > 0 and len(own.token) == 16
    rid = victim["remote_request_id"]
    before = d.kv()["retained"]
    try:
        for msg in (f"done:{rid}".encode(), f"skip:{rid}".encode(),
                    notif("done", rid, b"\0" * 16), notif("skip", rid, own.token)):
            t.send_notif(info.handshake.engine_id, msg)
        wait_for(lambda: d.kv()["retained"].get("refused_notifs", 0)
                 >= before.get("refused_notifs", 0) + 4, 10, "the notifications")
    finally:
        t.close()
    after = d.kv()["retained"]
    assert after["released"] == before["released"] and after["entries"] == before["entries"]
    # the real next turn still pulls the victim's history from D
    history = PROMPT + vj["choices"][0]["token_ids"]
    pj = prefill_leg(p, "/v1/completions", body(prompt=history + [7, 8, 9]), victim)
    assert pj["kv_stats"]["pulled_tokens"] >= 64, pj["kv_stats"]
    d.assert_integrity()


def test_one_readers_done_leaves_an_entry_another_reader_still_claims():
    """Two readers claimed one entry: the first one's `done` ends only its own claim (its token
    reads nothing more); the entry goes with the second one's `done`, and a repeat is refused."""
    from duplexkv.kv.retention import RetentionTable

    t = RetentionTable(16, b"seed")
    t.add("e", [1, 2], list(range(32)), "ttl", 60.0)
    a, b = (t.verify_and_claim("e", [], list(range(32)), 5.0) for _ in range(2))
    assert a.matched_tokens == b.matched_tokens == 16 and a.token != b.token
    assert t.release_claimed("e", a.token, "read") is None and len(t) == 1
    assert t.authorize_read(a.token, (1,)) is not None
    assert t.authorize_read(b.token, (1,)) is None
    assert t.release_claimed("e", b.token, "read") is not None and len(t) == 0
    assert t.release_claimed("e", b.token, "read") is None
    assert t.stats()["released"]["read"] == 1 and t.stats()["refused_notifs"] == 1


# (b)(c) ------------------------------------------------------------------------------------
EDITS = {
    "reversed blocks": lambda q: {**q, "remote_block_ids": [q["remote_block_ids"][0][::-1]]},
    "low blocks": lambda q: {**q, "remote_block_ids": [list(range(len(q["remote_block_ids"][0])))]},
    "signature removed": lambda q: {k: v for k, v in q.items() if k != "kv_signature"},
    "more tokens": lambda q: {**q, "remote_num_tokens": q["remote_num_tokens"] + 1},
    "fake holder": lambda q: {**q, "remote_request_id": "fake", "kv_signature": "0" * 64},
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_or_unsigned_params_are_untrusted_and_change_no_output(pd, edit):
    """A client's edits to a real P lease (finding c), a stripped signature or a made-up holder
    (finding b): declined before any connection, and the answer is the one without reuse."""
    p, d = pd
    params = prefill_leg(p, "/v1/completions", body())["kv_transfer_params"]
    before = _declined(d, "untrusted")
    pulls = d.kv()["counters"]["pulls"]
    r = decode_leg(d, "/v1/completions", body(), EDITS[edit](params))
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    plain = decode_leg(d, "/v1/completions", body(), None).json()["choices"][0]["token_ids"]
    assert got == plain
    assert _declined(d, "untrusted") == before + 1
    assert d.kv()["counters"]["pulls"] == pulls
    d.assert_integrity()


# (d) ---------------------------------------------------------------------------------------
def test_unsigned_params_make_no_connection_to_the_host_they_name(pd):
    """A canary listener named in unsigned params never sees a connection."""
    _, d = pd
    canary = socket.create_server(("127.0.0.1", 0))
    canary.settimeout(0.2)
    seen: list = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                seen.append(canary.accept())
            except OSError:
                pass

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        params = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": "canary", "remote_request_id": "r",
                  "remote_block_ids": [[0, 1, 2, 3, 4]], "remote_host": "127.0.0.1",
                  "remote_port": canary.getsockname()[1], "remote_num_tokens": len(PROMPT)}
        before = _declined(d, "untrusted")
        r = decode_leg(d, "/v1/completions", body(), params)
        assert r.status_code == 200, r.text
        assert _declined(d, "untrusted") == before + 1
        time.sleep(1.0)
        assert not seen, "the worker connected to the host named in unsigned params"
    finally:
        stop.set()
        th.join(2)
        canary.close()


# (e) ---------------------------------------------------------------------------------------
def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))


def test_idle_connections_do_not_create_a_thread_each(pd):
    p, d = pd
    host, port = _addr(d.kv()["transport"]["listen"])
    base = _threads(d.proc.pid)
    conns = []
    try:
        for _ in range(300):
            try:
                conns.append(socket.create_connection((host, port), timeout=5))
            except OSError:
                pass
        time.sleep(1.5)
        grown = _threads(d.proc.pid) - base
        assert grown < 100, f"{grown} more threads for 300 idle connections"
    finally:
        for c in conns:
            c.close()
    # the server still serves real readers
    _, dj = _turn(p, d)
    assert dj["kv_transfer_params"]["do_remote_decode"] is True
    assert d.kv()["counters"]["pulls"] >= 1


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) / 1024


def _hello(host: str, port: int, engine_id: str) -> socket.socket:
    """A raw transport connection past the HELLO (the attacker holds the secret)."""
    import os

    from duplexkv.kv.auth import KVAuth
    from duplexkv.kv.transport import tcp_wire as w

    auth = KVAuth(TEST_SECRET.encode())
    s = socket.create_connection((host, port), timeout=5)
    cn = os.urandom(w.NONCE_BYTES)
    hello = json.dumps({"from": "raw", "to": engine_id, "nonce": cn.hex()}).encode()
    s.sendall(w.HELLO_HDR.pack(w.HELLO, len(hello)) + hello)
    status, n = w.HELLO_HDR.unpack(w.recv_exact(s, w.HELLO_HDR.size))
    reply = json.loads(w.recv_exact(s, n))
    assert status == w.OK, reply
    mine = auth.hello_mac(b"reader", cn, bytes.fromhex(reply["nonce"]), b"raw",
                          engine_id.encode())
    s.sendall(w.HELLO_HDR.pack(w.AUTH, len(mine)) + mine)
    status, n = w.HELLO_HDR.unpack(w.recv_exact(s, w.HELLO_HDR.size))
    assert status == w.OK, w.recv_exact(s, n)
    w.recv_exact(s, n)
    return s


def test_huge_or_unclaimed_reads_with_replies_unread_cost_d_no_memory(pd):
    """Finding (e), second half: one READ of 1M block ids, READs of the whole pool without a
    claim, and the claim's own READ repeated 50 times, replies never read: D buffers nothing
    (it used to grow by 390 MB) and still serves a real pull."""
    from duplexkv.kv import messages as m
    from duplexkv.kv import side_channel
    from duplexkv.kv.auth import KVAuth
    from duplexkv.kv.transport import tcp_wire as w

    p, d = pd
    _, dj = _turn(p, d)
    dparams = dj["kv_transfer_params"]
    kv = d.kv()
    host, port = _addr(kv["transport"]["listen"])
    engine_id = kv["engine_id"]
    sc_host, sc_port = _addr(kv["side_channel"])
    claim = side_channel.request(sc_host, sc_port, m.Verify(
        dparams["remote_request_id"], [], PROMPT + dj["choices"][0]["token_ids"]),
        m.VerifyReply, 5.0, KVAuth(TEST_SECRET.encode()))
    assert claim.matched > 0
    base = _rss_mb(d.proc.pid)
    socks = []
    try:
        huge = _hello(host, port, engine_id)
        socks.append(huge)
        n = 1 << 20
        huge.sendall(w.READ_HDR.pack(w.READ, 1, n, 0, b"\0" * 16))
        try:
            huge.sendall(b"\0" * (4 * n))
        except OSError:
            pass  # refused (and closed) on the header
        whole = _hello(host, port, engine_id)
        socks.append(whole)
        ids = list(range(128))
        for i in range(20):
            whole.sendall(w.READ_HDR.pack(w.READ, i, len(ids), 0, b"\0" * 16)
                          + struct.pack(f">{len(ids)}I", *ids))
        mine = _hello(host, port, engine_id)
        socks.append(mine)
        blocks = dparams["remote_block_ids"][0][:1]
        for i in range(50):
            mine.sendall(w.READ_HDR.pack(w.READ, i, len(blocks), 0, claim.token)
                         + struct.pack(f">{len(blocks)}I", *blocks))
        time.sleep(1.5)
        grown = _rss_mb(d.proc.pid) - base
        assert grown < 64, f"D grew by {grown:.0f} MB"
    finally:
        for s in socks:
            s.close()
    history = PROMPT + dj["choices"][0]["token_ids"]  # D still serves the real next turn
    pj = prefill_leg(p, "/v1/completions", body(prompt=history + [7, 8, 9]), dparams)
    assert pj["kv_stats"]["pulled_tokens"] >= 64, pj["kv_stats"]
    d.assert_integrity()


# secret handling ---------------------------------------------------------------------------
def test_without_a_secret_a_non_loopback_bind_is_refused(tiny_model_dir, tmp):
    with pytest.raises(RuntimeError, match="DUPLEXKV_KV_SECRET"):
        w = start_worker(tiny_model_dir, tmp / "open.log", *ARGS, secret=None,
                         kv=kv_config("TcpConnector", side_channel_host="0.0.0.0"))
        w.stop()


def test_the_secret_is_never_logged_nor_in_a_repr(pd):
    from duplexkv.kv.auth import KVAuth

    p, d = pd
    assert TEST_SECRET not in repr(KVAuth(TEST_SECRET.encode()))
    for w in (p, d):
        assert TEST_SECRET not in w.log.read_text(errors="replace")
        assert TEST_SECRET not in json.dumps(w.health())


# NIXL: one-sided READs never reach the holder, so a claim decides what is registered -------
@pytest.fixture(scope="module")
def pd_nixl(tiny_model_dir, tmp):
    need_nixl()
    kv = kv_config("NixlConnector", bidirectional_kv_xfer=True)
    p = start_worker(tiny_model_dir, tmp / "p_nixl.log", *ARGS, "--no-enable-prefix-caching",
                     kv=kv)
    d = start_worker(tiny_model_dir, tmp / "d_nixl.log", *ARGS, kv=kv)
    yield p, d
    p.stop()
    d.stop()


def _nixl_read(agent, local, peer: str, base: int, ids: list[int], block_bytes: int,
               msg: bytes = b"x") -> str:
    """READ blocks `ids` of `peer` (pool at `base`) with NIXL's own API into local blocks
    0..n-1: "DONE", or why NIXL refused or failed."""
    import numpy as np

    from duplexkv.kv.transport.nixl_agent import block_dlist

    try:
        remote = agent.prep_xfer_dlist(peer, block_dlist(base, ids, block_bytes), "DRAM")
    except Exception as e:  # noqa: BLE001 - NIXL's refusal is the expected outcome
        return f"prepare refused: {type(e).__name__}"
    try:
        idx = np.arange(len(ids), dtype=np.int32)
        req = agent.make_prepped_xfer("READ", local, idx, remote, idx, notif_msg=msg)
        state, end = agent.transfer(req), time.monotonic() + 10
        while state == "PROC" and time.monotonic() < end:
            state = agent.check_xfer_state(req)
        req.release()
        return state
    finally:
        remote.release()


def test_nixl_reads_only_the_blocks_of_a_live_claim(pd_nixl, monkeypatch):
    """A NIXL peer holding D's agent metadata (it has the cluster secret) but no claim gets no
    byte of D's pool, using NIXL's own API: the metadata registers no memory, so NIXL prepares
    no descriptor for any block (it used to be the whole pool's). A claim's grant covers exactly
    the claim's blocks; once the entry is released D has deregistered them and a new verify
    grants nothing. The normal pull still equals reuse off."""
    from nixl._api import nixl_agent, nixl_agent_config

    from duplexkv.kv import messages as m
    from duplexkv.kv import side_channel
    from duplexkv.kv.auth import KVAuth
    from duplexkv.kv.transport import meta
    from duplexkv.kv.transport.nixl_agent import dlist

    p, d = pd_nixl
    pulls = d.kv()["counters"]["pulls"]
    _, dj = _turn(p, d)
    plain = decode_leg(d, "/v1/completions", body(), None).json()["choices"][0]["token_ids"]
    assert dj["choices"][0]["token_ids"] == plain  # the NIXL pull equals reuse off
    assert d.kv()["counters"]["pulls"] == pulls + 1
    dparams = dj["kv_transfer_params"]
    rid, blocks = dparams["remote_request_id"], dparams["remote_block_ids"][0]

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    auth = KVAuth(TEST_SECRET.encode())
    host, port = _addr(d.kv()["side_channel"])
    hs = side_channel.handshake(host, port, 5.0, auth=auth).handshake
    header, agent_md = meta.unpack(hs.transport_metadata)
    base, bb = int(header["base_ptr"]), hs.block_bytes
    pool = torch.zeros((len(blocks), bb), dtype=torch.uint8)
    agent = nixl_agent("nixl-attacker", nixl_agent_config(enable_prog_thread=False,
                                                          backends=["UCX"]))
    reg = agent.register_memory([(pool.data_ptr(), pool.numel(), 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", dlist(pool.data_ptr(), len(blocks), bb),
                                  "DRAM")
    try:
        assert agent.add_remote_agent(agent_md) in (hs.engine_id, hs.engine_id.encode())
        # no claim: no block of D's pool (those of D's retained turn, or any other)
        for ids in (blocks, [0], list(range(hs.num_blocks))[-2:]):
            got = _nixl_read(agent, local, hs.engine_id, base, ids[:len(blocks)], bb)
            assert got != "DONE" and not pool.any(), f"read {ids} without a claim: {got}"
        # a claim on the first block: its grant covers that block and no other
        reply = side_channel.request(host, port, m.Verify(rid, [], PROMPT + dj["choices"][0][
            "token_ids"]), m.VerifyReply, 5.0, auth)
        assert 0 < reply.matched <= 16 and reply.grant
        agent.add_remote_agent(reply.grant)
        got = _nixl_read(agent, local, hs.engine_id, base, blocks[1:3], bb)
        assert got != "DONE" and not pool.any(), f"blocks outside the claim: {got}"
        assert d.kv()["transport"]["exposed_claims"] == 1
        got = _nixl_read(agent, local, hs.engine_id, base, blocks[:1], bb,
                         notif("done", rid, reply.token))
        assert got == "DONE" and pool[0].any() and not pool[1:].any(), got
        # released: the registration is gone and nothing grants these blocks again
        wait_for(lambda: d.kv()["transport"]["exposed_claims"] == 0, 10, "the withdrawal")
        again = side_channel.request(host, port, m.Verify(rid, [], PROMPT), m.VerifyReply, 5.0,
                                     auth)
        assert again.matched == 0 and again.reason == "unknown" and not again.grant
    finally:
        local.release()
        agent.remove_remote_agent(hs.engine_id)
        agent.deregister_memory(reg)
    d.assert_integrity()


# the router shows no store credentials -----------------------------------------------------
def test_router_health_and_metrics_show_no_redis_url_or_password(tmp):
    """A Redis URL may carry a password: `/health` and `/metrics` name the store by its role
    only, also when Redis fails (it used to show the whole URL)."""
    import shutil
    import subprocess

    import httpx
    from test_router import start_router

    from duplexkv.launch.ports import free_port

    exe = shutil.which("redis-server")
    if exe is None:
        skip_or_fail("redis-server is not installed (apt-get install -y redis-server)")
    import redis

    port, password = free_port(), "pw-4417-swordfish"
    with open(tmp / "redis-auth.log", "wb") as fh:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--requirepass", password],
                                stdout=fh, stderr=subprocess.STDOUT)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    router = None
    try:
        wait_for(lambda: _pings(redis, url), 10, "redis-server")
        dead = f"http://127.0.0.1:{free_port()}"
        router = start_router(tmp / "router-redis.log", [dead], [dead], "--store", url)

        def bodies() -> list[str]:
            return [httpx.get(router.url + path, timeout=10).text
                    for path in ("/health", "/metrics")]

        for text in bodies():  # the port as a number of its own (not inside a timestamp)
            assert password not in text and not named(port, text) and "redis://" not in text
        assert httpx.get(router.url + "/health", timeout=10).json()["store"] == "redis"
        proc.terminate()  # a failing store: its error must not name it either
        proc.wait(10)
        for text in bodies():  # the port as a number of its own (not inside a timestamp)
            assert password not in text and not named(port, text) and "redis://" not in text
        assert password not in (tmp / "router-redis.log").read_text()
    finally:
        if router is not None:
            router.stop()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def _pings(redis, url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.ConnectionError:
        return False
