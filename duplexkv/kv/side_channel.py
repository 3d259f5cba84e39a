"""Per-worker side channel (ZMQ + msgpack): handshake, block verification, heartbeats.

    reader (REQ)                                    holder (ROUTER, own thread)
    ["meta"]                                   ->   Handshake fields + holder perf_counter
    ["verify", req_id, [hash...], [token...]]  ->   {"matched": n, "expiry": t, "reason": r}
    ["hb", [req_id...]]                        ->   {"known": n}
Data moves over the transport; the completion notification travels with the READ.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import msgpack
import zmq

log = logging.getLogger(__name__)


class SideChannelError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Handshake:
    engine_id: str
    compat_hash: str  # model weights/config, dtype, block size, layout, protocol version
    transport: str  # "nixl" | "tcp"
    transport_metadata: bytes
    block_size: int
    num_blocks: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class PeerInfo:
    handshake: Handshake
    clock_offset: float  # holder perf_counter - ours


class SideChannelServer:
    def __init__(self, host: str, port: int, handshake: Handshake,
                 handlers: dict[str, Callable[..., dict]]) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self.handshake = handshake
        self.handlers = handlers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="side-channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            try:
                msg = msgpack.unpackb(body)
                kind, args = msg[0], msg[1:]
                if kind == "meta":
                    reply = {**asdict(self.handshake), "clock": time.perf_counter()}
                else:
                    reply = self.handlers[kind](*args)
            except Exception as e:  # a bad message gets an error reply, never kills the thread
                log.warning("side channel: bad request: %r", e)
                reply = {"error": repr(e)}
            self.sock.send_multipart([ident, b"", msgpack.packb(reply)])


def request(host: str, port: int, msg: list, timeout_s: float = 5.0) -> dict:
    """One request/reply to a holder's side channel; SideChannelError on timeout or error."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgpack.packb(msg))
        reply = msgpack.unpackb(sock.recv())
    except zmq.Again:
        raise SideChannelError(f"side channel {host}:{port} did not answer in {timeout_s}s") \
            from None
    finally:
        sock.close(0)
    if not isinstance(reply, dict) or "error" in reply:
        raise SideChannelError(f"side channel {host}:{port} refused: {reply!r}")
    return reply


def handshake(host: str, port: int, timeout_s: float = 5.0, rounds: int = 3) -> PeerInfo:
    """Fetch the holder's metadata; the clock offset comes from the lowest-RTT round."""
    best = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        reply = request(host, port, ["meta"], timeout_s)
        t1 = time.perf_counter()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, reply["clock"] - (t0 + t1) / 2, reply)
    assert best is not None
    r = best[2]
    hs = Handshake(r["engine_id"], r["compat_hash"], r["transport"], r["transport_metadata"],
                   r["block_size"], r["num_blocks"], r["block_bytes"])
    return PeerInfo(hs, best[1])
