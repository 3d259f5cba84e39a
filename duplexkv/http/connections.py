"""Bounded connections for the worker's and the router's HTTP server (issue 32).

uvicorn (with h11) accepts every connection and keeps it until the client closes it: a
connection that never finishes its first request holds a file descriptor forever, and 1,100 idle
ones under the common 1,024 open-files limit made accept() fail thousands of times a second.
uvicorn's own knobs cover part of it, and are used: `timeout_keep_alive` closes a connection idle
*after* a response, h11's `max_incomplete_event_size` refuses oversized header blocks. What
uvicorn lacks is added here, as a subclass of its h11 protocol (`bounded_protocol`):

- a deadline for a whole request (headers and body), counted from the connection's opening or
  the end of the previous response to the request's last body byte; a client still sending at
  the deadline gets a 408 in OpenAI's error shape and the connection is closed (one that sent
  nothing is closed silently). The deadline ends when the request is read: a slow model, a long
  prefill or a long stream is never cut.
- a cap on connections that have not completed a request (`max_pending`): a new connection over
  it closes the oldest of them, so a flood of idle or slow clients cannot keep a real client out.
- a cap on all connections (`max_connections`): over it, a new connection is answered a 503 in
  OpenAI's shape and closed, instead of the process running out of descriptors.

uvicorn's `limit_concurrency` is not used: it counts only once a request's headers are in (idle
connections are never refused) and answers a plain-text 503.

`raise_open_files` raises the soft RLIMIT_NOFILE to the hard limit at start; the caps' defaults
derive from the resulting limit, leaving room for the process's own files and, on the router,
one upstream connection per client connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("duplexkv.http")

DEFAULT_REQUEST_TIMEOUT_S = 10.0
MAX_DEFAULT_CONNECTIONS = 8192
# descriptors kept for the process itself (model files, logs, the KV plane, sockets to peers)
RESERVED_FILES = 128
REFUSE_LINGER_S = 0.5


def raise_open_files() -> int:
    """Raise the soft open-files limit to the hard limit (logged); the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open-files limit raised from %d to the hard limit %d", soft, hard)
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    max_pending: int  # connections that have not completed a request (idle or still sending)
    request_timeout_s: float  # headers and body of one request, from its first chance to start

    @classmethod
    def for_files(cls, open_files: int, per_connection: int = 1,
                  max_connections: int | None = None, max_pending: int | None = None,
                  request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> ConnectionLimits:
        """Defaults from the open-files limit: what is left after RESERVED_FILES, divided by the
        descriptors one client connection costs (`per_connection`: 2 on the router, whose
        requests each hold an upstream connection); half of it for pending connections."""
        auto = max(16, (open_files - RESERVED_FILES) // per_connection)
        total = max_connections if max_connections is not None else \
            min(MAX_DEFAULT_CONNECTIONS, auto)
        pending = max_pending if max_pending is not None else max(1, total // 2)
        if total < 1 or pending < 1 or request_timeout_s <= 0:
            raise ValueError("--max-connections and --max-pending-connections must be >= 1 and "
                             "--request-read-timeout must be > 0")
        return cls(total, min(pending, total), request_timeout_s)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open client connections at most; a new one over it gets a 503 and is "
                        "closed (default: from the open-files limit, which is raised to the hard "
                        f"limit at start: the limit less {RESERVED_FILES}, halved on the router, "
                        f"at most {MAX_DEFAULT_CONNECTIONS})")
    p.add_argument("--max-pending-connections", type=int, default=None, metavar="N",
                   help="connections that have not completed a request (idle or still sending) "
                        "at most; a new one over it closes the oldest of them (default: half of "
                        "--max-connections)")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   metavar="S",
                   help="a client has S seconds to send a whole request, headers and body, from "
                        "its connection's opening or its previous response's end: then a 408 "
                        "and the connection is closed (default 10; generation time never "
                        "counts)")


def limits_from(args: argparse.Namespace, open_files: int,
                per_connection: int = 1) -> ConnectionLimits:
    return ConnectionLimits.for_files(open_files, per_connection, args.max_connections,
                                      args.max_pending_connections, args.request_read_timeout)


def _raw_error(status: int, reason: str, message: str, kind: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


BUSY = _raw_error(503, "Service Unavailable", "The server has too many open connections; retry "
                  "later.", "service_unavailable_error")
TOO_SLOW = _raw_error(408, "Request Timeout", "The request was not received in time.",
                      "invalid_request_error")


class ConnectionGate:
    """Shared by every connection of one server: the pending ones, oldest first, and counts."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.pending: dict[BoundedConnection, None] = {}  # insertion order: oldest first
        # connections not given up (uvicorn's own set keeps a closed one until its
        # connection_lost, a loop iteration later: a burst of accepts would count them)
        self.live: set[BoundedConnection] = set()
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0

    def stats(self) -> dict:
        return {"open": len(self.live), "pending": len(self.pending), "refused": self.refused,
                "evicted": self.evicted, "timed_out": self.timed_out,
                "max_connections": self.limits.max_connections,
                "max_pending": self.limits.max_pending}

    def make_room(self) -> None:
        while len(self.pending) >= self.limits.max_pending:
            oldest = next(iter(self.pending))
            self.evicted += 1
            oldest.give_up()


class BoundedConnection(H11Protocol):
    """uvicorn's h11 protocol with the request deadline and the gate's caps (class attribute
    `gate`, set by `bounded_protocol`)."""

    gate: ConnectionGate

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.done_cycle = None  # the last request cycle whose body was read in full
        self.started = False  # a byte of the current request arrived
        self.deadline: asyncio.TimerHandle | None = None
        self.refused = False
        self.gate.live.add(self)
        if len(self.gate.live) > self.gate.limits.max_connections:
            self.refuse()
            return
        self.wait_for_request()

    def refuse(self) -> None:
        """The 503, then the client's request is read and dropped for REFUSE_LINGER_S before
        the close (closing with its request unread would reset the connection, and the client
        could lose the 503)."""
        self.refused = True
        self.gate.live.discard(self)
        self.gate.refused += 1
        self.transport.write(BUSY)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSE_LINGER_S, self.transport.close)

    def wait_for_request(self) -> None:
        self.gate.make_room()
        self.started = False
        self.gate.pending[self] = None
        self.cancel_deadline()
        self.deadline = self.loop.call_later(self.gate.limits.request_timeout_s, self.timed_out)

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def request_read(self) -> None:
        self.gate.pending.pop(self, None)
        self.cancel_deadline()

    def check_read(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle is not self.done_cycle and not cycle.more_body:
            self.done_cycle = cycle
            self.request_read()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.started = True
        super().data_received(data)
        self.check_read()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.wait_for_request()
        super().on_response_complete()  # may start a pipelined request
        self.check_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self.request_read()
        self.gate.live.discard(self)
        super().connection_lost(exc)

    def timed_out(self) -> None:
        self.deadline = None
        self.gate.timed_out += 1
        self.give_up()

    def give_up(self) -> None:
        """Close a connection whose request is not in: a 408 if it began one and no response
        has started, else silently."""
        self.request_read()
        self.gate.live.discard(self)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        answering = cycle is not None and cycle is not self.done_cycle and \
            cycle.response_started
        if self.started and not answering:
            if cycle is not None:
                cycle.disconnected = True  # the app's own answer, if any, goes nowhere
            self.transport.write(TOO_SLOW)
        self.transport.close()


def bounded_protocol(limits: ConnectionLimits) -> tuple[type[BoundedConnection], ConnectionGate]:
    """A protocol class for `uvicorn.Config(http=...)`, and its gate (for /health or logs)."""
    gate = ConnectionGate(limits)
    return type("BoundedH11Protocol", (BoundedConnection,), {"gate": gate}), gate
