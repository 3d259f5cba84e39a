"""One client request through P and D: recall the conversation, P leg (with the retry rules),
D leg (JSON or a relayed stream), remember D's params for the next turn.

Longer than 300 lines: the two legs and their failure rules (below) are one sequence.

Failure rules (issue 5, protocol.md 6)
    connection refused/timed out   nothing was sent: mark the worker down, use another of its role
    P fails on a replayed turn     retry once as a plain miss (D's blocks may be gone)
    P or D answers 503             the engine is dead: mark it down, use another
    marked down while in flight    (health checks failed: host unreachable, partitioned) the
                                   leg is abandoned and another worker of its role is used
    other worker 4xx / 5xx         relayed to the client as it is
    no worker of a role answers    503 in OpenAI's shape, naming the role and the last error
Client-visible messages name a worker by role and index ("prefill[0]"), never by its URL, and
carry no exception text (which can hold addresses); the log has the details.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx
from starlette.responses import Response

from duplexkv.http.errors import APIError
from duplexkv.http.sse import SSEResponse
from duplexkv.router.backends import Backend, BackendPool
from duplexkv.router.config import RouterConfig
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.conversation.store import ConversationStore, Entry
from duplexkv.router.legs import (
    TurnStats,
    decode_body,
    dumps,
    finish_json,
    prefill_body,
    rewrite_remote_host,
    worker_stats,
)
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.placement import (
    Placement,
    choose,
    local_params,
    prompt_chars,
    with_prompt_chars,
)
from duplexkv.router.request import ClientRequest
from duplexkv.router.stream import DONE, StreamRelay
from duplexkv.router.upstream import Upstream
from duplexkv.router.warmup import PairWarmer
from duplexkv.router.verify import (
    Verdict,
    held_sequence,
    prefix_holds,
    release_params,
    token_list,
    tokenize_body,
    verify,
)
from duplexkv.wire.kv_params import miss_params, replay_params

log = logging.getLogger("duplexkv.router")
perf = time.perf_counter


class WentDown(Exception):
    """The worker was marked down while a leg to it was in flight."""


class Unreachable(Exception):
    """The request never reached the worker."""


@dataclass(slots=True)
class Relayed(Exception):
    """A worker's error answer, passed to the client as it is."""

    status: int
    content: bytes
    media_type: str

    def response(self, request_id: str) -> Response:
        return Response(self.content, self.status, media_type=self.media_type,
                        headers={"X-Request-Id": request_id})


def no_worker(role: str, detail: str) -> APIError:
    return APIError(503, f"No {role} worker could serve the request: {detail}",
                    type="service_unavailable_error")


@dataclass(slots=True)
class Turn:
    req: ClientRequest
    arrival: float
    request_id: str
    stats: TurnStats = field(default_factory=TurnStats)
    key: str | None = None
    entry: Entry | None = None
    p_params: dict | None = None
    upstream_s: float = 0.0  # time spent waiting for workers
    chars: int | None = None  # the prompt's size, for the next turn's suffix estimate
    placement: Placement | None = None
    local_d: Backend | None = None  # decode_local: the one D that holds the history
    p: Backend | None = None  # the P that prefilled this turn
    verdict: Verdict | None = None  # the router's token check of a replay (router/verify.py)


