"""One generation request end to end: parse, tokenize, run on the engine, answer (JSON or SSE).

A client that goes away aborts its request (closing the engine stream frees its KV blocks):
before the first output and for non-stream requests we race the engine against the ASGI
`http.disconnect` message; while streaming, Starlette cancels the body iterator and `SSEResponse`
closes it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from duplexkv.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from duplexkv.engine.kv_transfer import KVParamsError, KVTransferParams
from duplexkv.engine.llm_engine import LLMEngine, RequestOutput, RequestRejected
from duplexkv.engine.sampling_params import SamplingParams
from duplexkv.http.body import DEFAULT_MAX_REQUEST_BYTES, parse_json, read_body
from duplexkv.http.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    internal_error,
    model_not_found,
)
from duplexkv.http.openai import GenerateRequest, Kind, parse_request
from duplexkv.http.request_id import clean_request_id
from duplexkv.http.sse import SSEResponse
from duplexkv.server.metrics import ServerMetrics
from duplexkv.server.responses import DONE, Formatter, cached_tokens, sse

log = logging.getLogger("duplexkv.server")
T = TypeVar("T")
PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
ENDPOINT = {"completion": "completions", "chat": "chat_completions"}
PREP_THREADS = 2


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Prepared:
    req: GenerateRequest
    prompt_ids: list[int]
    params: SamplingParams
    kv_params: KVTransferParams | None


@dataclass(slots=True)
class RequestCtx:
    request_id: str  # the engine's id
    response_id: str
    endpoint: str
    arrival: float
    max_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None  # when the last output with new tokens arrived
    done: bool = False


def prepare(engine: LLMEngine, served_model_names: tuple[str, ...], body: dict,
            kind: Kind) -> Prepared:
    req = parse_request(body, kind)
    if req.model is not None and req.model not in served_model_names:
        raise model_not_found(req.model)
    ids = _tokenize(engine, req)
    # default max_tokens: the rest of the context, as vLLM does (bounded by the KV pool), or
    # the generation config's max_new_tokens when smaller
    limit = min(engine.max_model_len, engine.bm.num_blocks * engine.config.block_size)
    defaults = engine.sampling_defaults
    max_tokens = req.max_tokens if req.max_tokens is not None else \
        max(1, min(limit - len(ids), defaults.get("max_tokens", limit)))
    kwargs = req.sampling_kwargs(max_tokens)
    # the model's generation config fills what the request left out (vLLM)
    kwargs.update({k: v for k, v in defaults.items() if k != "max_tokens" and body.get(k) is None})
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        m = re.search(r"parameter (\w+)=", str(e))
        raise bad_request(str(e), m.group(1) if m else None) from None
    try:
        kv = None if req.kv_transfer_params is None else \
            KVTransferParams.from_dict(req.kv_transfer_params)
    except KVParamsError as e:
        raise bad_request(str(e), "kv_transfer_params") from None
    try:
        engine.check_request(len(ids), params)
    except RequestRejected as e:
        raise bad_request(str(e), e.param) from None
    return Prepared(req, ids, params, kv)


def _tokenize(engine: LLMEngine, req: GenerateRequest) -> list[int]:
    field = "prompt" if req.kind == "completion" else "messages"
    try:
        if req.kind == "completion":
            return engine.tokenize(req.prompt)  # type: ignore[arg-type]
        return engine.tokenize(req.messages, req.add_generation_prompt,  # type: ignore[arg-type]
                               req.chat_options.render_kwargs())
    except RequestRejected as e:
        raise bad_request(str(e), field) from None
    except Exception as e:  # a chat template that cannot render these messages
        what = "apply the chat template" if req.kind == "chat" else "tokenize the prompt"
        raise bad_request(f"could not {what}: {e}", field) from None


class RequestIds:
    """Engine request ids: the client's X-Request-Id when given (suffixed if in flight)."""

    def __init__(self) -> None:
        self.in_flight: set[str] = set()

    def claim(self, header: str | None, kind: Kind) -> tuple[str, str]:
        """-> (engine request id, response id)."""
        base = clean_request_id(header) or ""
        rid = base or f"{PREFIX[kind]}-{uuid.uuid4().hex}"
        while rid in self.in_flight:
            rid = f"{base}-{uuid.uuid4().hex[:8]}"
        self.in_flight.add(rid)
        return rid, rid if rid.startswith(PREFIX[kind] + "-") else f"{PREFIX[kind]}-{rid}"

    def release(self, rid: str) -> None:
        self.in_flight.discard(rid)




async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


