"""The worker's FastAPI app: OpenAI endpoints plus vLLM's extras, /health, /metrics and
/debug/engine.

    POST /v1/completions, /v1/chat/completions   (serving.OpenAIServing)
    POST /v1/messages    Anthropic's Messages API, run as a chat request (http/messages.py)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, GET .../{id}/input_items
                                                        (responses_routes: the chat path)
    POST /tokenize, /detokenize                  (tokenize, vLLM's shapes)
    GET  /v1/models, /version, /health, /metrics, /debug/engine

With `api_keys`, every path but /health, /metrics and /version needs one of them
(`duplexkv.http.auth`).

Request bodies are read raw and validated by `protocol`, so client mistakes are 400s in OpenAI's
error shape (never FastAPI's 422); a dead engine thread gives 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from duplexkv.engine.async_engine import AsyncEngine
from duplexkv.http import debug_memory, messages
from duplexkv.http.auth import APIKeyAuth
from duplexkv.http.errors import APIError, bad_request, engine_unavailable, internal_error
from duplexkv.http.version import version_endpoint
from duplexkv.engine.state import EngineSnapshot
from duplexkv.server.chat_output import ChatParsing
from duplexkv.server.metrics import ServerMetrics
from duplexkv.server import responses_routes, tokenize
from duplexkv.server.serving import OpenAIServing

log = logging.getLogger("duplexkv.server")
ENGINE_CALL_TIMEOUT_S = 5.0  # a busy engine answers between steps; longer than this = busy
# /health waits this long for the engine thread, then answers with the snapshot it published
# after a recent step: a long step (a big prefill under load) must not make /health late
HEALTH_ENGINE_WAIT_S = 0.2


async def _snapshot(aeng: AsyncEngine,
                    timeout_s: float = ENGINE_CALL_TIMEOUT_S) -> EngineSnapshot | None:
    """Engine state, or None when the engine thread is dead or too busy to answer in time."""
    if aeng.dead:
        return None
    try:
        return await asyncio.wait_for(aeng.call(aeng.engine.snapshot), timeout_s)
    except (TimeoutError, RuntimeError):
        return None


def _busy_state(aeng: AsyncEngine) -> dict:
    """What /health says while the engine thread runs a step: the snapshot the engine published
    after a recent step (its age), and how long the running step has taken so far."""
    now, snap, started = time.monotonic(), aeng.last_snapshot, aeng.step_started
    out: dict = {"engine_busy": True,
                 "step_running_s": round(now - started, 3) if started else None}
    if snap is not None:
        out.update(snap.as_dict(), snapshot_age_s=round(now - aeng.snapshot_at, 3))
    return out


def default_max_request_bytes(max_model_len: int) -> int:
    """A few MiB more than the longest prompt the model accepts could take as JSON text
    (generously 32 bytes a token: escaped text or token ids with separators)."""
    return 32 * max_model_len + (4 << 20)


def build_app(aeng: AsyncEngine, served_model_names: str | Sequence[str],
              health_extra: Callable[[], dict] | None = None,
              collectors: tuple = (), max_request_bytes: int | None = None,
              api_keys: tuple[str, ...] = (), parsing: ChatParsing | None = None) -> FastAPI:
    """The app for one engine; `health_extra()` adds fields to /health (e.g. the KV layer's).
    Requests may name any of `served_model_names`; responses and metrics carry the first.
    `parsing`: the tool-call and reasoning parsers of chat answers (none by default)."""
    names = (served_model_names,) if isinstance(served_model_names, str) \
        else tuple(served_model_names)
    assert names, "at least one served model name"
    served_model_name = names[0]
    app = FastAPI(title="duplexkv worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(APIKeyAuth, keys=api_keys)
    metrics = ServerMetrics(served_model_name, aeng.engine.capacity())
    for collector in collectors:  # e.g. the KV connector's
        metrics.registry.register(collector)
    serving = OpenAIServing(aeng, names, metrics, max_request_bytes
                            or default_max_request_bytes(aeng.engine.max_model_len), parsing)
    created = int(time.time())
    app.state.aeng, app.state.metrics, app.state.serving = aeng, metrics, serving

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return messages.shaped(request.url.path, bad_request(f"invalid request: {exc.errors()}"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return messages.shaped(request.url.path,
                               APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return messages.shaped(request.url.path, internal_error(exc))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.handle(request, "chat")

    @app.post(messages.PATH)
    async def anthropic_messages(request: Request) -> Response:
        return messages.as_message(await serving.handle(request, "chat", messages.to_chat))

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [{"id": name, "object": "model", "created": created,
                  "owned_by": "duplexkv", "root": served_model_name, "parent": None,
                  "max_model_len": aeng.engine.max_model_len} for name in names]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> Response:
        if aeng.dead:
            return engine_unavailable(aeng.dead).response()
        snap = await _snapshot(aeng, HEALTH_ENGINE_WAIT_S)
        body: dict = {"status": "ok", "model": served_model_name}
        body.update(snap.as_dict() if snap is not None else _busy_state(aeng))
        body["in_flight_requests"] = len(serving.ids.in_flight)
        if health_extra is not None:
            body.update(health_extra())
        return JSONResponse(body)

    @app.get("/debug/engine")
    async def debug_engine() -> Response:
        """Engine state plus the block pool's invariants, checked on the engine thread."""
        if aeng.dead:
            return engine_unavailable(aeng.dead).response()
        return JSONResponse(await aeng.call(aeng.engine.debug_state))

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.update(not aeng.dead, await _snapshot(aeng))
        return Response(metrics.render(), media_type=metrics.content_type)

    tokenize.add_routes(app, serving)
    responses_routes.add_routes(app, serving)
    app.add_route("/version", version_endpoint, methods=["GET"])
    debug_memory.add_route(app, lambda: {**_structures(aeng, serving),
                                         "responses.stored": app.state.responses.store.held_here()})
    return app


def _structures(aeng: AsyncEngine, serving: OpenAIServing) -> dict:
    """Sizes of a worker's per-request maps, caches and queues, for /debug/memory (lengths read
    without locks)."""
    e = aeng.engine
    return {**e.structures(), "async.streams": aeng.num_streams(),
            "serving.in_flight": len(serving.ids.in_flight), **e.connector.structures()}
