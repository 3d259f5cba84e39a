"""The P leg: P prefills the prompt (max_tokens=1) and hands back its kv_transfer_params for D.

    offer      what P is handed (legs.prefill_body): a miss, or D's stored params (a replay: P
               reads the history from D). A P and a D of different kinds (ours and vLLM) never
               exchange KV: a miss ("mixed", logged once per pair). A P that does not verify
               tokens (vLLM) gets the params the router's token check cut to the verified
               prefix (token_check.py), else D's params with nothing to read (a release: P
               frees D's blocks at once), else a miss
    attempts   as retry.py says; each counted in P's `outstanding` (backends.in_flight)
    result     P's kv_stats (or usage) and timing in kv_stats, P's params (remote_host fixed up
               when loopback), and for a replay the reuse outcome P reported (metrics)
Before the first attempt the turn waits, if it must, for a vLLM pair's warm-up (warmup.py): P's
lease on the blocks it computes starts with the leg, and D must be able to read them in time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import httpx

from duplexkv.router.backends import Backend, BackendPool, in_flight
from duplexkv.router.conversation.store import Entry
from duplexkv.router.legs import prefill_body, rewrite_remote_host, worker_stats
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.placement import OURS
from duplexkv.router.turn.calls import Relayed, Unreachable, WorkerCalls, no_worker
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.retry import (
    ANSWER,
    MISMATCH,
    TRANSPORT,
    UNREACHABLE,
    Failure,
    Next,
    RetryPolicy,
)
from duplexkv.router.turn.token_check import TokenCheck
from duplexkv.router.verify import Verdict, prefix_holds, release_params
from duplexkv.router.warmup import PairWarmer
from duplexkv.wire.kv_params import miss_params, replay_params

log = logging.getLogger("duplexkv.router")
perf = time.perf_counter


@dataclass(frozen=True, slots=True)
class Offer:
    """The kv_transfer_params of a P attempt, and what they are."""

    params: dict
    replaying: bool = False  # D's stored params: P reads the history from D
    released: bool = False  # D's params with nothing to read: P frees D's blocks

    @property
    def carries_stored(self) -> bool:
        return self.replaying or self.released


def miss() -> Offer:
    return Offer(miss_params())


@dataclass(frozen=True, slots=True)
class Prefilled:
    p: Backend  # the P that prefilled
    params: dict | None  # its kv_transfer_params, for D
    pulled: bool  # P read the history from D (else it computed the prompt)


class PrefillLeg:
    def __init__(self, pool: BackendPool, calls: WorkerCalls, policy: RetryPolicy,
                 metrics: RouterMetrics, check: TokenCheck, warmer: PairWarmer | None = None,
                 rewrite_host: bool = True) -> None:
        self.pool, self.calls, self.policy, self.metrics = pool, calls, policy, metrics
        self.check, self.warmer, self.rewrite_host = check, warmer, rewrite_host
        self._mixed_logged: set[tuple[str, str]] = set()

    async def run(self, turn: Turn, entry: Entry | None) -> Prefilled:
        """Prefill on some P, replaying `entry` (None: a miss); raises Relayed (P's 4xx) or
        APIError 503 (no P could serve)."""
        stats = turn.stats
        if self.warmer is not None:
            waited = await self.warmer.ready()
            if waited:
                stats.warmup_wait_ms = round(waited * 1e3, 3)
        offer = Offer(replay_params(entry.params), replaying=True) if entry else miss()
        verdict: Verdict | None = None  # the token check's, once made
        tried: set[Backend] = set()
        last = "no prefill worker is configured"
        for _ in range(self.policy.prefill_attempts(len(self.pool.prefill))):
            p = self.pool.choose_prefill(tried)
            if p is None:
                break
            offer, checked, verdict = await self._fit(turn, p, entry, offer, verdict)
            answer, failure = await self._attempt(turn, p, offer, checked)
            if answer is not None and checked and not prefix_holds(answer, offer.params,
                                                                   entry.tokens):
                # P's prompt is not what /tokenize said: never let it read on that basis
                log.warning("%s: %s's prompt does not start with the verified prefix; retrying "
                            "as a miss", turn.request_id, p.name)
                verdict = replace(verdict, outcome="mismatch", reason="prompt_differs")
                stats.verify = verdict.as_dict()
                answer, failure = None, Failure(MISMATCH)
            if answer is not None:
                return self._prefilled(turn, p, answer, offer.replaying, verdict)
            last = failure.detail or last
            step = self.policy.prefill(failure, offer.carries_stored)
            if step is Next.AS_MISS:
                if failure.kind != MISMATCH:  # D may be gone or unreachable
                    log.warning("%s: P leg failed with stored params (%s); retrying as a miss",
                                turn.request_id, last)
                self.metrics.reuse.labels("retried").inc()
                offer, stats.conversation = miss(), "retried"
            elif step is Next.RELAY:
                raise failure.reply
            else:
                tried.add(p)
        raise no_worker("prefill", last)

    async def _fit(self, turn: Turn, p: Backend, entry: Entry | None, offer: Offer,
                   verdict: Verdict | None) -> tuple[Offer, bool, Verdict | None]:
        """The replay fitted to this P -> (the offer; whether it is the token check's cut, which
        P must confirm by its prompt's tokens; the token check's verdict, once made)."""
        if offer.replaying and self._mixed(p, entry.decode_url):
            turn.stats.conversation = "mixed"
            return miss(), False, verdict
        if not offer.replaying or p.kind == OURS:  # ours verifies tokens before it reads
            return offer, False, verdict
        cut, verdict = await self.check.run(turn, p, entry)
        if cut is not None:
            return Offer(cut, replaying=True), True, verdict
        # nothing to read: free D's blocks at once (a release), or a plain miss
        release = release_params(replay_params(entry.params))
        return (Offer(release, released=True) if release else miss()), False, verdict

    async def _attempt(self, turn: Turn, p: Backend, offer: Offer,
                       checked: bool) -> tuple[dict | None, Failure | None]:
        """One call to `p`: -> (P's answer, None) or (None, how it failed)."""
        body = prefill_body(turn.req, offer.params)
        if checked:
            body["return_token_ids"] = True
        with in_flight(p):
            try:
                resp = await self.calls.send(p, turn, body)
                answer = resp.json() if resp.status_code == 200 else None
            except Unreachable as e:
                return None, Failure(UNREACHABLE, str(e))
            except (httpx.HTTPError, ValueError) as e:
                return None, Failure(TRANSPORT, f"{p.name}: {type(e).__name__}")
            if isinstance(answer, dict):
                return answer, None
            return None, Failure(ANSWER, self.calls.bad_status(p, resp), resp.status_code,
                                 Relayed.of(resp))

    def _mixed(self, p: Backend, decode_url: str) -> bool:
        """P and the D holding the conversation are different servers (our worker and vLLM):
        neither reads the other's KV, so the turn runs as plain P/D; logged once per pair."""
        d = self.pool.decode_at(decode_url)
        if d is None or p.kind is None or d.kind is None or p.kind == d.kind:
            return False
        self.metrics.reuse.labels("mixed").inc()
        if (p.name, d.name) not in self._mixed_logged:
            self._mixed_logged.add((p.name, d.name))
            log.warning("%s is %s and %s is %s: they cannot exchange KV, so conversations "
                        "held on %s run as plain P/D on %s", p.name, p.kind, d.name, d.kind,
                        d.name, p.name)
        return True

    def _prefilled(self, turn: Turn, p: Backend, answer: dict, replayed: bool,
                   verdict: Verdict | None) -> Prefilled:
        stats = turn.stats
        stats.prefill, stats.prefill_source = worker_stats(answer)
        stats.prefill_done_ms = round((perf() - turn.arrival) * 1e3, 3)
        params = answer.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        if self.rewrite_host:
            params = rewrite_remote_host(params, p.url)
        if verdict is not None and verdict.reuses:
            stats.prefill = {**(stats.prefill or {}), "pull_outcome": verdict.pull_outcome(),
                             "offered_tokens": verdict.offered_tokens}
        if replayed:
            self.metrics.reuse_outcome(stats.prefill)
        return Prefilled(p, params, (stats.prefill or {}).get("pull_outcome") == "pulled")
