"""The TCP transport's wire format and zero-copy socket helpers (standard library only).

One connection per (reader, holder) pair, opened by the reader; messages from the reader:
    HELLO  ">BH"  type=1, json length        + {"from": reader id, "to": holder id,
                                                "nonce": 32 hex digits (cn)}
           reply ">BH" status, json length   + {"nonce": 32 hex digits (sn), "mac": hex of
                                                HMAC(k, "holder" | cn | sn | holder id)}
                                                (status 0), or the text "refused" (status 1)
    AUTH   ">BH"  type=4, 32                 + HMAC(k, "reader" | cn | sn | reader id |
                                                holder id)
           reply ">BH" status, text length   + text (status 0 = ok; 1 = "refused")
    READ   ">BQII16s" type=2, xfer id, n, notif length, capability token + n x u32 remote
           block ids + notif
           reply ">BQQ" status, xfer id, payload length + payload: the n blocks in request
           order (status 0), or an error text (status 1)
    NOTIF  ">BI"  type=3, length             + msg (no reply)
k is the hello key derived from the cluster secret (kv/auth.py); each side checks the other's
MAC before it goes on, so neither learns anything from a peer without the secret, and the
holder's refusal never names its engine id. Nothing but HELLO and AUTH is accepted before the
AUTH succeeded. The capability token is the one the holder's verify returned (section 2): the
holder serves only blocks of that live claim, in the claim's order, at most the claim's count.
The holder sends block data with sendmsg over memoryviews of its pool (no copy in user space)
and the reader receives with recvmsg_into straight into its own blocks.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

import torch

HELLO, READ, NOTIF, AUTH = 1, 2, 3, 4
OK, ERR = 0, 1
HELLO_HDR = struct.Struct(">BH")
READ_HDR = struct.Struct(">BQII16s")
TOKEN_BYTES = 16
NONCE_BYTES = 16
MAX_HELLO = 4096
READ_REPLY = struct.Struct(">BQQ")
NOTIF_HDR = struct.Struct(">BI")
MAX_NOTIF = 1 << 20
try:
    IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (ValueError, OSError):
    IOV_MAX = 1024


class PeerClosed(ConnectionError):
    pass


def pool_view(pool: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    nbytes = pool.numel() * pool.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(pool.data_ptr())).cast("B")


def tune(sock: socket.socket) -> None:
    """No Nagle delay for the small request/notification messages. Buffer sizes are left to
    the kernel's autotuning (setting SO_SNDBUF/SO_RCVBUF disables it, which hurts on long fat
    links and measured no better on loopback)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_time_slices(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose send/recv calls give up after `seconds` (kernel timeouts), so one
    call can wait for a whole message (MSG_WAITALL) without holding the GIL or busy-polling,
    and the caller still gets control back regularly to check deadlines and cancellation."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Consume n bytes from bufs[i:]; return the index of the first unfinished buffer."""
    while n:
        size = len(bufs[i])
        if n >= size:
            n -= size
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i


def sendmsg_all(sock: socket.socket, bufs: list, check=None, moved=None) -> None:
    """Send every buffer, in order, in as few sendmsg calls as IOV_MAX allows. `check()` runs
    before each call (at least once a time slice); `moved(n)` after each call that moved bytes."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    i = 0
    while i < len(views):
        if check is not None:
            check()
        try:
            sent = sock.sendmsg(views[i : i + IOV_MAX])
        except (BlockingIOError, InterruptedError):
            continue  # a time slice elapsed
        if moved is not None and sent:
            moved(sent)
        i = _advance(views, i, sent)


def recvmsg_all(sock: socket.socket, bufs: list[memoryview], check=None, moved=None) -> None:
    """Fill every buffer, in order: one recvmsg(MSG_WAITALL) per IOV_MAX buffers when the
    data keeps coming, so a whole read costs a few system calls and GIL hand-offs."""
    views = [b for b in bufs if len(b)]
    i = 0
    while i < len(views):
        if check is not None:
            check()
        try:
            got = sock.recvmsg_into(views[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, InterruptedError):
            continue  # a time slice elapsed
        if not got:
            raise PeerClosed("connection closed by peer")
        if moved is not None:
            moved(got)
        i = _advance(views, i, got)


def recv_exact(sock: socket.socket, n: int, check=None, moved=None) -> bytes:
    buf = bytearray(n)
    recvmsg_all(sock, [memoryview(buf)], check, moved)
    return bytes(buf)


def read_file_exact(f, n: int) -> bytes:
    """Read exactly n bytes from a buffered socket file, or raise PeerClosed."""
    data = f.read(n)
    if data is None or len(data) != n:
        raise PeerClosed("connection closed by peer")
    return data
