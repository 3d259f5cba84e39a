"""The router's side of discovery: read every registration in Redis, every `interval_s`.

    poll   the ids in the index (newest first, at most MAX_RECORDS), then MGET their keys in
           batches; each value is checked by `record.decode` (shape, key = id, signature and age
           when the router has a secret); a key that is gone while its index entry stays expired
           (a worker that deregisters removes both in one transaction, registrar.py); index
           entries whose expiry is INDEX_FORGET_S past are pruned
    -> Snapshot(records by id, rejected keys with their reason, expired ids), handed to
       `on_snapshot`
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
    INDEX_FORGET_S,
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
    expired: set[str] = field(default_factory=set)  # ids still indexed whose key expired


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
        now = time.time()
        index = self.prefix + "index"  # INDEX_KEY under this prefix
        await self.redis.zremrangebyscore(index, "-inf", f"({int((now - INDEX_FORGET_S) * 1000)}")
        ids = await self.redis.zrevrangebyscore(index, "+inf", "-inf", start=0,
                                                num=MAX_RECORDS + 1)
        snap = Snapshot(truncated=len(ids) > MAX_RECORDS)
        keys = [self.prefix.encode() + (i if isinstance(i, bytes) else i.encode())
                for i in ids[:MAX_RECORDS]]
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            for raw_key, raw in zip(batch, await self.redis.mget(batch), strict=True):
                k = raw_key.decode(errors="replace")
                if raw is None:  # expired (a deregistered worker's index entry is gone too)
                    snap.expired.add(k[len(self.prefix):])
                    continue
                try:
                    reg = decode(raw, k, self._key, now, self.prefix)
                except RegistrationError as e:
                    snap.rejected[k] = e.reason
                    continue
                snap.records[reg.id] = reg
        return snap
