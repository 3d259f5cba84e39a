"""The D leg: D decodes over P's KV (or, for a decode_local turn, prefills the new suffix over
the history it holds, then decodes); its answer goes to the client and its kv_transfer_params to
the conversation's store, for the next turn.

    choice   decode_local: only the D that holds the history; otherwise the conversation's D
             unless it is busier, else the least loaded (backends.py); each D at most once, as
             retry.py says; each attempt counted in D's `outstanding` (backends.in_flight), a
             streamed answer until its stream closes
    tokens   a conversation turn with one choice, on a D that is not ours, asks D for its
             tokens (`return_token_ids`) for the next turn's check (verify.py); they are
             removed from the answer unless the client asked for them
    JSON     D's answer without kv_transfer_params, with the combined kv_stats (legs.py)
    stream   D's events relayed as they come (stream_leg.py), with D's token ids (removed
             unless the client asked for them): a D that breaks mid-stream has the answer
             continued on another D (migrate.py)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import httpx
from starlette.responses import Response

from duplexkv.http.sse import SSEResponse
from duplexkv.router.backends import Backend, BackendPool, InFlight, in_flight
from duplexkv.router.conversation.answer import StreamedAnswer, json_answer
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.legs import decode_body, dumps, finish_json
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.placement import OURS, with_prompt_chars
from duplexkv.router.stream import StreamRelay
from duplexkv.router.turn.calls import Relayed, Unreachable, WorkerCalls, no_worker
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.migrate import Migration, migratable
from duplexkv.router.turn.plan import DecodeOrder
from duplexkv.router.turn.retry import ANSWER, TRANSPORT, UNREACHABLE, Failure, Next, RetryPolicy
from duplexkv.router.turn.stream_leg import StreamLeg
from duplexkv.router.verify import held_sequence

perf = time.perf_counter


@dataclass(frozen=True, slots=True)
class Opened:
    d: Backend
    resp: httpx.Response  # D's 200 (a stream: its headers; the body is left to read)
    count: InFlight  # the leg in D's outstanding: kept for a stream, already given back else


class DecodeLeg:
    def __init__(self, pool: BackendPool, calls: WorkerCalls, policy: RetryPolicy,
                 conversations: Conversations, metrics: RouterMetrics) -> None:
        self.pool, self.calls, self.policy, self.metrics = pool, calls, policy, metrics
        self.conversations = conversations

    async def run(self, turn: Turn, order: DecodeOrder,
                  avoid: frozenset[Backend] = frozenset()) -> Response:
        """The client's answer; raises Relayed (D's error answer) or APIError 503 (no D).
        `avoid`: D's tried only when no other is left (P could not reach them)."""
        if turn.req.stream:
            return await self._stream(turn, order, avoid)
        return await self._json(turn, order, avoid)

    async def _json(self, turn: Turn, order: DecodeOrder, avoid: frozenset[Backend]) -> Response:
        d = (opened := await self._open(turn, order, avoid, stream=False)).d
        try:
            d_json = opened.resp.json()
        except ValueError:
            raise no_worker("decode", f"{d.name} answered invalid JSON") from None
        out, params = finish_json(d_json, turn.stats)
        tokens = None
        if _learns_tokens(turn, order, d):
            tokens = _held_from_json(out, params, strip=not _client_wants_tokens(turn))
        await self._remember(turn, order, d, partial(json_answer, out), params, tokens)
        self.metrics.overhead.observe(turn.overhead(perf()))
        self.metrics.requests.labels(turn.req.endpoint, "ok").inc()
        return Response(dumps(out), media_type="application/json",
                        headers={"X-Request-Id": turn.request_id})

    async def _stream(self, turn: Turn, order: DecodeOrder,
                      avoid: frozenset[Backend]) -> Response:
        d = (opened := await self._open(turn, order, avoid, stream=True)).d
        answer = StreamedAnswer() if order.recognition is not None else None
        relay = StreamRelay(turn.stats, turn.arrival, tokens=_learns_tokens(turn, order, d),
                            strip_tokens=not _client_wants_tokens(turn),
                            collect=migratable(turn.req.body),
                            on_choice=answer.feed if answer is not None else None)
        migration = Migration(self.pool, self.calls, turn, relay) if relay.collecting else None
        leg = StreamLeg(turn, d, opened.resp, opened.count, relay, self.metrics,
                        partial(self._remember, turn, order, d,
                                answer.message if answer is not None else _no_answer),
                        self.calls.liveness, migration)
        return SSEResponse(leg.events(), on_close=leg.close,
                           headers={"X-Request-Id": turn.request_id, "Cache-Control": "no-cache"})

    async def _remember(self, turn: Turn, order: DecodeOrder, d: Backend,
                        answer: Callable[[], dict | None], params: dict | None,
                        tokens: list[int] | None) -> None:
        """`answer()`: the assistant message D produced (a recognised conversation's key)."""
        turn.kept.key = key = order.next_key(answer)
        await self.conversations.remember(key, d.url,
                                          with_prompt_chars(params, order.prompt_chars),
                                          turn.request_id, tokens, order.key)

    def _candidates(self, order: DecodeOrder, avoid: frozenset[Backend]) -> Iterator[Backend]:
        if order.only is not None:  # decode_local: only the D that holds the history
            yield self.pool.pick(order.only)
            return
        tried: set[Backend] = set()
        preferred = None if avoid else order.preferred_url
        for _ in range(self.policy.decode_attempts(len(self.pool.decode))):
            d, _pref = self.pool.choose_decode(preferred, tried | avoid, order.prefill)
            if d is None:
                d, _pref = self.pool.choose_decode(None, tried, order.prefill)
            if d is None:
                return
            tried.add(d)
            yield d

    async def _open(self, turn: Turn, order: DecodeOrder, avoid: frozenset[Backend],
                    stream: bool) -> Opened:
        """The first D that answers 200, under the retry policy."""
        body = decode_body(turn.req, order.params)
        last = "no decode worker is configured"
        for d in self._candidates(order, avoid):
            ids = _learns_tokens(turn, order, d) or (stream and migratable(turn.req.body))
            leg_body = {**body, "return_token_ids": True} if ids else body
            failure = None
            with in_flight(d) as count:
                try:
                    resp = await self.calls.send(d, turn, leg_body, stream=stream)
                except Unreachable as e:
                    failure = Failure(UNREACHABLE, str(e))
                except httpx.HTTPError as e:
                    failure = Failure(TRANSPORT, f"{d.name}: {type(e).__name__}")
                else:
                    if resp.status_code == 200:
                        return Opened(d, resp, count.keep() if stream else count)
            if failure is None:  # an answer that is not a 200, read once the count is given back
                failure = await self._refused(d, resp, stream)
            last = failure.detail
            if self.policy.decode(failure) is Next.RELAY:
                raise failure.reply
        raise no_worker("decode", last)

    async def _refused(self, d: Backend, resp: httpx.Response, stream: bool) -> Failure:
        if stream:
            await resp.aread()
            await resp.aclose()
        return Failure(ANSWER, self.calls.bad_status(d, resp), resp.status_code,
                       Relayed.of(resp))


def _no_answer() -> None:
    return None


def _learns_tokens(turn: Turn, order: DecodeOrder, d: Backend) -> bool:
    """Ask D for its sequence in tokens (for the next turn's check, router/verify.py): a
    conversation turn with one choice on a D that is not ours."""
    n = turn.req.body.get("n")
    return order.key is not None and d.kind != OURS and n in (None, 1)


def _client_wants_tokens(turn: Turn) -> bool:
    return bool(turn.req.body.get("return_token_ids"))


def _held_from_json(out: dict, params: dict | None, strip: bool) -> list[int] | None:
    """D's held sequence from its JSON answer (chat: top-level prompt_token_ids; completions:
    the choice's), the token ids removed from `out` when the client did not ask for them."""
    choices = out.get("choices") if isinstance(out.get("choices"), list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt = out.get("prompt_token_ids", first.get("prompt_token_ids"))
    held = held_sequence(prompt, first.get("token_ids"), params)
    if strip:
        out.pop("prompt_token_ids", None)
        for c in choices:
            if isinstance(c, dict):
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
    return held
