"""The worker's side of discovery: keep its registration alive in Redis, remove it on the way out.

    start      once the HTTP server listens (the engine is loaded by then)
    heartbeat  every h: SET <key> <record, seq+1, issued now, signed> PX 3h, and ZADD the id to
               the index with the record's expiry (one pipelined round trip)
    failure    Redis down, slow or refusing: log (the first failure, then once a minute), retry
               twice after h/4, then after h, 2h, 4h, ... up to MAX_BACKOFF_S; serving is never
               affected
    stop       (SIGTERM/SIGINT, before the server drains) DEL <key> + ZREM, one timeout, so
               routers stop choosing this worker at their next poll

Every Redis call has a socket timeout (at most the heartbeat, at most 1 s); the loop runs on the
worker's event loop and never blocks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from duplexkv.discovery.client import connect, scrub
from duplexkv.discovery.record import INDEX_KEY, DiscoveryURL, Registration, encode

log = logging.getLogger("duplexkv.discovery")
MAX_BACKOFF_S = 10.0
LOG_EVERY_S = 60.0


def retry_delay(h: float, failures: int) -> float:
    """After a failed heartbeat: two quick retries (the key outlives two missed heartbeats), then
    h, 2h, 4h, ... up to MAX_BACKOFF_S."""
    return h / 4 if failures <= 2 else min(MAX_BACKOFF_S, h * 2 ** min(failures - 3, 8))


class Registrar:
    def __init__(self, url: DiscoveryURL, record: Registration, key: bytes | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.url, self.record, self._key, self._clock = url, record, key, clock
        self.redis = connect(url, min(1.0, record.heartbeat_s))
        self.redis_key = record.key()
        self.state = "starting"  # registered | retrying | stopped
        self.failures = 0  # consecutive
        self.last_ok: float | None = None  # monotonic
        self.last_error = ""
        self._last_log = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="discovery-registrar")

    async def _loop(self) -> None:
        h = self.record.heartbeat_s
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            ok = await self.heartbeat()
            now = loop.time()
            if ok:  # a fixed rate: the call's own time does not stretch the period
                due = max(due + h, now + h / 2)
            else:
                due = now + retry_delay(h, self.failures)
            await asyncio.sleep(max(0.0, due - now))

    async def heartbeat(self) -> bool:
        rec = self.record = msgspec.structs.replace(self.record, seq=self.record.seq + 1,
                                                    issued_at=self._clock())
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.redis_key, encode(rec, self._key), px=rec.ttl_ms())
                pipe.zadd(INDEX_KEY, {rec.id: int(rec.issued_at * 1000) + rec.ttl_ms()})
                await pipe.execute()
        except Exception as e:  # noqa: BLE001 - any client error: retry later, keep serving
            self._failed(e)
            return False
        if self.state != "registered":
            log.info("registered as %s %s (model %s) in %s; heartbeat %.3g s", rec.role, rec.url,
                     rec.model, self.url, rec.heartbeat_s)
        self.state, self.failures, self.last_ok, self.last_error = (
            "registered", 0, time.monotonic(), "")
        return True

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        # the log gets the error's text without the password, /health only its type
        self.last_error = type(e).__name__
        now = time.monotonic()
        if self.failures == 1 or now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("discovery: cannot register in %s (%s: %s); retrying with backoff, "
                        "still serving", self.url, type(e).__name__, scrub(str(e), self.url))
        self.state = "retrying"

    async def stop(self) -> None:
        """Stop the heartbeat and delete the key and its index entry (best effort, one bounded
        call): in one transaction, so a router never sees the key gone and the entry still
        there, which is how it tells an expired key ("lost") from a deregistration ("left")."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.state == "stopped":
            return
        self.state = "stopped"
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.redis_key)
                pipe.zrem(INDEX_KEY, self.record.id)
                await pipe.execute()
            log.info("deregistered from %s", self.url)
        except Exception as e:  # noqa: BLE001 - the key expires by itself
            log.warning("discovery: could not deregister (%s); the key expires in %.3g s",
                        type(e).__name__, self.record.ttl_ms() / 1000)
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def health(self) -> dict:
        """For the worker's /health: no URL, no password."""
        return {"state": self.state, "role": self.record.role, "id": self.record.id,
                "heartbeat_s": self.record.heartbeat_s, "seq": self.record.seq,
                "failures": self.failures, "last_error": self.last_error or None,
                "last_ok_age_s": None if self.last_ok is None
                else round(time.monotonic() - self.last_ok, 3),
                "signed": self._key is not None}
