"""A TCP READ that stops making progress fails in about `read_stall_s` (1 s by default), not at
its deadline (`read_timeout_s`, 10 s), while one that keeps moving on a 1 Mbit/s link is never
cut. The link is a relay on loopback between reader and holder (the holder advertises
127.0.0.2, where the relay listens on the holder's port) that paces the holder's bytes at
1 Mbit/s and can freeze: it stops forwarding without closing anything, as a cut link does."""

from __future__ import annotations

import socket
import threading
import time

import torch

from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.transport import XferState, make_transport

BLOCK = (2, 2, 16, 2, 32)  # 16 KiB a block in float32
RATE = 125_000  # bytes a second: 1 Mbit/s
CFG = KVTransferConfig()  # the defaults, as the connector passes them


class Link:
    """A paced TCP relay from 127.0.0.2:port to 127.0.0.1:port (test-side network emulation)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.frozen = threading.Event()
        self.closed = False
        self.srv = socket.create_server(("127.0.0.2", port))
        self.socks: list[socket.socket] = [self.srv]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.port))
            self.socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while True:
                data = src.recv(4096 if paced else 65536)
                if not data:
                    return
                while self.frozen.is_set() and not self.closed:
                    time.sleep(0.01)
                if self.closed:
                    return
                dst.sendall(data)
                if paced:
                    time.sleep(len(data) / RATE)
        except OSError:
            return

    def close(self) -> None:
        self.closed = True
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def _pair():
    reader = make_transport("tcp", engine_id="R", timeout_s=CFG.read_timeout_s,
                            stall_s=CFG.read_stall_s)
    holder = make_transport("tcp", engine_id="H", timeout_s=CFG.read_timeout_s,
                            stall_s=CFG.read_stall_s, advertise_host="127.0.0.2")
    reader.register(torch.zeros((40, *BLOCK)))
    src = torch.randn((40, *BLOCK))
    holder.register(src)
    link = Link(int(holder.health()["listen"].rsplit(":", 1)[1]))
    reader.connect("H", holder.metadata())
    return reader, holder, src, link


def _wait(t, h, limit: float) -> float:
    t0 = time.monotonic()
    while t.poll(h) is XferState.PENDING and time.monotonic() - t0 < limit:
        time.sleep(0.005)
    return time.monotonic() - t0


def test_read_on_a_1_mbit_link_is_not_cut():
    """256 KiB at 1 Mbit/s: ~2 s, longer than the stall deadline; every byte lands."""
    reader, holder, src, link = _pair()
    try:
        h = reader.read("H", list(range(16)), list(range(16)), b"n")
        took = _wait(reader, h, 20)
        assert h.state is XferState.DONE, h.error
        assert took > 1.5  # slower than read_stall_s: the pacing held
        assert torch.equal(reader._pool[:16], src[:16])
    finally:
        link.close()
        reader.close()
        holder.close()


def test_read_stalled_mid_way_fails_in_about_the_stall_deadline():
    """The link freezes half a second into a READ: the READ fails ~1 s later (it waited for
    read_timeout_s, 10 s, before), and the next READ over the healed link succeeds."""
    reader, holder, src, link = _pair()
    try:
        h = reader.read("H", list(range(16)), list(range(16)), b"n")
        time.sleep(0.5)
        link.frozen.set()
        t0 = time.monotonic()
        _wait(reader, h, 20)
        stalled_after = time.monotonic() - t0
        assert h.state is XferState.FAILED and h.stalled and "stalled" in (h.error or ""), h.error
        assert stalled_after < 1.0 + 1.0, stalled_after  # stall 1 s, 0.25 s slices, a busy CI
        reader.release(h)
        link.frozen.clear()
        h = reader.read("H", [20], [20], b"n2")
        _wait(reader, h, 20)
        assert h.state is XferState.DONE, h.error
        assert torch.equal(reader._pool[20], src[20])
    finally:
        link.close()
        reader.close()
        holder.close()
