"""The KV transport interface: one-sided READs of whole KV blocks between worker processes.

A transfer is a pull: the reader READs remote block ids into its own block ids (layout.py: block
`b` is a fixed byte range of the registered pool), then the holder receives a notification
(opaque bytes) so that it can free the blocks. `KVTransport` is the contract callers use and
the bookkeeping both implementations share (registration, peers, handles, deadlines, counters,
health); each implementation writes only the hooks (hooks.py). Implementations: `nixl` (NIXL /
UCX) and `tcp` (standard library sockets). `duplexkv.kv.transport.make_transport(kind, **kw)`
picks one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from duplexkv.kv.transport import meta
from duplexkv.kv.transport.handle import TransferStats, XferHandle, XferState
from duplexkv.kv.transport.hooks import ConnT, Peer, TransportHooks
from duplexkv.kv.transport.layout import PoolLayout, check_block_ids

DEFAULT_TIMEOUT_S = 10.0
NIXL_INSTALL_HINT = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
log = logging.getLogger(__name__)


class KVTransport(TransportHooks[ConnT]):
    """Moves whole KV blocks between workers by one-sided READs, with completion notifications.

    Threading: call every method from one thread (the worker's loop). Implementations may use
    internal threads; they never call back into the caller. Nothing here blocks for long: `read`
    returns at once (NIXL over CMA may copy inside `read`/`poll`, on the caller's thread; there is
    no DMA engine on a CPU), `poll` and `get_notifs` never wait.

    The public methods below keep the bookkeeping every transport shares (the registered pool,
    the peer table, block-id checks, handles and their deadlines, counters, the `health()`
    shape) and call the hooks (hooks.py) for what a transport does differently. Handles are
    finished (`_complete`) only on the caller's thread, so the counters need no lock.
    """

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.engine_id = engine_id
        self.timeout_s = float(timeout_s)
        self.stats = TransferStats()
        self.warnings: list[str] = []
        self.layout: PoolLayout | None = None
        self._pool: torch.Tensor | None = None
        self._peers: dict[str, Peer[ConnT]] = {}
        self._closed = False
        #: holder side: `(token, remote block ids) -> None | why refused`, called from the
        #: transport's server threads before a READ is served. None serves any block in range
        #: (bare transports in tests); the connector always sets the holder's claim check.
        #: NIXL cannot call it (one-sided reads never reach the holder's code): there the
        #: claim itself decides what is readable (`expose` / `withdraw`).
        self.read_authorizer = None

    def register(self, pool: torch.Tensor) -> None:
        """Register this worker's KV pool. Call exactly once, before `metadata`.

        `pool` is a contiguous CPU tensor whose first dimension is the block index (any dtype);
        the transport keeps a reference and reads/writes its memory in place for its lifetime.
        """
        if self.layout is not None:
            raise RuntimeError("register() may be called only once")
        layout = PoolLayout.of(pool)
        self._register_impl(pool, layout)
        self.layout, self._pool = layout, pool

    def metadata(self) -> bytes:
        """Everything a peer needs to `connect` to us (opaque; carried by the side channel)."""
        layout = self._need_registered()
        header, blob = self._metadata_impl(layout)
        return meta.pack({"kind": self.name, "engine_id": self.engine_id,
                          "num_blocks": layout.num_blocks, "block_bytes": layout.block_bytes,
                          **header, **meta.host_identity()}, blob)

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        """Prepare to read from `peer` (the remote engine id) using its `metadata()`.

        Idempotent: connecting again with the same metadata does nothing; new metadata for a
        known peer (it restarted) replaces the old connection. Raises ValueError if the
        metadata is not for `peer` or its block size differs from ours.
        """
        layout = self._need_registered()
        md = bytes(peer_metadata)
        old = self._peers.get(peer)
        if old is not None and old.metadata == md:
            return
        header, blob = meta.unpack(md)
        meta.check_peer(header, self.name, peer, layout.block_bytes)
        self.disconnect(peer)
        self._peers[peer] = Peer(md, header, self._connect_impl(peer, header, blob, layout))

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
             notif: bytes, token: bytes = b"", grant: bytes = b"") -> XferHandle:
        """Start READing remote blocks into local blocks; return at once.

        `remote_block_ids[i]` lands in `local_block_ids[i]`. After the data has landed the
        holder gets `notif` from `get_notifs()` (sender = our engine id); if the read fails the
        holder gets nothing and relies on its own lease/TTL. ValueError if the lists differ in
        length, an id is out of range, or local ids repeat; RuntimeError if `peer` is not
        connected. An empty read moves nothing, still notifies, and is DONE at once.
        `token` is the capability the holder's verify returned (TCP sends it with the READ);
        `grant` is what the holder's `expose` returned for that claim (NIXL needs it).
        """
        layout = self._need_registered()
        p = self._peer(peer)
        loc, rem = check_block_ids(local_block_ids, remote_block_ids, layout.num_blocks,
                                   int(p.header["num_blocks"]))
        now = time.monotonic()
        h = XferHandle(peer, loc, rem, len(loc) * layout.block_bytes, now + self.timeout_s, now,
                       token=bytes(token), grant=bytes(grant))
        self.stats.reads += 1
        if not loc:
            self.send_notif(peer, notif)
            self._complete(h, XferState.DONE)
        else:
            self._start_read(h, p.conn, bytes(notif))
        return h

    def poll(self, handle: XferHandle) -> XferState:
        """PENDING, DONE or FAILED (then `handle.error` says why). Never blocks.

        A read that has not finished `timeout_s` after it started is FAILED (a dead or stuck
        peer never hangs the caller). Once FAILED is returned, no more data is written into the
        local blocks unless `handle.error` says cancelling failed.
        """
        if handle.state is not XferState.PENDING:
            return handle.state
        self._poll_impl(handle)
        if (handle.state is XferState.PENDING
                and time.monotonic() > handle.deadline + self.overdue_grace_s):
            self._poll_overdue(handle)
        return handle.state

    def release(self, handle: XferHandle) -> None:
        """Free the handle's resources. Releasing a PENDING read cancels it (best effort)."""
        self._release_impl(handle)

    def expose(self, token: bytes, block_ids: tuple[int, ...]) -> bytes:
        """Holder side, when a claim is made: make `block_ids` readable under `token` and return
        what the reader needs for that (its `grant`). Called on the side-channel thread;
        thread-safe. The TCP transport checks every READ itself (`read_authorizer`) and
        returns b""; NIXL registers just these blocks and returns their partial metadata."""
        return b""

    def withdraw(self, token: bytes) -> None:
        """Holder side, when a claim ends (done, skip, release, lapse): undo `expose`.
        Unknown tokens are ignored. Thread-safe."""

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send `msg` to a connected peer without moving data (e.g. the reader declined).

        Ordered after earlier reads to the same peer. Best effort: if the peer is gone the
        failure is logged and counted in `health()`, not raised (it has nothing left to free).
        RuntimeError if `peer` is not connected.
        """
        p = self._peer(peer)
        self.stats.notifs_sent += 1
        self._send_notif_impl(peer, p.conn, bytes(msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender engine id, msg). Never blocks."""
        out = self._get_notifs_impl()
        self.stats.notifs_received += len(out)
        return out

    def disconnect(self, peer: str) -> None:
        """Forget `peer`; unknown peers are ignored. Reads in flight to it fail."""
        p = self._peers.pop(peer, None)
        if p is not None:
            self._disconnect_impl(peer, p.conn)

    def close(self) -> None:
        """Disconnect everything, stop threads, unregister the pool. Idempotent."""
        if self._closed:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        self._close_impl()
        self._closed = True

    def health(self) -> dict:
        """JSON-serialisable state: transport details, counters, `warnings` (list of str)."""
        return {
            "transport": self.name, "engine_id": self.engine_id, "closed": self._closed,
            "timeout_s": self.timeout_s, **self._health_impl(),
            "peers": {name: self._peer_health(p) for name, p in self._peers.items()},
            **self.stats.as_dict(), "warnings": self.warnings + self._live_warnings(),
        }

    # Shared helpers for the implementations.

    def _need_registered(self) -> PoolLayout:
        if self.layout is None or self._closed:
            raise RuntimeError("the transport is closed or has no registered pool")
        return self.layout

    def _peer(self, peer: str) -> Peer[ConnT]:
        self._need_registered()
        p = self._peers.get(peer)
        if p is None:
            raise RuntimeError(f"not connected to peer {peer!r}; call connect() first")
        return p

    def _connection(self, peer: str) -> ConnT | None:
        """`peer`'s transport state, or None when it is not (or no longer) connected."""
        p = self._peers.get(peer)
        return None if p is None else p.conn

    def _connections(self) -> list[ConnT]:
        return [p.conn for p in self._peers.values()]

    def _complete(self, h: XferHandle, state: XferState, error: str | None = None) -> None:
        """Mark a PENDING handle DONE or FAILED and count it (once); caller's thread only."""
        if h.state is XferState.PENDING:
            h.state, h.error, h.finished = state, error, time.monotonic()
            self.stats.finished(h)

    def _warn(self, msg: str) -> None:
        """A lasting warning for `health()`, logged once."""
        if msg not in self.warnings:
            self.warnings.append(msg)
            log.warning("%s", msg)
