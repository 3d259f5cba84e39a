"""The reader: pulls a holder's blocks for a parked request, verified first.

Longer than 300 lines: the pull state machine (verify, decide, reserve, READ, land or decline),
its network jobs and its failure isolation are one concept.

    start(seq, params)     hash the prompt's blocks; a verify job goes to the holder's side
                           channel on a kv-net thread, gated per peer (`peer_gate`)
    verified (poll)        usable = tokens the holder has for exactly this prompt; gain = usable
                           minus the local prefix hit; a transfer predicted to cost more than
                           recomputing (or a gain below an explicit threshold: pull_decision),
                           expiring soon, no room -> declined (the holder is told `skip:` with
                           the claim's token, to free at once);
                           else blocks are reserved and the READ starts (`done:` on landing)
    READ polled            DONE -> KVLanded; FAILED -> declined (`failed`); heartbeats renew
                           the holder's lease while it runs
Each pull ends in exactly one event for the engine: KVLanded, PullDeclined or LoadFailed (the
last when the transfer failed and `kv_load_failure_policy` is "fail"). Everything but the jobs
runs on the engine thread; a failure while handling one pull ends that pull, never the poll.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from duplexkv.engine.block_manager import hash_token_blocks
from duplexkv.engine.kv_transfer import (
    ConnectorEvent,
    EngineHost,
    KVLanded,
    LoadFailed,
    PullDeclined,
)
from duplexkv.engine.sequence import Sequence
from duplexkv.kv import messages as m
from duplexkv.kv import side_channel
from duplexkv.kv.auth import KVAuth
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.holder import notif
from duplexkv.kv.link_model import LinkModel
from duplexkv.kv.peer_gate import PeerGate
from duplexkv.kv.pull_decision import COST_MODEL, decide
from duplexkv.kv.transport import KVTransport, XferHandle, XferState
from duplexkv.wire.kv_params import KVTransferParams

log = logging.getLogger(__name__)
# declines that mean the KV could not be loaded (kv_load_failure_policy applies to these)
LOAD_FAILURES = ("failed", "bad_reply", "unreachable", "peer_down")
MAX_PEERS = 1024


@dataclass(slots=True)
class Pull:
    seq: Sequence
    params: KVTransferParams
    threshold: int
    state: str = "verifying"  # verifying -> reading -> (event emitted)
    handle: XferHandle | None = None
    local_block_ids: list[int] = field(default_factory=list)
    usable_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_heartbeat: float = field(default_factory=time.perf_counter)
    nbytes: int = 0
    read_started: float = 0.0  # perf_counter when the READ began (after the verify)
    token: bytes = b""  # the holder's claim (verify): READ capability, and proof for done/skip


@dataclass(frozen=True, slots=True)
class _Verified:
    request_id: str
    info: side_channel.PeerInfo | None
    reply: m.VerifyReply | None
    why: str | None = None  # set when the verify itself failed
    error: str | None = None


class Reader:
    def __init__(self, cfg: KVTransferConfig, host: EngineHost, transport: KVTransport,
                 gate: PeerGate, compat_hash: str, counters: dict,
                 auth: KVAuth | None = None) -> None:
        self.cfg, self.host, self.transport, self.gate = cfg, host, transport, gate
        self.auth = auth if auth is not None else KVAuth(None)
        self.layout = host.kv_layout()
        self.bs = self.layout.block_size
        self.compat_hash = compat_hash
        self.counters = counters
        # handshakes by (engine id, side-channel address): the same id elsewhere is asked again
        self.peers: dict[tuple[str, str], side_channel.PeerInfo] = {}
        self._peers_lock = threading.Lock()  # kv-net threads handshake concurrently
        self.connected: set[str] = set()
        self.pulls: dict[str, Pull] = {}
        self.orphans: list[tuple[XferHandle, list[int]]] = []  # aborted READs still landing
        self.results: queue.SimpleQueue[_Verified] = queue.SimpleQueue()
        # kept, authenticated side-channel sockets: the CURVE handshake is paid once per socket
        self.side = side_channel.ClientPool(self.auth)
        self.link = LinkModel(cfg.kv_link_prior_rtt_ms, cfg.kv_link_prior_gbps,
                              cfg.kv_link_assumed_gbps, cfg.kv_link_sample_max_age_s)

    def threshold_for(self, p: KVTransferParams) -> int | None:
        """Tokens a pull must gain, or None when these params ask for no pull."""
        if not p.has_remote_blocks:
            return None
        if p.do_remote_prefill:
            return 0  # D leg: P computed this prompt for us; take any gain
        if p.do_remote_decode and self.cfg.bidirectional_kv_xfer:
            t = self.cfg.kv_recompute_threshold
            return COST_MODEL if t is None else t
        return None

    def start(self, seq: Sequence, p: KVTransferParams, threshold: int) -> None:
        self.pulls[seq.request_id] = Pull(seq, p, threshold)
        trusted, why = self.auth.params_trusted(p)
        if not trusted:  # before any connection: forged params reach no host (protocol.md 6)
            self.results.put(_Verified(seq.request_id, None, None, "untrusted", why))
            return
        tokens = seq.prompt_token_ids[: p.remote_num_tokens]
        hashes = hash_token_blocks(self.layout.fingerprint, tokens, self.bs)
        rid = seq.request_id
        self.gate.submit(_addr(p), lambda: self._verify_job(rid, p, hashes, tokens),
                         lambda why: self.results.put(_Verified(
                             rid, None, None, why, "skipped while the peer's breaker is open")))

    # kv-net threads ----------------------------------------------------------------------
    def _peer(self, p: KVTransferParams) -> side_channel.PeerInfo:
        key = (p.remote_engine_id or "", _addr(p))
        info = self.peers.get(key)
        if info is None:
            info = side_channel.handshake(p.remote_host or "", p.remote_port or 0,
                                          self.cfg.connect_timeout_s, pool=self.side)
            hs = info.handshake
            if hs.engine_id != p.remote_engine_id:
                raise side_channel.SideChannelError(
                    f"engine id mismatch: params name {p.remote_engine_id}, "
                    f"{_addr(p)} is {hs.engine_id} (restarted?)")
            if self.cfg.enforce_handshake_compat and hs.compat_hash != self.compat_hash:
                raise side_channel.SideChannelError(
                    f"incompatible KV layout or model at {hs.engine_id}: compatibility hash "
                    f"{hs.compat_hash[:12]} != ours {self.compat_hash[:12]}")
            if hs.transport != self.cfg.transport:
                raise side_channel.SideChannelError(
                    f"peer uses transport {hs.transport}, we use {self.cfg.transport}")
            with self._peers_lock:
                if len(self.peers) >= MAX_PEERS:
                    self.peers.pop(next(iter(self.peers)))
                self.peers[key] = info
        return info

    def _verify_job(self, rid: str, p: KVTransferParams, hashes: list, tokens: list) -> bool:
        """Handshake (first time) and verify. Returns whether the peer behaved (for its
        breaker); the result goes to the engine thread through `results`."""
        try:
            info = self._peer(p)
            t0 = time.perf_counter()
            reply = self.side.request(p.remote_host or "", p.remote_port or 0,
                                      m.Verify(p.remote_request_id or "", hashes, tokens),
                                      m.VerifyReply, self.cfg.connect_timeout_s)
            assert isinstance(reply, m.VerifyReply)
            self.link.observe_rtt(p.remote_engine_id or "", (time.perf_counter() - t0) * 1e3)
            self.results.put(_Verified(rid, info, reply))
            return True
        except side_channel.BadReply as e:
            self.results.put(_Verified(rid, None, None, "bad_reply", str(e)))
        except side_channel.PeerUnreachable as e:
            self.results.put(_Verified(rid, None, None, "unreachable", str(e)))
        except Exception as e:
            self.results.put(_Verified(rid, None, None, "failed", str(e)))
            return True  # it answered (refused, or is another engine): not a dead peer
        return False

    def _heartbeat_job(self, p: KVTransferParams) -> bool:
        try:
            self.side.request(p.remote_host or "", p.remote_port or 0,
                              m.Heartbeat([p.remote_request_id or ""]), m.HeartbeatReply,
                              self.cfg.connect_timeout_s)
            return True
        except Exception as e:
            log.warning("heartbeat to %s failed: %s", p.remote_engine_id, e)
            return not isinstance(e, (side_channel.BadReply, side_channel.PeerUnreachable))

    # engine thread -----------------------------------------------------------------------
    def poll(self) -> list[ConnectorEvent]:
        events: list[ConnectorEvent] = []
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                break
            events.extend(self._isolated(res.request_id, self._on_verified, res))
        now = time.perf_counter()
        for pull in list(self.pulls.values()):
            if pull.state == "reading":
                events.extend(self._isolated(pull.seq.request_id, self._poll_read, pull, now))
        for item in list(self.orphans):
            try:
                if self.transport.poll(item[0]) is not XferState.PENDING:
                    self.transport.release(item[0])
                    self.host.unpin(item[1])
                    self.orphans.remove(item)
            except Exception:
                log.exception("polling an aborted READ failed")
        return events

    def _isolated(self, rid: str, fn, *args) -> list[ConnectorEvent]:
        try:
            ev = fn(*args)
            return [] if ev is None else [ev]
        except Exception as e:
            log.exception("KV pull for %s failed while handling it", rid)
            pull = self.pulls.get(rid)
            if pull is None:
                return []
            self._orphan_if_reading(pull)
            return [self._decline(pull, "failed", repr(e))]

    def _orphan_if_reading(self, pull: Pull) -> None:
        if pull.state == "reading" and pull.handle is not None \
                and pull.handle.state is XferState.PENDING:
            # the READ may still land in these blocks: hold them until it ends
            self.host.pin(pull.local_block_ids)
            self.orphans.append((pull.handle, list(pull.local_block_ids)))
            pull.state = "orphaned"

    def _on_verified(self, res: _Verified) -> ConnectorEvent | None:
        pull = self.pulls.get(res.request_id)
        if pull is None or pull.seq.is_finished:
            return None
        seq, p = pull.seq, pull.params
        if res.why is not None:
            return self._decline(pull, res.why, res.error)
        reply, info = res.reply, res.info
        assert reply is not None and info is not None
        pull.token = reply.token
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
        if gain <= 0:
            return self._decline(pull, "local_hit", notify=info)
        first = local // self.bs
        last = self.host.blocks_needed(usable)
        dec = decide(pull.threshold, gain, local, (last - first) * self.layout.block_bytes,
                     self.link.estimate(p.remote_engine_id or ""),
                     self.host.prefill_cost_model())
        seq.stats.pull_decision = dec.as_dict()
        self._count_decision(dec)
        if not dec.pull:
            return self._decline(pull, dec.reason, notify=info)
        table = self.host.reserve_for_remote_kv(seq, usable)
        if table is None:
            return self._decline(pull, "no_room", notify=info)
        try:
            self._connect(p, info)
            pull.local_block_ids = table[first:last]
            remote = list(p.remote_block_ids[first:last])
            if len(remote) != len(pull.local_block_ids):
                raise ValueError("holder's block list is shorter than its token count")
            pull.read_started = time.perf_counter()  # NIXL over CMA copies inside read()
            pull.handle = self.transport.read(
                p.remote_engine_id or "", pull.local_block_ids, remote,
                notif("done", p.remote_request_id or "", reply.token), reply.token, reply.grant)
        except Exception as e:
            return self._decline(pull, "failed", str(e))
        pull.state, pull.usable_tokens = "reading", usable
        pull.nbytes = len(remote) * self.layout.block_bytes
        return None

    def _count_decision(self, dec) -> None:
        c = self.counters["decisions"]
        key = f"{dec.policy}:{'pull' if dec.pull else 'decline'}"
        c[key] = c.get(key, 0) + 1
        if dec.pull:
            self.counters["predicted_transfer_ms"] += dec.predicted_transfer_ms
        elif dec.predicted_recompute_ms is not None:
            self.counters["predicted_recompute_ms"] += dec.predicted_recompute_ms

    def _connect(self, p: KVTransferParams, info: side_channel.PeerInfo) -> None:
        if p.remote_engine_id not in self.connected:
            self.transport.connect(p.remote_engine_id or "", info.handshake.transport_metadata)
            self.connected.add(p.remote_engine_id or "")

    def _takes_first_token(self, seq: Sequence, p: KVTransferParams) -> bool:
        """May this D leg emit P's first token instead of computing the last prompt token?
        Only when both sides decode greedily over the same whole prompt (the READ must then
        cover every prompt token) and nothing in this request changes its logits (bans,
        logit_bias, penalties)."""
        tok, sp = p.first_token_id, seq.params
        return (self.cfg.use_prefill_first_token and p.do_remote_prefill and tok is not None
                and sp.greedy and seq.num_output_tokens == 0
                and not sp.logit_bias and not sp.has_penalties
                and p.remote_num_tokens == seq.num_prompt_tokens
                and 0 <= tok < self.layout.vocab_size
                and tok not in self.host.banned_tokens(seq))

    def _decline(self, pull: Pull, reason: str, error: str | None = None,
                 notify: side_channel.PeerInfo | None = None) -> ConnectorEvent:
        """Not pulling (or the pull failed): tell the holder, then compute locally or fail."""
        seq, p = pull.seq, pull.params
        self.pulls.pop(seq.request_id, None)
        d = self.counters["declined"]
        d[reason] = d.get(reason, 0) + 1
        if notify is not None and pull.token:  # no claim (nothing matched): nothing to free
            try:
                self._connect(p, notify)
                self.transport.send_notif(p.remote_engine_id or "",
                                          notif("skip", p.remote_request_id or "", pull.token))
            except Exception as e:
                log.warning("notify-only to %s failed: %s", p.remote_engine_id, e)
        if reason == "untrusted":
            log.warning("KV pull for %s declined (untrusted params): %s", seq.request_id, error)
        if reason in LOAD_FAILURES:
            log.warning("KV pull for %s declined (%s): %s", seq.request_id, reason, error)
            if self.cfg.kv_load_failure_policy == "fail":
                return LoadFailed(seq.request_id, reason, f"KV transfer failed: {error}")
        return PullDeclined(seq.request_id, reason)

    def _poll_read(self, pull: Pull, now: float) -> ConnectorEvent | None:
        assert pull.handle is not None
        state = self.transport.poll(pull.handle)
        if state is XferState.DONE:
            self.link.observe_read(pull.params.remote_engine_id or "", pull.nbytes,
                                   pull.handle.elapsed_s * 1e3)
            self.transport.release(pull.handle)
            return self._landed(pull)
        if state is XferState.FAILED:
            h = pull.handle
            err = h.error or "transfer failed"
            if h.finished is not None and h.finished >= h.deadline:  # timed out: a bound
                self.link.observe_timed_out_read(pull.params.remote_engine_id or "", pull.nbytes,
                                                 h.elapsed_s * 1e3)
            self.transport.release(h)
            return self._decline(pull, "failed", err)
        if now - pull.last_heartbeat > self.cfg.heartbeat_interval_s:
            pull.last_heartbeat = now
            p = pull.params
            self.gate.submit(_addr(p), lambda: self._heartbeat_job(p), lambda why: None)
        return None

    def _landed(self, pull: Pull) -> KVLanded:
        seq = pull.seq
        self.pulls.pop(seq.request_id, None)
        gained = pull.usable_tokens - seq.num_computed_tokens
        now = time.perf_counter()
        ms = (now - pull.started) * 1e3
        c = self.counters
        c["pulls"] += 1
        c["verify_ms"] += (pull.read_started - pull.started) * 1e3  # the pull's two phases
        c["read_ms"] += (now - pull.read_started) * 1e3
        c["pulled_tokens"] += gained
        c["pulled_bytes"] += pull.nbytes
        c["transfer_ms"] += ms
        if seq.stats.pull_decision is not None:
            seq.stats.pull_decision["actual_transfer_ms"] = round(ms, 3)
        first = None
        if pull.usable_tokens == seq.num_prompt_tokens:  # see _takes_first_token
            c["prefill_first_tokens"] += 1
            first = pull.params.first_token_id
        return KVLanded(seq.request_id, pull.usable_tokens, gained, pull.nbytes, ms, first)

    def forget(self, seq: Sequence) -> None:
        """The request is gone (aborted or failed): drop its pull."""
        pull = self.pulls.pop(seq.request_id, None)
        if pull is not None:
            self._orphan_if_reading(pull)

    def refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for _, blocks in self.orphans:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs


def _addr(p: KVTransferParams) -> str:
    return f"{p.remote_host}:{p.remote_port}"
