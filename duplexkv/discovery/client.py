"""The Redis client both sides of discovery use: one timeout per call, no backoff loop inside a
call (the registrar and the watcher decide when to try again), one immediate retry of a refused
or reset connection (a restarted Redis, a stale pooled connection)."""

from __future__ import annotations

from duplexkv.discovery.record import DiscoveryURL


def connect(url: DiscoveryURL, timeout_s: float):
    """A `redis.asyncio.Redis` for `url` (imported only when discovery is configured)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return aioredis.Redis.from_url(
        url.url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))


def scrub(text: str, url: DiscoveryURL) -> str:
    """An error's text with the URL's password (if any) cut out, for the log."""
    from urllib.parse import unquote, urlsplit

    password = urlsplit(url.url).password
    for secret in {password, unquote(password)} if password else ():
        if secret:
            text = text.replace(secret, "***")
    return text
