"""Claims: a reader's right to READ the blocks it verified, for a while.

A verify that matches makes a claim: a random capability token (returned to the reader) naming
the entry's blocks that cover the matched tokens, until the READ's timeout has passed. While it
lives the entry is neither expired nor released early. The TCP transport serves a READ only
under a live claim's token, and only blocks of that claim in its order (`why_not`, called from
the transport's threads); a transport whose READs never reach the holder (NIXL) instead makes
only the claim's blocks readable while the claim lives (`Grants.expose` / `withdraw`: the grant
bytes go back with the verify reply). The reader's `done:` / `skip:` must carry its claim's
token too: a peer without a claim on an entry cannot release it.

Every method runs under the retention table's lock (retention.py), which also guards the
entries these claims name.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from duplexkv.kv.retained import Retained

TOKEN_BYTES = 16
MAX_CLAIMS_PER_ENTRY = 8


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str
    block_ids: tuple[int, ...]  # the entry's blocks covering the matched tokens, in order
    until: float


class Grants(Protocol):
    """The transport's side of a claim (`KVTransport.expose` / `withdraw`)."""

    def expose(self, token: bytes, block_ids: tuple[int, ...]) -> bytes: ...

    def withdraw(self, token: bytes) -> None: ...


class Claims:
    def __init__(self, grants: Grants | None = None) -> None:
        self._by_token: dict[bytes, Claim] = {}  # capability token -> claim
        self.grants = grants  # the transport's exposure (None: a bare table)
        self.refused_reads = 0

    def __len__(self) -> int:
        return len(self._by_token)

    def make(self, entry: Retained, matched: int, block_size: int, now: float,
             claim_s: float) -> tuple[bytes, bytes]:
        """Claim the blocks of `entry` that cover `matched` tokens for `claim_s`; -> (token,
        grant). Raises when the transport cannot expose them: then there is no claim."""
        token = secrets.token_bytes(TOKEN_BYTES)
        blocks = tuple(entry.block_ids[: -(-matched // block_size)])
        grant = self.grants.expose(token, blocks) if self.grants is not None else b""
        entry.claimed_until = max(entry.claimed_until, now + claim_s)
        entry.expiry = max(entry.expiry, entry.claimed_until)
        self._by_token[token] = Claim(entry.request_id, blocks, now + claim_s)
        entry.tokens.append(token)
        if len(entry.tokens) > MAX_CLAIMS_PER_ENTRY:
            self._drop(entry.tokens.pop(0))
        return token, grant

    def why_not(self, token: bytes, block_ids: tuple[int, ...],
                entries: Mapping[str, Retained], now: float) -> str | None:
        """None if `token` is a live claim on a held entry whose blocks contain `block_ids` as
        one run in the claim's order; else why not (counted in `refused_reads`)."""
        claim = self._by_token.get(bytes(token))
        why = None
        if claim is None or claim.request_id not in entries:
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

    def on(self, token: bytes, request_id: str) -> bool:
        """Is `token` a claim on the entry `request_id`?"""
        claim = self._by_token.get(bytes(token))
        return claim is not None and claim.request_id == request_id

    def end(self, entry: Retained, token: bytes, now: float) -> float | None:
        """End the claim `token` on `entry`; -> until when the entry's other live claims last
        (None: no other live claim)."""
        entry.tokens.remove(bytes(token))
        self._drop(bytes(token))
        others = [c.until for t in entry.tokens if (c := self._by_token.get(t)) is not None
                  and c.until > now]
        return max(others) if others else None

    def lapse(self, entry: Retained, now: float) -> None:
        """End the entry's claims that ran out (a READ cannot still run under them: a claim
        outlasts the read timeout)."""
        lapsed = [t for t in entry.tokens
                  if (c := self._by_token.get(t)) is None or c.until <= now]
        for t in lapsed:
            entry.tokens.remove(t)
            self._drop(t)

    def drop_all(self, entry: Retained) -> None:
        """Released blocks are never served again, whoever holds a token."""
        for t in entry.tokens:
            self._drop(t)
        entry.tokens.clear()

    def _drop(self, token: bytes) -> None:
        """Forget one claim and withdraw what its transport exposed."""
        if self._by_token.pop(token, None) is not None and self.grants is not None:
            self.grants.withdraw(token)
