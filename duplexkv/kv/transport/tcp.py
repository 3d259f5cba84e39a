"""The built-in KV transport: plain TCP sockets, standard library only, works across hosts.

Holder: `BlockServer` (tcp_server.py) listens on host:port (0 = any free port) and answers READ
requests with the requested blocks, sent with sendmsg straight from the pool's memory; it queues
the reader's notification once the bytes are handed to the kernel (the blocks may be freed).
Reader: one `PeerLink` per peer owns a cached connection and a thread that receives straight
into the local blocks (contiguous runs coalesced, one recvmsg_into(MSG_WAITALL) per up to
IOV_MAX runs on a blocking socket with kernel time slices: a 64 MiB read is a handful of system
calls and GIL hand-offs, whatever the caller's thread does meanwhile), so `read` returns at
once and `poll` only looks at the result. Reads to one peer are served in order.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence

import torch

from duplexkv.kv.transport import meta
from duplexkv.kv.transport import tcp_wire as w
from duplexkv.kv.transport.base import (
    DEFAULT_TIMEOUT_S,
    KVTransport,
    PoolLayout,
    TransferStats,
    XferHandle,
    XferState,
    check_block_ids,
)
from duplexkv.kv.transport.tcp_client import FORCE_FAIL_S, SLICE_S, Job, PeerLink
from duplexkv.kv.transport.tcp_server import BlockServer

log = logging.getLogger(__name__)


class TcpTransport(KVTransport):
    """TCP transport. `host`/`port`: where the block server listens (port 0 = any free port);
    `advertise_host`: the address peers should dial (default: `host`, or the machine's name when
    listening on a wildcard address)."""

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self.engine_id = engine_id
        self.timeout_s = float(timeout_s)
        self.bind_host, self.bind_port, self.advertise_host = host, port, advertise_host
        self.stats = TransferStats()
        self.layout: PoolLayout | None = None
        self._pool: torch.Tensor | None = None
        self._mv: memoryview | None = None
        self._server: BlockServer | None = None
        self._links: dict[str, PeerLink] = {}
        self._peer_meta: dict[str, bytes] = {}
        self._closed = False

    @property
    def name(self) -> str:
        return "tcp"

    def register(self, pool: torch.Tensor) -> None:
        if self.layout is not None:
            raise RuntimeError("register() may be called only once")
        self.layout = PoolLayout.of(pool)
        self._pool, self._mv = pool, w.pool_view(pool)
        self._server = BlockServer(self.engine_id, self.bind_host, self.bind_port, self.layout,
                                   self._mv)

    def _need_registered(self) -> tuple[PoolLayout, BlockServer]:
        if self.layout is None or self._server is None or self._closed:
            raise RuntimeError("the transport is closed or has no registered pool")
        return self.layout, self._server

    def metadata(self) -> bytes:
        layout, server = self._need_registered()
        host = self.advertise_host or server.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return meta.pack({"kind": "tcp", "engine_id": self.engine_id, "host": host,
                          "port": server.port, "num_blocks": layout.num_blocks,
                          "block_bytes": layout.block_bytes, **meta.host_identity()})

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        layout, _ = self._need_registered()
        if self._peer_meta.get(peer) == bytes(peer_metadata):
            return
        header, _ = meta.unpack(peer_metadata)
        meta.check_peer(header, "tcp", peer, layout.block_bytes)
        self.disconnect(peer)
        assert self._mv is not None
        self._links[peer] = PeerLink(self.engine_id, peer, header, self._mv, layout.block_bytes)
        self._peer_meta[peer] = bytes(peer_metadata)

    def _link(self, peer: str) -> PeerLink:
        self._need_registered()
        link = self._links.get(peer)
        if link is None:
            raise RuntimeError(f"not connected to peer {peer!r}; call connect() first")
        return link

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
             notif: bytes) -> XferHandle:
        layout, _ = self._need_registered()
        link = self._link(peer)
        loc, rem = check_block_ids(local_block_ids, remote_block_ids, layout.num_blocks,
                                   int(link.header["num_blocks"]))
        now = time.monotonic()
        h = XferHandle(peer, loc, rem, len(loc) * layout.block_bytes, now + self.timeout_s, now)
        self.stats.reads += 1
        if not loc:
            self.send_notif(peer, notif)
            h._finish(XferState.DONE)
            self.stats.finished(h)
            return h
        h.impl = job = Job(h, bytes(notif))
        link.submit(job)
        return h

    def poll(self, handle: XferHandle) -> XferState:
        if handle.state is not XferState.PENDING:
            return handle.state
        job = handle.impl
        assert isinstance(job, Job)
        if job.result is None:
            time.sleep(0)  # let the link thread take the GIL if it waits for it (busy pollers)
        if job.result is not None:
            handle._finish(*job.result)
            self.stats.finished(handle)
        elif time.monotonic() > handle.deadline + SLICE_S:
            job.cancelled = True
            link = self._links.get(handle.peer)
            if link is not None and link.current is job:
                link.abort()
            if job.done.wait(0.05) and job.result is not None:
                handle._finish(*job.result)
            elif time.monotonic() > handle.deadline + FORCE_FAIL_S:
                handle._finish(XferState.FAILED, f"READ from {handle.peer!r} timed out and did "
                               "not stop: local blocks may still be written")
            if handle.state is not XferState.PENDING:
                self.stats.finished(handle)
        return handle.state

    def release(self, handle: XferHandle) -> None:
        job = handle.impl
        if isinstance(job, Job) and job.result is None:
            job.cancelled = True  # a queued job is skipped, a running one stops at its next chunk

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._link(peer).submit(Job(None, bytes(msg)))
        self.stats.notifs_sent += 1

    def get_notifs(self) -> list[tuple[str, bytes]]:
        if self._server is None:
            return []
        out = []
        q = self._server.notifs
        while q:
            out.append(q.popleft())
        self.stats.notifs_received += len(out)
        return out

    def disconnect(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        self._peer_meta.pop(peer, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        if self._closed:
            return
        for peer in list(self._links):
            self.disconnect(peer)
        if self._server is not None:
            self._server.close()
        self._closed = True

    def health(self) -> dict:
        s = self._server
        warnings = []
        notif_errors = sum(link.notif_errors for link in self._links.values())
        if notif_errors:
            warnings.append(f"{notif_errors} notifications could not be delivered")
        return {
            "transport": "tcp", "engine_id": self.engine_id, "closed": self._closed,
            "listen": f"{s.host}:{s.port}" if s else None, "timeout_s": self.timeout_s,
            "served": dict(s.served) if s else {},
            "peers": {p: {"addr": f"{link.addr[0]}:{link.addr[1]}",
                          "connected": link.sock is not None} for p, link in self._links.items()},
            **self.stats.as_dict(), "warnings": warnings,
        }
