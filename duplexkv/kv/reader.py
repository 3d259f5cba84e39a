"""The reader: pulls a holder's blocks for a parked request, verified first.

    start(seq, params)     hash the prompt's blocks; a verify job goes to the holder's side
                           channel on a kv-net thread (holder_client.py), gated per peer
                           (`peer_gate`)
    verified (poll)        usable = tokens the holder has for exactly this prompt; gain = usable
                           minus the local prefix hit; a transfer predicted to cost more than
                           recomputing (or a gain below an explicit threshold: pull_decision),
                           expiring soon, no room -> declined (the holder is told `skip:` with
                           the claim's token, to free at once);
                           else blocks are reserved and the READ starts (transfers.py; `done:`
                           on landing)
    READ polled            DONE -> KVLanded; FAILED -> declined (`failed`); heartbeats renew
                           the holder's lease while it runs
Each pull ends in exactly one event for the engine: KVLanded, PullDeclined or LoadFailed (the
last when the transfer failed and `kv_load_failure_policy` is "fail"). Everything but the jobs
runs on the engine thread; a failure while handling one pull ends that pull, never the poll.
What the pulls did is counted in `counters` (pull_stats.py).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from duplexkv.engine.block_manager import hash_token_blocks, salt_tag, salted
from duplexkv.engine.kv_transfer import (
    ConnectorEvent,
    EngineHost,
    KVLanded,
    LoadFailed,
    PullDeclined,
)
from duplexkv.engine.sequence import Sequence
from duplexkv.kv import side_channel
from duplexkv.kv.auth import KVAuth
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.holder_client import HolderClient, Verified, address
from duplexkv.kv.link_model import LinkModel
from duplexkv.kv.peer_gate import PeerGate
from duplexkv.kv.pull_decision import decide
from duplexkv.kv.pull_stats import PullCounters
from duplexkv.kv.transfers import Transfers
from duplexkv.kv.transport import KVTransport, XferHandle, XferState
from duplexkv.wire.kv_params import KVTransferParams

log = logging.getLogger(__name__)
# declines that mean the KV could not be loaded (kv_load_failure_policy applies to these)
# ("stalled": the READ moved no byte for read_stall_s, TcpConnector: the link to D is cut or D hung)
LOAD_FAILURES = ("failed", "stalled", "bad_reply", "unreachable", "peer_down")


@dataclass(slots=True)
class Pull:
    seq: Sequence
    params: KVTransferParams
    threshold: int
    state: str = "verifying"  # verifying -> reading -> (event emitted) | orphaned
    handle: XferHandle | None = None
    local_block_ids: list[int] = field(default_factory=list)
    usable_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_heartbeat: float = field(default_factory=time.perf_counter)
    nbytes: int = 0
    read_started: float = 0.0  # perf_counter when the READ began (after the verify)
    token: bytes = b""  # the holder's claim (verify): READ capability, and proof for done/skip


class Reader:
    def __init__(self, cfg: KVTransferConfig, host: EngineHost, transport: KVTransport,
                 gate: PeerGate, compat_hash: str, auth: KVAuth | None = None) -> None:
        self.cfg, self.host, self.gate = cfg, host, gate
        self.auth = auth if auth is not None else KVAuth(None)
        self.layout = host.kv_layout()
        self.bs = self.layout.block_size
        self.counters = PullCounters()
        self.pulls: dict[str, Pull] = {}
        self.results: queue.SimpleQueue[Verified] = queue.SimpleQueue()
        self.link = LinkModel(cfg.kv_link_prior_rtt_ms, cfg.kv_link_prior_gbps,
                              cfg.kv_link_assumed_gbps, cfg.kv_link_sample_max_age_s)
        self.client = HolderClient(cfg, compat_hash, self.auth, self.link)
        self.transfers = Transfers(transport, host)

    def start(self, seq: Sequence, p: KVTransferParams, threshold: int) -> None:
        self.pulls[seq.request_id] = Pull(seq, p, threshold)
        trusted, why = self.auth.params_trusted(p)
        if not trusted:  # before any connection: forged params reach no host (protocol.md 6)
            self.results.put(Verified(seq.request_id, None, None, "untrusted", why))
            return
        tokens = seq.prompt_token_ids[: p.remote_num_tokens]
        fp, salt = self.layout.fingerprint, seq.params.cache_salt  # the holder's, same salt
        hashes = hash_token_blocks(salted(fp, salt), tokens, self.bs)
        rid, tag = seq.request_id, salt_tag(fp, salt)

        def verify() -> bool:  # on a kv-net thread
            res, behaved = self.client.verify(rid, p, hashes, tokens, tag)
            self.results.put(res)
            return behaved

        self.gate.submit(address(p), verify, lambda why: self.results.put(Verified(
            rid, None, None, why, "skipped while the peer's breaker is open")))

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
        self.transfers.poll_orphans()
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
        if pull.state == "reading" and self.transfers.orphan(pull.handle, pull.local_block_ids):
            pull.state = "orphaned"  # the READ may still land in these blocks

    def _on_verified(self, res: Verified) -> ConnectorEvent | None:
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
        self.counters.decided(dec)
        if not dec.pull:
            return self._decline(pull, dec.reason, notify=info)
        table = self.host.reserve_for_remote_kv(seq, usable)
        if table is None:
            return self._decline(pull, "no_room", notify=info)
        try:
            pull.local_block_ids = table[first:last]
            remote = list(p.remote_block_ids[first:last])
            if len(remote) != len(pull.local_block_ids):
                raise ValueError("holder's block list is shorter than its token count")
            pull.read_started = time.perf_counter()  # NIXL over CMA copies inside read()
            pull.handle = self.transfers.read(p, info, pull.local_block_ids, remote,
                                              reply.token, reply.grant)
        except Exception as e:
            return self._decline(pull, "failed", str(e))
        pull.state, pull.usable_tokens = "reading", usable
        pull.nbytes = len(remote) * self.layout.block_bytes
        return None

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
        self.counters.declined_for(reason)
        if notify is not None and pull.token:  # no claim (nothing matched): nothing to free
            self.transfers.skip(p, notify, pull.token)
        if reason == "untrusted":
            log.warning("KV pull for %s declined (untrusted params): %s", seq.request_id, error)
        if reason in LOAD_FAILURES:
            log.warning("KV pull for %s declined (%s): %s", seq.request_id, reason, error)
            if self.cfg.kv_load_failure_policy == "fail":
                return LoadFailed(seq.request_id, reason, f"KV transfer failed: {error}")
        return PullDeclined(seq.request_id, reason)

    def _poll_read(self, pull: Pull, now: float) -> ConnectorEvent | None:
        h, peer = pull.handle, pull.params.remote_engine_id or ""
        assert h is not None
        state = self.transfers.poll(h)
        if state is XferState.DONE:
            self.link.observe_read(peer, pull.nbytes, h.elapsed_s * 1e3)
            self.transfers.release(h)
            return self._landed(pull)
        if state is XferState.FAILED:
            err = h.error or "transfer failed"
            # timed out, or stalled (no byte for read_stall_s): the link did not move nbytes
            # in that time, a bound on it
            if h.stalled or (h.finished is not None and h.finished >= h.deadline):
                self.link.observe_timed_out_read(peer, pull.nbytes, h.elapsed_s * 1e3)
            self.transfers.release(h)
            return self._decline(pull, "stalled" if h.stalled else "failed", err)
        if now - pull.last_heartbeat > self.cfg.heartbeat_interval_s:
            pull.last_heartbeat = now
            p = pull.params
            self.gate.submit(address(p), lambda: self.client.heartbeat(p), lambda why: None)
        return None

    def _landed(self, pull: Pull) -> KVLanded:
        seq = pull.seq
        self.pulls.pop(seq.request_id, None)
        gained = pull.usable_tokens - seq.num_computed_tokens
        now = time.perf_counter()
        ms = (now - pull.started) * 1e3
        whole = pull.usable_tokens == seq.num_prompt_tokens  # see _takes_first_token
        self.counters.landed(gained, pull.nbytes, (pull.read_started - pull.started) * 1e3,
                             (now - pull.read_started) * 1e3, ms, whole)
        if seq.stats.pull_decision is not None:
            seq.stats.pull_decision["actual_transfer_ms"] = round(ms, 3)
        first = pull.params.first_token_id if whole else None
        return KVLanded(seq.request_id, pull.usable_tokens, gained, pull.nbytes, ms, first)

    def forget(self, seq: Sequence) -> None:
        """The request is gone (aborted or failed): drop its pull."""
        pull = self.pulls.pop(seq.request_id, None)
        if pull is not None:
            self._orphan_if_reading(pull)

    def busy(self) -> bool:
        """Pulls in flight, or aborted READs still landing."""
        return bool(self.pulls) or self.transfers.num_orphans() > 0

    def refs(self) -> dict[int, int]:
        return self.transfers.refs()

    def close(self) -> None:
        self.client.close()
