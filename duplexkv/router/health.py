"""The health-check loop: every worker's /health each `interval` (and, once it is up, its
/v1/models: the models it serves and who serves them, `owned_by`; a vLLM worker's KV block size
from its /metrics, for verify.py).

    down       a refused connection marks a worker down at once; otherwise `unhealthy_after`
               failed checks in a row (a busy worker answers /health between engine steps)
    up         one good check marks it up; a worker that came up (or whose kind was learned) is
               handed to `on_up` (warmup.py opens its vLLM pairs' channels)
    KV plane   a worker reached over the network whose KV plane listens on loopback only is
               reported once in the log and in /health (`kv_warning`)
    load       what the worker reports of its load is kept (`Backend.load`, worker_load.py):
               from our workers' /health; a vLLM worker's from its /metrics, read each check
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from duplexkv.router.backends import Backend, BackendPool
from duplexkv.router.verify import block_size_from_metrics
from duplexkv.router.worker_load import from_health, from_vllm_metrics

log = logging.getLogger("duplexkv.router")


class HealthChecker:
    """Polls every worker's /health (and /v1/models once it is up) on the router's client."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, interval_s: float,
                 timeout_s: float, on_up: Callable[[Backend], None] | None = None,
                 on_round: Callable[[], None] | None = None) -> None:
        self.pool = pool
        self.on_up = on_up  # called when a worker comes up (its kind learned): warmup.py
        self.on_round = on_round  # called after each round of checks
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.all))

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            if self.on_round is not None:
                self.on_round()
            await asyncio.sleep(self.interval_s)

    async def check(self, b: Backend) -> None:
        t = time.monotonic()
        try:
            r = await self.client.get(b.url + "/health", timeout=self.timeout_s)
            ok, reason = r.status_code == 200, f"/health returned {r.status_code}"
            b.note_rtt(t)
        except httpx.ConnectError as e:
            ok, reason = False, f"connection failed ({type(e).__name__})"
            b.failed_checks = self.pool.unhealthy_after  # nothing listens there: down at once
        except httpx.TimeoutException as e:
            ok, reason = False, f"/health failed ({type(e).__name__})"
            if b.healthy and not self.pool.has_alternative(b):
                # slow, not gone: the only healthy worker of its role is kept (nowhere else to
                # send its legs; a slow answer beats a 503), as the liveness probes do
                b.last_check = time.monotonic()
                return
        except httpx.HTTPError as e:
            ok, reason = False, f"/health failed ({type(e).__name__})"
        b.last_check = time.monotonic()
        if ok:
            self._check_kv_address(b, r)
            await self._note_load(b, r)
            came_up = not b.models or not b.healthy
            if came_up:
                await self._learn_models(b)
            b.mark_up()
            if came_up and b.models and self.on_up is not None:
                self.on_up(b)
            return
        b.failed_checks += 1
        if b.failed_checks >= self.pool.unhealthy_after:
            b.mark_down(reason)

    async def _note_load(self, b: Backend, r: httpx.Response) -> None:
        try:
            body = r.json()
        except ValueError:  # vLLM's /health has no body
            body = None
        try:
            load = from_health(body)
            if load is None and b.kind == "vllm":
                m = await self.client.get(b.url + "/metrics", timeout=self.timeout_s)
                load = from_vllm_metrics(m.text) if m.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        if load is not None:
            b.load = load

    def _check_kv_address(self, b: Backend, r: httpx.Response) -> None:
        """A worker reached over the network whose KV plane advertises loopback: peers on other
        hosts cannot pull from it (each such turn recomputes). Said once in the log (with the
        address) and in /health (without it)."""
        try:
            side = r.json().get("kv_transfer", {}).get("side_channel", "")
        except (ValueError, AttributeError):
            return
        host = urlsplit(b.url).hostname or ""
        kv_host = side.rsplit(":", 1)[0] if isinstance(side, str) else ""
        loop = ("127.", "::1", "[::1]", "localhost")
        if kv_host.startswith(loop) and not host.startswith(loop):
            warning = ("its KV plane listens on loopback only: workers on other hosts cannot "
                       "read its KV (set VLLM_NIXL_SIDE_CHANNEL_HOST on it)")
            if not b.kv_warning:
                log.error("%s (%s): %s, advertised %s", b.name, b.url, warning, side)
            b.kv_warning = warning
        else:
            b.kv_warning = ""

    async def _learn_models(self, b: Backend) -> None:
        try:
            r = await self.client.get(b.url + "/v1/models", timeout=self.timeout_s)
            data = r.json().get("data") if r.status_code == 200 else None
            if isinstance(data, list):
                b.models = tuple(m["id"] for m in data if isinstance(m, dict) and "id" in m)
                lens = [m.get("max_model_len") for m in data if isinstance(m, dict)]
                b.max_model_len = next((n for n in lens if type(n) is int and n > 0), None)
                owner = data[0].get("owned_by") if data and isinstance(data[0], dict) else None
                b.kind = owner[:32] if isinstance(owner, str) and owner else None
            if b.kind == "vllm":
                r = await self.client.get(b.url + "/metrics", timeout=self.timeout_s)
                b.block_size = block_size_from_metrics(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            pass
