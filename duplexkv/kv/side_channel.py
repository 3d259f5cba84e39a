"""Per-worker side channel (ZMQ + msgpack): handshake, block verification, heartbeats.

The messages and their bounds are in `messages.py`; nothing a peer sends is used before it has
been decoded into those types. Data moves over the transport; the completion notification
travels with the READ.

With a cluster secret (kv/auth.py) the socket is a ZMQ CURVE server whose keypair, and the one
client keypair, are derived from the secret; a ZAP handler admits only the derived client key,
so a peer without the secret completes no handshake and is told nothing, not even the engine
id. Without a secret the side channel listens on loopback only.

Readers keep their sockets (`ClientPool`): a few REQ sockets per holder address, each connected
and (with a secret) CURVE-authenticated once, reused for every later verify and heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from duplexkv.kv import messages as m
from duplexkv.kv.auth import KVAuth

log = logging.getLogger(__name__)


class SideChannelError(RuntimeError):
    pass


class BadReply(SideChannelError):
    """The peer answered, but with something that is not a valid reply."""


class PeerUnreachable(SideChannelError):
    """The peer did not answer in time (dead, partitioned or stuck)."""
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


class _OnlyClusterClient:
    """ZAP credentials provider: admit exactly the client key derived from the secret."""

    def __init__(self, client_public: bytes) -> None:
        self.key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class SideChannelServer:
    def __init__(self, host: str, port: int, handshake: Handshake,
                 handlers: dict[str, Callable[..., object]], auth: KVAuth | None = None) -> None:
        self.authenticator = None
        if auth is not None and auth.enabled:
            # own context: the ZAP handler is per context and only this socket needs it
            self.ctx = zmq.Context()
            self.authenticator = ThreadAuthenticator(self.ctx, log=log.getChild("zap"))
            self.authenticator.start()
            client_public, _ = auth.curve_keys("client")
            self.authenticator.configure_curve_callback(
                "*", credentials_provider=_OnlyClusterClient(client_public))
        else:
            self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        if self.authenticator is not None:
            assert auth is not None
            pub, sec = auth.curve_keys("server")
            self.sock.curve_secretkey = sec
            self.sock.curve_publickey = pub
            self.sock.curve_server = True
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
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
        if self.authenticator is not None:
            self.authenticator.stop()
            self.ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) < 2:
                continue  # not a REQ envelope: nothing to answer
            ident, body = frames[0], frames[-1]
            try:
                reply = self._answer(m.decode_request(body))
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                log.warning("side channel: malformed request: %s", e)
                reply = m.ErrorReply(f"malformed request: {e}"[:4096])
            except Exception as e:  # a handler's error is the caller's answer, never fatal
                log.warning("side channel: request failed: %r", e)
                reply = m.ErrorReply(f"request failed: {e!r}"[:4096])
            try:
                self.sock.send_multipart([ident, b"", m.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("side channel: reply not sent: %s", e)

    def _answer(self, req: m.Request) -> object:
        if isinstance(req, m.Meta_):
            return m.MetaReply(**asdict(self.handshake), clock=time.perf_counter())
        if isinstance(req, m.Verify):
            return self.handlers["verify"](req)
        return self.handlers["hb"](req)


def _open(host: str, port: int, timeout_s: float, auth: KVAuth | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 22)
    if auth is not None and auth.enabled:
        pub, sec = auth.curve_keys("client")
        sock.curve_serverkey = auth.curve_keys("server")[0]
        sock.curve_publickey = pub
        sock.curve_secretkey = sec
    sock.connect(f"tcp://{host}:{port}")
    return sock


def _round_trip(sock: zmq.Socket, host: str, port: int, msg: object,
                timeout_s: float) -> bytes:
    """Send and receive on a REQ socket; PeerUnreachable after `timeout_s` (the socket is then
    unusable: a REQ socket cannot send again before it has received)."""
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    try:
        sock.send(m.encode(msg))
        return sock.recv()
    except zmq.Again:
        raise PeerUnreachable(f"side channel {host}:{port} did not answer in {timeout_s}s") \
            from None


def request(host: str, port: int, msg: object, reply_type: type, timeout_s: float,
            auth: KVAuth | None = None) -> object:
    """One request/reply on a fresh socket, decoded into `reply_type`.
    PeerUnreachable when nothing comes back within `timeout_s` (connecting included), BadReply
    for a malformed answer, SideChannelError when the holder refused."""
    sock = _open(host, port, timeout_s, auth)
    try:
        raw = _round_trip(sock, host, port, msg, timeout_s)
    finally:
        sock.close(0)
    return _decode(raw, reply_type, host, port)


def _decode(raw: bytes, reply_type: type, host: str, port: int) -> object:
    try:
        reply = m.decode_reply(raw, reply_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadReply(f"side channel {host}:{port} sent a malformed reply: {e}") from None
    if isinstance(reply, m.ErrorReply):
        raise SideChannelError(f"side channel {host}:{port} refused: {reply.error}")
    return reply


class ClientPool:
    """Persistent side-channel sockets: up to `per_peer` idle REQ sockets per holder address,
    each connected (and with a secret CURVE-authenticated) once. Thread-safe: a request takes
    an idle socket or opens one, uses it alone, and gives it back after a reply; a socket that
    timed out or failed is closed, so the next request opens a fresh one (a restarted holder is
    reconnected to). Every wait is bounded by the request's `timeout_s`."""

    def __init__(self, auth: KVAuth | None = None, per_peer: int = 4,
                 max_peers: int = 256) -> None:
        self.auth = auth
        self.per_peer, self.max_peers = per_peer, max_peers
        self._idle: OrderedDict[tuple[str, int], list[zmq.Socket]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0

    def request(self, host: str, port: int, msg: object, reply_type: type,
                timeout_s: float) -> object:
        """As `request()`, on a kept socket."""
        key = (host, port)
        with self._lock:
            idle = self._idle.get(key)
            sock = idle.pop() if idle else None
        if sock is None:
            sock = _open(host, port, timeout_s, self.auth)
            self.opened += 1
        ok = False
        try:
            raw = _round_trip(sock, host, port, msg, timeout_s)
            ok = True
        finally:
            if not ok or not self._give_back(key, sock):
                sock.close(0)
        return _decode(raw, reply_type, host, port)

    def _give_back(self, key: tuple[str, int], sock: zmq.Socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            idle = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(idle) >= self.per_peer:
                return False
            idle.append(sock)
            while len(self._idle) > self.max_peers:  # forget the least recently used holder
                for old in self._idle.popitem(last=False)[1]:
                    old.close(0)
            return True

    def idle(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for v in self._idle.values() for s in v]
            self._idle.clear()
        for sock in socks:
            sock.close(0)


def handshake(host: str, port: int, timeout_s: float, rounds: int = 3,
              auth: KVAuth | None = None, pool: ClientPool | None = None) -> PeerInfo:
    """Fetch the holder's metadata; the clock offset comes from the lowest-RTT round."""
    best = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        reply = (pool.request(host, port, m.Meta_(), m.MetaReply, timeout_s) if pool else
                 request(host, port, m.Meta_(), m.MetaReply, timeout_s, auth))
        t1 = time.perf_counter()
        assert isinstance(reply, m.MetaReply)
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, reply.clock - (t0 + t1) / 2, reply)
    assert best is not None
    r = best[2]
    hs = Handshake(r.engine_id, r.compat_hash, r.transport, r.transport_metadata,
                   r.block_size, r.num_blocks, r.block_bytes)
    return PeerInfo(hs, best[1])
