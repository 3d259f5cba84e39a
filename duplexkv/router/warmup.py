"""Cold start: each vLLM P<->D pair's NIXL channel is opened before the pair takes turns.

vLLM's NixlConnector opens a pair's channel (the NIXL handshake) on the first read between them.
P holds a finished prefill's blocks for D under a lease (`kv_lease_duration`, 30 s, extended by
D's heartbeats once D is connected): a first handshake slower than that lets the lease run out
before D's first READ, and D then reads blocks P has already freed. So a vLLM worker that comes
up (at start, or back after being down) is "cold" until the router has run one tiny exchange
with every healthy partner of the other role and the same kind:

    1  P  prompt W, max_tokens 1, miss params      P holds W's blocks for D (its lease)
    2  D  W + P's params (JSON)                    D reads P (handshake D->P) and, when
                                                   bidirectional, holds W's blocks and says so
    3  P  W + D's params, remote_num_tokens 0,     P reads nothing and notifies D (handshake
          streamed, closed at its first event      P->D): D frees its blocks; the close aborts
                                                   P's request, so P frees its own at once
W is shorter than a block, so no prefix cache keeps it and every pair really reads.

A worker is warm once one of its pairs is. While a role has a healthy warm worker the pool
picks warm ones, and a D whose pair with the turn's P is still warming only when no other D is
left (backends.py); while none of a role is warm yet and a warm-up is running, or the first
round of health checks (which finds the workers' kinds) has not ended, a turn waits (`ready`,
at most `timeout_s`). A warm-up that fails is logged and the pair used anyway: it never makes a
worker unavailable. Our own workers need none (their KV plane connects per read, with its own
deadline), nor do pairs that cannot exchange KV (different kinds).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client import Counter

from duplexkv.router.backends import Backend, BackendPool
from duplexkv.router.legs import dumps, rewrite_remote_host
from duplexkv.router.upstream import Upstream
from duplexkv.router.verify import release_params
from duplexkv.wire.kv_params import miss_params, replay_params

log = logging.getLogger("duplexkv.router")

WARM_PROMPT = "duplexkv warm-up: open the KV channel between this prefill and decode worker."
REQUEST_PREFIX = "duplexkv-warmup-"  # the X-Request-Id of every warm-up call


def needs_warmup(b: Backend) -> bool:
    return b.kind is not None and b.kind != "duplexkv"


class PairWarmer:
    """Runs the exchange above for each new (P, D) pair; `ready()` is the turns' gate."""

    def __init__(self, pool: BackendPool, upstream: Upstream, headers: dict[str, str],
                 timeout_s: float, rewrite_host: bool, outcomes: Counter) -> None:
        self.pool, self.upstream, self.headers = pool, upstream, headers
        self.timeout_s, self.rewrite_host, self.outcomes = timeout_s, rewrite_host, outcomes
        # the pairs being warmed, (P url, D url) -> their exchange; the pool's `cold_pairs`
        self._pairs: dict[tuple[str, str], asyncio.Task] = {}
        pool.cold_pairs = self._pairs
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Condition()
        self.checked = asyncio.Event()  # the health checks' first round is done (kinds known)
        self._seq = 0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def on_up(self, b: Backend) -> None:
        """The health check saw `b` come up (or learned its kind): warm its pairs."""
        if not self.enabled or not needs_warmup(b):
            return
        b.warm = False
        self._spawn(self._warm_backend(b))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _warm_backend(self, b: Backend) -> None:
        """`b` is warm once any of its pairs is (or it has none); each pair is cold (in
        `_pairs`, the pool's `cold_pairs`) until its own exchange has ended."""
        others = self.pool.decode if b.role == "prefill" else self.pool.prefill
        partners = [o for o in others if o.healthy and o.kind == b.kind and o.models]
        tasks = []
        for o in partners:
            p, d = (b, o) if b.role == "prefill" else (o, b)
            key = (p.url, d.url)
            task = self._pairs.get(key)
            if task is None:  # also a worker that came back: it needs a new channel
                task = self._pairs[key] = self._spawn(self._warm_pair(p, d))
            tasks.append(task)
        try:
            if tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            b.warm = True
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _warm_pair(self, p: Backend, d: Backend) -> None:
        t = time.perf_counter()
        try:
            await asyncio.wait_for(self._exchange(p, d), self.timeout_s)
        except (httpx.HTTPError, ValueError, TypeError, KeyError, RuntimeError,
                asyncio.TimeoutError) as e:
            self.outcomes.labels("failed").inc()
            log.warning("warm-up of %s -> %s failed (%r); the pair is used cold", p.name,
                        d.name, e)
        else:
            self.outcomes.labels("ok").inc()
            log.info("warm-up of %s <-> %s: NIXL channel open in %.2f s", p.name, d.name,
                     time.perf_counter() - t)
        finally:
            self._pairs.pop((p.url, d.url), None)
            await self._notify()

    async def _exchange(self, p: Backend, d: Backend) -> None:
        p_params = await self._post_json(p, miss_params())
        if self.rewrite_host:
            p_params = rewrite_remote_host(p_params, p.url)
        if not isinstance(p_params, dict):
            raise RuntimeError(f"{p.name} returned no kv_transfer_params")
        d_params = await self._post_json(d, p_params)
        release = release_params(replay_params(d_params)) if isinstance(d_params, dict) \
            else None
        if release is None:  # D holds nothing (not bidirectional): D->P was the channel
            return
        if self.rewrite_host:
            release = rewrite_remote_host(release, d.url)
        await self._first_event(p, release)

    def _body(self, b: Backend, params: dict, **extra) -> bytes:
        return dumps({"model": b.models[0], "prompt": WARM_PROMPT, "max_tokens": 1,
                      "temperature": 0, "kv_transfer_params": params, **extra})

    def _headers(self) -> dict[str, str]:
        self._seq += 1
        return {"content-type": "application/json",
                "x-request-id": f"{REQUEST_PREFIX}{self._seq}", **self.headers}

    async def _post_json(self, b: Backend, params: dict) -> dict | None:
        resp = await self.upstream.post(b.url + "/v1/completions", self._body(b, params),
                                        self._headers())
        if resp.status_code != 200:
            raise RuntimeError(f"{b.name} answered HTTP {resp.status_code}")
        return resp.json().get("kv_transfer_params")

    async def _first_event(self, p: Backend, params: dict) -> None:
        """Stream from P and close at the first bytes: P has been scheduled (its notify to D
        is out) and the close aborts it before it ends, so P holds nothing for a lease.
        `ignore_eos` and 64 tokens keep it from ending on its own first."""
        body = self._body(p, params, stream=True, max_tokens=64, ignore_eos=True)
        resp = await self.upstream.post(p.url + "/v1/completions", body, self._headers(),
                                        stream=True)
        try:
            if resp.status_code != 200:
                raise RuntimeError(f"{p.name} answered HTTP {resp.status_code}")
            async for _ in resp.aiter_bytes():
                break
        finally:
            await resp.aclose()

    def _role_ready(self, role: list[Backend]) -> bool:
        healthy = [b for b in role if b.healthy]
        return not healthy or any(b.warm for b in healthy)

    def is_ready(self) -> bool:
        return self._role_ready(self.pool.prefill) and self._role_ready(self.pool.decode)

    async def ready(self) -> float:
        """Wait (at most `timeout_s` in all) for the first round of health checks (which
        starts the warm-ups), then until each role has a warm healthy worker or none is
        warming; -> the seconds waited."""
        if not self.enabled or (self.checked.is_set() and (self.is_ready() or not self._tasks)):
            return 0.0
        t = time.perf_counter()
        deadline = t + self.timeout_s
        if not self.checked.is_set():
            try:
                await asyncio.wait_for(self.checked.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                return time.perf_counter() - t
        async with self._changed:
            while not self.is_ready() and self._tasks:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    break
        return time.perf_counter() - t

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

