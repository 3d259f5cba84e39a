"""Holder side of the TCP transport: a listener thread and one thread per reader connection,
bounded: at most `max_connections` at once and `max_per_peer` from one address (more are
closed at once), a HELLO must be authenticated within `hello_timeout_s`, and a connection that
sends nothing (or reads nothing of a reply) for `idle_timeout_s` is closed. A READ is served
only under the capability token of a live claim (`read_authorizer`), at most the claim's blocks,
straight from the pool's memory: the holder buffers nothing per READ beyond the kernel's socket
buffer."""

from __future__ import annotations

import collections
import hmac
import json
import logging
import os
import socket
import struct
import threading

from duplexkv.kv.transport import tcp_wire as w
from duplexkv.kv.transport.layout import PoolLayout, runs

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 64
MAX_PER_PEER = 16
HELLO_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 120.0
REFUSED = b"refused"


class BlockServer:
    """Serves READs of `pool_mv` (the registered pool) and queues notifications."""

    def __init__(self, engine_id: str, host: str, port: int, layout: PoolLayout,
                 pool_mv: memoryview, auth, authorizer=None,
                 max_connections: int = MAX_CONNECTIONS, max_per_peer: int = MAX_PER_PEER,
                 hello_timeout_s: float = HELLO_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.engine_id = engine_id
        self.auth = auth  # kv.auth.KVAuth: the HELLO's key
        self.authorizer = authorizer  # a callable returning the transport's read_authorizer
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.hello_timeout_s, self.idle_timeout_s = hello_timeout_s, idle_timeout_s
        self._per_peer: collections.Counter[str] = collections.Counter()
        self.layout = layout
        self.pool_mv = pool_mv
        self.notifs: collections.deque[tuple[str, bytes]] = collections.deque()
        self.served = {"reads": 0, "bytes": 0, "errors": 0, "connections": 0,
                       "refused_connections": 0, "refused_hellos": 0, "refused_reads": 0}
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
                if len(self._conns) >= self.max_connections \
                        or self._per_peer[addr[0]] >= self.max_per_peer:
                    self.served["refused_connections"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self._per_peer[addr[0]] += 1
                self.served["connections"] += 1
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"kv-tcp-serve-{addr[1]}").start()

    def _serve(self, conn: socket.socket, addr) -> None:
        f = conn.makefile("rb", buffering=1 << 16)
        try:
            conn.settimeout(self.hello_timeout_s)
            peer = self._hello(conn, f)
            if peer is None:
                self.served["refused_hellos"] += 1
                return
            conn.settimeout(self.idle_timeout_s)
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
                self._per_peer[addr[0]] -= 1
                if self._per_peer[addr[0]] <= 0:
                    del self._per_peer[addr[0]]
            f.close()
            conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        conn.sendall(w.HELLO_HDR.pack(w.ERR, len(REFUSED)) + REFUSED)

    def _hello(self, conn: socket.socket, f) -> str | None:
        """The challenge-response of tcp_wire.py. Our MAC binds our engine id, so a reader that
        named another engine fails its own check; a peer without the key learns nothing (not
        even our id) and gets a bare "refused"."""
        kind, n = w.HELLO_HDR.unpack(w.read_file_exact(f, w.HELLO_HDR.size))
        if kind != w.HELLO or n > w.MAX_HELLO:
            self._refuse(conn)
            return None
        try:
            hello = json.loads(w.read_file_exact(f, n))
            cn = bytes.fromhex(hello["nonce"])
            peer = str(hello["from"])[:256]
            if len(cn) != w.NONCE_BYTES:
                raise ValueError("nonce length")
        except (ValueError, KeyError, TypeError):
            self._refuse(conn)
            return None
        sn = os.urandom(w.NONCE_BYTES)
        mac = self.auth.hello_mac(b"holder", cn, sn, self.engine_id.encode())
        body = json.dumps({"nonce": sn.hex(), "mac": mac.hex()}).encode()
        conn.sendall(w.HELLO_HDR.pack(w.OK, len(body)) + body)
        kind, n = w.HELLO_HDR.unpack(w.read_file_exact(f, w.HELLO_HDR.size))
        theirs = w.read_file_exact(f, n) if kind == w.AUTH and n <= w.MAX_HELLO else b""
        want = self.auth.hello_mac(b"reader", cn, sn, peer.encode(), self.engine_id.encode())
        if not hmac.compare_digest(theirs, want):
            self._refuse(conn)
            return None
        conn.sendall(w.HELLO_HDR.pack(w.OK, 0))
        return peer

    def _read(self, conn: socket.socket, f, peer: str) -> None:
        xfer_id, n, notif_len, token = struct.unpack(">QII16s",
                                                     w.read_file_exact(f, w.READ_HDR.size - 1))
        if n > self.layout.num_blocks or notif_len > w.MAX_NOTIF:
            raise ValueError(f"oversized READ request ({n} blocks, {notif_len}-byte notif)")
        ids = struct.unpack(f">{n}I", w.read_file_exact(f, 4 * n))
        notif = w.read_file_exact(f, notif_len)
        bad = [b for b in ids if b >= self.layout.num_blocks]
        if bad:
            text = f"block ids out of range [0, {self.layout.num_blocks}): {bad[:8]}".encode()
            conn.sendall(w.READ_REPLY.pack(w.ERR, xfer_id, len(text)) + text)
            self.served["errors"] += 1
            return
        authorize = self.authorizer() if self.authorizer is not None else None
        why = authorize(token, ids) if authorize is not None else None
        if why is not None:
            text = f"READ refused: {why}".encode()
            conn.sendall(w.READ_REPLY.pack(w.ERR, xfer_id, len(text)) + text)
            self.served["refused_reads"] += 1
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
