"""Passive failure detection: a worker is judged by what it does for the turns, not only by the
periodic health checks (health.py, every 2 s with a 10 s timeout, which leave a hung or
black-holed worker in rotation for ~20 s).

    watch      a leg that has waited `watch_after_s` for its worker (response headers, or the
               next event of a stream) has the worker probed: GET /health with `probe_timeout_s`,
               again every `watch_after_s` while the leg still waits. A worker that answers the
               probe is alive (a long prefill under load is never cut: the worker's HTTP loop
               answers /health beside its engine thread); one that does not is marked down,
               which abandons every leg in flight to it (calls.py), and the turn goes on
               elsewhere. A hung (SIGSTOP) or black-holed worker is given up on in
               watch_after_s + probe_timeout_s (1.5 s by default). All legs waiting on one
               worker share its probe (at most one /health in flight per worker).
    suspect    a worker that failed a leg (a transport error, a 5xx), or that P could not reach
               for a turn's pull (P's decline reason, runner.py), is suspect at once: chosen only
               when no other worker of its role is left, and probed now. The probe clears it or
               marks it down.
The health loop still marks a worker up again (one good check) and clears `suspect`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from duplexkv.router.backends import Backend

log = logging.getLogger("duplexkv.router")
T = TypeVar("T")

WATCH_AFTER_S = 0.5
PROBE_TIMEOUT_S = 1.0


class WentDown(Exception):
    """The worker was marked down while a call to it was in flight."""


@dataclass(frozen=True, slots=True)
class LivenessConfig:
    watch_after_s: float = WATCH_AFTER_S  # a leg waiting this long has its worker probed
    probe_timeout_s: float = PROBE_TIMEOUT_S  # a probe not answered in this time: down


class Liveness:
    def __init__(self, client: httpx.AsyncClient, cfg: LivenessConfig = LivenessConfig()) -> None:
        self.client, self.cfg = client, cfg
        self._probes: dict[Backend, asyncio.Task] = {}

    async def probe(self, b: Backend) -> bool:
        """One /health probe; a worker that does not answer it 200 in time is marked down."""
        try:
            r = await self.client.get(b.url + "/health", timeout=self.cfg.probe_timeout_s)
            alive, why = r.status_code == 200, f"probe: /health answered {r.status_code}"
        except httpx.HTTPError as e:
            alive, why = False, f"probe: /health failed ({type(e).__name__})"
        if alive:
            b.suspect = False
        else:
            b.mark_down(why)
        return alive

    def probing(self, b: Backend) -> asyncio.Task:
        """The probe of `b` in flight, or a new one: every leg waiting on `b` shares it."""
        task = self._probes.get(b)
        if task is None or task.done():
            task = self._probes[b] = asyncio.create_task(self.probe(b))
        return task

    def suspect(self, b: Backend, reason: str) -> None:
        """Mark `b` suspect and probe it now."""
        if not b.suspect:
            log.warning("%s (%s) is suspect: %s; probing it", b.name, b.url, reason)
        b.suspect = True
        self.probing(b)

    async def _watch(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.cfg.watch_after_s)
            if not await asyncio.shield(self.probing(b)):
                return

    async def guard(self, b: Backend, call: Awaitable[T]) -> T:
        """`await call` while `b` is watched; raises WentDown (the call cancelled) when `b` is
        marked down first, by the watch's probe or anyone else."""
        task = asyncio.ensure_future(call)
        down = asyncio.ensure_future(b.went_down().wait())
        watch = asyncio.ensure_future(self._watch(b))
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise WentDown()
        return task.result()

    async def next(self, b: Backend, it: AsyncIterator[T]) -> T:
        """The next item of a stream from `b`, the stream watched once it has been quiet for
        `watch_after_s` (one task per item otherwise); StopAsyncIteration at its end."""
        task = asyncio.ensure_future(anext(it))
        done, _ = await asyncio.wait((task,), timeout=self.cfg.watch_after_s)
        if done:
            return task.result()
        return await self.guard(b, task)

    async def aclose(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
