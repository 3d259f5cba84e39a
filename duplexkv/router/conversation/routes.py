"""The conversation lifecycle endpoints (lifecycle.py has the policy):

    POST   /v1/conversations/{id}/keepalive   body optional: {"seconds": s} (default
           `--keepalive-seconds`, at most the router's conversation TTL). The conversation stays
           active that long: the router renews D's lease on its last turn (an agent about to run
           a long tool call). 200 {"id", "object": "conversation.keepalive", "held": bool |
           null (D did not answer; renewals go on), "expires_in_s": float | null}; 404 when
           the router holds no turn of it.
    DELETE /v1/conversations/{id}   the conversation is over: its entry leaves the store and D
           releases the blocks before the answer. 200 {"id", "object": "conversation.deleted",
           "deleted": true, "released": bool | null}; 404 when there is nothing to delete.

Both are behind the router's API keys like every other path, and the id is namespaced by the key
that authenticated the call (store.conversation_key): a client can neither keep alive nor delete
another tenant's conversation, and cannot tell whether it exists.
"""

from __future__ import annotations

import json
import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duplexkv.http.auth import api_key_of
from duplexkv.http.body import read_body
from duplexkv.http.errors import APIError, bad_request
from duplexkv.router.conversation.lifecycle import LeaseKeeper
from duplexkv.router.conversation.store import ConversationStore, conversation_key

MAX_ID_CHARS = 1024
MAX_BODY = 4096


def _not_found(conv_id: str) -> APIError:
    return APIError(404, f"No conversation {conv_id!r} is held for this API key",
                    type="not_found_error")


def _store_down(e: Exception) -> APIError:
    return APIError(503, f"the conversation store is unavailable ({type(e).__name__})",
                    type="service_unavailable_error")


def _conv_id(request: Request) -> str:
    conv_id = request.path_params["conversation_id"]
    if not conv_id or len(conv_id) > MAX_ID_CHARS:
        raise bad_request(f"a conversation id is 1 to {MAX_ID_CHARS} characters")
    return conv_id


async def _seconds(request: Request, default: float, most: float) -> float:
    raw = await read_body(request, MAX_BODY)
    if not raw.strip():
        return default
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the body must be JSON: {\"seconds\": <number>}") from None
    if not isinstance(body, dict) or set(body) - {"seconds"}:
        raise bad_request("the body may only hold `seconds`")
    s = body.get("seconds", default)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) \
            or not 0 < s <= most:
        raise bad_request(f"`seconds` must be a number in (0, {most:g}]", "seconds")
    return float(s)


def routes(store: ConversationStore, keeper: LeaseKeeper, default_s: float,
           most_s: float) -> list[Route]:
    async def keepalive(request: Request) -> Response:
        try:
            conv_id = _conv_id(request)
            seconds = await _seconds(request, default_s, most_s)
            key = conversation_key(api_key_of(request.scope), conv_id)
            try:
                entry = await store.peek(key)
            except Exception as e:  # noqa: BLE001 - the store's failure, not the client's
                raise _store_down(e) from None
            if entry is None:
                keeper.metrics.lifecycle.labels("keepalive", "not_found").inc()
                raise _not_found(conv_id)
        except APIError as e:
            return e.response()
        outcome, left = await keeper.keepalive(key, entry, seconds)
        keeper.metrics.lifecycle.labels("keepalive", outcome).inc()
        return JSONResponse({"id": conv_id, "object": "conversation.keepalive",
                             "held": None if outcome == "error" else outcome == "held",
                             "expires_in_s": None if left is None else round(left, 3)})

    async def delete(request: Request) -> Response:
        try:
            conv_id = _conv_id(request)
            key = conversation_key(api_key_of(request.scope), conv_id)
            try:
                taken = await store.take(key)
            except Exception as e:  # noqa: BLE001 - as in keepalive
                raise _store_down(e) from None
            if taken.entry is None:
                keeper.metrics.lifecycle.labels("delete", "not_found").inc()
                raise _not_found(conv_id)
        except APIError as e:
            return e.response()
        released = await keeper.delete(key, taken.entry)
        keeper.metrics.lifecycle.labels(
            "delete", "error" if released is None else "released" if released
            else "not_held").inc()
        return JSONResponse({"id": conv_id, "object": "conversation.deleted", "deleted": True,
                             "released": released})

    return [Route("/v1/conversations/{conversation_id:path}/keepalive", keepalive,
                  methods=["POST"]),
            Route("/v1/conversations/{conversation_id:path}", delete, methods=["DELETE"])]
