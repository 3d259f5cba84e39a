"""The built-in KV transport: plain TCP sockets, standard library only, works across hosts.

Holder: `BlockServer` (tcp_server.py) listens on host:port (0 = any free port) and answers READ
requests with the requested blocks, sent with sendmsg straight from the pool's memory; it queues
the reader's notification once the bytes are handed to the kernel (the blocks may be freed).
Reader: one `_PeerLink` per peer owns a cached connection and a thread that receives with
recv_into straight into the local blocks (contiguous runs coalesced), so `read` returns at once
and `poll` only looks at the result. Reads to one peer are served in order on its connection.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from duplexkv.kv.transport import meta, tcp_wire as w
from duplexkv.kv.transport.base import (DEFAULT_TIMEOUT_S, KVTransport, PoolLayout,
                                        TransferStats, XferHandle, XferState, check_block_ids,
                                        runs)
from duplexkv.kv.transport.tcp_server import BlockServer

log = logging.getLogger(__name__)
_SLICE_S = 0.25  # socket timeout granularity: deadlines are checked at least this often
_FORCE_FAIL_S = 2.0  # a job still running this long after its deadline is failed regardless


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class _Job:
    handle: XferHandle | None  # None for a notification
    notif: bytes
    xfer_id: int = 0
    cancelled: bool = False
    result: tuple[XferState, str | None] | None = None  # set by the link thread, last
    done: threading.Event = field(default_factory=threading.Event)


class _PeerLink:
    """Reader side of one peer: a lazily (re)opened connection and the thread that uses it."""

    def __init__(self, me: str, peer: str, header: dict, local_mv: memoryview,
                 block_bytes: int) -> None:
        self.me, self.peer, self.header = me, peer, header
        self.addr = (header["host"], int(header["port"]))
        self.local_mv, self.bb = local_mv, block_bytes
        self.sock: socket.socket | None = None
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.ids = itertools.count(1)
        self.current: _Job | None = None
        self.notif_errors = 0
        self.closing = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"kv-tcp-{peer}")
        self.thread.start()

    def submit(self, job: _Job) -> None:
        job.xfer_id = next(self.ids)
        self.jobs.put(job)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.current = job
            try:
                if self.closing:
                    job.result = (XferState.FAILED, f"disconnected from {self.peer!r}")
                elif job.handle is None:
                    self._notify(job)
                else:
                    job.result = self._read(job)
            finally:
                self.current = None
                job.done.set()
        self._drop()

    def _connect(self, deadline: float) -> socket.socket:
        if self.sock is None:
            s = socket.create_connection(self.addr, timeout=max(0.01, deadline - time.monotonic()))
            try:
                w.tune(s)
                hello = json.dumps({"from": self.me, "to": self.peer}).encode()
                s.sendall(w.HELLO_HDR.pack(w.HELLO, len(hello)) + hello)
                status, n = w.HELLO_HDR.unpack(w.recv_exact(s, w.HELLO_HDR.size))
                text = w.recv_exact(s, n).decode(errors="replace")
                if status != w.OK:
                    raise ConnectionError(f"{self.addr[0]}:{self.addr[1]} refused us: {text}")
            except BaseException:
                s.close()
                raise
            s.settimeout(_SLICE_S)
            self.sock = s
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _read(self, job: _Job) -> tuple[XferState, str | None]:
        h = job.handle
        assert h is not None
        if job.cancelled:
            return XferState.FAILED, "cancelled before it started"
        if time.monotonic() > h.deadline:
            return XferState.FAILED, f"READ from {self.peer!r} timed out in the queue"

        def check() -> None:
            if job.cancelled:
                raise _Cancelled()
            if time.monotonic() > h.deadline:
                raise TimeoutError(f"READ from {self.peer!r} timed out")

        try:
            check()
            s = self._connect(h.deadline)
            n = len(h.remote_block_ids)
            req = w.READ_HDR.pack(w.READ, job.xfer_id, n, len(job.notif))
            w.sendmsg_all(s, [req, _pack_ids(h.remote_block_ids), job.notif])
            reply = bytearray(w.READ_REPLY.size)
            _recv_into(s, memoryview(reply), check)
            status, xfer_id, length = w.READ_REPLY.unpack(reply)
            if status != w.OK:
                text = bytearray(length)
                _recv_into(s, memoryview(text), check)
                return XferState.FAILED, f"{self.peer!r} refused the READ: {text.decode()}"
            if xfer_id != job.xfer_id or length != n * self.bb:
                raise ConnectionError(f"protocol error: reply for READ {xfer_id} with {length} "
                                      f"bytes, expected READ {job.xfer_id} with {n * self.bb}")
            mv, bb = self.local_mv, self.bb
            for first, count in runs(h.local_block_ids):
                _recv_into(s, mv[first * bb : (first + count) * bb], check)
            return XferState.DONE, None
        except _Cancelled:
            self._drop()  # the stream is mid-message: start over on the next job
            return XferState.FAILED, "cancelled"
        except (OSError, ValueError) as e:
            self._drop()
            why = "timed out" if isinstance(e, TimeoutError) else f"failed: {e}"
            return XferState.FAILED, f"READ of {len(h.remote_block_ids)} blocks from " \
                                     f"{self.peer!r} at {self.addr[0]}:{self.addr[1]} {why}"

    def _notify(self, job: _Job) -> None:
        for attempt in (0, 1):  # a cached connection may have died since: reconnect once
            try:
                s = self._connect(time.monotonic() + 5.0)
                w.sendmsg_all(s, [w.NOTIF_HDR.pack(w.NOTIF, len(job.notif)), job.notif])
                return
            except OSError as e:
                self._drop()
                if attempt:
                    self.notif_errors += 1
                    log.warning("notification to %s failed: %s", self.peer, e)

    def abort(self) -> None:
        """Unblock the thread's socket call (used when a job overstays its deadline)."""
        s = self.sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closing = True
        self.jobs.put(None)
        cur = self.current
        if cur is not None:
            cur.cancelled = True
        self.abort()
        self.thread.join(timeout=_FORCE_FAIL_S)


