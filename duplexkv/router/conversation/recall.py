"""A conversation's turns as the router uses them: which entry a turn replays, what it keeps.

    recall     (api key, conversation id) -> the stored entry, taken (single use); no id: the
               entry of the newest stored prefix of the request's messages (recognise.py),
               looked up newest first and taken the same way; neither -> none
    remember   D's params of a finished turn (remote_host fixed up if loopback) -> the store;
               a D that returned none (e.g. vLLM without bidirectional KV transfer) leaves a
               marker with empty params, so that the next turn reports `not_retained` instead of
               a bare `miss` (counted; logged once per D worker: it is the worker's setting)
    lifecycle  with a `LeaseKeeper` (lifecycle.py): an entry D has released is not handed out
               (state "invalidated", the turn runs as a miss), a recalled entry's lease is
               renewed while its turn is in flight, a kept-alive conversation's new entry too
    expiry     D's `remote_blocks_expiry_time` (D's perf_counter clock) is honoured when D is
               on this host (same monotonic clock): an entry within EXPIRY_MARGIN_S of it is
               not replayed (`expired`); for another host only the router's TTL applies
    outages    a failing store costs reuse, never the request: the turn runs as a miss, the
               failure is logged and counted (while the store's breaker is open, calls are
               skipped: counted, logged at debug level only)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from duplexkv.router.conversation.breaker import BreakerOpen
from duplexkv.router.conversation.lifecycle import LeaseKeeper
from duplexkv.router.conversation.recognise import Recognition
from duplexkv.router.conversation.store import (
    ConversationStore,
    Entry,
    TakeResult,
    conversation_key,
)
from duplexkv.router.legs import rewrite_remote_host, shares_our_clock
from duplexkv.router.metrics import RouterMetrics

log = logging.getLogger("duplexkv.router")
EXPIRY_MARGIN_S = 1.0  # D's blocks must outlive the P leg's read by this much


@dataclass(frozen=True, slots=True)
class Recalled:
    """What the store held for a turn's conversation when the turn began."""

    key: str | None  # the store key; None: no conversation (neither named nor recognisable)
    entry: Entry | None  # the entry to replay (taken: no other turn gets it); None: a miss
    state: str  # none | miss | expired | invalidated | hit | not_retained
    recognition: Recognition | None = None  # no id: the content's keys (recognise.py)
    recognised: bool | None = None  # no id: whether a stored turn matched (None: an id, or none)


class Conversations:
    def __init__(self, store: ConversationStore, metrics: RouterMetrics,
                 rewrite_host: bool = True, keeper: LeaseKeeper | None = None) -> None:
        self.store, self.metrics, self.rewrite_host = store, metrics, rewrite_host
        self.keeper = keeper  # lifecycle.py: renews the leases of active conversations
        if keeper is not None:
            keeper.prune = store.prune  # and drops what D released from an in-memory store
        self._warned: set[str] = set()  # D workers already logged as not retaining

    async def recall(self, api_key: str | None, conversation_id: str | None,
                     request_id: str, recognition: Recognition | None = None,
                     key: str | None = None) -> Recalled:
        """The entry of the conversation the request names (by id, or by its store `key`: a
        Responses chain's), else of the one its content continues (`recognition`: the
        prefixes to look up, newest first; an explicit id wins)."""
        if conversation_id is not None:
            key = conversation_key(api_key, conversation_id)
        if key is not None:
            return self._classify(key, await self._take(key, request_id))
        if recognition is None:
            return Recalled(None, None, "none")
        for key in recognition.candidates:
            taken = await self._take(key, request_id)
            if taken is None:  # the store failed: a miss
                break
            if taken.entry is not None or taken.expired:
                self.metrics.recognised.labels("matched").inc()
                return replace(self._classify(key, taken), recognition=recognition,
                               recognised=True)
        self.metrics.recognised.labels("unmatched").inc()
        self.metrics.conversations.labels("miss").inc()
        return Recalled(recognition.own_key, None, "miss", recognition, False)

    async def _take(self, key: str, request_id: str) -> TakeResult | None:
        try:
            return await self.store.take(key)
        except Exception as e:  # noqa: BLE001 - any store failure: run the turn as a miss
            _log_failure(request_id, "take", e)
            self.metrics.store_errors.labels("take").inc()
            return None

    def _classify(self, key: str, taken: TakeResult | None) -> Recalled:
        """What a take from the store gives the turn (None: the store failed)."""
        m = self.metrics.conversations
        if taken is None:
            return Recalled(key, None, "miss")
        if taken.expired:
            m.labels("expired").inc()
        if taken.entry is None:
            m.labels("miss").inc()
            return Recalled(key, None, "expired" if taken.expired else "miss")
        if not taken.entry.params:  # D kept nothing last turn: a miss, and why
            m.labels("miss").inc()
            return Recalled(key, None, "not_retained")
        if _past_d_expiry(taken.entry):
            m.labels("expired").inc()
            m.labels("miss").inc()
            return Recalled(key, None, "expired")
        if self.keeper is not None:
            if self.keeper.is_dropped(taken.entry):
                self.keeper.metrics.invalidated.inc()
                m.labels("invalidated").inc()
                return Recalled(key, None, "invalidated")
            self.keeper.turn_started(key, taken.entry)
        m.labels("hit").inc()
        return Recalled(key, taken.entry, "hit")

    async def remember(self, key: str | None, decode_url: str, params: dict | None,
                       request_id: str, tokens: list[int] | None = None,
                       recalled_key: str | None = None) -> None:
        """`recalled_key`: the key the turn was recalled under, when the entry goes to another
        (a recognised conversation's key moves with every turn)."""
        if recalled_key not in (None, key) and self.keeper is not None:
            self.keeper.turn_finished(recalled_key, None)
        if key is None:
            return
        if not params:
            if self.keeper is not None:
                self.keeper.turn_finished(key, None)
            params = {}
            self.metrics.conversations.labels("not_retained").inc()
            if decode_url not in self._warned:
                self._warned.add(decode_url)
                log.warning("decode worker %s returned no kv_transfer_params: it keeps no KV "
                            "for the next turn (a vLLM D needs bidirectional KV transfer), so "
                            "its conversations run as plain P/D (one-way transfer) every turn",
                            decode_url)
        elif self.rewrite_host:
            params = rewrite_remote_host(params, decode_url)
        entry = Entry(params, decode_url, time.time(), tokens if params else None)
        if params and self.keeper is not None:
            self.keeper.turn_finished(key, entry)
        try:
            res = await self.store.put(key, entry)
        except Exception as e:  # noqa: BLE001 - as in recall
            _log_failure(request_id, "put", e)
            self.metrics.store_errors.labels("put").inc()
            return
        m = self.metrics.conversations
        if params:
            m.labels("stored").inc()
        m.labels("expired").inc(res.expired)
        m.labels("evicted").inc(res.evicted)


def _past_d_expiry(entry: Entry) -> bool:
    expiry = entry.params.get("remote_blocks_expiry_time")
    if (not isinstance(expiry, (int, float)) or isinstance(expiry, bool)
            or not math.isfinite(expiry) or not shares_our_clock(entry.decode_url)):
        return False
    return expiry - EXPIRY_MARGIN_S <= time.perf_counter()


def _log_failure(request_id: str, op: str, e: Exception) -> None:
    level = logging.DEBUG if isinstance(e, BreakerOpen) else logging.WARNING
    log.log(level, "%s: conversation store %s failed: %r", request_id, op, e)
