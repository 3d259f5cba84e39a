"""Prometheus metrics of the router (its own CollectorRegistry)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from duplexkv.router.backends import BackendPool

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025,
                    0.05, 0.1)
# what P reports in kv_stats.pull_outcome on a replayed turn; anything else counts as "other"
REUSE_OUTCOMES = ("pulled", "threshold", "mismatch", "expired", "failed", "stalled", "unknown",
                  "local_hit", "no_room")


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        m = {"registry": r}
        self.requests = Counter(
            "duplexkv_router_requests", "Client requests by endpoint and outcome (ok, bad_request, "
            "not_found, upstream_4xx, upstream_error, unavailable, aborted)",
            ["endpoint", "outcome"], **m)
        self.conversations = Counter(
            "duplexkv_router_conversations", "Conversation entries by event (stored, hit, miss, "
            "expired, evicted; not_retained = D returned no params to keep for the next turn)", ["event"], **m)
        self.recognised = Counter(
            "duplexkv_router_recognised", "Chat turns without a conversation id looked up by "
            "their content (matched: a stored turn's messages are a prefix of theirs; "
            "unmatched: none is)", ["result"], **m)
        self.reuse = Counter(
            "duplexkv_router_reuse", "Replayed turns by the outcome P reported (pulled, "
            "threshold, mismatch, expired, failed, ...; retried = P failed and the turn was "
            "retried as a miss; mixed = P and D are different servers, run as a miss)", ["outcome"], **m)
        self.placement = Counter(
            "duplexkv_router_placement", "Conversation turns by where their prefill ran "
            "(decode_local, prefill_pull, prefill_recompute) and why (router/placement.py)",
            ["kind", "reason"], **m)
        self.store_errors = Counter("duplexkv_router_store_errors",
                                    "Conversation store operations that failed", ["op"], **m)
        self.upstream_errors = Counter(
            "duplexkv_router_upstream_errors", "Failed calls to workers by role and kind",
            ["role", "kind"], **m)
        self.warmups = Counter(
            "duplexkv_router_warmups", "P<->D channel warm-ups before a vLLM pair takes turns "
            "(router/warmup.py) by outcome (ok, failed)", ["outcome"], **m)
        self.ttft = Histogram("duplexkv_router_time_to_first_token_seconds",
                              "Router arrival to the first token sent (streaming requests)",
                              buckets=TTFT_BUCKETS, **m)
        self.overhead = Histogram(
            "duplexkv_router_overhead_seconds", "Router time per request not spent waiting for "
            "workers (to the first byte when streaming)", buckets=OVERHEAD_BUCKETS, **m)
        self.backend_up = Gauge("duplexkv_router_backend_up", "1 while a worker is healthy",
                                ["role", "worker"], **m)
        self.backend_outstanding = Gauge("duplexkv_router_backend_outstanding",
                                         "Requests in flight per worker", ["role", "worker"], **m)
        self.stored = Gauge("duplexkv_router_conversations_stored",
                            "Conversation entries in the store", **m)
        for event in ("stored", "hit", "miss", "expired", "evicted", "not_retained"):
            self.conversations.labels(event)
        for result in ("matched", "unmatched"):
            self.recognised.labels(result)
        for outcome in (*REUSE_OUTCOMES, "other", "retried", "mixed"):
            self.reuse.labels(outcome)

    def reuse_outcome(self, p_stats: dict | None) -> None:
        outcome = (p_stats or {}).get("pull_outcome") or "other"
        self.reuse.labels(outcome if outcome in REUSE_OUTCOMES else "other").inc()

    def update(self, pool: BackendPool, stored: int | None) -> None:
        for b in pool.all:
            self.backend_up.labels(b.role, b.name).set(1 if b.healthy else 0)
            self.backend_outstanding.labels(b.role, b.name).set(b.outstanding)
        if stored is not None:
            self.stored.set(stored)

    def render(self) -> bytes:
        return generate_latest(self.registry)
