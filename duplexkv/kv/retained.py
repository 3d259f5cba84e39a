"""A retained entry: blocks a worker keeps for another worker to READ, and how a reader's
prompt is matched against them.

An entry holds the KV of `token_ids` in `block_ids`, with the chained hashes of its full blocks.
Its `expiry` is a lease that renewals move (never past `cap`); a live claim (`claimed_until`)
protects it from expiry and early release; `rhythm` is its conversation's pace (eviction.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

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
    seed_tag: bytes = b""  # its request's cache_salt's tag (b"": none): readers must present it
    misses: int = 0  # verifies that matched less than the whole entry (retention.py)

    def claimed(self, now: float) -> bool:
        return self.claimed_until > now

    def gone(self, now: float) -> bool:
        """Past its lease (or deleted) and no claim protects it."""
        return (self.expiry <= now or self.deleted) and not self.claimed(now)


class VerifyResult(NamedTuple):
    matched_tokens: int  # leading tokens whose KV the holder has for the reader's prompt
    expiry: float  # holder clock
    reason: str  # "" or why nothing matched ("unknown", "expired")
    token: bytes = b""  # the claim's capability for the READ (when matched_tokens > 0)
    grant: bytes = b""  # what the transport needs to READ the claim's blocks (NIXL metadata)


def answer(entry: Retained, hashes: list[bytes], tokens: list[int], tag: bytes, block_size: int,
           max_misses: int) -> int:
    """A verify's matched count as told to the peer: nothing for another seed tag (another
    cache_salt), else `revealed`; a verify that matched less than the whole entry is a miss,
    and after `max_misses` the entry is marked deleted (no more guesses: released at the next
    engine poll, or when the claims already made on it end)."""
    matched = 0
    if tag == entry.seed_tag:
        matched = revealed(entry, match_tokens(entry, hashes, tokens, block_size), block_size)
    if matched < len(entry.token_ids):
        entry.misses += 1
        if entry.misses >= max_misses:
            entry.deleted = True
    return matched


def revealed(entry: Retained, matched: int, block_size: int) -> int:
    """What a verify may tell a peer: the whole entry, or whole blocks of it. A count inside a
    block would let a peer guess a turn one token at a time (docs/security.md)."""
    return matched if matched >= len(entry.token_ids) else matched - matched % block_size


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
