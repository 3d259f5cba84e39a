"""Blocks a node keeps for another node to READ: P's prefill under a lease, D's finished turn
under a renewable lease capped by a TTL. Shared between the engine thread (creates and releases
entries, owns the block references), the side-channel thread (verifies, claims, renews) and the
HTTP thread (the router's renewals and release notices), hence the lock.

    kind    created when                    renewed by               released by
    lease   P leg finished (prefill done)   heartbeats, claim        reader's done-notif, expiry
    ttl     D leg finished (stop/length)    the router (its          reader's done-notif, expiry
            for `decoder_kv_lease_duration` conversation is active), (lease or cap), deletion,
            capped at `decoder_kv_blocks_ttl` claim                  memory pressure (by value)

The table owns the entries (retained.py) and the one lock; under it a release drops the entry's
claims (claims.py: capability tokens, the transport's grants), logs the release for the router
(release_log.py) and tells the conversations' model what happened (eviction.py), atomically.
Under memory pressure the entry with the lowest value goes first (eviction.py), never one under
a live claim. A reader's `done:` / `skip:` releases an entry only under its own claim's token
(`release_claimed`).

A verify is no oracle (docs/security.md): it must present the entry's seed tag (its request's
cache_salt), it learns whole blocks or the whole entry (`retained.revealed`), and an entry
answers at most `MAX_MISSES` verifies that matched less than all of it; after that it is gone
("unknown") and released at the next engine poll.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from duplexkv.engine.block_manager import hash_token_blocks, salt_tag, salted
from duplexkv.kv import eviction
from duplexkv.kv.claims import Claims, Grants
from duplexkv.kv.release_log import Released, ReleaseLog
from duplexkv.kv.retained import Retained, VerifyResult, answer

MAX_MISSES = 4  # partial verifies an entry answers (a reader verifies once per pull)


class RetentionTable:
    def __init__(self, block_size: int, seed: bytes, clock=time.perf_counter,
                 lease_s: float = 60.0, grants: Grants | None = None) -> None:
        self.block_size = block_size
        self.seed = seed
        self.clock = clock
        self.lease_s = lease_s  # a "ttl" entry's renewable lease
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Retained] = OrderedDict()  # oldest first
        self._claims = Claims(grants)  # grants: the transport's exposure of a claim's blocks
        self.refused_notifs = 0
        self.released = {"read": 0, "notified": 0, "expired": 0, "capped": 0, "pressure": 0,
                         "deleted": 0, "abort": 0,
                         "local": 0}  # local: its D reused it for the next turn itself
        self.renewals = 0  # "ttl" leases renewed by the router
        self._log = ReleaseLog()
        self._conversations = eviction.Conversations(lease_s)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, block_ids: list[int], token_ids: list[int], kind: str,
            duration_s: float, cap_s: float | None = None, salt: str | None = None) -> Retained:
        """Hold for `duration_s`; renewals (kind "ttl") never past `cap_s` from now. `salt`: the
        request's cache_salt (a reader must hash with the same)."""
        hashes = hash_token_blocks(salted(self.seed, salt), token_ids, self.block_size)
        now = self.clock()
        cap = now + cap_s if cap_s is not None else float("inf")
        entry = Retained(request_id, list(block_ids), list(token_ids), hashes, kind,
                         min(now + duration_s, cap), created=now, cap=cap,
                         seed_tag=salt_tag(self.seed, salt))
        with self._lock:
            if kind == "ttl":
                entry.rhythm = self._conversations.turn(hashes, now)
            self._entries[request_id] = entry
        return entry

    def get(self, request_id: str) -> Retained | None:
        with self._lock:
            return self._entries.get(request_id)

    def pop(self, request_id: str, why: str) -> Retained | None:
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self._gone(entry, why)
            return entry

    def _gone(self, entry: Retained, why: str) -> None:
        """Bookkeeping of a release (lock held): counters, claims, the release log, and what
        the entry's fate says about its conversation (eviction.py)."""
        self.released[why] += 1
        self._claims.drop_all(entry)
        if entry.kind == "ttl":
            self._log.add(entry.request_id)
            self._conversations.released(entry, why)

    def verify_and_claim(self, request_id: str, hashes: list[bytes], tokens: list[int],
                         claim_s: float, tag: bytes = b"") -> VerifyResult:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.misses >= MAX_MISSES:
                return VerifyResult(0, 0.0, "unknown")
            if entry.gone(now):
                return VerifyResult(0, entry.expiry, "expired")
            matched = answer(entry, hashes, tokens, tag, self.block_size, MAX_MISSES)
            token, grant = b"", b""
            if matched > 0:  # may raise (the transport's exposure): then no claim
                token, grant = self._claims.make(entry, matched, self.block_size, now, claim_s)
            return VerifyResult(matched, entry.expiry, "" if matched else "mismatch", token,
                                grant)

    def authorize_read(self, token: bytes, block_ids: tuple[int, ...]) -> str | None:
        """None if `token` is a live claim whose blocks contain `block_ids` as one run in the
        claim's order (what a reader READs: its blocks past its own prefix hit); else why not.
        Called by the transport's server threads."""
        now = self.clock()
        with self._lock:
            return self._claims.why_not(token, block_ids, self._entries, now)

    def release_claimed(self, request_id: str, token: bytes, why: str) -> Retained | None:
        """A reader's `done:` / `skip:` for `request_id` under its claim's `token`: end that
        claim; release the entry (return it) unless another reader's claim on it still lives,
        in which case it goes when that claim ends. A notification without a claim on this
        entry changes nothing (counted in `refused_notifs`)."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or not self._claims.on(token, request_id):
                self.refused_notifs += 1
                return None
            others_until = self._claims.end(entry, token, now)
            if others_until is not None:  # not ours alone: expire once the others are over
                entry.claimed_until, entry.expiry = others_until, now
                return None
            del self._entries[request_id]
            self._gone(entry, why)
            return entry

    def refuse_notif(self) -> None:
        """A notification that names no claim at all (not `done:` / `skip:` with a token)."""
        with self._lock:
            self.refused_notifs += 1

    def heartbeat(self, request_ids: list[str], extend_s: float) -> int:
        """Renew leases (not TTLs) to at least now + extend_s; returns how many were known."""
        now, n = self.clock(), 0
        with self._lock:
            for rid in request_ids:
                entry = self._entries.get(rid)
                if entry is not None:
                    n += 1
                    if entry.kind == "lease":
                        entry.expiry = max(entry.expiry, now + extend_s)
        return n

    def renew(self, request_ids: list[str]) -> tuple[dict[str, float], list[str]]:
        """The router's renewal of "ttl" leases: each to now + the lease, never past its cap.
        -> (held id -> seconds until its (new) expiry, ids not held)."""
        now = self.clock()
        held: dict[str, float] = {}
        unknown: list[str] = []
        with self._lock:
            for rid in request_ids:
                entry = self._entries.get(rid)
                if entry is None or entry.kind != "ttl" or entry.deleted \
                        or (entry.expiry <= now and not entry.claimed(now)):
                    unknown.append(rid)
                    continue
                entry.expiry = max(entry.expiry, min(now + self.lease_s, entry.cap))
                entry.renewed_at = now
                self.renewals += 1
                held[rid] = entry.expiry - now
        return held, unknown

    def mark_deleted(self, request_ids: list[str]) -> list[str]:
        """Conversations that are over: their "ttl" entries go at the next engine poll (no new
        claim from now on; a READ already claimed completes). -> the ids that were held."""
        found = []
        with self._lock:
            for rid in request_ids:
                entry = self._entries.get(rid)
                if entry is not None and entry.kind == "ttl":
                    entry.deleted = True
                    found.append(rid)
        return found

    def released_since(self, generation: int) -> Released:
        with self._lock:
            return self._log.since(generation)

    def pop_expired(self) -> list[Retained]:
        """Entries past their lease (or deleted), unless a claim protects them; also ends lapsed
        claims."""
        now = self.clock()
        with self._lock:
            for e in self._entries.values():
                self._claims.lapse(e, now)
            gone = [e for e in self._entries.values() if e.gone(now)]
            for e in gone:
                del self._entries[e.request_id]
                why = ("deleted" if e.deleted else "capped" if e.renewed_at and e.expiry >= e.cap
                       else "expired")
                self._gone(e, why)
        return gone

    def pop_for_pressure(self, policy: str = "value") -> Retained | None:
        """Under memory pressure: release the unclaimed entry worth least ("value"), or the
        oldest unclaimed one ("oldest"); eviction.py chooses."""
        now = self.clock()
        with self._lock:
            e = self._conversations.victim(self._entries.values(), now, policy)
            if e is not None:
                del self._entries[e.request_id]
                self._gone(e, "pressure")
            return e

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
            claims = len(self._claims)
            c = self._conversations
            return {"entries": len(kinds), "leases": kinds.count("lease"),
                    "ttl": kinds.count("ttl"), "blocks": blocks, "released": dict(self.released),
                    "refused_reads": self._claims.refused_reads,
                    "refused_notifs": self.refused_notifs, "claims": claims,
                    "renewals": self.renewals, "generation": self._log.generation,
                    "linked": c.linked, "continuation": round(c.population.continuation, 3)}
