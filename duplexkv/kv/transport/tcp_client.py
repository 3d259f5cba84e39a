"""Reader side of the TCP transport: one `PeerLink` per holder, with a cached connection and
a thread that runs the peer's READs (and notifications) in order.

A READ fails at its deadline (`timeout_s`, 10 s by default) or as soon as it has moved no byte
for `stall_s` (STALL_S): a link cut or a holder that stopped mid-READ costs about a second (the
reader then recomputes), while a slow link that keeps delivering (1 Mbit/s: ~30 KB each time
slice) is never cut by it."""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from duplexkv.kv.transport import tcp_wire as w
from duplexkv.kv.transport.handle import XferHandle, XferState
from duplexkv.kv.transport.layout import runs

log = logging.getLogger(__name__)
SLICE_S = 0.25  # socket timeout granularity: deadlines are checked at least this often
FORCE_FAIL_S = 2.0  # a job still running this long after its deadline is failed regardless
STALL_S = 1.0  # a READ that moved no byte (either way) for this long has stalled: failed
REOPEN_IDLE_S = 60.0  # a kept connection idle this long is reopened (holders close at 120 s)


class _Cancelled(Exception):
    pass


class Stalled(TimeoutError):
    """No byte of a READ moved (either way) for `stall_s`."""


@dataclass(eq=False)
class Job:
    handle: XferHandle | None  # None for a notification
    notif: bytes
    xfer_id: int = 0
    cancelled: bool = False
    result: tuple[XferState, str | None] | None = None  # set by the link thread, last
    done: threading.Event = field(default_factory=threading.Event)


