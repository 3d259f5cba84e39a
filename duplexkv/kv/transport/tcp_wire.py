"""The TCP transport's wire format and zero-copy socket helpers (standard library only).

One connection per (reader, holder) pair, opened by the reader; messages from the reader:
    HELLO  ">BH"  type=1, json length        + {"from": reader id, "to": holder id}
           reply ">BH" status, text length   + text (status 0 = ok)
    READ   ">BQII" type=2, xfer id, n, notif length + n x u32 remote block ids + notif
           reply ">BQQ" status, xfer id, payload length + payload: the n blocks in request
           order (status 0), or an error text (status 1)
    NOTIF  ">BI"  type=3, length             + msg (no reply)
The holder sends block data with sendmsg over memoryviews of its pool (no copy in user space)
and the reader receives with recv_into straight into its own blocks.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

import torch

HELLO, READ, NOTIF = 1, 2, 3
OK, ERR = 0, 1
HELLO_HDR = struct.Struct(">BH")
READ_HDR = struct.Struct(">BQII")
READ_REPLY = struct.Struct(">BQQ")
NOTIF_HDR = struct.Struct(">BI")
MAX_NOTIF = 1 << 20
try:
    IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (ValueError, OSError):
    IOV_MAX = 1024
SOCK_BUF = 4 << 20  # socket buffer sizes (the kernel may clamp them)


class PeerClosed(ConnectionError):
    pass


def pool_view(pool: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    nbytes = pool.numel() * pool.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(pool.data_ptr())).cast("B")


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def sendmsg_all(sock: socket.socket, bufs: list) -> None:
    """Send every buffer, in order, with as few sendmsg calls as IOV_MAX allows."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i : i + IOV_MAX])
        while sent:
            n = len(bufs[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, stop=None) -> None:
    """Fill `view` from the socket; `stop()` (if given) is checked between chunks."""
    pos, n = 0, len(view)
    while pos < n:
        if stop is not None:
            stop()
        got = sock.recv_into(view[pos:])
        if not got:
            raise PeerClosed("connection closed by peer")
        pos += got


def read_file_exact(f, n: int) -> bytes:
    """Read exactly n bytes from a buffered socket file, or raise PeerClosed."""
    data = f.read(n)
    if data is None or len(data) != n:
        raise PeerClosed("connection closed by peer")
    return data
