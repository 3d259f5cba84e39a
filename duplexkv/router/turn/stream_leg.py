"""A streamed answer's lifetime: D's events go to the client one at a time (stream.py rewrites
them), D's params are stored before [DONE] goes out (the client may send its next turn at once),
and the leg closes once, whatever ends it: D's [DONE] or end, a broken D, a client that left
(even before the first byte; http/sse.py). A D that goes quiet is probed (liveness.py) and
given up on when it does not answer. The close gives D's in-flight count back and counts
the request: `ok` once [DONE] (or D's whole body) was handed to the client, `upstream_error`
when D sent an error or broke before that, `aborted` when the client left first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from duplexkv.http.errors import APIError
from duplexkv.router.backends import Backend, InFlight
from duplexkv.router.legs import dumps
from duplexkv.router.liveness import Liveness, WentDown
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.stream import DONE, StreamRelay
from duplexkv.router.turn.calls import Unreachable
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.migrate import Migration

log = logging.getLogger("duplexkv.router")
perf = time.perf_counter

# (D's params, D's held tokens) -> the conversation's store (decode.py binds the rest)
Remember = Callable[[dict | None, list[int] | None], Awaitable[None]]


class StreamLeg:
    def __init__(self, turn: Turn, d: Backend, resp: httpx.Response, count: InFlight,
                 relay: StreamRelay, metrics: RouterMetrics, remember: Remember,
                 liveness: Liveness, migration: Migration | None = None) -> None:
        self.turn, self.d, self.resp, self.count = turn, d, resp, count
        self.liveness, self.migration = liveness, migration
        self.relay, self.metrics, self.remember = relay, metrics, remember
        self.headers_at = perf()
        self.outcome = "aborted"  # until the client has received [DONE] (or D's whole body)
        self.delivered = False  # [DONE] was handed to the client's connection
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        turn, d, relay, m = self.turn, self.d, self.relay, self.metrics
        stored, first_wait = False, None
        try:
            async for chunk in self._chunks():
                if first_wait is None:  # headers -> first bytes (the headers are in `waited`)
                    first_wait = perf() - self.headers_at
                for event in relay.feed(chunk):
                    if relay.done and not stored:  # store before [DONE]: the next turn may follow
                        await self.remember(relay.params, relay.held(relay.params))
                        stored = True
                    yield event
                    if not self.delivered and event.startswith(DONE):  # resumed: it went out
                        self.delivered = True
                        self.outcome = "upstream_error" if relay.error else "ok"
                    if first_wait is not None and first_wait >= 0:
                        m.overhead.observe(turn.overhead(perf(), first_wait))
                        first_wait = -1.0
            for event in relay.flush():
                yield event
            if not stored:
                await self.remember(relay.params, relay.held(relay.params))
            if not self.delivered:  # D closed without [DONE]: the client has all D sent
                self.outcome = "upstream_error" if relay.error else "ok"
        except (httpx.HTTPError, WentDown) as e:
            if self.delivered:  # the client has its whole answer; only D's tail broke
                log.info("%s: decode stream from %s broke after [DONE]: %r",
                         turn.request_id, d.url, e)
                return
            log.warning("%s: decode stream from %s broke: %r", turn.request_id, d.url, e)
            m.upstream_errors.labels("decode", "stream").inc()
            self.count.release()  # D's part is over
            self.liveness.suspect(d, f"its stream broke ({type(e).__name__})")
            async for event in self._migrated(e):
                yield event
        finally:
            await self.close()

    async def _migrated(self, e: Exception) -> AsyncIterator[bytes]:
        """The rest of the answer from another D (migrate.py), else an error event."""
        try:
            if self.migration is None:
                raise Unreachable("the stream cannot be continued elsewhere")
            self.metrics.upstream_errors.labels("decode", "migrated").inc()
            async for event in self.migration.events(self.d):
                yield event
                if event.startswith(DONE):
                    self.delivered = True
            self.outcome = "ok" if self.delivered and not self.relay.error else "upstream_error"
            return
        except Unreachable as why:
            log.warning("%s: %s", self.turn.request_id, why)
        self.outcome = "upstream_error"
        err = APIError(502, f"the decode worker's stream broke ({self.d.name}: "
                       f"{type(e).__name__})", type="server_error")
        yield b"data: " + dumps(err.body()) + b"\n\n" + DONE + b"\n\n"

    async def _chunks(self) -> AsyncIterator[bytes]:
        """D's body as it comes, each wait watched (liveness.py): WentDown when D went down."""
        it = self.resp.aiter_bytes()
        while True:
            try:
                yield await self.liveness.next(self.d, it)
            except StopAsyncIteration:
                return

    async def close(self) -> None:
        """Once per stream, whether it ended, broke, or the client left before the first byte."""
        if self.closed:
            return
        self.closed = True
        self.count.release()
        await self.resp.aclose()
        if self.relay.first_token_at is not None:
            self.metrics.ttft.observe(self.relay.first_token_at - self.turn.arrival)
        self.metrics.requests.labels(self.turn.req.endpoint, self.outcome).inc()
