"""A server-sent-events response that always cleans up (shared by the worker and the router)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.responses import StreamingResponse


class SSEResponse(StreamingResponse):
    """Always closes its body iterator and then runs `on_close`, even when the client left before
    the first byte, so that a dropped client aborts the request upstream (engine or D leg)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()
