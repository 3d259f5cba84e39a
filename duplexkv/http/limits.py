"""Header limits: a 431 in OpenAI's shape when a request's headers, all together, exceed the
limit (the HTTP server itself refuses only far larger ones)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from duplexkv.http.errors import APIError

DEFAULT_MAX_HEADER_BYTES = 32 << 10


def headers_too_large(limit: int) -> APIError:
    return APIError(431, f"The request headers are larger than the limit of {limit} bytes.")


class HeaderLimit:
    """ASGI middleware: a 431 in OpenAI's shape when the request's headers, all together, exceed
    `max_bytes` (the HTTP server itself refuses only far larger ones)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(
                len(k) + len(v) + 4 for k, v in scope["headers"]) > self.max_bytes:
            await headers_too_large(self.max_bytes).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
