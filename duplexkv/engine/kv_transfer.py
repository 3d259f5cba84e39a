"""The engine's side of KV transfer: the connector contract, and the engine as a connector sees it.

`KVTransferParams` (the typed `kv_transfer_params`) is part of the wire vocabulary
(duplexkv/wire/kv_params.py); the engine carries it from the HTTP edge down to the connector.

`KVConnectorBase` is everything the engine knows about KV transfer; the engine calls it at these
points and nowhere else (docs/architecture.md, "The connector contract"):

    add_request   wants_remote_kv(seq, params)  True -> the engine parks seq (local prefix hit
                                                applied) and calls start_pull(seq)
    every step    poll() -> [KVLanded | PullDeclined | LoadFailed]   the engine resumes or fails
                                                the named requests
    finish        on_finish(seq, reason) -> KVTransferParams | None  (blocks the connector keeps
                                                for another worker, handed back to the client)
    abort         on_abort(seq)
    no room       reclaim(need_blocks) -> blocks released from what the connector holds
    integrity     extra_refs() -> {block id: references the connector holds}

`NoKVConnector` is the single-node engine: it wants nothing and holds nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duplexkv.wire.kv_params import KVTransferParams

if TYPE_CHECKING:
    from duplexkv.engine.sequence import Sequence

# --- the connector contract ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVLanded:
    """Remote KV for the request's first `num_computed_tokens` tokens is in its blocks."""
    request_id: str
    num_computed_tokens: int
    pulled_tokens: int  # of those, read from the holder (the rest were a local prefix hit)
    transfer_bytes: int
    transfer_ms: float
    first_token_id: int | None = None  # the holder's greedy next token, to emit as is


@dataclass(frozen=True, slots=True)
class PullDeclined:
    """No remote KV (threshold, mismatch, expired, a failed transfer under policy recompute...):
    the request continues from its local prefix hit."""
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The KV could not be loaded and the policy says fail: the request ends with an error."""
    request_id: str
    reason: str
    message: str


ConnectorEvent = KVLanded | PullDeclined | LoadFailed


class KVConnectorBase(ABC):
    """What the engine asks of a KV-transfer layer. Every method runs on the engine thread."""

    @abstractmethod
    def wants_remote_kv(self, seq: Sequence, params: KVTransferParams) -> bool:
        """A request arrived with `params`. Remember what the holder side needs at finish;
        True when KV should be pulled for it (the engine then parks `seq` with its local prefix
        hit applied and calls `start_pull`)."""

    @abstractmethod
    def start_pull(self, seq: Sequence) -> None:
        """Begin pulling for a parked `seq` (network work happens off the engine thread); the
        outcome arrives later as exactly one event from `poll` naming its request id."""

    @abstractmethod
    def poll(self) -> list[ConnectorEvent]:
        """Events since the last call; also releases what expired or was read. Never blocks."""

    @abstractmethod
    def poll_timeout(self) -> float | None:
        """How long the engine may sleep when idle before polling again (None: until work)."""

    @abstractmethod
    def on_finish(self, seq: Sequence, reason: str) -> KVTransferParams | None:
        """`seq` finished (stop/length/...) and its blocks are about to be freed. Return params
        describing blocks the connector keeps (it pins them first) for the client to hand on."""

    @abstractmethod
    def on_abort(self, seq: Sequence) -> None:
        """`seq` was aborted or failed; forget it (a READ still landing keeps its blocks)."""

    @abstractmethod
    def reclaim(self, need_blocks: int) -> int:
        """Live work needs `need_blocks` free blocks: release held blocks; return entries
        released."""

    @abstractmethod
    def extra_refs(self) -> dict[int, int]:
        """Block id -> references the connector holds (for the pool's integrity check)."""


class NoKVConnector(KVConnectorBase):
    """The single-node engine: no remote KV, nothing held."""

    def wants_remote_kv(self, seq: Sequence, params: KVTransferParams) -> bool:
        return False

    def start_pull(self, seq: Sequence) -> None:
        raise AssertionError("NoKVConnector never pulls")

    def poll(self) -> list[ConnectorEvent]:
        return []

    def poll_timeout(self) -> float | None:
        return None

    def on_finish(self, seq: Sequence, reason: str) -> KVTransferParams | None:
        return None

    def on_abort(self, seq: Sequence) -> None:
        pass

    def reclaim(self, need_blocks: int) -> int:
        return 0

    def extra_refs(self) -> dict[int, int]:
        return {}
