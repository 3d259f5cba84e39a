"""The holder: blocks this worker keeps for another worker to READ, and the verify/claim service.

    kind    created when (on_finish)           renewed by          released by
    lease   P leg finished (do_remote_decode)  heartbeats, claim   reader's done/skip, expiry
    ttl     D leg finished (do_remote_prefill, the router, claim   reader's done/skip, lease
            bidirectional on)                  (up to the TTL)     expiry, TTL cap, deletion,
                                                                   memory pressure (by value)

A reader first asks `serve_verify` which leading tokens of its prompt the held blocks contain
(chained block hashes, then token by token) and thereby claims the entry for the READ; the READ
itself is served by the transport; its completion notification (`done:<id>:<token>`) or a
reader's notify-only message (`skip:<id>:<token>`) releases the entry, only under the token of a
claim on that entry (`notif`, `parse_notif`). Engine-thread methods: `hold`,
`on_notification`, `expire`, `reclaim`, `refs`. Side-channel thread: `serve_verify`,
`serve_heartbeat` (the retention table is locked); HTTP thread: `sync` (the router's renewals,
deletions and release notices, http/retention_sync.py); transport threads: `authorize_read` (the
capability check before any block is served, under the same lock).
"""

from __future__ import annotations

import logging
import secrets

from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.engine.kv_transfer import EngineHost
from duplexkv.engine.sequence import Sequence
from duplexkv.http import retention_sync as rs
from duplexkv.kv import messages as m
from duplexkv.kv.auth import SIGNATURE_KEY, KVAuth
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.claims import Grants
from duplexkv.kv.retained import Retained
from duplexkv.kv.retention import RetentionTable

log = logging.getLogger(__name__)


def notif(kind: str, request_id: str, token: bytes) -> bytes:
    """A reader's notification to the holder: `done` (READ landed) or `skip` (declined)."""
    return f"{kind}:{request_id}:{token.hex()}".encode()


def parse_notif(msg: bytes) -> tuple[str, str, bytes] | None:
    """(kind, request id, claim token), or None for anything else. Request ids may contain
    ':' (they embed the client's); the token is the last field and never does."""
    kind, _, rest = msg.decode(errors="replace").partition(":")
    rid, _, tok = rest.rpartition(":")
    if kind not in ("done", "skip") or not rid:
        return None
    try:
        return kind, rid, bytes.fromhex(tok)
    except ValueError:
        return None


