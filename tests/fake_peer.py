"""A scripted KV holder for the reader's side of the side channel: it answers the handshake with
a real holder's metadata (so the reader accepts it as that holder) and then answers `verify` the
way a test tells it to: malformed, truncated, slow (never), or by closing nothing at all."""

from __future__ import annotations

import threading

import msgpack
import zmq


class FakePeer:
    """Listens on 127.0.0.1:<free port>. `verify_reply` is raw bytes to send for a verify (None:
    never answer). `meta_reply` likewise for the handshake (default: `real_meta`)."""

    def __init__(self, real_meta: dict) -> None:
        self.real_meta = real_meta
        self.meta_reply: bytes | None = msgpack.packb(real_meta)
        self.verify_reply: bytes | None = None
        self.requests: list[list] = []
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _, body = self.sock.recv_multipart()
            msg = msgpack.unpackb(body)
            self.requests.append(msg)
            reply = self.meta_reply if msg[0] == "meta" else self.verify_reply
            if reply is not None:
                self.sock.send_multipart([ident, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)


def real_meta(host: str, port: int) -> dict:
    """The handshake of a real worker's side channel, as a plain dict (with its clock)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgpack.packb(["meta"]))
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close(0)