class Proxy:
    def __init__(self, cfg: RouterConfig, pool: BackendPool, store: ConversationStore,
                 metrics: RouterMetrics, upstream: Upstream,
                 warmer: PairWarmer | None = None) -> None:
        self.cfg, self.pool, self.metrics, self.upstream = cfg, pool, metrics, upstream
        self.warmer = warmer
        self.worker_headers = cfg.worker_headers()  # never the client's Authorization
        self.conversations = Conversations(store, metrics, cfg.rewrite_remote_host)
        self._mixed_logged: set[tuple[str, str]] = set()

    def new_turn(self, req: ClientRequest, arrival: float) -> Turn:
        return Turn(req, arrival, req.request_id or uuid.uuid4().hex)

    async def run(self, turn: Turn) -> Response:
        await self.recall(turn)
        if turn.key is not None and await self._placed_on_decode(turn):
            try:
                return await self._decode(turn)
            except APIError as e:  # that D is gone: the turn runs as a miss through P
                if e.status != 503:
                    raise
                log.warning("%s: decode_local on %s failed (%s); running it through P",
                            turn.request_id, turn.local_d.name if turn.local_d else "?", e)
                self._fall_back_from_local(turn)
        await self.prefill(turn)
        return await self._decode(turn)

    def _decode(self, turn: Turn):
        return self.decode_stream(turn) if turn.req.stream else self.decode_json(turn)

    async def _placed_on_decode(self, turn: Turn) -> bool:
        """Choose where this conversation turn's prefill runs (router/placement.py)."""
        turn.chars = prompt_chars(turn.req.body)
        entry = turn.entry
        d = self.pool.by_url.get(("decode", entry.decode_url)) if entry else None
        pl = choose(self.cfg.placement, entry.params if entry else None, d, turn.chars)
        turn.placement = pl
        turn.stats.placement_reason, turn.stats.suffix_estimate = pl.reason, pl.suffix_tokens
        if not pl.local:
            return False
        assert entry is not None and d is not None
        turn.local_d, turn.p_params = d, local_params(entry.params)
        self._placed(turn, "decode_local")
        return True

    def _placed(self, turn: Turn, kind: str) -> None:
        turn.stats.placement = kind
        self.metrics.placement.labels(kind, turn.stats.placement_reason or "").inc()

    def _fall_back_from_local(self, turn: Turn) -> None:
        self.metrics.placement.labels("decode_local", "decode_local_failed").inc()
        turn.entry, turn.local_d, turn.p_params = None, None, None
        turn.stats.conversation, turn.stats.placement_reason = "retried", "decode_local_failed"

    async def recall(self, turn: Turn) -> None:
        req = turn.req
        recalled = await self.conversations.recall(req.api_key, req.conversation_id,
                                                   turn.request_id)
        turn.key, turn.entry, turn.stats.conversation = (recalled.key, recalled.entry,
                                                         recalled.state)

    async def remember(self, turn: Turn, d: Backend, params: dict | None,
                       tokens: list[int] | None = None) -> None:
        await self.conversations.remember(turn.key, d.url, with_prompt_chars(params, turn.chars),
                                          turn.request_id, tokens)

    # upstream calls
    def _headers(self, turn: Turn) -> dict[str, str]:
        return {"content-type": "application/json", "x-request-id": turn.request_id,
                **self.worker_headers}

    async def _send(self, b: Backend, turn: Turn, body: dict, stream: bool = False,
                    path: str | None = None) -> httpx.Response:
        """POST to a worker (headers only when `stream`); the caller owns b.outstanding."""
        t = perf()
        try:
            resp = await self._unless_down(b, self.upstream.post(
                b.url + (path or turn.req.path), dumps(body), self._headers(turn), stream=stream))
        except WentDown:
            b.errors += 1
            log.warning("%s: %s (%s) went down during the request; abandoned",
                        turn.request_id, b.name, b.url)
            self.metrics.upstream_errors.labels(b.role, "went_down").inc()
            raise Unreachable(f"{b.name}: went down during the request") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            b.errors += 1
            log.warning("%s: %s (%s) unreachable: %r", turn.request_id, b.name, b.url, e)
            b.mark_down(f"connection failed ({type(e).__name__})")
            self.metrics.upstream_errors.labels(b.role, "connect").inc()
            raise Unreachable(f"{b.name}: connection failed ({type(e).__name__})") from e
        except httpx.HTTPError as e:
            b.errors += 1
            log.warning("%s: %s (%s) failed: %r", turn.request_id, b.name, b.url, e)
            b.last_error = type(e).__name__
            self.metrics.upstream_errors.labels(b.role, "transport").inc()
            raise
        finally:
            turn.upstream_s += perf() - t
        return resp

    @staticmethod
    async def _unless_down(b: Backend, call):
        """`await call`, unless `b` is marked down first (then WentDown, the call cancelled)."""
        task = asyncio.ensure_future(call)
        down = asyncio.ensure_future(b.went_down().wait())
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise WentDown()
        return task.result()

    def _bad_status(self, b: Backend, resp: httpx.Response) -> str:
        """Account for an answer that is not a usable 200 (a 4xx is the client's, not b's)."""
        self.metrics.upstream_errors.labels(b.role, f"http_{resp.status_code // 100}xx").inc()
        if not 400 <= resp.status_code < 500:
            b.errors += 1
            b.last_error = f"HTTP {resp.status_code}"
        if resp.status_code == 503:
            b.mark_down("answered 503 (engine not available)")
        log.warning("%s (%s) answered HTTP %d: %s", b.name, b.url, resp.status_code,
                    resp.text[:300])
        return f"{b.name} answered HTTP {resp.status_code}"

    # P leg
    async def prefill(self, turn: Turn) -> None:
        req, stats = turn.req, turn.stats
        if self.warmer is not None:  # P's lease starts now: D must be able to read in time
            waited = await self.warmer.ready()
            if waited:
                stats.warmup_wait_ms = round(waited * 1e3, 3)
        params = replay_params(turn.entry.params) if turn.entry else miss_params()
        replaying = turn.entry is not None
        released = False  # P is sent D's params to read nothing (verify.release_params)
        tried: set[Backend] = set()
        last = "no prefill worker is configured"
        for _ in range(len(self.pool.prefill) + 1):
            p = self.pool.choose_prefill(tried)
            if p is None:
                break
            if replaying and self._mixed(p, turn.entry.decode_url):
                params, replaying, stats.conversation = miss_params(), False, "mixed"
            checked = None  # the params a P that does not verify tokens was handed
            if replaying and p.kind != "duplexkv":
                checked = await self._verified(turn, p)
                if checked is None:  # nothing to read: free D's blocks now, or a plain miss
                    release = release_params(replay_params(turn.entry.params))
                    params, replaying, released = release or miss_params(), False, bool(release)
                else:
                    params, replaying = checked, True
            body = prefill_body(req, params)
            if checked is not None:
                body["return_token_ids"] = True
            answer, status, resp = None, 0, None
            p.outstanding += 1
            try:
                resp = await self._send(p, turn, body)
                status = resp.status_code
                answer = resp.json() if status == 200 else None
                if not isinstance(answer, dict):
                    answer = None
                    last = self._bad_status(p, resp)
            except Unreachable as e:
                tried.add(p)
                last = str(e)
                continue
            except (httpx.HTTPError, ValueError) as e:
                last = f"{p.name}: {type(e).__name__}"
            finally:
                p.outstanding -= 1
            if answer is not None and checked is not None and not prefix_holds(
                    answer, checked, turn.entry.tokens):
                # P's prompt is not what /tokenize said: never let it read on that basis
                log.warning("%s: %s's prompt does not start with the verified prefix; retrying "
                            "as a miss", turn.request_id, p.name)
                turn.verdict.outcome, turn.verdict.reason = "mismatch", "prompt_differs"
                stats.verify = turn.verdict.as_dict()
                self.metrics.reuse.labels("retried").inc()
                params, replaying, stats.conversation = miss_params(), False, "retried"
                continue
            if answer is not None:
                self._prefilled(turn, p, answer, replaying)
                return
            if replaying or released:  # D may be gone or unreachable: retry once as a plain miss
                log.warning("%s: P leg failed with stored params (%s); retrying as a miss",
                            turn.request_id, last)
                self.metrics.reuse.labels("retried").inc()
                params, replaying, stats.conversation = miss_params(), False, "retried"
                released = False
                continue
            if resp is not None and 400 <= status < 500:
                raise Relayed(status, resp.content,
                              resp.headers.get("content-type", "application/json"))
            tried.add(p)
        raise no_worker("prefill", last)

    async def _verified(self, turn: Turn, p: Backend) -> dict | None:
        """The entry's params cut to the prefix P's prompt shares with D's held sequence, or
        None (the turn runs as a miss, counted by its reason); router/verify.py."""
        entry, t = turn.entry, perf()
        prompt = await self._tokenize(turn, p) if entry.tokens is not None else None
        d = self.pool.by_url.get(("decode", entry.decode_url))
        block = (d.block_size if d is not None else None) or p.block_size
        checked, v = verify(replay_params(entry.params), entry.tokens, prompt, block,
                            self.cfg.kv_recompute_threshold)
        v.verify_ms = round((perf() - t) * 1e3, 3)
        turn.verdict, turn.stats.verify = v, v.as_dict()
        if checked is None:
            self.metrics.reuse.labels(v.pull_outcome()).inc()
            log.info("%s: not replaying D's KV to %s: %s %s (held %d, matched %d tokens)",
                     turn.request_id, p.name, v.outcome, v.reason, v.held_tokens,
                     v.matched_tokens)
        return checked

    async def _tokenize(self, turn: Turn, p: Backend) -> list[int] | None:
        """P's own tokens for this request's prompt (its /tokenize), or None if it cannot say."""
        body = tokenize_body(turn.req.body, chat=turn.req.path.endswith("/chat/completions"))
        try:
            resp = await self._send(p, turn, body, path="/tokenize")
            tokens = token_list(resp.json().get("tokens")) if resp.status_code == 200 else None
        except (Unreachable, httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("%s: %s/tokenize failed: %r", turn.request_id, p.name, e)
            return None
        if tokens is None:
            log.warning("%s: %s/tokenize answered %d without tokens", turn.request_id, p.name,
                        resp.status_code)
        return tokens

    def _mixed(self, p: Backend, decode_url: str) -> bool:
        """P and the D holding the conversation are different servers (our worker and vLLM):
        neither reads the other's KV, so the turn runs as plain P/D; logged once per pair."""
        d = self.pool.by_url.get(("decode", decode_url))
        if d is None or p.kind is None or d.kind is None or p.kind == d.kind:
            return False
        self.metrics.reuse.labels("mixed").inc()
        if (p.name, d.name) not in self._mixed_logged:
            self._mixed_logged.add((p.name, d.name))
            log.warning("%s is %s and %s is %s: they cannot exchange KV, so conversations "
                        "held on %s run as plain P/D on %s", p.name, p.kind, d.name, d.kind,
                        d.name, p.name)
        return True

    def _prefilled(self, turn: Turn, p: Backend, answer: dict, replayed: bool) -> None:
        stats = turn.stats
        turn.p = p
        stats.prefill, stats.prefill_source = worker_stats(answer)
        stats.prefill_done_ms = round((perf() - turn.arrival) * 1e3, 3)
        params = answer.get("kv_transfer_params")
        turn.p_params = params if isinstance(params, dict) else None
        if self.cfg.rewrite_remote_host:
            turn.p_params = rewrite_remote_host(turn.p_params, p.url)
        if turn.verdict is not None and turn.verdict.reuses:
            stats.prefill = {**(stats.prefill or {}), "pull_outcome": turn.verdict.pull_outcome(),
                             "offered_tokens": turn.verdict.offered_tokens}
        if replayed:
            self.metrics.reuse_outcome(stats.prefill)
        if turn.key is not None:
            pulled = (stats.prefill or {}).get("pull_outcome") == "pulled"
            self._placed(turn, "prefill_pull" if pulled else "prefill_recompute")

    # D leg
    def _decode_candidates(self, turn: Turn):
        if turn.local_d is not None:  # decode_local: only the D that holds the history
            turn.local_d.picks += 1
            yield turn.local_d
            return
        tried: set[Backend] = set()
        preferred = turn.entry.decode_url if turn.entry else None
        for _ in range(len(self.pool.decode)):
            d, _pref = self.pool.choose_decode(preferred, tried, turn.p)
            if d is None:
                return
            tried.add(d)
            yield d

    @staticmethod
    def _learns_tokens(turn: Turn, d: Backend) -> bool:
        """Ask D for its sequence in tokens (for the next turn's check, router/verify.py): a
        conversation turn with one choice on a D that is not ours."""
        n = turn.req.body.get("n")
        return turn.key is not None and d.kind != "duplexkv" and n in (None, 1)

    @staticmethod
    def _client_wants_tokens(turn: Turn) -> bool:
        return bool(turn.req.body.get("return_token_ids"))

    async def _decode_call(self, turn: Turn, stream: bool) -> tuple[Backend, httpx.Response]:
        body = decode_body(turn.req, turn.p_params)
        last = "no decode worker is configured"
        for d in self._decode_candidates(turn):
            d.outstanding += 1
            try:
                leg_body = {**body, "return_token_ids": True} if self._learns_tokens(turn, d) \
                    else body
                resp = await self._send(d, turn, leg_body, stream=stream)
            except (Unreachable, httpx.HTTPError) as e:
                d.outstanding -= 1
                last = str(e) if isinstance(e, Unreachable) else f"{d.name}: {type(e).__name__}"
                continue
            if resp.status_code == 200:
                return d, resp  # the caller decrements d.outstanding when done
            d.outstanding -= 1
            if stream:
                await resp.aread()
                await resp.aclose()
            last = self._bad_status(d, resp)
            if resp.status_code != 503:
                raise Relayed(resp.status_code, resp.content,
                              resp.headers.get("content-type", "application/json"))
        raise no_worker("decode", last)

    async def decode_json(self, turn: Turn) -> Response:
        d, resp = await self._decode_call(turn, stream=False)
        d.outstanding -= 1
        try:
            d_json = resp.json()
        except ValueError:
            raise no_worker("decode", f"{d.name} answered invalid JSON") from None
        out, params = finish_json(d_json, turn.stats)
        tokens = None
        if self._learns_tokens(turn, d):
            tokens = _held_from_json(out, params, strip=not self._client_wants_tokens(turn))
        await self.remember(turn, d, params, tokens)
        self.metrics.overhead.observe(max(0.0, perf() - turn.arrival - turn.upstream_s))
        self.metrics.requests.labels(turn.req.endpoint, "ok").inc()
        return Response(dumps(out), media_type="application/json",
                        headers={"X-Request-Id": turn.request_id})

    async def decode_stream(self, turn: Turn) -> Response:
        d, resp = await self._decode_call(turn, stream=True)
        relay = StreamRelay(turn.stats, turn.arrival, tokens=self._learns_tokens(turn, d),
                            strip_tokens=not self._client_wants_tokens(turn))
        leg = _StreamLeg(turn, d, resp, relay, perf())
        return SSEResponse(self._relay(leg), on_close=lambda: self._close(leg),
                           headers={"X-Request-Id": turn.request_id, "Cache-Control": "no-cache"})

    async def _relay(self, leg: _StreamLeg):
        turn, d, relay, m = leg.turn, leg.d, leg.relay, self.metrics
        stored, first_wait = False, None
        try:
            async for chunk in leg.resp.aiter_bytes():
                if first_wait is None:  # headers -> first bytes (the headers are in upstream_s)
                    first_wait = perf() - leg.headers_at
                for event in relay.feed(chunk):
                    if relay.done and not stored:  # store before [DONE]: the next turn may follow
                        await self.remember(turn, d, relay.params, relay.held(relay.params))
                        stored = True
                    yield event
                    if not leg.delivered and event.startswith(DONE):  # resumed: it went out
                        leg.delivered = True
                        leg.outcome = "upstream_error" if relay.error else "ok"
                    if first_wait is not None and first_wait >= 0:
                        m.overhead.observe(max(0.0, perf() - turn.arrival - turn.upstream_s
                                               - first_wait))
                        first_wait = -1.0
            for event in relay.flush():
                yield event
            if not stored:
                await self.remember(turn, d, relay.params, relay.held(relay.params))
            if not leg.delivered:  # D closed without [DONE]: the client has all D sent
                leg.outcome = "upstream_error" if relay.error else "ok"
        except httpx.HTTPError as e:
            if leg.delivered:  # the client has its whole answer; only D's tail broke
                log.info("%s: decode stream from %s broke after [DONE]: %r",
                         turn.request_id, d.url, e)
                return
            # D went away mid-stream: tell the client in the stream
            log.warning("%s: decode stream from %s broke: %r", turn.request_id, d.url, e)
            leg.outcome = "upstream_error"
            m.upstream_errors.labels("decode", "stream").inc()
            err = APIError(502, f"the decode worker's stream broke ({d.name}: "
                           f"{type(e).__name__})", type="server_error")
            yield b"data: " + dumps(err.body()) + b"\n\ndata: [DONE]\n\n"
        finally:
            await self._close(leg)

    async def _close(self, leg: _StreamLeg) -> None:
        """Once per stream, whether it ended, broke, or the client left before the first byte."""
        if leg.closed:
            return
        leg.closed = True
        leg.d.outstanding -= 1
        await leg.resp.aclose()
        if leg.relay.first_token_at is not None:
            self.metrics.ttft.observe(leg.relay.first_token_at - leg.turn.arrival)
        self.metrics.requests.labels(leg.turn.req.endpoint, leg.outcome).inc()


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


@dataclass(slots=True)
class _StreamLeg:
    turn: Turn
    d: Backend
    resp: httpx.Response
    relay: StreamRelay
    headers_at: float
    outcome: str = "aborted"  # until the client has received [DONE] (or D's whole body)
    delivered: bool = False  # [DONE] was handed to the client's connection
    closed: bool = False
