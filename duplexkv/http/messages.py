"""`POST /v1/messages` at the HTTP edge, shared by the worker and the router: both run the
request as a chat request (`to_chat`, wire/messages_api.py) and hand the chat answer they made
(a Response, JSON or SSE) to `as_message`, which answers in Anthropic's shapes
(wire/messages_answer.py):

    200 JSON    the chat answer -> a Message
    200 SSE     the chat stream's events, as they come -> Anthropic's events (the chat stream's
                cleanup, its `on_close`, still runs once, whoever ends the stream)
    an error    any status, any body (ours in OpenAI's shape, a worker's relayed by the router)
                -> {"type": "error", "error": {"type", "message"}} with the same status, which
                the anthropic SDK reads
`error_response` is the same shape for an APIError raised before the chat path runs, and
`shaped` for the apps' own error handlers (an unknown method, an unexpected exception).
`/v1/messages/count_tokens` is the worker's /tokenize of the prompt (`to_count`, `as_count`).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from duplexkv.http.errors import APIError
from duplexkv.http.sse import SSEResponse
from duplexkv.wire.messages_answer import MessageStream, error_body, message_of
from duplexkv.wire.messages_api import MessagesError, chat_request, count_request

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
_PASSED_HEADERS = ("x-request-id",)


def to_chat(body: dict) -> dict:
    """A Messages body -> the chat body that runs it; a 400 (APIError) naming the field."""
    try:
        return chat_request(body)
    except MessagesError as e:
        raise APIError(400, e.message, param=e.param) from None


def to_count(body: dict) -> dict:
    """A count_tokens body -> the worker's /tokenize body for its prompt; a 400 naming the
    field."""
    try:
        return count_request(body)
    except MessagesError as e:
        raise APIError(400, e.message, param=e.param) from None


def as_count(resp: Response) -> Response:
    """A /tokenize answer -> count_tokens' {"input_tokens"} (errors in Anthropic's shape)."""
    headers = _headers(resp)
    raw = bytes(resp.body)
    if resp.status_code != 200:
        return error_response(resp.status_code, _error_message(raw), headers)
    return JSONResponse({"input_tokens": json.loads(raw)["count"]}, headers=headers)


def relayed(status: int, raw: bytes) -> Response:
    """A worker's count_tokens answer passed on: a 200 as it is, an error in Anthropic's shape
    (whatever shape the worker used)."""
    if status == 200:
        return Response(raw, 200, media_type="application/json")
    return error_response(status, _error_message(raw))


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def shaped(path: str, err: APIError) -> Response:
    """An app-wide error handler's answer: Anthropic's shape on the Messages paths, else ours."""
    if path.startswith(PATH):
        return error_response(err.status, err.message)
    return err.response()


def _headers(resp: Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() in _PASSED_HEADERS}


def _error_message(raw: bytes) -> str:
    """The message of an error body in OpenAI's shape (else the body's text, cut)."""
    try:
        body = json.loads(raw)
        message = body["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, TypeError, KeyError):
        pass
    return raw.decode("utf-8", "replace")[:500] or "error"


def as_message(resp: Response, model: str | None = None) -> Response:
    """A chat endpoint's answer -> the Messages API's (module docstring)."""
    headers = _headers(resp)
    if isinstance(resp, StreamingResponse):
        chunks = resp.body_iterator
        inner_close = resp.on_close if isinstance(resp, SSEResponse) else _nothing

        async def on_close() -> None:  # the chat stream's cleanup, even if never started
            await chunks.aclose()  # type: ignore[attr-defined]
            await inner_close()

        return SSEResponse(_events(chunks, MessageStream(model or "")), on_close,
                           headers={**headers, "Cache-Control": "no-cache"})
    raw = bytes(resp.body)
    if resp.status_code != 200:
        return error_response(resp.status_code, _error_message(raw), headers)
    try:
        chat = json.loads(raw)
    except ValueError:
        chat = None
    if not isinstance(chat, dict):
        return error_response(502, "the chat answer is not a JSON object", headers)
    return JSONResponse(message_of(chat, model), headers=headers)


async def _nothing() -> None:
    return None


async def _events(chunks: AsyncIterator[str | bytes], stream: MessageStream
                  ) -> AsyncIterator[str]:
    """The chat stream's SSE text -> Anthropic's events; the chat stream is closed on the way
    out (whatever ends this one)."""
    buf, utf8 = "", codecs.getincrementaldecoder("utf-8")("replace")
    try:
        async for chunk in chunks:
            buf += utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
            while "\n\n" in buf:
                raw, buf = buf.split("\n\n", 1)
                for line in _translate(raw, stream):
                    yield line
        for line in _translate(buf, stream) if buf.strip() else ():
            yield line
        for line in stream.done():
            yield line
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _translate(raw: str, stream: MessageStream) -> list[str]:
    data = "".join(line[5:].strip() for line in raw.replace("\r", "").split("\n")
                   if line.startswith("data:"))
    if not data:
        return []
    if data == "[DONE]":
        return stream.done()
    try:
        obj = json.loads(data)
    except ValueError:
        return []
    if not isinstance(obj, dict):
        return []
    if isinstance(obj.get("error"), dict):
        err = obj["error"]
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return stream.error(status, str(err.get("message") or "error"))
    return stream.feed(obj)


__all__ = ["COUNT_PATH", "PATH", "as_count", "as_message", "error_response", "relayed",
           "shaped", "to_chat", "to_count"]
