"""The router's side of discovery: read every registration in Redis, every `interval_s`.

    poll   SCAN MATCH duplexkv:workers:* then MGET in batches; each value is checked by
           `record.decode` (shape, key = id, signature and age when the router has a secret)
    -> Snapshot(records by id, rejected keys with their reason), handed to `on_snapshot`
    fail   Redis down or slow: `on_error(exc)`, nothing else changes (the router keeps the
           members it knows: a Redis outage removes no worker); the next poll tries again

The whole poll is bounded (`poll_timeout_s`), and so is what it reads: at most MAX_RECORDS keys,
values over MAX_RECORD_BYTES are rejected unread by the decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from duplexkv.discovery.client import connect
from duplexkv.discovery.record import (
    KEY_PREFIX,
    DiscoveryURL,
    Registration,
    RegistrationError,
    decode,
)

log = logging.getLogger("duplexkv.discovery")
MAX_RECORDS = 1024
BATCH = 256


@dataclass(slots=True)
class Snapshot:
    records: dict[str, Registration] = field(default_factory=dict)  # by worker id
    rejected: dict[str, str] = field(default_factory=dict)  # Redis key -> reason
    truncated: bool = False


class Watcher:
    def __init__(self, url: DiscoveryURL, key: bytes | None, interval_s: float,
                 on_snapshot: Callable[[Snapshot], None],
                 on_error: Callable[[BaseException], None], timeout_s: float = 1.0,
                 prefix: str = KEY_PREFIX) -> None:
        self.url, self._key, self.interval_s, self.prefix = url, key, interval_s, prefix
        self.on_snapshot, self.on_error = on_snapshot, on_error
        self.poll_timeout_s = 4 * timeout_s
        self.redis = connect(url, timeout_s)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="discovery-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> Snapshot | None:
        try:
            snap = await asyncio.wait_for(self.poll(), self.poll_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any client error: keep the members, retry
            self.on_error(e)
            return None
        self.on_snapshot(snap)
        return snap

    async def poll(self) -> Snapshot:
        keys: list[bytes] = []
        truncated = False
        async for k in self.redis.scan_iter(match=self.prefix + "*", count=BATCH):
            if len(keys) == MAX_RECORDS:
                truncated = True
                break
            keys.append(k if isinstance(k, bytes) else k.encode())
        snap = Snapshot(truncated=truncated)
        now = time.time()
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            for raw_key, raw in zip(batch, await self.redis.mget(batch), strict=True):
                if raw is None:  # expired or deleted between SCAN and MGET
                    continue
                k = raw_key.decode(errors="replace")
                try:
                    reg = decode(raw, k, self._key, now, self.prefix)
                except RegistrationError as e:
                    snap.rejected[k] = e.reason
                    continue
                snap.records[reg.id] = reg
        return snap