class OpenAIServing:
    def __init__(self, aeng: AsyncEngine, served_model_names: tuple[str, ...],
                 metrics: ServerMetrics,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.aeng = aeng
        self.names = served_model_names
        self.model = served_model_names[0]
        self.metrics = metrics
        self.ids = RequestIds()
        self.max_request_bytes = max_request_bytes
        # parsing, templating and tokenizing run here, never on the event loop
        self.prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="prepare")

    def _prepare(self, raw: bytes, kind: Kind) -> Prepared:
        return prepare(self.aeng.engine, self.names, parse_json(raw), kind)

    async def handle(self, request: Request, kind: Kind) -> Response:
        endpoint, arrival = ENDPOINT[kind], time.perf_counter()
        try:
            try:
                raw = await read_body(request, self.max_request_bytes)
            except ClientDisconnect:
                return Response(status_code=499)
            if self.aeng.dead:
                raise engine_unavailable(self.aeng.dead)
            loop = asyncio.get_running_loop()
            prep = await loop.run_in_executor(self.prep_pool, self._prepare, raw, kind)
        except APIError as e:
            self.metrics.record_rejected(endpoint, e.outcome)
            return e.response()
        rid, resp_id = self.ids.claim(request.headers.get("x-request-id"), kind)
        ctx = RequestCtx(rid, resp_id, endpoint, arrival, prep.params.max_tokens)
        fmt = Formatter(kind, resp_id, self.model, prep.req.include_usage,
                        prep.req.return_token_ids)
        headers = {"X-Request-Id": rid}
        log.info("%s %s: prompt=%d max_tokens=%d stream=%s kv_transfer=%s", rid, endpoint,
                 len(prep.prompt_ids), prep.params.max_tokens, prep.req.stream,
                 prep.req.kv_transfer_params is not None)
        gen = self.aeng.generate(rid, prep.prompt_ids, prep.params,
                                 kv_params=prep.kv_params)
        try:
            if prep.req.stream:
                first = await unless_disconnected(request, self._next(gen, ctx))

                async def on_close() -> None:
                    await gen.aclose()
                    self._finish(ctx, "aborted", None)

                return SSEResponse(self._stream(gen, first, fmt, ctx), on_close, headers=headers)
            final = await unless_disconnected(request, self._collect(gen, ctx))
        except ClientDisconnected:
            self._finish(ctx, "aborted", None)
            return Response(status_code=499)
        except Exception as e:
            await gen.aclose()
            err = self._api_error(e, ctx)
            self._finish(ctx, err.outcome, None)
            return err.response(headers)
        self._finish(ctx, "ok", final)
        return JSONResponse(fmt.full(final), headers=headers)

    def _seen(self, out: RequestOutput, ctx: RequestCtx) -> None:
        """Token timings as the server sees each output."""
        now = time.perf_counter()
        if ctx.first_token is None:
            ctx.first_token = ctx.last_token = now
        elif out.new_token_ids and self.metrics.vllm is not None:
            self.metrics.vllm.token_gaps(now - (ctx.last_token or now), len(out.new_token_ids))
            ctx.last_token = now

    async def _next(self, gen: AsyncIterator[RequestOutput], ctx: RequestCtx) -> RequestOutput:
        out = await gen.__anext__()
        self._seen(out, ctx)
        return out

    async def _collect(self, gen: AsyncIterator[RequestOutput], ctx: RequestCtx) -> RequestOutput:
        final = None
        async for final in gen:  # runs the stream to its end, so nothing is left to abort
            self._seen(final, ctx)
        assert final is not None and final.finished
        return final

    async def _stream(self, gen, first: RequestOutput, fmt: Formatter,
                      ctx: RequestCtx) -> AsyncIterator[str]:
        outcome, out = "aborted", first
        try:
            async with aclosing(gen):
                if (line := fmt.start_chunk()) is not None:
                    yield line
                if (line := fmt.chunk(out)) is not None:
                    yield line
                async for out in gen:
                    self._seen(out, ctx)
                    if (line := fmt.chunk(out)) is not None:
                        yield line
            outcome = "ok"
            if fmt.include_usage:
                yield fmt.usage_chunk(out)
            yield DONE
        except Exception as e:
            err = self._api_error(e, ctx)
            outcome = err.outcome
            yield sse(err.body())
            yield DONE
        finally:
            self._finish(ctx, outcome, out if outcome == "ok" else None)

    def _api_error(self, e: Exception, ctx: RequestCtx) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, EngineDeadError):
            return engine_unavailable(str(e))
        if isinstance(e, RequestFailed):
            return APIError(500, str(e), type="server_error")
        if isinstance(e, ValueError):  # rejected on the engine thread (e.g. kv_transfer_params)
            return bad_request(str(e))
        log.exception("%s failed", ctx.request_id)
        return internal_error(e)

    def _finish(self, ctx: RequestCtx, outcome: str, out: RequestOutput | None) -> None:
        if ctx.done:
            return
        ctx.done = True
        self.ids.release(ctx.request_id)
        now = time.perf_counter()
        self.metrics.record_finished(ctx.endpoint, outcome, out, ctx.max_tokens)
        if out is None:
            log.info("%s %s", ctx.request_id, outcome)
            return
        ttft = (ctx.first_token or now) - ctx.arrival
        self.metrics.record_timings(ttft, now - ctx.arrival, out)
        log.info("%s finished (%s): prompt=%d cached=%d output=%d ttft=%.3fs e2e=%.3fs",
                 ctx.request_id, out.finish_reason, len(out.prompt_token_ids), cached_tokens(out),
                 len(out.token_ids), ttft, now - ctx.arrival)