class Holder:
    def __init__(self, cfg: KVTransferConfig, host: EngineHost, block_size: int, seed: bytes,
                 engine_id: str, auth: KVAuth | None = None,
                 grants: Grants | None = None) -> None:
        """`grants`: the transport's exposure of a claim's blocks (NIXL registers them)."""
        self.cfg, self.host, self.engine_id = cfg, host, engine_id
        self.auth = auth if auth is not None else KVAuth(None)
        self.retained = RetentionTable(block_size, seed,
                                       lease_s=min(cfg.decoder_kv_lease_duration,
                                                   cfg.decoder_kv_blocks_ttl), grants=grants)
        self.address: tuple[str, int] = ("", 0)  # the side channel's, set once it listens
        self.counters = {"lease": 0, "ttl": 0}

    def kind_for(self, p: KVTransferParams) -> str | None:
        """What finishing a request with these params leaves held: "lease", "ttl" or None."""
        if p.do_remote_decode:
            return "lease"
        if p.do_remote_prefill and self.cfg.bidirectional_kv_xfer:
            return "ttl"
        return None

    def hold(self, seq: Sequence, kind: str) -> KVTransferParams:
        """Pin the finished `seq`'s computed blocks under a lease or TTL; the params say where."""
        if kind == "lease":
            duration, cap = self.cfg.kv_lease_duration, None
        else:  # a renewable lease, never held past the TTL
            duration, cap = self.cfg.decoder_kv_lease_duration, self.cfg.decoder_kv_blocks_ttl
        n = seq.num_computed_tokens  # the last sampled token has no KV
        blocks = seq.block_table[: self.host.blocks_needed(n)]
        self.host.pin(blocks)
        rid = f"{seq.request_id}-{secrets.token_hex(16)}"  # unguessable: it names the entry
        entry = self.retained.add(rid, blocks, seq.all_token_ids[:n], kind, duration, cap,
                                  seq.params.cache_salt)
        self.counters[kind] += 1
        # P's first token is what a greedy D would compute, if nothing masked P's logits
        sp = seq.params
        first = seq.output_token_ids[0] if (
            kind == "lease" and sp.greedy and sp.min_tokens == 0 and seq.output_token_ids
            and n == seq.num_prompt_tokens and not sp.logit_bias and not sp.has_penalties
        ) else None
        host, port = self.address
        p = KVTransferParams(
            do_remote_decode=kind == "ttl", do_remote_prefill=kind == "lease",
            remote_block_ids=tuple(blocks), remote_engine_id=self.engine_id,
            remote_request_id=rid, remote_host=host, remote_port=port, remote_num_tokens=n,
            # the latest the blocks can live (the cap); renewals never pass it, and they may go
            # sooner (lease not renewed, deletion, pressure): verify's expiry is the live one
            remote_blocks_expiry_time=entry.cap if kind == "ttl" else None,
            first_token_id=first)
        if self.auth.enabled:  # readers trust nothing else in params (docs/protocol.md, 6)
            p.extra[SIGNATURE_KEY] = self.auth.sign_params(p)
        return p

    def _release(self, entry: Retained | None) -> None:
        if entry is not None:
            self.host.unpin(entry.block_ids)

    def on_notification(self, msg: bytes) -> None:
        """A reader finished READing (`done:<id>:<token>`) or declined (`skip:...`); without a
        claim's token on that entry nothing is released (retention.py, `release_claimed`)."""
        parsed = parse_notif(msg)
        if parsed is None:
            self.retained.refuse_notif()
            return
        kind, rid, token = parsed
        self._release(self.retained.release_claimed(rid, token,
                                                    "read" if kind == "done" else "notified"))

    def expire(self) -> None:
        for entry in self.retained.pop_expired():
            log.info("retained blocks of %s expired (%s)", entry.request_id, entry.kind)
            self._release(entry)

    def reclaim(self, need_blocks: int) -> int:
        """Release retained entries, lowest value first (eviction.py; oldest first with
        `decoder_kv_eviction: "oldest"`), until `need_blocks` are free."""
        released = 0
        while self.host.num_free_blocks() < need_blocks:
            entry = self.retained.pop_for_pressure(self.cfg.decoder_kv_eviction)
            if entry is None:
                break
            self._release(entry)
            released += 1
        return released

    def refs(self) -> dict[int, int]:
        return self.retained.refs()

    # side-channel thread
    def serve_verify(self, req: m.Verify) -> m.VerifyReply:
        claim_s = self.cfg.read_timeout_s + self.cfg.expiry_margin_s
        r = self.retained.verify_and_claim(req.request_id, req.hashes, req.tokens, claim_s,
                                           req.seed_tag)
        return m.VerifyReply(r.matched_tokens, r.expiry, r.reason, r.token, r.grant)

    # transport server threads
    def authorize_read(self, token: bytes, block_ids: tuple[int, ...]) -> str | None:
        """The transport's READ check: None, or why the READ is refused (claims.py)."""
        return self.retained.authorize_read(token, block_ids)

    # HTTP thread (the router's POST /v1/kv/retention); deleted entries go at the next `expire`
    def sync(self, req: rs.SyncRequest) -> tuple[rs.SyncReply, bool]:
        """-> (the reply, whether entries were marked deleted: call `expire` on the engine
        thread to free them now)."""
        t = self.retained
        held, unknown = t.renew(req.renew)
        deleted = set(t.mark_deleted(req.delete))
        unknown += [rid for rid in req.delete if rid not in deleted]
        notices = t.released_since(req.since)
        return rs.SyncReply(notices.generation, held, unknown, notices.request_ids,
                            notices.reset), bool(deleted)

    def serve_heartbeat(self, req: m.Heartbeat) -> m.HeartbeatReply:
        return m.HeartbeatReply(self.retained.heartbeat(req.request_ids,
                                                        self.cfg.kv_lease_duration * 2 / 3))
