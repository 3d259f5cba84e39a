"""Blocks a node keeps for another node to READ: P's prefill under a lease, D's finished turn
under a renewable lease capped by a TTL. Shared between the engine thread (creates and releases
entries, owns the block references), the side-channel thread (verifies, claims, renews) and the
HTTP thread (the router's renewals and release notices), hence the lock.

    kind    created when                    renewed by               released by
    lease   P leg finished (prefill done)   heartbeats, claim        reader's done-notif, expiry
    ttl     D leg finished (stop/length)    the router (its          reader's done-notif, expiry
            for `decoder_kv_lease_duration` conversation is active), (lease or cap), deletion,
            capped at `decoder_kv_blocks_ttl` claim                  memory pressure (by value)
Every release of a "ttl" entry is logged with a generation number (`released_since`): the router
learns from it which entries D has dropped and stops handing them out. Under memory pressure the
entry with the lowest value goes first (eviction.py), never one under a live claim.

Longer than 300 lines: entries, claims, renewals and the release log change together under one
lock (a release drops its claims and logs it atomically); splitting the table would split it.
A claim (a reader verified the blocks and is about to READ them) protects an entry from expiry
and from early release until the claim lapses. Each claim carries a random capability token
(returned by verify): the TCP transport serves a READ only under a live claim's token, and only
blocks of that claim in its order (`authorize_read`, called from the transport's threads); a
transport whose READs never reach the holder (NIXL) instead makes only the claim's blocks
readable while the claim lives (`Grants.expose` / `withdraw`: the grant bytes go back with the
verify reply). The reader's `done:` / `skip:` notification must carry its claim's token too:
a peer without a claim on an entry cannot release it (`release_claimed`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from duplexkv.engine.block_manager import hash_token_blocks
from duplexkv.kv import eviction


@dataclass(slots=True)
class Retained:
    request_id: str  # the remote_request_id a reader names
    block_ids: list[int]
    token_ids: list[int]  # tokens whose KV the blocks hold, in order
    hashes: list[bytes]  # chained hashes of the full blocks
    kind: str  # "lease" | "ttl"
    expiry: float  # time.perf_counter() deadline (the lease; renewals move it, up to `cap`)
    claimed_until: float = 0.0
    tokens: list[bytes] = field(default_factory=list)  # its live claims' capability tokens
    created: float = 0.0
    cap: float = float("inf")  # no renewal goes past this ("ttl": created + the TTL)
    renewed_at: float = 0.0  # last renewal by the router (0: never)
    deleted: bool = False  # its conversation was deleted: released at the next engine poll
    rhythm: eviction.Rhythm = field(default_factory=eviction.Rhythm)

    def claimed(self, now: float) -> bool:
        return self.claimed_until > now


class VerifyResult(NamedTuple):
    matched_tokens: int  # leading tokens whose KV the holder has for the reader's prompt
    expiry: float  # holder clock
    reason: str  # "" or why nothing matched ("unknown", "expired")
    token: bytes = b""  # the claim's capability for the READ (when matched_tokens > 0)
    grant: bytes = b""  # what the transport needs to READ the claim's blocks (NIXL metadata)


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str
    block_ids: tuple[int, ...]  # the entry's blocks covering the matched tokens, in order
    until: float


class Grants(Protocol):
    """The transport's side of a claim (`KVTransport.expose` / `withdraw`)."""

    def expose(self, token: bytes, block_ids: tuple[int, ...]) -> bytes: ...

    def withdraw(self, token: bytes) -> None: ...


class Released(NamedTuple):
    generation: int  # the table's generation after these releases
    request_ids: list[str]  # "ttl" entries released after the asked-for generation
    reset: bool  # the log no longer reaches back that far: some releases are missing


