"""Conversation state: conversation -> D's `kv_transfer_params` of its last turn.

An entry is single-use: `take` removes it atomically, so of two racing turns at most one replays
D's blocks (the other runs as a miss). Entries expire before D frees the blocks (the router's
TTL < D's `decoder_kv_blocks_ttl`) and the store keeps at most `max_entries` (oldest first out).
Keys are namespaced by the caller's API key: one tenant cannot name another's conversation.

Redis is called with short socket timeouts and behind a circuit breaker (`GuardedStore`): with
Redis down or hung, turns run as misses (plain P/D) at the cost of at most one timeout per breaker
period, /health reports the store as degraded, and the first call after a period probes Redis.
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from duplexkv.discovery.record import redact
from duplexkv.router.conversation.breaker import Breaker
from duplexkv.router.verify import token_list


def conversation_key(api_key: str | None, conversation_id: str) -> str:
    """The store key of (tenant, conversation): a digest, so neither is stored in clear."""
    h = hashlib.sha256()
    h.update((api_key or "").encode())
    h.update(b"\x00")
    h.update(conversation_id.encode())
    return h.hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class Entry:
    params: dict  # D's kv_transfer_params, opaque
    decode_url: str  # the D that holds the blocks
    stored_at: float  # wall clock, informational
    # D's sequence whose KV it holds, for a P that does not verify tokens (router/verify.py)
    tokens: list[int] | None = None

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | bytes) -> Entry:
        d = json.loads(raw)
        return cls(d["params"], d["decode_url"], float(d["stored_at"]), token_list(d.get("tokens")))


class TakeResult(NamedTuple):
    entry: Entry | None
    expired: bool = False  # there was one, but it outlived the TTL unused


class PutResult(NamedTuple):
    expired: int  # entries found expired (never used) while making room
    evicted: int  # live entries dropped to stay within the bound


class ConversationStore(ABC):
    """Contract: `take` returns a live entry at most once (atomic get-and-delete) and never one
    older than `ttl_s`; `put` replaces the key's entry and keeps at most `max_entries`."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries

    @abstractmethod
    async def take(self, key: str) -> TakeResult: ...

    @abstractmethod
    async def put(self, key: str, entry: Entry) -> PutResult: ...

    @abstractmethod
    async def size(self) -> int: ...

    @abstractmethod
    async def peek(self, key: str) -> Entry | None:
        """The live entry, left in place (a keepalive reads where the conversation is held)."""

    async def close(self) -> None:
        pass

    def describe(self) -> str:
        """The store's role, for clients (/health): never an address or a credential."""
        return "memory"

    def location(self) -> str:
        """Where the store is, for the operator (log, CLI errors): credentials redacted."""
        return self.describe()

    def state(self) -> str:
        """ok | degraded (failing recently: turns run as misses)."""
        return "ok"

    def held_here(self) -> int:
        """Entries held in this process's memory (GET /debug/memory); 0 for a remote store."""
        return 0

    def prune(self, dead: Callable[[Entry], bool]) -> int:
        """Drop the entries held in this process for which `dead(entry)`; how many (a remote
        store holds none here: its TTL bounds it)."""
        return 0


class MemoryStore(ConversationStore):
    """One process: an OrderedDict in expiry order (one TTL for all: put order = expiry order)."""

    def __init__(self, ttl_s: float, max_entries: int, clock=time.monotonic) -> None:
        super().__init__(ttl_s, max_entries)
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, Entry]] = OrderedDict()

    async def take(self, key: str) -> TakeResult:
        item = self._entries.pop(key, None)
        if item is None:
            return TakeResult(None)
        if item[0] <= self._clock():
            return TakeResult(None, expired=True)
        return TakeResult(item[1])

    async def put(self, key: str, entry: Entry) -> PutResult:
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = (now + self.ttl_s, entry)
        expired = evicted = 0
        while self._entries:
            k, (deadline, _) = next(iter(self._entries.items()))
            if deadline <= now:
                expired += 1
            elif len(self._entries) > self.max_entries:
                evicted += 1
            else:
                break
            del self._entries[k]
        return PutResult(expired, evicted)

    async def size(self) -> int:
        return len(self._entries)

    def held_here(self) -> int:
        return len(self._entries)

    def prune(self, dead: Callable[[Entry], bool]) -> int:
        gone = [k for k, (_, entry) in self._entries.items() if dead(entry)]
        for k in gone:
            del self._entries[k]
        return len(gone)

    async def peek(self, key: str) -> Entry | None:
        item = self._entries.get(key)
        return item[1] if item is not None and item[0] > self._clock() else None