class PeerLink:
    """Reader side of one peer: a lazily (re)opened connection and the thread that uses it."""

    def __init__(self, me: str, peer: str, header: dict, local_mv: memoryview,
                 block_bytes: int, auth, stall_s: float = STALL_S) -> None:
        self.me, self.peer, self.header = me, peer, header
        self.stall_s = stall_s
        self.auth = auth  # kv.auth.KVAuth: the HELLO's key
        self.addr = (header["host"], int(header["port"]))
        self.local_mv, self.bb = local_mv, block_bytes
        self.sock: socket.socket | None = None
        self.last_used = 0.0  # time.monotonic() of the connection's last good exchange
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.ids = itertools.count(1)
        self.current: Job | None = None
        self.notif_errors = 0
        self.closing = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"kv-tcp-{peer}")
        self.thread.start()

    def submit(self, job: Job) -> None:
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
        if self.sock is not None and time.monotonic() - self.last_used > REOPEN_IDLE_S:
            self._drop()  # the holder has closed it or is about to: don't lose a READ to that
        if self.sock is None:
            s = socket.create_connection(self.addr, timeout=max(0.01, deadline - time.monotonic()))
            try:
                w.tune(s)
                self._hello(s)
            except BaseException:
                s.close()
                raise
            w.set_time_slices(s, SLICE_S)
            self.sock, self.last_used = s, time.monotonic()
        return self.sock

    def _hello(self, s: socket.socket) -> None:
        """Mutual challenge-response (tcp_wire.py): the holder proves the key and its engine
        id first, then we do."""
        where = f"{self.addr[0]}:{self.addr[1]}"
        cn = os.urandom(w.NONCE_BYTES)
        hello = json.dumps({"from": self.me, "to": self.peer, "nonce": cn.hex()}).encode()
        s.sendall(w.HELLO_HDR.pack(w.HELLO, len(hello)) + hello)
        status, n = w.HELLO_HDR.unpack(w.recv_exact(s, w.HELLO_HDR.size))
        if n > w.MAX_HELLO:
            raise ConnectionError(f"{where}: oversized HELLO reply")
        body = w.recv_exact(s, n)
        if status != w.OK:
            raise ConnectionError(f"{where} refused us: {body.decode(errors='replace')}")
        try:
            reply = json.loads(body)
            sn = bytes.fromhex(reply["nonce"])
            mac = bytes.fromhex(reply["mac"])
        except (ValueError, KeyError, TypeError):
            raise ConnectionError(f"{where}: malformed HELLO reply") from None
        want = self.auth.hello_mac(b"holder", cn, sn, self.peer.encode())
        if len(sn) != w.NONCE_BYTES or not hmac.compare_digest(mac, want):
            raise ConnectionError(f"{where} is not {self.peer!r} or does not hold the cluster "
                                  "secret (HELLO authentication failed)")
        mine = self.auth.hello_mac(b"reader", cn, sn, self.me.encode(), self.peer.encode())
        s.sendall(w.HELLO_HDR.pack(w.AUTH, len(mine)) + mine)
        status, n = w.HELLO_HDR.unpack(w.recv_exact(s, w.HELLO_HDR.size))
        text = w.recv_exact(s, min(n, w.MAX_HELLO)).decode(errors="replace")
        if status != w.OK:
            raise ConnectionError(f"{where} refused our HELLO authentication: {text} (is "
                                  "DUPLEXKV_KV_SECRET the same on both workers?)")

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _read(self, job: Job) -> tuple[XferState, str | None]:
        h = job.handle
        assert h is not None
        if job.cancelled:
            return XferState.FAILED, "cancelled before it started"
        if time.monotonic() > h.deadline:
            return XferState.FAILED, f"READ from {self.peer!r} timed out in the queue"

        last = [time.monotonic()]  # when a byte last moved

        def moved(n: int) -> None:
            last[0] = time.monotonic()

        def check() -> None:
            if job.cancelled:
                raise _Cancelled()
            now = time.monotonic()
            if now > h.deadline:
                raise TimeoutError(f"READ from {self.peer!r} timed out")
            if now - last[0] > self.stall_s:
                raise Stalled(f"READ from {self.peer!r} stalled (no byte moved for "
                                   f"{self.stall_s:g} s)")

        try:
            check()
            n = len(h.remote_block_ids)
            req = w.READ_HDR.pack(w.READ, job.xfer_id, n, len(job.notif),
                                  h.token[: w.TOKEN_BYTES])
            for attempt in (0, 1):
                cached = self.sock is not None
                s = self._connect(h.deadline)
                last[0] = time.monotonic()
                try:
                    w.sendmsg_all(s, [req, _pack_ids(h.remote_block_ids), job.notif], check,
                                  moved)
                    reply = w.recv_exact(s, w.READ_REPLY.size, check, moved)
                    break
                except (ConnectionError, BrokenPipeError) as e:
                    # a kept connection the holder closed meanwhile (its idle timeout): no
                    # byte of a reply came, so it served nothing; reconnect once
                    self._drop()
                    if attempt or not cached:
                        raise
                    log.info("connection to %s was closed (%s); reconnecting", self.peer, e)
            status, xfer_id, length = w.READ_REPLY.unpack(reply)
            if status != w.OK:
                text = w.recv_exact(s, length, check, moved).decode(errors="replace")
                return XferState.FAILED, f"{self.peer!r} refused the READ: {text}"
            if xfer_id != job.xfer_id or length != n * self.bb:
                raise ConnectionError(f"protocol error: reply for READ {xfer_id} with {length} "
                                      f"bytes, expected READ {job.xfer_id} with {n * self.bb}")
            mv, bb = self.local_mv, self.bb
            w.recvmsg_all(s, [mv[first * bb : (first + count) * bb]
                              for first, count in runs(h.local_block_ids)], check, moved)
            self.last_used = time.monotonic()
            return XferState.DONE, None
        except _Cancelled:
            self._drop()  # the stream is mid-message: start over on the next job
            return XferState.FAILED, "cancelled"
        except (OSError, ValueError) as e:
            self._drop()
            h.stalled = isinstance(e, Stalled)  # set before the result: the caller reads after
            why = f"failed: {e}"
            where = f"{self.peer!r} at {self.addr[0]}:{self.addr[1]}"
            return XferState.FAILED, f"READ of {len(h.remote_block_ids)} blocks from {where} {why}"

    def _notify(self, job: Job) -> None:
        deadline = time.monotonic() + 5.0

        def check() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError("timed out")

        for attempt in (0, 1):  # a cached connection may have died since: reconnect once
            try:
                s = self._connect(deadline)
                w.sendmsg_all(s, [w.NOTIF_HDR.pack(w.NOTIF, len(job.notif)), job.notif], check)
                self.last_used = time.monotonic()
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
        self.thread.join(timeout=FORCE_FAIL_S)


def _pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f">{len(ids)}I", *ids)