TOKEN_BYTES = 16
MAX_CLAIMS_PER_ENTRY = 8
RELEASE_LOG = 8192  # release notices kept for the router's polls


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
    def __init__(self, block_size: int, seed: bytes, clock=time.perf_counter,
                 lease_s: float = 60.0) -> None:
        self.block_size = block_size
        self.seed = seed
        self.clock = clock
        self.lease_s = lease_s  # a "ttl" entry's renewable lease
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Retained] = OrderedDict()  # oldest first
        self._claims: dict[bytes, Claim] = {}  # capability token -> claim
        self.grants: Grants | None = None  # set by the connector: the transport's exposure
        self.refused_reads = 0
        self.refused_notifs = 0
        self.released = {"read": 0, "notified": 0, "expired": 0, "capped": 0, "pressure": 0,
                         "deleted": 0, "abort": 0,
                         "local": 0}  # local: its D reused it for the next turn itself
        self.renewals = 0  # "ttl" leases renewed by the router
        self.linked = 0  # "ttl" entries recognised as a later turn of a conversation seen before
        self.generation = 0
        self._log: deque[tuple[int, str]] = deque(maxlen=RELEASE_LOG)
        self.lineage = eviction.Lineage()
        self.population = eviction.Population()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, block_ids: list[int], token_ids: list[int], kind: str,
            duration_s: float, cap_s: float | None = None) -> Retained:
        """Hold for `duration_s`; renewals (kind "ttl") never past `cap_s` from now."""
        hashes = hash_token_blocks(self.seed, token_ids, self.block_size)
        now = self.clock()
        cap = now + cap_s if cap_s is not None else float("inf")
        entry = Retained(request_id, list(block_ids), list(token_ids), hashes, kind,
                         min(now + duration_s, cap), created=now, cap=cap)
        with self._lock:
            if kind == "ttl":
                r = self.lineage.find(hashes)
                if r is not None:  # a later turn of a conversation D has seen
                    self.linked += 1
                    gap = max(now - r.last_created, 0.0)
                    r.observe(gap)
                    self.population.observe_gap(gap)
                else:
                    r = eviction.Rhythm()
                r.last_created = now
                entry.rhythm = r
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
        self._drop_claims(entry)
        if entry.kind != "ttl":
            return
        self.generation += 1
        self._log.append((self.generation, entry.request_id))
        if why in ("expired", "capped", "deleted"):
            self.population.ended += 1
        if why != "deleted" and entry.hashes:  # its conversation's next turn may still come
            self.lineage.released(entry.hashes[-1], entry.rhythm)

    def _drop_claims(self, entry: Retained) -> None:
        """Released blocks are never served again, whoever holds a token (lock held)."""
        for t in entry.tokens:
            self._drop_claim(t)
        entry.tokens.clear()

    def _drop_claim(self, token: bytes) -> None:
        """Forget one claim and withdraw what its transport exposed (lock held)."""
        if self._claims.pop(token, None) is not None and self.grants is not None:
            self.grants.withdraw(token)

    def verify_and_claim(self, request_id: str, hashes: list[bytes], tokens: list[int],
                         claim_s: float) -> VerifyResult:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return VerifyResult(0, 0.0, "unknown")
            if (entry.expiry <= now or entry.deleted) and not entry.claimed(now):
                return VerifyResult(0, entry.expiry, "expired")
            matched = match_tokens(entry, hashes, tokens, self.block_size)
            token, grant = b"", b""
            if matched > 0:
                token = secrets.token_bytes(TOKEN_BYTES)
                nblocks = -(-matched // self.block_size)
                blocks = tuple(entry.block_ids[:nblocks])
                if self.grants is not None:  # may raise: then no claim, the reader recomputes
                    grant = self.grants.expose(token, blocks)
                entry.claimed_until = max(entry.claimed_until, now + claim_s)
                entry.expiry = max(entry.expiry, entry.claimed_until)
                self._claims[token] = Claim(request_id, blocks, now + claim_s)
                entry.tokens.append(token)
                if len(entry.tokens) > MAX_CLAIMS_PER_ENTRY:
                    self._drop_claim(entry.tokens.pop(0))
            return VerifyResult(matched, entry.expiry, "" if matched else "mismatch", token,
                                grant)

    def authorize_read(self, token: bytes, block_ids: tuple[int, ...]) -> str | None:
        """None if `token` is a live claim whose blocks contain `block_ids` as one run in the
        claim's order (what a reader READs: its blocks past its own prefix hit); else why not.
        Called by the transport's server threads."""
        now = self.clock()
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

    def release_claimed(self, request_id: str, token: bytes, why: str) -> Retained | None:
        """A reader's `done:` / `skip:` for `request_id` under its claim's `token`: end that
        claim; release the entry (return it) unless another reader's claim on it still lives,
        in which case it goes when that claim ends. A notification without a claim on this
        entry changes nothing (counted in `refused_notifs`)."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(request_id)
            claim = self._claims.get(bytes(token))
            if entry is None or claim is None or claim.request_id != request_id:
                self.refused_notifs += 1
                return None
            entry.tokens.remove(bytes(token))
            self._drop_claim(bytes(token))
            others = [c.until for t in entry.tokens if (c := self._claims.get(t)) is not None
                      and c.until > now]
            if others:  # not ours alone: expire as soon as the other claims are over
                entry.claimed_until, entry.expiry = max(others), now
                return None
            del self._entries[request_id]
            self._gone(entry, why)
            return entry

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
            oldest = self._log[0][0] if self._log else self.generation + 1
            ids = [rid for g, rid in self._log if g > generation]
            return Released(self.generation, ids, 0 <= generation < oldest - 1)

    def pop_expired(self) -> list[Retained]:
        """Entries past their lease (or deleted), unless a claim protects them; also ends lapsed
        claims."""
        now = self.clock()
        with self._lock:
            for e in self._entries.values():  # lapsed claims end (a READ cannot still run
                lapsed = [t for t in e.tokens  # under them: a claim outlasts the read timeout)
                          if (c := self._claims.get(t)) is None or c.until <= now]
                for t in lapsed:
                    e.tokens.remove(t)
                    self._drop_claim(t)
            gone = [e for e in self._entries.values()
                    if (e.expiry <= now or e.deleted) and not e.claimed(now)]
            for e in gone:
                del self._entries[e.request_id]
                why = ("deleted" if e.deleted else "capped" if e.renewed_at and e.expiry >= e.cap
                       else "expired")
                self._gone(e, why)
        return gone

    def value(self, e: Retained, now: float) -> float:
        """What keeping `e` is worth per block-second (eviction.py; lock held)."""
        renewed = e.renewed_at > 0 and now - e.renewed_at < self.lease_s
        return eviction.value(tokens=len(e.token_ids), blocks=len(e.block_ids),
                              created=e.created, expiry=e.expiry, cap=e.cap, renewed=renewed,
                              deleted=e.deleted, rhythm=e.rhythm, pop=self.population, now=now)

    def pop_for_pressure(self, policy: str = "value") -> Retained | None:
        return self.pop_lowest_value() if policy == "value" else self.pop_oldest_unclaimed()

    def pop_lowest_value(self) -> Retained | None:
        """Under memory pressure: the unclaimed entry worth least (P's leases are never chosen
        while a "ttl" entry is left: a P lease is a request's prefill that D is about to READ)."""
        now = self.clock()
        with self._lock:
            best, best_key = None, None
            for e in self._entries.values():
                if e.claimed(now):
                    continue
                key = (e.kind != "ttl", self.value(e, now) if e.kind == "ttl" else 0.0)
                if best_key is None or key < best_key:
                    best, best_key = e, key
            if best is not None:
                del self._entries[best.request_id]
                self._gone(best, "pressure")
            return best

    def pop_oldest_unclaimed(self) -> Retained | None:
        """The policy before eviction by value (`decoder_kv_eviction: "oldest"`, the retention
        benchmark's baseline)."""
        now = self.clock()
        with self._lock:
            for e in self._entries.values():
                if not e.claimed(now):
                    del self._entries[e.request_id]
                    self._gone(e, "pressure")
                    return e
        return None

    def pop_all(self) -> list[Retained]:
        with self._lock:
            gone = list(self._entries.values())
            for e in gone:
                self._drop_claims(e)
            self._entries.clear()
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
            claims = len(self._claims)
        return {"entries": len(kinds), "leases": kinds.count("lease"),
                "ttl": kinds.count("ttl"), "blocks": blocks, "released": dict(self.released),
                "refused_reads": self.refused_reads, "refused_notifs": self.refused_notifs,
                "claims": claims, "renewals": self.renewals,
                "generation": self.generation, "linked": self.linked,
                "continuation": round(self.population.continuation, 3)}
