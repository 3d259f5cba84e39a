"""A turn end to end: data (the plan) and small steps (the legs).

    1 recall    the conversation's entry, taken from the store (conversation/recall.py); a
                chat request without an id: the entry its content continues (recognise.py)
    2 plan      plan_turn (plan.py, pure): decode_local on the D that holds the history, or
                through P; kv_stats gets the recall's state and the placement's reason
    3 legs      decode_local: the D leg alone (decode.py); if that D cannot serve, the plan
                falls back and the turn runs through P as a miss; otherwise the P leg
                (prefill.py), then the D leg with P's params. When P could not reach the
                conversation's D for its pull (P's decline reason: unreachable, peer_down,
                stalled),
                that D is suspect (probed, liveness.py) and this turn's D leg goes elsewhere
    4 remember  D's params, for the next turn (the D leg stores them, before a stream's [DONE])
Failures follow retry.py; calls.py says what a worker's failure does and what a client sees.
"""

from __future__ import annotations

import logging

from starlette.responses import Response

from duplexkv.http.errors import APIError
from duplexkv.router.backends import BackendPool
from duplexkv.router.config import RouterConfig
from duplexkv.router.conversation.recall import Conversations
from duplexkv.router.conversation.recognise import recognition_of
from duplexkv.router.liveness import Liveness
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.turn.calls import WorkerCalls
from duplexkv.router.turn.context import Turn
from duplexkv.router.turn.decode import DecodeLeg
from duplexkv.router.turn.plan import TurnPlan, plan_turn
from duplexkv.router.turn.prefill import PrefillLeg
from duplexkv.router.turn.retry import RetryPolicy
from duplexkv.router.turn.token_check import TokenCheck
from duplexkv.router.upstream import Upstream
from duplexkv.router.warmup import PairWarmer

log = logging.getLogger("duplexkv.router")
# P's pull declines that say D is out of its reach (stalled: its READ from D stopped moving)
UNREACHED = ("unreachable", "peer_down", "stalled")


class TurnRunner:
    def __init__(self, cfg: RouterConfig, pool: BackendPool, conversations: Conversations,
                 metrics: RouterMetrics, upstream: Upstream,
                 warmer: PairWarmer | None = None, policy: RetryPolicy = RetryPolicy()) -> None:
        self.cfg, self.pool, self.conversations, self.metrics = cfg, pool, conversations, metrics
        self.policy = policy
        calls = WorkerCalls(upstream, metrics, cfg.worker_headers(),
                            Liveness(upstream.probe_client, alternative=pool.has_alternative))
        check = TokenCheck(calls, pool, metrics, cfg.kv_recompute_threshold)
        self.prefill = PrefillLeg(pool, calls, policy, metrics, check, warmer,
                                  cfg.rewrite_remote_host)
        self.decode = DecodeLeg(pool, calls, policy, conversations, metrics)

    async def run(self, turn: Turn) -> Response:
        """The client's answer; raises calls.Relayed (a worker's 4xx, D's other errors) or
        APIError (503: no worker of a role could serve)."""
        req = turn.req
        recognition = recognition_of(req) if self.cfg.recognise else None
        recalled = await self.conversations.recall(req.api_key, req.conversation_id,
                                                   turn.request_id, recognition,
                                                   req.conversation_key)
        turn.stats.recognised = recalled.recognised
        holder = self.pool.decode_at(recalled.entry.decode_url) if recalled.entry else None
        plan = plan_turn(req, recalled, holder.view() if holder else None, self.cfg.placement)
        _report(turn, plan)
        if plan.local:
            self._placed(turn, "decode_local")
            try:
                return await self.decode.run(turn, plan.local_order(holder))
            except APIError as e:  # that D is gone: the turn runs as a miss through P
                if not self.policy.falls_back_to_prefill(e):
                    raise
                log.warning("%s: decode_local on %s failed (%s); running it through P",
                            turn.request_id, holder.name, e)
                plan = plan.fallen_back()
                self.metrics.placement.labels("decode_local", plan.placement.reason).inc()
                _report(turn, plan)
        prefilled = await self.prefill.run(turn, plan.entry)
        if plan.key is not None:
            self._placed(turn, "prefill_pull" if prefilled.pulled else "prefill_recompute")
        avoid = self._unreached(turn, plan)
        return await self.decode.run(turn, plan.decode_order(prefilled.params, prefilled.p),
                                     avoid)

    def _unreached(self, turn: Turn, plan: TurnPlan) -> frozenset:
        """The conversation's D when P reported it could not reach it (not this turn's D)."""
        outcome = (turn.stats.prefill or {}).get("pull_outcome")
        d = self.pool.decode_at(plan.entry.decode_url) if plan.entry is not None else None
        if d is None or outcome not in UNREACHED:
            return frozenset()
        self.decode.calls.liveness.suspect(d, f"a prefill worker could not reach it ({outcome})")
        return frozenset((d,))

    def _placed(self, turn: Turn, kind: str) -> None:
        turn.stats.placement = kind
        self.metrics.placement.labels(kind, turn.stats.placement_reason or "").inc()


def _report(turn: Turn, plan: TurnPlan) -> None:
    """The plan's part of kv_stats: the conversation's state and why the prefill runs where."""
    turn.stats.conversation = plan.conversation
    if plan.placement is not None:
        turn.stats.placement_reason = plan.placement.reason
        turn.stats.suffix_estimate = plan.placement.suffix_tokens