def _pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f">{len(ids)}I", *ids)


def _recv_into(s: socket.socket, view: memoryview, check) -> None:
    pos, n = 0, len(view)
    while pos < n:
        check()
        try:
            got = s.recv_into(view[pos:])
        except TimeoutError:
            continue  # a socket slice elapsed: re-check the deadline
        if not got:
            raise w.PeerClosed("connection closed by peer")
        pos += got


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
        self._links: dict[str, _PeerLink] = {}
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
        self._links[peer] = _PeerLink(self.engine_id, peer, header, self._mv, layout.block_bytes)
        self._peer_meta[peer] = bytes(peer_metadata)

    def _link(self, peer: str) -> _PeerLink:
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
        h.impl = job = _Job(h, bytes(notif))
        link.submit(job)
        return h

    def poll(self, handle: XferHandle) -> XferState:
        if handle.state is not XferState.PENDING:
            return handle.state
        job = handle.impl
        assert isinstance(job, _Job)
        if job.result is not None:
            handle._finish(*job.result)
            self.stats.finished(handle)
        elif time.monotonic() > handle.deadline + _SLICE_S:
            job.cancelled = True
            link = self._links.get(handle.peer)
            if link is not None and link.current is job:
                link.abort()
            if job.done.wait(0.05) and job.result is not None:
                handle._finish(*job.result)
            elif time.monotonic() > handle.deadline + _FORCE_FAIL_S:
                handle._finish(XferState.FAILED, f"READ from {handle.peer!r} timed out and did "
                               "not stop: local blocks may still be written")
            if handle.state is not XferState.PENDING:
                self.stats.finished(handle)
        return handle.state

    def release(self, handle: XferHandle) -> None:
        job = handle.impl
        if isinstance(job, _Job) and job.result is None:
            job.cancelled = True  # a queued job is skipped, a running one stops at its next chunk

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._link(peer).submit(_Job(None, bytes(msg)))
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
