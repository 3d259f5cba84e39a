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

`EngineHost` is the other direction: everything a connector may ask of the engine (the KV pool
and its layout, block references, room for remote KV, a decode-local prefix, the cost model, the
sampler's bans). A connector is built on an `EngineHost`, never on the engine's internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from duplexkv.wire.kv_params import KVTransferParams

if TYPE_CHECKING:
    import torch

    from duplexkv.engine.cost_model import PrefillCostModel
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

    def structures(self) -> dict:
        """Sizes of the connector's own maps and queues, for /debug/memory (none by default)."""
        return {}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The engine's KV pool as peers must match it."""
    fingerprint: bytes  # model files + dtype + block size: the seed of the block hash chain
    block_size: int
    num_blocks: int
    block_bytes: int  # one block, all layers
    vocab_size: int


class EngineHost(Protocol):
    """What a KV connector may ask of the engine it serves, on the engine thread (its `poll`,
    its hooks), or before the engine thread starts (building the connector)."""

    def kv_layout(self) -> KVLayout:
        """The pool's layout and the model's fingerprint."""

    def kv_pool(self) -> torch.Tensor:
        """The block pool `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`, for a
        transport to register (READs land in it; a holder's blocks are read from it)."""

    def blocks_needed(self, num_tokens: int) -> int: ...

    def num_free_blocks(self) -> int: ...

    def pin(self, block_ids: Seq[int]) -> None:
        """Hold a reference on each block (kept for another worker, or a READ landing)."""

    def unpin(self, block_ids: Seq[int]) -> None: ...

    def is_private_block(self, block_id: int) -> bool:
        """Held by exactly one reference and in no prefix cache: its owner may write it."""

    def reserve_for_remote_kv(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        """Blocks for a parked `seq`'s first `num_tokens` tokens: its block table, or None."""

    def adopt_prefix(self, seq: Sequence, block_ids: list[int], num_tokens: int) -> None:
        """Start a fresh `seq` from `block_ids` holding its first `num_tokens` tokens."""

    def prefill_cost_model(self) -> PrefillCostModel:
        """The engine's prefill cost model (pull or recompute?)."""

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sampler may not pick next for `seq`."""


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
