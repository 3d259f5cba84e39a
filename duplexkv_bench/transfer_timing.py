"""What both KV READ benchmarks time (transfer.py on one host, transfer_hosts.py across two):
the `bench` model's KV block, one READ through a transport, and the same bytes over a plain
socket (its server side included)."""

from __future__ import annotations

import socket
import time

from duplexkv.kv.transport import XferState

BLOCK = (8, 2, 16, 2, 64)  # the bench model: layers, k/v, tokens per block, kv heads, head dim
BLOCK_TOKENS = 16
CLAIM = b"bench-claim-0000"  # the one claim a holder exposes its whole pool to


def raw_server(sock: socket.socket, mv: memoryview) -> None:
    """Answer each 8-byte length request with that many bytes of `mv`."""
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while (req := conn.recv(8)) and len(req) == 8:
                conn.sendall(mv[: int.from_bytes(req, "big")])


def timed_read(t, peer: str, local: list[int], remote: list[int], grant: bytes = b"") -> float:
    t0 = time.perf_counter()
    h = t.read(peer, local, remote, b"done", grant=grant)
    while t.poll(h) is XferState.PENDING:
        pass
    dt = time.perf_counter() - t0
    if h.state is not XferState.DONE:
        raise RuntimeError(f"{t.name} READ failed: {h.error}")
    t.release(h)
    return dt


def timed_raw(sock: socket.socket, view: memoryview) -> float:
    t0 = time.perf_counter()
    sock.sendall(len(view).to_bytes(8, "big"))
    pos = 0
    while pos < len(view):
        pos += sock.recv_into(view[pos:])
    return time.perf_counter() - t0
