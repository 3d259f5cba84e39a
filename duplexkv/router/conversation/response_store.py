"""Stored responses (the Responses API's `store`, `previous_response_id`, GET/DELETE by id) where
the router's conversations are: in this process (`--store memory`) or in the same Redis
(`--store redis://...`), so any router replica on that Redis continues a chain another started.

In Redis each response is one key under `duplexkv:resp:` with its own expiry (PX); a sorted set
of put times and a hash of sizes keep the count and the bytes bounded (oldest first out), all in
one Lua script. A failing Redis is a 503 for the request that needs a stored response (GET,
DELETE, previous_response_id); storing a new one that fails is logged and the answer still goes
out (http/responses_api/front.py). Redis sits behind a circuit breaker (`GuardedResponseStore`,
the conversation store's `Breaker`): with Redis down or hung, a call waits at most one socket
timeout per breaker period; in between, lookups are a 503 at once and new responses go unstored
without waiting (a user's agent loop would otherwise pay the timeout on every turn's `store`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from duplexkv.http.errors import APIError
from duplexkv.http.responses_api.store import (
    MemoryResponseStore,
    ResponseStore,
    StoredResponse,
    StoreSkipped,
    response_key,
)
from duplexkv.router.conversation.breaker import Breaker, BreakerOpen

log = logging.getLogger("duplexkv.router")
T = TypeVar("T")

# KEYS: entry, index zset, sizes hash. ARGV: value, ttl ms, now ms, max entries, max bytes, size
_PUT = """
local function drop(k)
  local s = redis.call('HGET', KEYS[3], k)
  if s then
    redis.call('HINCRBY', KEYS[3], '#total', -tonumber(s))
    redis.call('HDEL', KEYS[3], k)
  end
  redis.call('ZREM', KEYS[2], k)
  redis.call('DEL', k)
end
drop(KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], ARGV[6])
redis.call('HINCRBY', KEYS[3], '#total', tonumber(ARGV[6]))
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf',
                              tonumber(ARGV[3]) - tonumber(ARGV[2]))) do
  drop(k)
end
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[4])
      or tonumber(redis.call('HGET', KEYS[3], '#total') or 0) > tonumber(ARGV[5]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
return 1
"""
# KEYS: entry, index zset, sizes hash -> 1 if the entry was there
_DELETE = """
local existed = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
local s = redis.call('HGET', KEYS[3], KEYS[1])
if s then
  redis.call('HINCRBY', KEYS[3], '#total', -tonumber(s))
  redis.call('HDEL', KEYS[3], KEYS[1])
end
return existed
"""


def unavailable() -> APIError:
    return APIError(503, "The response store is not available; try again.",
                    type="service_unavailable_error")


class RedisResponseStore(ResponseStore):
    def __init__(self, url: str, *args, prefix: str = "duplexkv:resp:", timeout_s: float = 0.5,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import redis.asyncio as aioredis  # the `redis` extra, as the conversation store's

        self.prefix = prefix
        self.index, self.sizes = prefix + "#index", prefix + "#sizes"
        self.redis = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                             socket_timeout=timeout_s)
        self._put = self.redis.register_script(_PUT)
        self._delete = self.redis.register_script(_DELETE)

    def _keys(self, api_key: str | None, response_id: str) -> list[str]:
        return [self.prefix + response_key(api_key, response_id), self.index, self.sizes]

    async def get(self, api_key: str | None, response_id: str) -> StoredResponse | None:
        raw = await self.redis.get(self._keys(api_key, response_id)[0])
        if raw is None:
            return None
        try:
            return StoredResponse.loads(raw)
        except (ValueError, KeyError, TypeError) as e:  # not ours (written by hand?): not there
            log.warning("stored response %.40s unreadable (%r): treated as absent", response_id, e)
            return None

    async def put(self, api_key: str | None, entry: StoredResponse) -> bool:
        raw = entry.dumps().encode("utf-8", "surrogatepass")
        if len(raw) > self.max_entry_bytes:
            return False
        ttl_ms = int(self.ttl_s * 1000)
        await self._put(keys=self._keys(api_key, entry.response["id"]),
                        args=[raw, ttl_ms, int(time.time() * 1000), self.max_entries,
                              self.max_bytes, len(raw)])
        return True

    async def delete(self, api_key: str | None, response_id: str) -> bool:
        return bool(await self._delete(keys=self._keys(api_key, response_id)))

    async def close(self) -> None:
        await self.redis.aclose()


class GuardedResponseStore(ResponseStore):
    """A response store behind a `Breaker`. Any failure of a lookup (get, delete) is a 503
    (`unavailable`); while the breaker is open, lookups are that 503 at once and `put` raises
    `StoreSkipped` without calling the store; the first call after the period probes it."""

    def __init__(self, inner: ResponseStore, breaker_period_s: float) -> None:
        super().__init__(inner.ttl_s, inner.max_entries, inner.max_bytes, inner.max_entry_bytes)
        self.inner = inner
        self.breaker = Breaker("the response store", breaker_period_s)

    async def _call(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        try:
            return await self.breaker.run(call)
        except BreakerOpen as e:
            log.debug("response store %s skipped: %s", what, e)
            raise StoreSkipped(str(e)) from None

    async def _lookup(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        try:
            return await self._call(call, what)
        except Exception:  # noqa: BLE001 - any client error or an open breaker: unavailable
            raise unavailable() from None

    async def get(self, api_key: str | None, response_id: str) -> StoredResponse | None:
        return await self._lookup(lambda: self.inner.get(api_key, response_id), "get")

    async def put(self, api_key: str | None, entry: StoredResponse) -> bool:
        return await self._call(lambda: self.inner.put(api_key, entry), "put")

    async def delete(self, api_key: str | None, response_id: str) -> bool:
        return await self._lookup(lambda: self.inner.delete(api_key, response_id), "delete")

    async def close(self) -> None:
        await self.inner.close()


def make_response_store(url: str, ttl_s: float, timeout_s: float = 0.5,
                        breaker_period_s: float = 5.0) -> ResponseStore:
    """Where `--store` keeps conversations: `memory` (cannot fail), or the same Redis behind a
    breaker."""
    if url == "memory":
        return MemoryResponseStore(ttl_s)
    return GuardedResponseStore(RedisResponseStore(url, ttl_s, timeout_s=timeout_s),
                                breaker_period_s)
