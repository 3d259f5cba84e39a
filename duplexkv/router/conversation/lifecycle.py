"""Conversation lifecycle on the router: which retained turns D should keep, and which it dropped.

    active     a conversation is active while a turn of it is in flight (from recall to the
               next remember, at most the request timeout) and while its client keeps it alive
               (`POST /v1/conversations/{id}/keepalive`, for `seconds`); every `period` the
               router renews the leases of the active conversations' entries on their D
               (`POST /v1/kv/retention`, http/retention_sync.py), which holds them for its
               `decoder_kv_lease_duration` more, never past `decoder_kv_blocks_ttl`
    deleted    `DELETE /v1/conversations/{id}`: the entry leaves the store and D releases its
               blocks before the call returns
    dropped    the same call brings D's release notices (every entry it released since the last
               generation the router saw); an entry D no longer holds is never handed out
               again (`is_dropped`, checked at recall: P spends no verify round trip on it),
               and once it is PRUNE_AFTER_S old it leaves an in-memory store (`prune`): D
               releases under pressure, and a finished conversation's last entry would
               otherwise stay in the router's memory for the whole conversation TTL (450 s;
               the router's RSS grew ~1.8 MB/min in every soak shorter than that)

State is per router process (with several routers on one Redis, each renews the turns it runs
and the keepalives it receives, and each learns every D's releases). A D that fails the call is
retried next period; nothing here ever fails a client's turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter

from duplexkv.http import retention_sync as rs
from duplexkv.router.conversation.store import Entry

log = logging.getLogger("duplexkv.router")
DROPPED_PER_D = 65536  # release notices remembered per D (oldest first out)
SYNC_TIMEOUT_S = 5.0
NO_API_RECHECK_S = 300.0  # a D without the retention API (404: vLLM's) is asked again after this
PRUNE_AFTER_S = 60.0  # a released entry's age (since stored) before it leaves the store


def retained_id(entry: Entry) -> str | None:
    rid = entry.params.get("remote_request_id") if isinstance(entry.params, dict) else None
    return rid if isinstance(rid, str) and rid else None


@dataclass(slots=True)
class Active:
    decode_url: str
    rid: str
    keep_until: float = 0.0  # monotonic: kept alive by its client until then
    turn_until: float = 0.0  # monotonic: a turn is in flight (bounded by the request timeout)

    def active(self, now: float) -> bool:
        return self.keep_until > now or self.turn_until > now


class LifecycleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = {"registry": registry}
        self.renewals = Counter("duplexkv_router_lease_renewals", "Retained-turn leases the "
                                "router asked D to renew, by D's answer (held, unknown)",
                                ["result"], **m)
        self.invalidated = Counter("duplexkv_router_entries_invalidated", "Conversation entries "
                                   "not handed out because D had released them", **m)
        self.notices = Counter("duplexkv_router_release_notices", "Release notices received "
                               "from decode workers", **m)
        self.lifecycle = Counter("duplexkv_router_conversation_calls", "Conversation lifecycle "
                                 "calls by op (keepalive, delete) and outcome (held, released, "
                                 "not_found, not_held, error)", ["op", "outcome"], **m)
        self.sync_errors = Counter("duplexkv_router_retention_sync_errors",
                                   "Failed retention calls to decode workers", **m)
        for r in ("held", "unknown"):
            self.renewals.labels(r)


class LeaseKeeper:
    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], period_s: float,
                 turn_timeout_s: float, metrics: LifecycleMetrics) -> None:
        self.client, self.headers = client, {**headers, "content-type": "application/json"}
        self.period_s, self.turn_timeout_s, self.metrics = period_s, turn_timeout_s, metrics
        self.active: dict[str, Active] = {}  # conversation key ->
        self.dropped: dict[str, OrderedDict[str, None]] = {}  # D url -> released ids
        self.since: dict[str, int] = {}  # D url -> last release generation seen
        self.no_api: dict[str, float] = {}  # D url -> monotonic time to ask it again
        self.decode_urls: Callable[[], list[str]] = list
        # the store's prune (Conversations sets it): released entries leave an in-memory store
        self.prune: Callable[[Callable[[Entry], bool]], int] | None = None
        self._task: asyncio.Task | None = None

    # a turn's hooks (via Conversations, recall.py) ---------------------------------------
    def is_dropped(self, entry: Entry) -> bool:
        rid = retained_id(entry)
        return rid is not None and rid in self.dropped.get(entry.decode_url, ())

    def turn_started(self, key: str, entry: Entry) -> None:
        rid = retained_id(entry)
        if rid is None:
            return
        a = self.active.get(key)
        if a is None or a.rid != rid:
            a = self.active[key] = Active(entry.decode_url, rid, a.keep_until if a else 0.0)
        a.turn_until = time.monotonic() + self.turn_timeout_s

    def turn_finished(self, key: str, entry: Entry | None) -> None:
        """The turn left a new entry (or none): a kept-alive conversation keeps the new one."""
        a = self.active.get(key)
        if a is None:
            return
        rid = retained_id(entry) if entry is not None else None
        if rid is None or a.keep_until <= time.monotonic():
            del self.active[key]
        else:
            self.active[key] = Active(entry.decode_url, rid, a.keep_until)

    # client calls ----------------------------------------------------------------------------
    async def keepalive(self, key: str, entry: Entry, seconds: float) -> tuple[str, float | None]:
        """Keep the conversation active for `seconds` and renew its lease now. -> ("held",
        seconds until D's renewed expiry) | ("not_held", None): D released it | ("error", None):
        D did not answer (the router keeps renewing every period)."""
        rid = retained_id(entry)
        if rid is None:
            return "not_held", None
        a = self.active.get(key)
        if a is None or a.rid != rid:
            a = self.active[key] = Active(entry.decode_url, rid, 0.0, a.turn_until if a else 0.0)
        a.keep_until = max(a.keep_until, time.monotonic() + seconds)
        reply = await self._sync(entry.decode_url, renew=[rid])
        if reply is None:
            return "error", None
        held = reply.held.get(rid)
        if held is None:
            self.active.pop(key, None)
            return "not_held", None
        return "held", held

    async def delete(self, key: str, entry: Entry) -> bool | None:
        """Tell D to release the conversation's blocks now. -> whether D held them (None: D did
        not answer; its lease runs out on its own)."""
        self.active.pop(key, None)
        rid = retained_id(entry)
        if rid is None:
            return False
        reply = await self._sync(entry.decode_url, delete=[rid])
        return None if reply is None else rid not in reply.unknown

    # the loop -----------------------------------------------------------------------------
    def start(self, decode_urls: Callable[[], list[str]]) -> None:
        """`decode_urls()`: the pool's decode workers now (static or discovered)."""
        self.decode_urls = decode_urls
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.sync_all()
            self.prune_released()
            await asyncio.sleep(self.period_s)

    def prune_released(self) -> int:
        """Drop from the store the entries D released at least PRUNE_AFTER_S after they were
        stored (a younger one stays, to be counted `invalidated` at its next turn)."""
        if self.prune is None:
            return 0
        cutoff = time.time() - PRUNE_AFTER_S
        return self.prune(lambda e: e.stored_at < cutoff and self.is_dropped(e))

    async def sync_all(self) -> None:
        now = time.monotonic()
        by_d: dict[str, list[str]] = {url: [] for url in self.decode_urls()}
        for key, a in list(self.active.items()):
            if not a.active(now):
                del self.active[key]
            else:
                by_d.setdefault(a.decode_url, []).append(a.rid)
        await asyncio.gather(*(self._sync(url, renew=ids[:rs.MAX_IDS])
                               for url, ids in by_d.items()
                               if self.no_api.get(url, 0.0) <= now))

    async def _sync(self, url: str, renew: list[str] = (), delete: list[str] = ()
                    ) -> rs.SyncReply | None:
        req = rs.SyncRequest(list(renew), list(delete), self.since.get(url, -1))
        try:
            r = await self.client.post(url + "/v1/kv/retention", content=rs.encode(req),
                                       headers=self.headers, timeout=SYNC_TIMEOUT_S)
            if r.status_code == 404:  # a worker without KV transfer, or vLLM's: no call
                self.no_api[url] = time.monotonic() + NO_API_RECHECK_S  # every period
                return None
            r.raise_for_status()
            reply = rs.decode_reply(r.content)
        except (httpx.HTTPError, msgspec.ValidationError, msgspec.DecodeError) as e:
            self.metrics.sync_errors.inc()
            log.debug("retention call to %s failed: %r", url, e)
            return None
        self._learn(url, req, reply)
        return reply

    def _learn(self, url: str, req: rs.SyncRequest, reply: rs.SyncReply) -> None:
        self.metrics.renewals.labels("held").inc(len(reply.held))
        self.metrics.renewals.labels("unknown").inc(len(set(reply.unknown) & set(req.renew)))
        self.since[url] = reply.generation  # all releases up to it are in the reply
        gone = reply.released + reply.unknown
        self.metrics.notices.inc(len(reply.released))
        dropped = self.dropped.setdefault(url, OrderedDict())
        for rid in gone:
            dropped[rid] = None
        while len(dropped) > DROPPED_PER_D:
            dropped.popitem(last=False)
        if gone:
            gone_set = set(gone)
            for key in [k for k, a in self.active.items()
                        if a.decode_url == url and a.rid in gone_set]:
                del self.active[key]
