"""Issue 32, the router's memory growth (~1.8 MB/min in every soak): the in-memory conversation
store kept every finished conversation's last entry for the whole conversation TTL (450 s) even
after D had released its blocks under pressure (a soak at t=340 s: 414 entries in the store, 0
retained on D). Entries D released leave the store once PRUNE_AFTER_S old; a younger one stays
(its next turn still counts it `invalidated`)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import httpx
from prometheus_client import CollectorRegistry

from duplexkv.router.conversation.lifecycle import PRUNE_AFTER_S, LeaseKeeper, LifecycleMetrics
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.conversation.store import Entry, MemoryStore
from duplexkv.router.metrics import RouterMetrics

D = "http://d:1"


def entry(rid: str, age_s: float) -> Entry:
    return Entry({"remote_request_id": rid}, D, time.time() - age_s)


def test_released_entries_leave_the_memory_store():
    async def run() -> None:
        store = MemoryStore(450, 1000)
        keeper = LeaseKeeper(httpx.AsyncClient(), {}, 10, 600,
                             LifecycleMetrics(CollectorRegistry()))
        Conversations(store, RouterMetrics(), keeper=keeper)
        await store.put("old-released", entry("r1", PRUNE_AFTER_S + 5))
        await store.put("young-released", entry("r2", 1))
        await store.put("old-held", entry("r3", PRUNE_AFTER_S + 5))
        keeper.dropped[D] = OrderedDict({"r1": None, "r2": None})
        assert keeper.prune_released() == 1
        assert await store.size() == 2
        assert (await store.take("old-released")).entry is None
        assert (await store.take("young-released")).entry is not None
        assert (await store.take("old-held")).entry is not None

    asyncio.run(run())
