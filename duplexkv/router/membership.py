"""Discovered workers joining and leaving the router's pool (`--discovery redis://...`).

Each snapshot of the registry (duplexkv/discovery/watcher.py) is compared with the members:

    new record          join: one Backend per role ("both" = a prefill and a decode backend),
                        named by role and the next unused index ("decode[2]"; an index is never
                        reused, so the change log stays unambiguous); a URL the static lists (or
                        another member) already have is not added twice
    record gone         leave, reason "lost" if its key expired after missed heartbeats (its
                        index entry is still there: `Snapshot.expired`), else "left" (the worker
                        deregistered: key and index entry go in one transaction); a fact read
                        from Redis, not a guess from how long the router last saw the seq move
                        (a busy worker's late heartbeats made a clean stop look "lost")
    seq not moving      leave, reason "lost", once the record has not changed for STALE_HEARTBEATS
                        (2) of its heartbeats and the health checks (or a refused leg) have marked
                        it down; a worker that still answers stays until its key expires (3
                        heartbeats), so a starved or Redis-cut worker is not dropped on a blip;
                        it joins again if its seq moves again
    rejected record     counted once per key and reason, never added
    poll failed         nothing changes (a Redis outage removes no worker); the next successful
                        poll restarts every member's staleness clock

Leaving only takes a backend out of the pool: new legs go elsewhere, legs in flight keep their
Backend object and finish. Static `--prefill/--decode` workers are never removed. Clients see
workers by name only (/health, /metrics): no URL.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import Counter, Gauge

from duplexkv.discovery.record import STALE_HEARTBEATS, Registration
from duplexkv.discovery.watcher import Snapshot
from duplexkv.router.backends import Backend, BackendPool
from duplexkv.router.metrics import RouterMetrics

log = logging.getLogger("duplexkv.router")
MAX_CHANGES = 64


@dataclass(slots=True)
class Member:
    record: Registration
    backends: list[Backend] = field(default_factory=list)
    seq_seen_at: float = 0.0  # monotonic: when this record's seq last moved


class Membership:
    def __init__(self, pool: BackendPool, metrics: RouterMetrics, shown_url: str,
                 verifies: bool, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.metrics, self.clock = pool, metrics, clock
        self.shown_url, self.verifies, self.interval_s = shown_url, verifies, interval_s
        self.members: dict[str, Member] = {}
        self.stale: dict[str, int] = {}  # id -> the seq that stopped moving (ignored until it moves)
        self.rejected: dict[str, str] = {}  # Redis key -> reason (currently present)
        self.changes: deque[dict] = deque(maxlen=MAX_CHANGES)
        self.next_index = {"prefill": len(pool.prefill), "decode": len(pool.decode)}
        self.static = {(b.role, b.url) for b in pool.all}
        self.owner: dict[tuple[str, str], str] = {}  # (role, url) -> member id
        self.last_poll: float | None = None
        self.last_error = ""
        self.poll_errors = 0
        self._failed_since: float | None = None
        r = {"registry": metrics.registry}
        self.joins = Counter("duplexkv_router_discovery_joins", "Discovered workers that joined, "
                             "by role", ["role"], **r)
        self.leaves = Counter("duplexkv_router_discovery_leaves", "Discovered workers that left, by "
                              "role and reason (left: deregistered; lost: missed heartbeats or "
                              "expired)", ["role", "reason"], **r)
        self.rejections = Counter("duplexkv_router_discovery_rejected", "Registry records not "
                                  "accepted, by reason (unsigned, bad_signature, too_old, "
                                  "malformed)", ["reason"], **r)
        self.poll_failures = Counter("duplexkv_router_discovery_poll_errors",
                                     "Registry polls that failed (members kept)", **r)
        self.gauge = Gauge("duplexkv_router_discovery_members", "Discovered workers in the pool, "
                           "by role", ["role"], **r)
        for role in ("prefill", "decode"):
            self.joins.labels(role)
            self.gauge.labels(role).set(0)
            for reason in ("left", "lost"):
                self.leaves.labels(role, reason)

    # --- the watcher's callbacks ---
    def apply(self, snap: Snapshot) -> None:
        now = self.clock()
        recovering = self._failed_since is not None
        self.last_poll, self._failed_since, self.last_error = now, None, ""
        for rid, rec in snap.records.items():
            m = self.members.get(rid)
            if m is None:
                if self.stale.get(rid) == rec.seq:
                    continue  # still not heartbeating
                self.stale.pop(rid, None)
                self._join(rec, now)
                continue
            if rec.url != m.record.url or rec.role != m.record.role:  # cannot happen honestly
                self._leave(rid, "left")
                self._join(rec, now)
                continue
            if rec.seq != m.record.seq or recovering:
                m.record, m.seq_seen_at = rec, now
            elif (now - m.seq_seen_at > STALE_HEARTBEATS * rec.heartbeat_s
                  and not any(b.healthy for b in m.backends)):
                self.stale[rid] = rec.seq
                self._leave(rid, "lost")
        for rid in [r for r in self.members if r not in snap.records]:
            self._leave(rid, "lost" if rid in snap.expired else "left")
        for rid in [r for r in self.stale if r not in snap.records]:
            del self.stale[rid]
        self._rejections(snap.rejected)
        if snap.truncated:
            log.warning("discovery: more records than the router reads; some are ignored")

    def failed(self, e: BaseException) -> None:
        self.poll_errors += 1
        self.poll_failures.inc()
        self.last_error = type(e).__name__
        if self._failed_since is None:
            self._failed_since = self.clock()
            log.warning("discovery: cannot read the registry in %s (%s); keeping the %d known "
                        "member(s) and retrying every %.3g s", self.shown_url, type(e).__name__,
                        len(self.members), self.interval_s)

    # --- changes ---
    def _join(self, rec: Registration, now: float) -> None:
        m = self.members[rec.id] = Member(rec, seq_seen_at=now)
        for role in rec.roles():
            slot = (role, rec.url)
            if slot in self.static:
                log.info("discovery: %s %s is also a static worker; kept once", role, rec.url)
                continue
            previous = self.owner.get(slot)
            if previous is not None:  # the same address re-registered (a restarted worker)
                old = self.members[previous]
                b = next(b for b in old.backends if b.role == role)
                old.backends.remove(b)
            else:
                i = self.next_index[role]
                self.next_index[role] = i + 1
                b = Backend(rec.url, role, f"{role}[{i}]", models=(rec.model,))
                getattr(self.pool, role).append(b)
                self.pool.by_url[slot] = b
                self.joins.labels(role).inc()
                self._change("joined", b, rec)
                log.info("discovery: %s joined (%s, model %s)", b.name, rec.url, rec.model)
            self.owner[slot] = rec.id
            m.backends.append(b)
        self._count()

    def _leave(self, rid: str, reason: str) -> None:
        m = self.members.pop(rid)
        for b in m.backends:
            del self.owner[(b.role, b.url)]
            with contextlib.suppress(ValueError):
                getattr(self.pool, b.role).remove(b)
            if self.pool.by_url.get((b.role, b.url)) is b:
                del self.pool.by_url[(b.role, b.url)]
            for gauge in (self.metrics.backend_up, self.metrics.backend_outstanding):
                with contextlib.suppress(KeyError):
                    gauge.remove(b.role, b.name)
            self.leaves.labels(b.role, reason).inc()
            self._change(reason, b, m.record)
            log.info("discovery: %s %s (%s; %d request(s) in flight finish there)", b.name,
                     "deregistered" if reason == "left" else "missed its heartbeats", b.url,
                     b.outstanding)
        self._count()

    def _rejections(self, rejected: dict[str, str]) -> None:
        for key, reason in rejected.items():
            if self.rejected.get(key) != reason:
                self.rejections.labels(reason).inc()
                self.changes.append({"at": _stamp(), "event": "rejected", "reason": reason})
                log.warning("discovery: ignoring the record under %r (%s)", key[:80], reason)
        self.rejected = dict(rejected)

    def _change(self, event: str, b: Backend, rec: Registration) -> None:
        self.changes.append({"at": _stamp(), "event": event, "worker": b.name, "role": b.role,
                             "model": rec.model})

    def _count(self) -> None:
        for role in ("prefill", "decode"):
            self.gauge.labels(role).set(sum(1 for m in self.members.values()
                                            for b in m.backends if b.role == role))

    # --- /health ---
    def state(self) -> dict:
        now = self.clock()
        members = [{"worker": b.name, "role": b.role, "model": m.record.model,
                    "registered_as": m.record.role, "heartbeat_s": m.record.heartbeat_s,
                    "capacity": {"max_num_seqs": m.record.capacity.max_num_seqs,
                                 "kv_blocks": m.record.capacity.kv_blocks,
                                 "block_size": m.record.capacity.block_size,
                                 "max_model_len": m.record.capacity.max_model_len},
                    "last_heartbeat_age_s": round(now - m.seq_seen_at, 3)}
                   for m in self.members.values() for b in m.backends]
        return {"state": "starting" if self.last_poll is None and not self.last_error
                else "degraded" if self._failed_since is not None else "ok",
                "verifies_signatures": self.verifies, "poll_interval_s": self.interval_s,
                "last_poll_age_s": None if self.last_poll is None
                else round(now - self.last_poll, 3),
                "error": self.last_error or None, "members": members,
                "rejected_records": len(self.rejected), "changes": list(self.changes)}


def _stamp() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
