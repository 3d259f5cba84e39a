"""One generation request end to end: parse, tokenize, run on the engine, answer (JSON or SSE).

A client that goes away aborts its request, every choice of it (closing the engine stream frees
its KV blocks): before the first output and for non-stream requests we race the engine against
the ASGI `http.disconnect` message; while streaming, Starlette cancels the body iterator and
`SSEResponse` closes it. With n > 1 the engine's outputs of the n choices arrive interleaved,
each with its index (server/responses.py shapes them as vLLM does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from duplexkv.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from duplexkv.engine.llm_engine import RequestOutput
from duplexkv.http.body import DEFAULT_MAX_REQUEST_BYTES, parse_json, read_body
from duplexkv.http.errors import APIError, bad_request, engine_unavailable, internal_error
from duplexkv.http.features import Features
from duplexkv.http.openai import Kind
from duplexkv.http.sse import SSEResponse
from duplexkv.server.chat_output import ChatParsing
from duplexkv.server.metrics import ChoiceTimes, ServerMetrics
from duplexkv.server.prepare import Prepared, RequestIds, prepare
from duplexkv.server.responses import DONE, Formatter, cached_tokens, sse

log = logging.getLogger("duplexkv.server")
T = TypeVar("T")
Translate = Callable[[dict], dict]
ENDPOINT = {"completion": "completions", "chat": "chat_completions"}
PREP_THREADS = 2


def _json_output(params) -> bool:
    """The grammar makes the whole answer JSON (no room for a reasoning trace)."""
    return params.structured is not None and params.structured.kind in ("json", "json_object")


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class RequestCtx:
    request_id: str  # the engine's id
    response_id: str
    endpoint: str
    arrival: float
    max_tokens: int = 0
    n: int = 1
    first_token: float | None = None  # of any choice
    # per choice: first token, last output with new tokens, finish (perf_counter)
    choices: dict[int, ChoiceTimes] = field(default_factory=dict)
    done: bool = False


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
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 parsing: ChatParsing | None = None) -> None:
        self.aeng = aeng
        self.parsing = parsing or ChatParsing()
        self.features = Features(structured=True,
                                 auto_tools=self.parsing.tool_parser is not None)
        self.names = served_model_names
        self.model = served_model_names[0]
        self.metrics = metrics
        self.ids = RequestIds()
        self.max_request_bytes = max_request_bytes
        # parsing, templating and tokenizing run here, never on the event loop
        self.prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="prepare")

    def _prepare(self, raw: bytes | dict, kind: Kind,
                 translate: Translate | None = None) -> Prepared:
        body = parse_json(raw) if isinstance(raw, bytes) else raw
        return prepare(self.aeng.engine, self.names, translate(body) if translate else body,
                       kind, self.features)

    async def handle(self, request: Request, kind: Kind, translate: Translate | None = None,
                     body: dict | None = None) -> Response:
        """`translate`: the body of another API -> the `kind` request that runs it (an
        APIError for what it cannot run), e.g. Anthropic's Messages -> chat. `body`: the
        request already read and parsed (the Responses API's chat request)."""
        endpoint, arrival = ENDPOINT[kind], time.perf_counter()
        try:
            try:
                raw = body if body is not None else \
                    await read_body(request, self.max_request_bytes)
            except ClientDisconnect:
                return Response(status_code=499)
            if self.aeng.dead:
                raise engine_unavailable(self.aeng.dead)
            loop = asyncio.get_running_loop()
            prep = await loop.run_in_executor(self.prep_pool, self._prepare, raw, kind,
                                              translate)
        except APIError as e:
            self.metrics.record_rejected(endpoint, e.outcome)
            return e.response()
        rid, resp_id = self.ids.claim(request.headers.get("x-request-id"), kind)
        n = prep.params.n
        ctx = RequestCtx(rid, resp_id, endpoint, arrival, prep.params.max_tokens, n)
        fmt = Formatter(kind, resp_id, self.model, prep.req.include_usage,
                        prep.req.return_token_ids, n, parser=None if kind != "chat" else
                        self.parsing.for_request(prep.req.chat_options,
                                                 _json_output(prep.params)))
        headers = {"X-Request-Id": rid}
        log.info("%s %s: prompt=%d max_tokens=%d n=%d stream=%s kv_transfer=%s", rid, endpoint,
                 len(prep.prompt_ids), prep.params.max_tokens, n, prep.req.stream,
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
            finals = await unless_disconnected(request, self._collect(gen, ctx))
        except ClientDisconnected:
            self._finish(ctx, "aborted", None)
            return Response(status_code=499)
        except Exception as e:
            await gen.aclose()
            err = self._api_error(e, ctx)
            self._finish(ctx, err.outcome, None)
            return err.response(headers)
        self._finish(ctx, "ok", finals)
        return JSONResponse(fmt.full(finals), headers=headers)

    def _seen(self, out: RequestOutput, ctx: RequestCtx) -> None:
        """Token timings as the server sees each output, per choice."""
        now = time.perf_counter()
        if ctx.first_token is None:
            ctx.first_token = now
        t = ctx.choices.get(out.index)
        if t is None:
            ctx.choices[out.index] = ChoiceTimes(now, now)
        elif out.new_token_ids and self.metrics.vllm is not None:
            self.metrics.vllm.token_gaps(now - t.last, len(out.new_token_ids))
            t.last = now
        if out.finished:
            ctx.choices[out.index].finished = now

    async def _next(self, gen: AsyncIterator[RequestOutput], ctx: RequestCtx) -> RequestOutput:
        out = await gen.__anext__()
        self._seen(out, ctx)
        return out

    async def _collect(self, gen: AsyncIterator[RequestOutput],
                       ctx: RequestCtx) -> list[RequestOutput]:
        """Every choice's final output, by index."""
        finals: dict[int, RequestOutput] = {}
        async for out in gen:  # runs the stream to its end, so nothing is left to abort
            self._seen(out, ctx)
            if out.finished:
                finals[out.index] = out
        assert len(finals) == ctx.n
        return [finals[i] for i in range(ctx.n)]

    async def _stream(self, gen, first: RequestOutput, fmt: Formatter,
                      ctx: RequestCtx) -> AsyncIterator[str]:
        outcome = "aborted"
        try:
            async with aclosing(gen):
                for line in fmt.start_chunks():
                    yield line
                if (line := fmt.chunk(first)) is not None:
                    yield line
                async for out in gen:
                    self._seen(out, ctx)
                    if (line := fmt.chunk(out)) is not None:
                        yield line
            outcome = "ok"
            if fmt.include_usage:
                yield fmt.usage_chunk()
            yield DONE
        except Exception as e:
            err = self._api_error(e, ctx)
            outcome = err.outcome
            yield sse(err.body())
            yield DONE
        finally:
            self._finish(ctx, outcome, fmt.finals() if outcome == "ok" else None)

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

    def _finish(self, ctx: RequestCtx, outcome: str, finals: list[RequestOutput] | None) -> None:
        """Once per request: metrics (ours per request, vLLM's per choice) and the log line."""
        if ctx.done:
            return
        ctx.done = True
        self.ids.release(ctx.request_id)
        now = time.perf_counter()
        self.metrics.record_finished(ctx.endpoint, outcome, finals, ctx.max_tokens, ctx.n)
        if finals is None:
            log.info("%s %s", ctx.request_id, outcome)
            return
        ttft = (ctx.first_token or now) - ctx.arrival
        self.metrics.record_timings(ctx.arrival, ttft, now - ctx.arrival, finals, ctx.choices)
        out = finals[0]
        log.info("%s finished (%s): prompt=%d cached=%d output=%d ttft=%.3fs e2e=%.3fs",
                 ctx.request_id, ",".join(str(f.finish_reason) for f in finals),
                 len(out.prompt_token_ids), cached_tokens(out),
                 sum(len(f.token_ids) for f in finals), ttft, now - ctx.arrival)
