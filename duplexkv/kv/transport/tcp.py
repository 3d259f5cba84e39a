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

import torch

from duplexkv.kv.transport import tcp_wire as w
from duplexkv.kv.transport.base import DEFAULT_TIMEOUT_S, KVTransport
from duplexkv.kv.transport.handle import XferHandle, XferState
from duplexkv.kv.transport.hooks import Peer
from duplexkv.kv.transport.layout import PoolLayout
from duplexkv.kv.transport.tcp_client import FORCE_FAIL_S, SLICE_S, STALL_S, Job, PeerLink
from duplexkv.kv.transport.tcp_server import BlockServer

log = logging.getLogger(__name__)


class TcpTransport(KVTransport[PeerLink]):
    """TCP transport. `host`/`port`: where the block server listens (port 0 = any free port);
    `advertise_host`: the address peers should dial (default: `host`, or the machine's name when
    listening on a wildcard address); `stall_s`: a READ that moved no byte this long fails
    (tcp_client.py)."""

    overdue_grace_s = SLICE_S  # the link thread fails its own timeouts; step in only if it hangs

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 auth=None, stall_s: float = STALL_S, **limits) -> None:
        super().__init__(engine_id, timeout_s)
        self.stall_s = float(stall_s)
        from duplexkv.kv.auth import KVAuth

        self.auth = auth if auth is not None else KVAuth(None)
        self.limits = limits  # BlockServer's max_connections, max_per_peer, timeouts
        self.bind_host, self.bind_port, self.advertise_host = host, port, advertise_host
        self._mv: memoryview | None = None
        self._server: BlockServer | None = None

    @property
    def name(self) -> str:
        return "tcp"

    def _register_impl(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        mv = w.pool_view(pool)
        self._server = BlockServer(self.engine_id, self.bind_host, self.bind_port, layout, mv,
                                   self.auth, lambda: self.read_authorizer, **self.limits)
        self._mv = mv

    def _metadata_impl(self, layout: PoolLayout) -> tuple[dict, bytes]:
        server = self._server
        assert server is not None
        host = self.advertise_host or server.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return {"host": host, "port": server.port}, b""

    def _connect_impl(self, peer: str, header: dict, blob: bytes,
                      layout: PoolLayout) -> PeerLink:
        assert self._mv is not None
        return PeerLink(self.engine_id, peer, header, self._mv, layout.block_bytes, self.auth,
                        self.stall_s)

    def _start_read(self, h: XferHandle, conn: PeerLink, notif: bytes) -> None:
        h.impl = job = Job(h, notif)
        conn.submit(job)

    def _poll_impl(self, h: XferHandle) -> None:
        job = h.impl
        assert isinstance(job, Job)
        if job.result is None:
            time.sleep(0)  # let the link thread take the GIL if it waits for it (busy pollers)
        if job.result is not None:
            self._complete(h, *job.result)

    def _poll_overdue(self, h: XferHandle) -> None:
        job = h.impl
        assert isinstance(job, Job)
        job.cancelled = True
        link = self._connection(h.peer)
        if link is not None and link.current is job:
            link.abort()
        if job.done.wait(0.05) and job.result is not None:
            self._complete(h, *job.result)
        elif time.monotonic() > h.deadline + FORCE_FAIL_S:
            self._complete(h, XferState.FAILED, f"READ from {h.peer!r} timed out and did not "
                           "stop: local blocks may still be written")

    def _release_impl(self, h: XferHandle) -> None:
        job = h.impl
        if isinstance(job, Job) and job.result is None:
            job.cancelled = True  # a queued job is skipped, a running one stops at its next chunk

    def _send_notif_impl(self, peer: str, conn: PeerLink, msg: bytes) -> None:
        conn.submit(Job(None, msg))  # the link thread logs and counts a failed delivery

    def _get_notifs_impl(self) -> list[tuple[str, bytes]]:
        if self._server is None:
            return []
        out = []
        q = self._server.notifs
        while q:
            out.append(q.popleft())
        return out

    def _disconnect_impl(self, peer: str, conn: PeerLink) -> None:
        conn.close()  # cancels the running read and fails the queued ones

    def _close_impl(self) -> None:
        if self._server is not None:
            self._server.close()

    def _health_impl(self) -> dict:
        s = self._server
        return {"listen": f"{s.host}:{s.port}" if s else None, "stall_s": self.stall_s,
                "served": dict(s.served) if s else {}}

    def _peer_health(self, p: Peer[PeerLink]) -> dict:
        link = p.conn
        return {"addr": f"{link.addr[0]}:{link.addr[1]}", "connected": link.sock is not None}

    def _live_warnings(self) -> list[str]:
        notif_errors = sum(link.notif_errors for link in self._connections())
        return [f"{notif_errors} notifications could not be delivered"] if notif_errors else []
