"""`/v1/responses` on a worker: OpenAI's Responses API run through the worker's own chat path
(`OpenAIServing.handle` with the translated chat body: the same validation, parsers, grammar
and engine as /v1/chat/completions), with stored responses in this process
(`http/responses_api`: bounded, expiring after `ttl_s`, namespaced by API key).

    POST   /v1/responses                  create (JSON or stream)
    GET    /v1/responses/{response_id}    a stored response
    GET    /v1/responses/{response_id}/input_items   the items it was generated from, paged
    DELETE /v1/responses/{response_id}
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from duplexkv.http.auth import api_key_of
from duplexkv.http.body import read_body
from duplexkv.http.errors import APIError
from duplexkv.http.responses_api.front import ChatAnswer, ResponsesFront
from duplexkv.http.responses_api.store import DEFAULT_TTL_S, MemoryResponseStore
from duplexkv.server.serving import OpenAIServing


def add_routes(app: FastAPI, serving: OpenAIServing, ttl_s: float = DEFAULT_TTL_S) -> None:
    front = ResponsesFront(MemoryResponseStore(ttl_s), serving.model)
    app.state.responses = front

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        async def run(chat: dict, _key: str | None) -> ChatAnswer:
            return ChatAnswer(await serving.handle(request, "chat", body=chat))

        try:
            raw = await read_body(request, serving.max_request_bytes)
            return await front.create(raw, api_key_of(request.scope), run)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:
            return e.response()

    @app.get("/v1/responses/{response_id}")
    async def get(request: Request, response_id: str) -> Response:
        return await front.get(api_key_of(request.scope), response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        return await front.input_items(api_key_of(request.scope), response_id,
                                       request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return await front.delete(api_key_of(request.scope), response_id)