# KEYS: entry key, index zset. ARGV: value, ttl ms, now ms, max entries.
_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
local oldest = tonumber(ARGV[3]) - tonumber(ARGV[2])
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', oldest)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
local evicted = 0
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do
    evicted = evicted + redis.call('DEL', old[i])
  end
end
return {expired, evicted}
"""
# KEYS: entry key, index zset. -> {value or false, 1 if it had expired unused}
_TAKE = """
local v = redis.call('GET', KEYS[1])
local indexed = redis.call('ZREM', KEYS[2], KEYS[1])
if v then
  redis.call('DEL', KEYS[1])
  return {v, 0}
end
return {false, indexed}
"""


class RedisStore(ConversationStore):
    """Shared by every router on one Redis: expiry is the key's own (PX), take is one Lua script
    (GET+DEL+ZREM, atomic on the server), the bound is kept with a sorted set of put times.
    Standalone Redis (the script touches keys it does not declare, so not Redis Cluster)."""

    def __init__(self, url: str, ttl_s: float, max_entries: int, prefix: str = "duplexkv:conv:",
                 timeout_s: float = 0.5) -> None:
        super().__init__(ttl_s, max_entries)
        try:
            import redis.asyncio as aioredis  # only when configured: the `redis` extra
        except ImportError as e:
            raise ValueError(f"a Redis conversation store needs the Redis client, which is not "
                             f"installed ({e}): pip install 'duplexkv[redis]'") from None
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.url = url
        self.prefix = prefix
        self.index = prefix + "index"
        # one timeout per call, no retry of a timeout (the breaker decides when to try again);
        # a refused or reset connection is retried once at once (a restarted Redis, a stale
        # pooled connection)
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._put = self.redis.register_script(_PUT)
        self._take = self.redis.register_script(_TAKE)

    async def take(self, key: str) -> TakeResult:
        raw, expired = await self._take(keys=[self.prefix + key, self.index])
        return TakeResult(None if raw is None else Entry.loads(raw), bool(expired))

    async def put(self, key: str, entry: Entry) -> PutResult:
        ttl_ms, now_ms = int(self.ttl_s * 1000), int(time.time() * 1000)
        expired, evicted = await self._put(keys=[self.prefix + key, self.index],
                                           args=[entry.dumps(), ttl_ms, now_ms, self.max_entries])
        return PutResult(int(expired), int(evicted))

    async def size(self) -> int:
        return int(await self.redis.zcard(self.index))

    async def peek(self, key: str) -> Entry | None:
        raw = await self.redis.get(self.prefix + key)
        return None if raw is None else Entry.loads(raw)

    async def ping(self) -> None:
        await self.redis.ping()

    async def close(self) -> None:
        await self.redis.aclose()

    def describe(self) -> str:
        return "redis"

    def location(self) -> str:
        return redact(self.url)


class GuardedStore(ConversationStore):
    """A store behind a `Breaker`: while it is open every call raises `BreakerOpen` at once (the
    caller runs the turn as a miss); the first call after the period probes the store."""

    def __init__(self, inner: ConversationStore, breaker_period_s: float) -> None:
        super().__init__(inner.ttl_s, inner.max_entries)
        self.inner = inner
        self.breaker = Breaker("the conversation store", breaker_period_s)

    async def _call(self, method, *args) -> Any:
        return await self.breaker.run(lambda: method(*args))

    async def take(self, key: str) -> TakeResult:
        return await self._call(self.inner.take, key)

    async def put(self, key: str, entry: Entry) -> PutResult:
        return await self._call(self.inner.put, key, entry)

    async def size(self) -> int:
        return await self._call(self.inner.size)

    async def peek(self, key: str) -> Entry | None:
        return await self._call(self.inner.peek, key)

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()

    def location(self) -> str:
        return self.inner.location()

    def state(self) -> str:
        return "ok" if self.breaker.healthy else "degraded"


def make_store(url: str, ttl_s: float, max_entries: int, timeout_s: float = 0.5,
               breaker_period_s: float = 5.0) -> ConversationStore:
    """`memory` (cannot fail) or Redis behind a breaker."""
    if url == "memory":
        return MemoryStore(ttl_s, max_entries)
    return GuardedStore(RedisStore(url, ttl_s, max_entries, timeout_s=timeout_s),
                        breaker_period_s)
