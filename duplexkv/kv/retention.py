"""Blocks a node keeps for another node to READ: P's prefill under a lease, D's finished turn
under a TTL. Shared between the engine thread (creates and releases entries, owns the block
references) and the side-channel thread (verifies, claims, renews), hence the lock.

    kind    created when                      renewed by          released by
    lease   P leg finished (prefill done)     heartbeats, claim   reader's done-notif, expiry
    ttl     D leg finished (stop/length)      claim only          reader's done-notif, expiry,
                                                                  memory pressure (oldest first)
A claim (a reader verified the blocks and is about to READ them) protects an entry from expiry
and from early release until the claim lapses. Each claim carries a random capability token
(returned by verify): the transport serves a READ only under a live claim's token, and only
blocks of that claim in its order (`authorize_read`, called from the transport's threads).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from duplexkv.engine.block_manager import hash_token_blocks


@dataclass(slots=True)
class Retained:
    request_id: str  # the remote_request_id a reader names
    block_ids: list[int]
    token_ids: list[int]  # tokens whose KV the blocks hold, in order
    hashes: list[bytes]  # chained hashes of the full blocks
    kind: str  # "lease" | "ttl"
    expiry: float  # time.perf_counter() deadline
    claimed_until: float = 0.0
    tokens: list[bytes] = field(default_factory=list)  # its live claims' capability tokens

    def claimed(self, now: float) -> bool:
        return self.claimed_until > now


class VerifyResult(NamedTuple):
    matched_tokens: int  # leading tokens whose KV the holder has for the reader's prompt
    expiry: float  # holder clock
    reason: str  # "" or why nothing matched ("unknown", "expired")
    token: bytes = b""  # the claim's capability for the READ (when matched_tokens > 0)


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str
    block_ids: tuple[int, ...]  # the entry's blocks covering the matched tokens, in order
    until: float

TOKEN_BYTES = 16
MAX_CLAIMS_PER_ENTRY = 8


def match_tokens(entry: Retained, hashes: list[bytes], tokens: list[int], block_size: int) -> int:
    """Leading tokens where the holder's blocks equal the reader's prompt, by position: whole
    blocks by chained hash, then token by token inside the first block that differs."""
    n = 0
    while n < min(len(hashes), len(entry.hashes)) and hashes[n] == entry.hashes[n]:
        n += 1
    start = n * block_size
    ours = entry.token_ids[start : start + block_size]
    theirs = tokens[start : start + block_size]
    k = 0
    while k < min(len(ours), len(theirs)) and ours[k] == theirs[k]:
        k += 1
    return start + k


class RetentionTable:
    def __init__(self, block_size: int, seed: bytes) -> None:
        self.block_size = block_size
        self.seed = seed
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Retained] = OrderedDict()  # oldest first
        self._claims: dict[bytes, Claim] = {}  # capability token -> claim
        self.refused_reads = 0
        self.released = {"read": 0, "notified": 0, "expired": 0, "pressure": 0, "abort": 0,
                         "local": 0}  # local: its D reused it for the next turn itself

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, block_ids: list[int], token_ids: list[int], kind: str,
            duration_s: float) -> Retained:
        hashes = hash_token_blocks(self.seed, token_ids, self.block_size)
        entry = Retained(request_id, list(block_ids), list(token_ids), hashes, kind,
                         time.perf_counter() + duration_s)
        with self._lock:
            self._entries[request_id] = entry
        return entry

    def get(self, request_id: str) -> Retained | None:
        with self._lock:
            return self._entries.get(request_id)

    def pop(self, request_id: str, why: str) -> Retained | None:
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self.released[why] += 1
                self._drop_claims(entry)
            return entry

    def _drop_claims(self, entry: Retained) -> None:
        """Released blocks are never served again, whoever holds a token (lock held)."""
        for t in entry.tokens:
            self._claims.pop(t, None)
        entry.tokens.clear()

    def verify_and_claim(self, request_id: str, hashes: list[bytes], tokens: list[int],
                         claim_s: float) -> VerifyResult:
        now = time.perf_counter()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return VerifyResult(0, 0.0, "unknown")
            if entry.expiry <= now and not entry.claimed(now):
                return VerifyResult(0, entry.expiry, "expired")
            matched = match_tokens(entry, hashes, tokens, self.block_size)
            token = b""
            if matched > 0:
                entry.claimed_until = max(entry.claimed_until, now + claim_s)
                entry.expiry = max(entry.expiry, entry.claimed_until)
                token = secrets.token_bytes(TOKEN_BYTES)
                nblocks = -(-matched // self.block_size)
                self._claims[token] = Claim(request_id, tuple(entry.block_ids[:nblocks]),
                                            now + claim_s)
                entry.tokens.append(token)
                if len(entry.tokens) > MAX_CLAIMS_PER_ENTRY:
                    self._claims.pop(entry.tokens.pop(0), None)
            return VerifyResult(matched, entry.expiry, "" if matched else "mismatch", token)

    def authorize_read(self, token: bytes, block_ids: tuple[int, ...]) -> str | None:
        """None if `token` is a live claim whose blocks contain `block_ids` as one run in the
        claim's order (what a reader READs: its blocks past its own prefix hit); else why not.
        Called by the transport's server threads."""
        now = time.perf_counter()
        with self._lock:
            claim = self._claims.get(bytes(token))
            why = None
            if claim is None or claim.request_id not in self._entries:
                why = "no such claim"
            elif claim.until <= now:
                why = "claim expired"
            elif block_ids:
                ids = claim.block_ids
                try:
                    k = ids.index(block_ids[0])
                except ValueError:
                    k = -1
                if k < 0 or ids[k : k + len(block_ids)] != tuple(block_ids):
                    why = "blocks outside the claim"
            if why is not None:
                self.refused_reads += 1
            return why

    def heartbeat(self, request_ids: list[str], extend_s: float) -> int:
        """Renew leases (not TTLs) to at least now + extend_s; returns how many were known."""
        now, n = time.perf_counter(), 0
        with self._lock:
            for rid in request_ids:
                entry = self._entries.get(rid)
                if entry is not None:
                    n += 1
                    if entry.kind == "lease":
                        entry.expiry = max(entry.expiry, now + extend_s)
        return n

    def pop_expired(self) -> list[Retained]:
        now = time.perf_counter()
        with self._lock:
            gone = [e for e in self._entries.values() if e.expiry <= now and not e.claimed(now)]
            for e in gone:
                del self._entries[e.request_id]
                self.released["expired"] += 1
                self._drop_claims(e)
        return gone

    def pop_oldest_unclaimed(self) -> Retained | None:
        now = time.perf_counter()
        with self._lock:
            for e in self._entries.values():
                if not e.claimed(now):
                    del self._entries[e.request_id]
                    self.released["pressure"] += 1
                    self._drop_claims(e)
                    return e
        return None

    def pop_all(self) -> list[Retained]:
        with self._lock:
            gone = list(self._entries.values())
            self._entries.clear()
            self._claims.clear()
        return gone

    def refs(self) -> dict[int, int]:
        """Block -> references held by retained entries (for integrity checks)."""
        out: dict[int, int] = {}
        with self._lock:
            for e in self._entries.values():
                for b in e.block_ids:
                    out[b] = out.get(b, 0) + 1
        return out

    def stats(self) -> dict:
        with self._lock:
            kinds = [e.kind for e in self._entries.values()]
            blocks = sum(len(e.block_ids) for e in self._entries.values())
        return {"entries": len(kinds), "leases": kinds.count("lease"),
                "ttl": kinds.count("ttl"), "blocks": blocks, "released": dict(self.released),
                "refused_reads": self.refused_reads}
