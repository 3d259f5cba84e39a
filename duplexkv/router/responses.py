"""`/v1/responses` on the router: OpenAI's Responses API as a chat turn through the turn runner
(P leg + D leg, placement, verified reuse), so a Responses client gets the same reuse as a chat
client; the answer is translated back (http/responses_api).

    conversation   a request with previous_response_id continues the conversation of that
                   response: the store key its turn left D's entry under (`Turn.kept`: a
                   recognised conversation's answer key, or the chain's key) is stored with
                   the response and recalled by the next one, which keeps it under the same
                   key, so a chain of responses is one conversation. Without
                   previous_response_id and without a conversation id the chat turn is
                   recognised from its content (an agent that resends the whole input); an
                   explicit `conversation_id` (or X-Session-ID) wins, as for chat.
    stored         in the router's conversation store's backend (memory, or the same Redis:
                   any replica continues a chain), namespaced by API key, expiring after
                   --conversation-ttl
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from duplexkv.http.auth import api_key_of
from duplexkv.http.body import read_body
from duplexkv.http.errors import APIError, model_not_found
from duplexkv.http.responses_api.front import ChatAnswer, ResponsesFront
from duplexkv.http.responses_api.store import ResponseStore
from duplexkv.router.backends import BackendPool
from duplexkv.router.config import RouterConfig
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.request import client_request
from duplexkv.router.tenants import Salter
from duplexkv.router.turn.calls import Relayed
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.runner import TurnRunner

ENDPOINT = "responses"


class ResponsesRoutes:
    def __init__(self, cfg: RouterConfig, pool: BackendPool, metrics: RouterMetrics,
                 store: ResponseStore, turns: Callable[[], TurnRunner], salter: Salter) -> None:
        self.cfg, self.pool, self.metrics, self.turns = cfg, pool, metrics, turns
        self.salter = salter  # the key's cache_salt on every leg, as for chat (tenants.py)
        self.store = store
        self.front = ResponsesFront(store, "", cfg.max_json_depth)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.get, methods=["GET"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items,
                      methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    async def create(self, request: Request) -> Response:
        arrival = time.perf_counter()
        api_key = api_key_of(request.scope)

        async def run(chat: dict, key: str | None) -> ChatAnswer:
            return await self._turn(request, chat, key, api_key, arrival)

        try:
            raw = await read_body(request, self.cfg.max_request_bytes)
            return await self.front.create(raw, api_key, run)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:
            self.metrics.requests.labels(ENDPOINT, e.outcome).inc()
            return e.response()

    async def _turn(self, request: Request, chat: dict, key: str | None, api_key: str | None,
                    arrival: float) -> ChatAnswer:
        """The chat turn; its error answers (a worker's 4xx, a 503) are the client's."""
        req = client_request(chat, request.headers, "chat", api_key, key, responses_api=True)
        self.salter.apply(req.body, req.api_key)
        models = self.pool.models()
        if req.model is not None and models and req.model not in models:
            raise model_not_found(req.model)
        turn = Turn.start(req, arrival)
        try:
            resp = await self.turns().run(turn)
        except Relayed as e:
            outcome = "upstream_4xx" if e.status < 500 else "upstream_error"
            self.metrics.requests.labels(req.endpoint, outcome).inc()
            return ChatAnswer(e.response(turn.request_id))
        except APIError as e:
            self.metrics.requests.labels(req.endpoint, e.outcome).inc()
            return ChatAnswer(e.response({"X-Request-Id": turn.request_id}))
        return ChatAnswer(resp, lambda: turn.kept.key)

    async def get(self, request: Request) -> Response:
        try:
            return await self.front.get(api_key_of(request.scope),
                                        request.path_params["response_id"])
        except APIError as e:
            return e.response()

    async def input_items(self, request: Request) -> Response:
        return await self.front.input_items(api_key_of(request.scope),
                                            request.path_params["response_id"],
                                            request.query_params)

    async def delete(self, request: Request) -> Response:
        try:
            return await self.front.delete(api_key_of(request.scope),
                                           request.path_params["response_id"])
        except APIError as e:
            return e.response()
