"""KV connector: turns `kv_transfer_params` into retained blocks and verified pulls.

Runs inside a worker, on the engine thread (hooks of AsyncEngine / LLMEngine / Scheduler);
network round trips (handshake, verify, heartbeat) run on a small thread pool and post back.

    reader side (a request arrives with a holder's params)
      on_add: apply the local prefix hit, park the sequence, ask the holder to verify+claim
      result: gain = verified tokens - local hit; READ if gain >= threshold, else notify-only
      READ done: the sequence resumes with the pulled tokens computed; failure -> policy
    holder side (a request finishes)
      P leg (do_remote_decode): keep the prompt blocks under a lease, return P params
      D leg (do_remote_prefill) with bidirectional on: keep prompt + answer under a TTL
      released on the reader's notification, at expiry, or (oldest first) under memory pressure
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from duplexkv.engine.async_engine import AsyncEngine
from duplexkv.engine.block_manager import hash_token_blocks
from duplexkv.engine.llm_engine import RequestOutput
from duplexkv.engine.sequence import Sequence
from duplexkv.kv import messages as m
from duplexkv.kv import side_channel
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.peer_gate import PeerGate
from duplexkv.kv.params import KVTransferParams
from duplexkv.kv.retention import RetentionTable
from duplexkv.kv.transport.base import XferState, make_transport

log = logging.getLogger(__name__)
PROTOCOL_VERSION = "duplexkv-kv-1"
NET_THREADS = 8
# declines that mean the KV could not be loaded (kv_load_failure_policy applies to these)
LOAD_FAILURES = ("failed", "bad_reply", "unreachable", "peer_down")


@dataclass(slots=True)
class Pull:
    seq: Sequence
    params: KVTransferParams
    threshold: int
    state: str = "verifying"  # verifying -> reading -> done
    handle: object = None
    local_block_ids: list[int] = field(default_factory=list)
    usable_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_heartbeat: float = field(default_factory=time.perf_counter)
    nbytes: int = 0


class KVConnector:
    def __init__(self, cfg: KVTransferConfig, aeng: AsyncEngine) -> None:
        self.cfg = cfg
        self.aeng = aeng
        self.engine = eng = aeng.engine
        self.bm, self.sched = eng.bm, eng.scheduler
        self.bs = eng.config.block_size
        self.engine_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.compat_hash = hashlib.sha256(
            eng.fingerprint + f"{PROTOCOL_VERSION}/{tuple(eng.runner.pool.shape[1:])}".encode()
        ).hexdigest()
        self.transport = make_transport(cfg.transport, engine_id=self.engine_id,
                                        host=cfg.transfer_host, timeout_s=cfg.read_timeout_s)
        self.transport.register(eng.runner.pool)
        self.retained = RetentionTable(self.bs, eng.fingerprint)
        hs = side_channel.Handshake(self.engine_id, self.compat_hash, cfg.transport,
                                    self.transport.metadata(), self.bs, eng.bm.num_blocks,
                                    eng.block_bytes)
        self.server = side_channel.SideChannelServer(
            cfg.side_channel_host, cfg.side_channel_port, hs,
            {"verify": self._serve_verify, "hb": self._serve_heartbeat})
        # handshakes by (engine id, side-channel address): the same id at another address is
        # asked again
        self.peers: dict[tuple[str, str], side_channel.PeerInfo] = {}
        self._peers_lock = threading.Lock()
        self.connected: set[str] = set()
        self.pulls: dict[str, Pull] = {}
        self.orphans: list[tuple[object, list[int]]] = []  # aborted reads still landing
        self.req_params: dict[str, KVTransferParams] = {}
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.pool = ThreadPoolExecutor(NET_THREADS, thread_name_prefix="kv-net")
        self.gate = PeerGate(self.pool, cfg.peer_max_in_flight, cfg.peer_breaker_s)
        self.counters = {"pulls": 0, "pulled_tokens": 0, "pulled_bytes": 0, "transfer_ms": 0.0,
                         "declined": {}, "retained": {"lease": 0, "ttl": 0},
                         "prefill_first_tokens": 0}
        aeng.on_add = self.on_add
        aeng.before_step = self.poll
        aeng.poll_timeout = self.poll_timeout
        eng.finish_hook = self.on_finish
        eng.abort_hook = self.on_abort
        eng.scheduler.reclaim = self.reclaim
        eng.extra_refs = self.refs
        self.server.start()

    # ----- holder side -----------------------------------------------------------------
    def on_finish(self, seq: Sequence, reason: str) -> dict | None:
        p = self.req_params.pop(seq.request_id, None)
        if p is None or reason not in ("stop", "length"):
            return None
        if p.do_remote_decode:
            kind, duration = "lease", self.cfg.kv_lease_duration
        elif p.do_remote_prefill and self.cfg.bidirectional_kv_xfer:
            kind, duration = "ttl", self.cfg.decoder_kv_blocks_ttl
        else:
            return None
        n = seq.num_computed_tokens  # the last sampled token has no KV
        blocks = seq.block_table[: self.bm.blocks_needed(n)]
        self.bm.pin(blocks)
        rid = f"{seq.request_id}-{uuid.uuid4().hex[:8]}"
        entry = self.retained.add(rid, blocks, seq.all_token_ids[:n], kind, duration)
        self.counters["retained"][kind] += 1
        # P's first token is what a greedy D would compute, if nothing masked P's logits
        sp = seq.params
        first = seq.output_token_ids[0] if (
            kind == "lease" and sp.greedy and sp.min_tokens == 0 and seq.output_token_ids
            and n == seq.num_prompt_tokens) else None
        return KVTransferParams(
            do_remote_decode=kind == "ttl", do_remote_prefill=kind == "lease",
            remote_block_ids=tuple(blocks), remote_engine_id=self.engine_id,
            remote_request_id=rid, remote_host=self.server.host, remote_port=self.server.port,
            remote_num_tokens=n,
            remote_blocks_expiry_time=entry.expiry if kind == "ttl" else None,
            first_token_id=first).to_dict()

    def _release(self, entry) -> None:
        if entry is not None:
            self.bm.unpin(entry.block_ids)

    def reclaim(self, need_blocks: int) -> int:
        """Release retained entries, oldest first, until `need_blocks` are free."""
        released = 0
        while self.bm.num_free_blocks < need_blocks:
            entry = self.retained.pop_oldest_unclaimed()
            if entry is None:
                break
            self._release(entry)
            released += 1
        return released

    def _serve_verify(self, req: m.Verify) -> m.VerifyReply:
        claim_s = self.cfg.read_timeout_s + self.cfg.expiry_margin_s
        r = self.retained.verify_and_claim(req.request_id, req.hashes, req.tokens, claim_s)
        return m.VerifyReply(r.matched_tokens, r.expiry, r.reason)

    def _serve_heartbeat(self, req: m.Heartbeat) -> m.HeartbeatReply:
        return m.HeartbeatReply(self.retained.heartbeat(req.request_ids,
                                                        self.cfg.kv_lease_duration * 2 / 3))

    # ----- reader side -----------------------------------------------------------------
    def on_add(self, seq: Sequence, raw: object) -> None:
        p = KVTransferParams.from_dict(raw)
        if p.do_remote_decode or p.do_remote_prefill:
            self.req_params[seq.request_id] = p
        if not p.has_remote_blocks:
            return
        if p.do_remote_prefill:
            threshold = 0  # D leg: P computed this prompt for us; take any gain
        elif p.do_remote_decode and self.cfg.bidirectional_kv_xfer:
            threshold = self.cfg.kv_recompute_threshold
        else:
            return
        self.sched.waiting.remove(seq)
        self.sched.apply_prefix_hit(seq)
        self.sched.park(seq)
        pull = Pull(seq, p, threshold)
        self.pulls[seq.request_id] = pull
        tokens = seq.prompt_token_ids[: p.remote_num_tokens]
        hashes = hash_token_blocks(self.bm.seed, tokens, self.bs)
        rid = seq.request_id
        self.gate.submit(_addr(p), lambda: self._verify_job(rid, p, hashes, tokens),
                         lambda why: self.results.put((rid, None, None, why, "peer is down "
                                                       "(skipped while its breaker is open)")))

    def _peer(self, p: KVTransferParams) -> side_channel.PeerInfo:
        key = (p.remote_engine_id, _addr(p))
        info = self.peers.get(key)
        if info is None:
            info = side_channel.handshake(p.remote_host, p.remote_port,
                                          self.cfg.connect_timeout_s)
            hs = info.handshake
            if hs.engine_id != p.remote_engine_id:
                raise side_channel.SideChannelError(
                    f"engine id mismatch: params name {p.remote_engine_id}, "
                    f"{p.remote_host}:{p.remote_port} is {hs.engine_id} (restarted?)")
            if self.cfg.enforce_handshake_compat and hs.compat_hash != self.compat_hash:
                raise side_channel.SideChannelError(
                    f"incompatible KV layout or model at {hs.engine_id}: compatibility hash "
                    f"{hs.compat_hash[:12]} != ours {self.compat_hash[:12]}")
            if hs.transport != self.cfg.transport:
                raise side_channel.SideChannelError(
                    f"peer uses transport {hs.transport}, we use {self.cfg.transport}")
            with self._peers_lock:  # kv-net threads handshake concurrently
                if len(self.peers) >= 1024:
                    self.peers.pop(next(iter(self.peers)))
                self.peers[key] = info
        return info

    def _connect(self, p: KVTransferParams, info: side_channel.PeerInfo) -> None:
        if p.remote_engine_id not in self.connected:
            self.transport.connect(p.remote_engine_id, info.handshake.transport_metadata)
            self.connected.add(p.remote_engine_id)

    def _verify_job(self, rid: str, p: KVTransferParams, hashes: list, tokens: list) -> bool:
        """On a kv-net thread: handshake (first time) and verify. Returns whether the peer
        behaved (for its breaker); the result goes to the engine thread's queue."""
        try:
            info = self._peer(p)
            reply = side_channel.request(p.remote_host, p.remote_port,
                                         m.Verify(p.remote_request_id, hashes, tokens),
                                         m.VerifyReply, self.cfg.connect_timeout_s)
            self.results.put((rid, info, reply, None, None))
            return True
        except side_channel.BadReply as e:
            self.results.put((rid, None, None, "bad_reply", str(e)))
        except side_channel.PeerUnreachable as e:
            self.results.put((rid, None, None, "unreachable", str(e)))
        except Exception as e:
            self.results.put((rid, None, None, "failed", str(e)))
            return True  # it answered (refused, or is another engine): not a dead peer
        return False

    def _heartbeat_job(self, p: KVTransferParams) -> bool:
        try:
            side_channel.request(p.remote_host, p.remote_port, m.Heartbeat([p.remote_request_id]),
                                 m.HeartbeatReply, self.cfg.connect_timeout_s)
            return True
        except Exception as e:
            log.warning("heartbeat to %s failed: %s", p.remote_engine_id, e)
            return not isinstance(e, (side_channel.BadReply, side_channel.PeerUnreachable))

    def _on_verified(self, rid: str, info, reply: m.VerifyReply | None, why: str | None,
                     error: str | None) -> RequestOutput | None:
        pull = self.pulls.get(rid)
        if pull is None or pull.seq.is_finished:
            return None
        seq, p = pull.seq, pull.params
        if why is not None:
            return self._decline(pull, why, error)
        assert reply is not None
        matched = reply.matched
        last_computed = 0 if self._takes_first_token(seq, p) else 1
        usable = min(matched, p.remote_num_tokens, seq.num_prompt_tokens - last_computed)
        local = seq.num_computed_tokens
        gain = usable - local
        if matched == 0:
            return self._decline(pull, reply.reason if reply.reason in ("unknown", "expired")
                                 else "mismatch", notify=info)
        expiry_local = reply.expiry - info.clock_offset
        if expiry_local - time.perf_counter() < self.cfg.expiry_margin_s:
            return self._decline(pull, "expired", notify=info)
        if gain <= 0 or gain < pull.threshold:
            return self._decline(pull, "threshold" if gain > 0 else "local_hit", notify=info)
        first = local // self.bs
        last = self.bm.blocks_needed(usable)
        if not self.bm.allocate_for(seq, usable) and not (
                self.reclaim(last - seq.num_blocks) and self.bm.allocate_for(seq, usable)):
            return self._decline(pull, "no_room", notify=info)
        try:
            self._connect(p, info)
            pull.local_block_ids = seq.block_table[first:last]
            remote = list(p.remote_block_ids[first:last])
            if len(remote) != len(pull.local_block_ids):
                raise ValueError("holder's block list is shorter than its token count")
            pull.handle = self.transport.read(p.remote_engine_id, pull.local_block_ids, remote,
                                              f"done:{p.remote_request_id}".encode())
        except Exception as e:
            return self._decline(pull, "failed", str(e))
        pull.state, pull.usable_tokens = "reading", usable
        pull.nbytes = len(remote) * self.engine.block_bytes
        return None

    def _takes_first_token(self, seq: Sequence, p: KVTransferParams) -> bool:
        """May this D leg emit P's first token instead of computing the last prompt token?
        Only when both sides decode greedily over the same whole prompt (the READ must then
        cover every prompt token) and this request's masking would not ban that token."""
        tok = p.first_token_id
        return (self.cfg.use_prefill_first_token and p.do_remote_prefill and tok is not None
                and seq.params.greedy and seq.num_output_tokens == 0
                and p.remote_num_tokens == seq.num_prompt_tokens
                and 0 <= tok < self.engine.model_config.vocab_size
                and tok not in self.engine.banned_tokens(seq))

    def _decline(self, pull: Pull, reason: str, error: str | None = None,
                 notify=None) -> RequestOutput | None:
        """Not pulling (or the pull failed): tell the holder, then compute locally or fail."""
        seq, p = pull.seq, pull.params
        self.pulls.pop(seq.request_id, None)
        d = self.counters["declined"]
        d[reason] = d.get(reason, 0) + 1
        seq.stats.pull_outcome = reason
        if notify is not None:
            try:
                self._connect(p, notify)
                self.transport.send_notif(p.remote_engine_id,
                                          f"skip:{p.remote_request_id}".encode())
            except Exception as e:
                log.warning("notify-only to %s failed: %s", p.remote_engine_id, e)
        if reason in LOAD_FAILURES:
            log.warning("KV pull for %s declined (%s): %s", seq.request_id, reason, error)
            if self.cfg.kv_load_failure_policy == "fail":
                return self.engine.fail_request(seq.request_id, f"KV transfer failed: {error}")
        # recompute: keep the local prefix hit, drop anything beyond it
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_hashed_blocks * self.bs)
        self.sched.unpark(seq)
        return None

    def _on_read_done(self, pull: Pull) -> RequestOutput | None:
        seq = pull.seq
        self.pulls.pop(seq.request_id, None)
        gained = pull.usable_tokens - seq.num_computed_tokens
        ms = (time.perf_counter() - pull.started) * 1e3
        seq.num_computed_tokens = pull.usable_tokens
        seq.stats.pulled_tokens += gained
        seq.stats.transfer_bytes += pull.nbytes
        seq.stats.transfer_ms += ms
        seq.stats.pull_outcome = "pulled"
        c = self.counters
        c["pulls"] += 1
        c["pulled_tokens"] += gained
        c["pulled_bytes"] += pull.nbytes
        c["transfer_ms"] += ms
        if seq.num_computed_tokens == seq.num_prompt_tokens:  # see _takes_first_token
            c["prefill_first_tokens"] += 1
            self.bm.cache_blocks(seq)  # no step may follow (the request can finish right here)
            out = self.engine.accept_token(seq.request_id, pull.params.first_token_id)
            if not seq.is_finished:
                self.sched.unpark(seq)
            return out
        self.sched.unpark(seq)
        return None

    def on_abort(self, seq: Sequence) -> None:
        self.req_params.pop(seq.request_id, None)
        pull = self.pulls.pop(seq.request_id, None)
        if pull is not None and pull.state == "reading":
            # the READ may still be landing in these blocks: hold them until it ends
            self.bm.pin(pull.local_block_ids)
            self.orphans.append((pull.handle, list(pull.local_block_ids)))

    # ----- the engine thread's poll ----------------------------------------------------
    def poll_timeout(self) -> float | None:
        if self.pulls or self.orphans:
            return 0.001
        return 0.05 if len(self.retained) else None

    def poll(self) -> list[RequestOutput]:
        """Advance every pull (verify results, READs), orphans, notifications and expiries.
        A failure while handling one pull ends that pull as a declined load, never the poll."""
        outs: list[RequestOutput] = []
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                break
            outs.extend(self._isolated(res[0], self._on_verified, *res))
        now = time.perf_counter()
        for pull in list(self.pulls.values()):
            if pull.state == "reading":
                outs.extend(self._isolated(pull.seq.request_id, self._poll_read, pull, now))
        for item in list(self.orphans):
            try:
                if self.transport.poll(item[0]) is not XferState.PENDING:
                    self.transport.release(item[0])
                    self.bm.unpin(item[1])
                    self.orphans.remove(item)
            except Exception:
                log.exception("polling an aborted READ failed")
        for peer, msg in self.transport.get_notifs():
            kind, _, rid = msg.decode(errors="replace").partition(":")
            self._release(self.retained.pop(rid, "read" if kind == "done" else "notified"))
        for entry in self.retained.pop_expired():
            log.info("retained blocks of %s expired (%s)", entry.request_id, entry.kind)
            self._release(entry)
        return outs

    def _isolated(self, rid: str, fn, *args) -> list[RequestOutput]:
        try:
            out = fn(*args)
            return [] if out is None else [out]
        except Exception as e:
            log.exception("KV pull for %s failed while handling it", rid)
            pull = self.pulls.get(rid)
            if pull is None or pull.seq.is_finished:
                return []
            if pull.state == "reading" and pull.handle.state is XferState.PENDING:
                # the READ may still land: hold its blocks until it ends
                self.bm.pin(pull.local_block_ids)
                self.orphans.append((pull.handle, list(pull.local_block_ids)))
                pull.state = "failed"
            try:
                out = self._decline(pull, "failed", repr(e))
            except Exception:
                log.exception("declining %s failed; ending the request", rid)
                out = self.engine.fail_request(rid, f"KV transfer failed: {e!r}")
            return [] if out is None else [out]

    def _poll_read(self, pull: Pull, now: float) -> RequestOutput | None:
        state = self.transport.poll(pull.handle)
        if state is XferState.DONE:
            self.transport.release(pull.handle)
            return self._on_read_done(pull)
        if state is XferState.FAILED:
            err = getattr(pull.handle, "error", "transfer failed")
            self.transport.release(pull.handle)
            return self._decline(pull, "failed", err)
        if now - pull.last_heartbeat > self.cfg.heartbeat_interval_s:
            pull.last_heartbeat = now
            p = pull.params
            self.gate.submit(_addr(p), lambda: self._heartbeat_job(p), lambda why: None)
        return None

    # ----- reporting / lifecycle -------------------------------------------------------
    def refs(self) -> dict[int, int]:
        refs = self.retained.refs()
        for _, blocks in self.orphans:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def health(self) -> dict:
        return {"engine_id": self.engine_id, "kv_connector": self.cfg.kv_connector,
                "side_channel": f"{self.server.host}:{self.server.port}",
                "transport": self.transport.health(), "retained": self.retained.stats(),
                "pulls_in_flight": len(self.pulls), "counters": self.counters,
                "peers": self.gate.state()}

    def close(self) -> None:
        self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def _addr(p: KVTransferParams) -> str:
    return f"{p.remote_host}:{p.remote_port}"
