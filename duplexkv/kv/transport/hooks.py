"""What a transport implements: the hooks `KVTransport`'s shared methods call, and the peer
table's entry that carries a transport's own per-peer state.

`KVTransport` (base.py) is what callers use: it checks arguments, keeps the peer table, handles,
deadlines, counters and the `health()` shape. For what differs it calls the hooks below; an
implementation (nixl.py, tcp.py) subclasses `KVTransport` and writes only these. A hook runs on
the caller's thread unless it says otherwise, and finishes handles through `_complete`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from duplexkv.kv.transport.handle import XferHandle
from duplexkv.kv.transport.layout import PoolLayout

ConnT = TypeVar("ConnT")


@dataclass(slots=True)
class Peer(Generic[ConnT]):
    """One connected peer: the metadata it was connected with and the transport's own state."""

    metadata: bytes
    header: dict
    conn: ConnT  # NIXL: prepared remote descriptors; TCP: the PeerLink


class TransportHooks(ABC, Generic[ConnT]):
    """The part of a transport that each implementation writes its own way."""

    #: `poll` calls `_poll_overdue` once a read is still PENDING this long after its deadline
    overdue_grace_s: float = 0.0

    @property
    @abstractmethod
    def name(self) -> str:
        """Short transport name: "nixl" or "tcp"."""

    @abstractmethod
    def _register_impl(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        """Make the pool readable by peers (called once, before `layout` is set)."""

    @abstractmethod
    def _metadata_impl(self, layout: PoolLayout) -> tuple[dict, bytes]:
        """Transport-specific header fields and opaque blob for `metadata()`."""

    @abstractmethod
    def _connect_impl(self, peer: str, header: dict, blob: bytes, layout: PoolLayout) -> ConnT:
        """Connect to a peer whose metadata passed the common checks (any old one is gone)."""

    @abstractmethod
    def _start_read(self, h: XferHandle, conn: ConnT, notif: bytes) -> None:
        """Start a non-empty READ; `_complete` it now if it finished or could not start."""

    @abstractmethod
    def _poll_impl(self, h: XferHandle) -> None:
        """Look at a PENDING read once and `_complete` it if it finished. Never blocks."""

    @abstractmethod
    def _poll_overdue(self, h: XferHandle) -> None:
        """The read is still PENDING `overdue_grace_s` after its deadline: cancel or fail it."""

    @abstractmethod
    def _release_impl(self, h: XferHandle) -> None:
        """Free `h.impl`; cancel the read if it is still PENDING."""

    @abstractmethod
    def _send_notif_impl(self, peer: str, conn: ConnT, msg: bytes) -> None:
        """Queue a notification to a connected peer; log (never raise) if it is gone."""

    @abstractmethod
    def _get_notifs_impl(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call."""

    @abstractmethod
    def _disconnect_impl(self, peer: str, conn: ConnT) -> None:
        """Tear down a peer already removed from the peer table; its reads in flight fail."""

    @abstractmethod
    def _close_impl(self) -> None:
        """After every peer is disconnected: stop threads, unregister the pool."""

    @abstractmethod
    def _health_impl(self) -> dict:
        """Transport details for `health()`, between the common fields and `peers`."""

    @abstractmethod
    def _peer_health(self, p: Peer[ConnT]) -> dict:
        """One peer's entry in `health()["peers"]`."""

    def _live_warnings(self) -> list[str]:
        """Warnings computed at `health()` time, after the lasting ones (`_warn`)."""
        return []
