"""The router's HTTP client to the workers: one pooled `httpx.AsyncClient` (health checks,
/v1/models, https workers) plus, for plain-http generation calls, httpx Requests handed straight
to the lean `FastTransport` (skipping the client layer's auth/redirect/cookie/hook machinery,
which the router does not use and which costs ~0.2 ms of CPU per call).

The worker API key (`--worker-api-key`) is the client's default header for its GETs; `post`
callers put it in their own headers (`RouterConfig.worker_headers`), as `send` adds no defaults.

`probe_client` (the liveness probes, liveness.py) keeps no connection: each probe connects
afresh, so a host that became unreachable fails the probe's connect (bounded on its own) instead
of a pooled connection's read, which waits as long as a loaded worker is given to answer.
"""

from __future__ import annotations

import httpx

from duplexkv.router.config import RouterConfig
from duplexkv.router.http_client import FastTransport


class Upstream:
    def __init__(self, cfg: RouterConfig) -> None:
        self.timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        self._timeouts = self.timeout.as_dict()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512,
                              keepalive_expiry=60)
        self.fast = FastTransport() if cfg.upstream_http == "fast" else None
        if self.fast is None:
            self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits, trust_env=False,
                                            headers=cfg.worker_headers())
        else:
            self.client = httpx.AsyncClient(
                timeout=self.timeout, trust_env=False, transport=self.fast,
                headers=cfg.worker_headers(),
                mounts={"https://": httpx.AsyncHTTPTransport(limits=limits)})
        self.probe_client = httpx.AsyncClient(
            timeout=self.timeout, trust_env=False, headers=cfg.worker_headers(),
            limits=httpx.Limits(max_keepalive_connections=0))
        self._urls: dict[str, httpx.URL] = {}  # parsing a URL costs ~0.1 ms in httpx

    def url(self, url: str) -> httpx.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        return parsed

    async def post(self, url: str, content: bytes, headers: dict[str, str],
                   stream: bool = False) -> httpx.Response:
        """POST; with `stream` the body is left to read (and the response to close)."""
        target = self.url(url)
        request = httpx.Request("POST", target, content=content, headers=headers,
                                extensions={"timeout": self._timeouts})
        if self.fast is None or target.scheme != "http":
            return await self.client.send(request, stream=stream)
        response = await self.fast.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.probe_client.aclose()
