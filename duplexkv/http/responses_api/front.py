"""`/v1/responses` end to end over a chat runner: the worker passes its own chat path, the router
its turn runner, so the Responses API adds no generation logic of its own.

    POST    parse (request.py) -> with previous_response_id, the stored chain's history (404
            when unknown or expired) and its conversation's key (where the router kept the
            previous turn's KV entry; none kept: the chain is named `response:<that id>` as a
            conversation id) -> the chat body -> run(chat body, conversation key) ->
            JSON: the Response (output.py); stream: the events (events.py) -> with `store`,
            the Response, its history and its items are stored before the client has the
            answer
    GET     the stored Response (404 unless this API key stored it and it has not expired)
    GET     .../input_items: a page of the items it was generated from (input_items.py)
    DELETE  {"id", "object": "response.deleted", "deleted": true}, or 404

An error answer of the chat runner (a 4xx or 5xx, already in OpenAI's shape) goes to the client
as it is; nothing is stored for it.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from duplexkv.http.body import DEFAULT_MAX_JSON_DEPTH, parse_json
from duplexkv.http.errors import APIError
from duplexkv.http.responses_api.events import ResponseEvents
from duplexkv.http.responses_api.input_items import chained, page, parse_query
from duplexkv.http.responses_api.output import ResponseShape, new_id
from duplexkv.http.responses_api.items import input_messages
from duplexkv.http.responses_api.request import ResponsesRequest, parse_responses_request
from duplexkv.http.responses_api.store import ResponseStore, StoredResponse, StoreSkipped
from duplexkv.http.sse import SSEResponse

log = logging.getLogger("duplexkv.http")
# what a request continues: the chain's chat history and its listed items (StoredResponse)
Before = tuple[list[dict], list[dict]]


def _no_key() -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    response: Response  # the chat answer: JSON, an SSEResponse, or an error
    # where the turn left its conversation's KV entry (the router's store key), read once the
    # answer is complete
    kept_key: Callable[[], str | None] = field(default=_no_key)


# (chat body, the conversation key of the chain it continues) -> the chat answer
ChatRun = Callable[[dict, str | None], Awaitable[ChatAnswer]]


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{response_id[:100]}' not found.",
                    type="invalid_request_error" if param else "not_found_error", param=param)


class ResponsesFront:
    def __init__(self, store: ResponseStore, model: str,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self.store, self.model, self.max_json_depth = store, model, max_json_depth

    async def create(self, raw: bytes, api_key: str | None, run: ChatRun) -> Response:
        """Raises APIError for the request's own mistakes (400, 404)."""
        req = parse_responses_request(parse_json(raw, self.max_json_depth))
        history, key, chain = [], None, []
        if req.previous_response_id is not None:
            prev = await self.store.get(api_key, req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history, key, chain = prev.history, prev.conversation_key, prev.chain_items()
        chat = req.chat_body(history)
        if req.previous_response_id is not None and key is None:
            # the chain's first link kept no conversation (nothing recognised): from here on
            # the chain is one, named after that response (the router keys it by API key)
            chat.setdefault("conversation_id", f"response:{req.previous_response_id}")
        shape = ResponseShape(new_id("resp"), req.model or self.model, req.echo)
        answer = await run(chat, key)
        resp = answer.response
        if resp.status_code != 200:
            return resp
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() in ("x-request-id", "cache-control")}
        if isinstance(resp, SSEResponse):
            return SSEResponse(self._events(resp, req, (history, chain), shape, api_key, answer),
                               on_close=_closer(resp), headers=headers)
        out = shape.from_chat(json.loads(resp.body))
        await self._save(api_key, req, (history, chain), out, answer)
        return JSONResponse(out, headers=headers)

    async def _events(self, resp: SSEResponse, req: ResponsesRequest, before: Before,
                      shape: ResponseShape, api_key: str | None,
                      answer: ChatAnswer) -> AsyncIterator[str]:
        events = ResponseEvents(shape)
        for line in events.start():
            yield line
        decoder, buf = codecs.getincrementaldecoder("utf-8")(), ""
        async for chunk in resp.body_iterator:
            buf += decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
            while (end := buf.find("\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2:]
                for line in events.feed_event(event):
                    yield line
            if events.failed:
                return
        lines = events.finish()
        if not events.failed:
            await self._save(api_key, req, before, events.response(), answer)
        for line in lines:
            yield line

    async def _save(self, api_key: str | None, req: ResponsesRequest, before: Before,
                    response: dict, answer: ChatAnswer) -> None:
        if not req.store:
            return
        history, chain = before
        ended = history + req.input_messages + input_messages(response["output"])
        stored = StoredResponse(response, ended, answer.kept_key(),
                                chained(chain, req.input_items))
        try:
            if not await self.store.put(api_key, stored):
                log.warning("response %s not stored: larger than %d bytes", response["id"],
                            self.store.max_entry_bytes)
        except StoreSkipped as e:  # failing, known: said once, when the breaker opened
            log.debug("response %s not stored: %s", response["id"], e)
        except Exception as e:  # noqa: BLE001 - a failing store costs the chain, not the answer
            log.warning("response %s not stored: %r", response["id"], e)

    async def get(self, api_key: str | None, response_id: str) -> Response:
        stored = await self.store.get(api_key, response_id)
        if stored is None:
            return not_found(response_id).response()
        return JSONResponse(stored.response)

    async def input_items(self, api_key: str | None, response_id: str,
                          params: Mapping[str, str]) -> Response:
        """A page of the items the response was generated from (input_items.py); a bad query
        is a 400 (checked before the store is asked), an unknown response a 404, a failing store
        a 503."""
        try:
            query = parse_query(params)
            stored = await self.store.get(api_key, response_id)
            if stored is None:
                raise not_found(response_id)
            return JSONResponse(page(stored.items or [], query))
        except APIError as e:
            return e.response()

    async def delete(self, api_key: str | None, response_id: str) -> Response:
        if not await self.store.delete(api_key, response_id):
            return not_found(response_id).response()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _closer(inner: SSEResponse) -> Callable[[], Awaitable[None]]:
    """Closing the Responses stream closes the chat stream under it (aborting its request)."""
    async def close() -> None:
        await inner.body_iterator.aclose()  # type: ignore[attr-defined]
        await inner.on_close()
    return close
