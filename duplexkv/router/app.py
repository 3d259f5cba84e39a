"""The router's HTTP app (Starlette, the toolkit FastAPI is built on; no per-request validation
layer, so the hot path stays short).

    POST /v1/chat/completions, /v1/completions   a turn: one P leg + one D leg (turn/runner.py)
    POST /v1/messages  Anthropic's Messages API: run as a chat turn, answered in its shapes
                       (http/messages.py); recognised from its messages like any chat turn
    POST /v1/messages/count_tokens   checked here, counted by a worker (healthy ones first)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
                       OpenAI's Responses API as a chat turn (responses.py)
    GET  /v1/models    the workers' models (from the first healthy worker that answers)
    GET  /health       per-backend state; 503 while no P or no D is healthy; status "degraded"
                       (200) while the conversation store is failing (turns run as misses);
                       with --discovery, the members and the recent joins and leaves (by name)
    GET  /metrics      Prometheus
    GET  /version      {"version": ...}, as vLLM
    POST /v1/conversations/{id}/keepalive, DELETE /v1/conversations/{id}
                       the conversation lifecycle (conversation/routes.py and lifecycle.py)

Client input is bounded before anything else runs: headers over `max_header_bytes` get a 431,
bodies over `max_request_bytes` a 413 (read no further), and `request.parse_client_request`
rejects malformed JSON, deep nesting and invalid Unicode with a 400, all in OpenAI's error shape.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duplexkv.http import debug_memory, messages
from duplexkv.http.auth import APIKeyAuth, api_key_of
from duplexkv.http.body import parse_json, read_body
from duplexkv.http.errors import APIError, model_not_found
from duplexkv.http.limits import HeaderLimit
from duplexkv.http.version import version_endpoint
from duplexkv.router.backends import BackendPool
from duplexkv.router.config import RouterConfig
from duplexkv.router.conversation import routes as conversation_routes
from duplexkv.router.conversation.lifecycle import LeaseKeeper, LifecycleMetrics
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.conversation.response_store import make_response_store
from duplexkv.router.conversation.store import ConversationStore, make_store
from duplexkv.router.discovery import Discovery
from duplexkv.router.health import HealthChecker
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.request import ENDPOINTS, Kind, parse_client_request
from duplexkv.router.responses import ResponsesRoutes
from duplexkv.router.turn.calls import Relayed
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.runner import TurnRunner
from duplexkv.router.tenants import Salter
from duplexkv.router.upstream import Upstream
from duplexkv.router.warmup import PairWarmer

log = logging.getLogger("duplexkv.router")


def public_models(r: httpx.Response) -> dict:
    """A worker's /v1/models without what names its host: `root` (vLLM's and our workers' model
    path) becomes the model id."""
    body = r.json()
    return {**body, "data": [{**card, "root": card.get("id")} if "root" in card else card
                             for card in body["data"]]}


def build_app(cfg: RouterConfig, store: ConversationStore | None = None) -> Starlette:
    pool = BackendPool.from_urls(cfg.prefill, cfg.decode, affinity_slack=cfg.affinity_slack,
                                 unhealthy_after=cfg.unhealthy_after)
    store = store or make_store(cfg.store, cfg.conversation_ttl_s, cfg.max_conversations,
                                cfg.store_timeout_s, cfg.store_breaker_period_s)
    metrics = RouterMetrics()
    state: dict = {}
    discovery = Discovery.configure(cfg, pool, metrics)
    keeper = LeaseKeeper(None, cfg.worker_headers(), cfg.lease_renew_period_s,
                         cfg.request_timeout_s, LifecycleMetrics(metrics.registry))
    conversations = Conversations(store, metrics, cfg.rewrite_remote_host, keeper)
    salter = Salter.from_env(cfg.share_kv_cache, bool(cfg.api_keys) and cfg.store != "memory")
    responses = ResponsesRoutes(cfg, pool, metrics,
                                make_response_store(cfg.store, cfg.conversation_ttl_s,
                                                    cfg.store_timeout_s,
                                                    cfg.store_breaker_period_s),
                                lambda: state["turns"], salter)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        upstream = Upstream(cfg)
        warmer = PairWarmer(pool, upstream, cfg.worker_headers(), cfg.warmup_timeout_s,
                            cfg.rewrite_remote_host, metrics.warmups)
        state["upstream"] = upstream
        state["turns"] = TurnRunner(cfg, pool, conversations, metrics, upstream, warmer)
        checker = HealthChecker(pool, upstream.client, cfg.health_interval_s,
                                cfg.health_timeout_s, on_up=warmer.on_up,
                                on_round=warmer.checked.set)
        checker.start()
        keeper.client = upstream.client
        keeper.start(lambda: [b.url for b in pool.decode])  # discovery may change the list
        if discovery is not None:
            discovery.start()
        try:
            yield
        finally:
            if discovery is not None:
                await discovery.stop()
            await keeper.stop()
            await checker.stop()
            await warmer.stop()
            await upstream.aclose()
            await store.close()
            await responses.store.close()

    async def generate(request: Request, kind: Kind,
                       translate: Callable[[dict], dict] | None = None) -> Response:
        arrival = time.perf_counter()
        turns: TurnRunner = state["turns"]
        try:
            raw = await read_body(request, cfg.max_request_bytes)
            req = parse_client_request(raw, request.headers, kind, cfg.max_json_depth,
                                       api_key_of(request.scope), translate)
            salter.apply(req.body, req.api_key)  # per-key cache_salt (router/tenants.py)
            models = pool.models()
            if req.model is not None and models and req.model not in models:
                raise model_not_found(req.model)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:
            metrics.requests.labels(ENDPOINTS[kind], e.outcome).inc()
            return e.response()
        turn = Turn.start(req, arrival)
        try:
            return await turns.run(turn)
        except Relayed as e:
            outcome = "upstream_4xx" if e.status < 500 else "upstream_error"
            metrics.requests.labels(req.endpoint, outcome).inc()
            return e.response(turn.request_id)
        except APIError as e:
            metrics.requests.labels(req.endpoint, e.outcome).inc()
            return e.response({"X-Request-Id": turn.request_id})

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def anthropic_messages(request: Request) -> Response:
        return messages.as_message(await generate(request, "chat", messages.to_chat))

    async def count_tokens(request: Request) -> Response:
        try:
            raw = await read_body(request, cfg.max_request_bytes)
            messages.to_count(parse_json(raw, cfg.max_json_depth))  # the worker's own 400s
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:
            return messages.error_response(e.status, e.message)
        headers = {"content-type": "application/json", **cfg.worker_headers()}
        for b in sorted(pool.all, key=lambda b: not b.healthy):
            with contextlib.suppress(httpx.HTTPError):
                r = await state["upstream"].post(b.url + messages.COUNT_PATH, raw, headers)
                if r.status_code < 500:
                    return messages.relayed(r.status_code, r.content)
        return messages.error_response(503, "No worker answered count_tokens")

    async def models(_: Request) -> Response:
        client = state["upstream"].client
        for b in sorted(pool.all, key=lambda b: not b.healthy):
            with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
                r = await client.get(b.url + "/v1/models", timeout=cfg.health_timeout_s)
                if r.status_code == 200:
                    return JSONResponse(public_models(r))
        return APIError(503, "No worker answered /v1/models",
                        type="service_unavailable_error").response()

    async def health(_: Request) -> Response:
        try:
            stored = await store.size()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            # the type only: a client error's text can name the store's host and port
            stored, store_error = None, type(e).__name__
        else:
            store_error = None
        ok = any(b.healthy for b in pool.prefill) and any(b.healthy for b in pool.decode)
        store_state = store.state()
        status = "unavailable" if not ok else "ok" if store_state == "ok" else "degraded"
        body = {"status": status, "store": store.describe(), "store_state": store_state,
                "conversations": stored, "store_error": store_error, **pool.state()}
        if discovery is not None:
            body["discovery"] = discovery.membership.state()
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(_: Request) -> Response:
        try:
            stored = await store.size()
        except Exception:  # noqa: BLE001 - the gauge keeps its last value
            stored = None
        metrics.update(pool, stored)
        return Response(metrics.render(), media_type=metrics.content_type)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return messages.shaped(request.url.path,
                               APIError(exc.status_code, str(exc.detail), type=kind))

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        # the exception's text can hold a worker's address: the client gets its type only
        return messages.shaped(request.url.path, APIError(
            500, f"internal error ({type(exc).__name__})", type="internal_server_error"))

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route(messages.PATH, anthropic_messages, methods=["POST"]),
              Route(messages.COUNT_PATH, count_tokens, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"]),
              Route("/version", version_endpoint, methods=["GET"]),
              *responses.routes(),
              *conversation_routes.routes(store, keeper, cfg.keepalive_s,
                                          cfg.conversation_ttl_s)]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(HeaderLimit, max_bytes=cfg.max_header_bytes),
                                Middleware(APIKeyAuth, keys=cfg.api_keys)],
                    exception_handlers={HTTPException: http_error, Exception: unexpected})
    app.state.pool, app.state.store, app.state.metrics = pool, store, metrics
    app.state.discovery = discovery
    debug_memory.add_route(app, lambda: {"store": store.held_here(),
                                         "responses": responses.store.held_here()})
    app.state.auth_summary = (f"{len(cfg.api_keys)} client API key(s)" if cfg.api_keys else
                              "no client API key") + (", a worker API key" if cfg.worker_api_key
                                                      else ", no worker API key")
    return app


