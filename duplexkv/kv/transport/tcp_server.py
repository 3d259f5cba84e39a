"""Holder side of the TCP transport: a listener thread and one thread per reader connection."""

from __future__ import annotations

import collections
import json
import logging
import socket
import struct
import threading

from duplexkv.kv.transport import tcp_wire as w
from duplexkv.kv.transport.base import PoolLayout, runs

log = logging.getLogger(__name__)


class BlockServer:
    """Serves READs of `pool_mv` (the registered pool) and queues notifications."""

    def __init__(self, engine_id: str, host: str, port: int, layout: PoolLayout,
                 pool_mv: memoryview) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.pool_mv = pool_mv
        self.notifs: collections.deque[tuple[str, bytes]] = collections.deque()
        self.served = {"reads": 0, "bytes": 0, "errors": 0, "connections": 0}
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = self.sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kv-tcp-listen-{self.port}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                break
            w.tune(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    break
                self._conns.add(conn)
                self.served["connections"] += 1
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"kv-tcp-serve-{addr[1]}").start()

    def _serve(self, conn: socket.socket, addr) -> None:
        f = conn.makefile("rb", buffering=1 << 16)
        try:
            peer = self._hello(conn, f)
            if peer is None:
                return
            while not self._closed:
                kind = f.read(1)
                if not kind:
                    return  # reader closed the connection
                if kind[0] == w.READ:
                    self._read(conn, f, peer)
                elif kind[0] == w.NOTIF:
                    (n,) = struct.unpack(">I", w.read_file_exact(f, 4))
                    if n > w.MAX_NOTIF:
                        raise ValueError(f"notification of {n} bytes")
                    self.notifs.append((peer, w.read_file_exact(f, n)))
                else:
                    raise ValueError(f"unknown message type {kind[0]}")
        except (OSError, ValueError) as e:
            if not self._closed:
                log.info("KV transfer connection from %s ended: %s", addr, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            f.close()
            conn.close()

    def _hello(self, conn: socket.socket, f) -> str | None:
        kind, n = w.HELLO_HDR.unpack(w.read_file_exact(f, w.HELLO_HDR.size))
        hello = json.loads(w.read_file_exact(f, n)) if kind == w.HELLO else {}
        if kind != w.HELLO or hello.get("to") != self.engine_id:
            text = f"this is engine {self.engine_id!r}, not {hello.get('to')!r}".encode()
            conn.sendall(w.HELLO_HDR.pack(w.ERR, len(text)) + text)
            return None
        conn.sendall(w.HELLO_HDR.pack(w.OK, 0))
        return str(hello.get("from", "?"))

    def _read(self, conn: socket.socket, f, peer: str) -> None:
        xfer_id, n, notif_len = struct.unpack(">QII", w.read_file_exact(f, w.READ_HDR.size - 1))
        if n > 16 * self.layout.num_blocks + 1024 or notif_len > w.MAX_NOTIF:
            raise ValueError(f"oversized READ request ({n} blocks, {notif_len}-byte notif)")
        ids = struct.unpack(f">{n}I", w.read_file_exact(f, 4 * n))
        notif = w.read_file_exact(f, notif_len)
        bad = [b for b in ids if b >= self.layout.num_blocks]
        if bad:
            text = f"block ids out of range [0, {self.layout.num_blocks}): {bad[:8]}".encode()
            conn.sendall(w.READ_REPLY.pack(w.ERR, xfer_id, len(text)) + text)
            self.served["errors"] += 1
            return
        bb = self.layout.block_bytes
        bufs: list = [w.READ_REPLY.pack(w.OK, xfer_id, n * bb)]
        mv = self.pool_mv
        bufs += [mv[first * bb : (first + count) * bb] for first, count in runs(ids)]
        w.sendmsg_all(conn, bufs)
        # the bytes are in the kernel now: the blocks may be freed
        self.served["reads"] += 1
        self.served["bytes"] += n * bb
        self.notifs.append((peer, notif))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)
