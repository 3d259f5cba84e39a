"""Network jobs to peers, gated per peer: a circuit breaker and a bound on jobs in flight.

A peer that just failed (did not answer in time, or answered garbage) is skipped for a while:
its jobs are refused at once instead of each waiting out a timeout. When the period ends, one
job goes through as a probe; success closes the breaker, failure opens it again for twice as
long (up to `max_open_s`). At most `max_in_flight` jobs per peer run at once; the rest wait in
that peer's queue, not in the shared thread pool, so one slow peer never holds the threads that
requests to other peers need.

Thread-safe: `submit` is called from the engine thread, jobs end on pool threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

Job = Callable[[], bool]  # runs the network call(s); True = the peer behaved
Skip = Callable[[str], None]  # called instead of the job, with why
MAX_PEERS = 1024


@dataclass(slots=True)
class _Peer:
    failures: int = 0  # consecutive
    open_until: float = 0.0  # time.monotonic(); 0 = closed
    probing: bool = False
    in_flight: int = 0
    queue: deque[tuple[Job, Skip]] = field(default_factory=deque)


class PeerGate:
    def __init__(self, pool: ThreadPoolExecutor, max_in_flight: int = 4, open_s: float = 2.0,
                 max_open_s: float = 60.0) -> None:
        self.pool = pool
        self.max_in_flight = max_in_flight
        self.open_s, self.max_open_s = open_s, max_open_s
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self.skipped = 0

    def submit(self, peer: str, job: Job, skip: Skip) -> None:
        """Run `job` for `peer` now, later (queued behind that peer's jobs) or not at all
        (`skip(reason)` when its breaker is open)."""
        with self._lock:
            if peer not in self._peers and len(self._peers) >= MAX_PEERS:
                self._forget_idle()
            st = self._peers.setdefault(peer, _Peer())
            st.queue.append((job, skip))
            ready, skipped = self._take(st)
        self._dispatch(peer, ready, skipped)

    def _forget_idle(self) -> None:
        """Bound the table (peers named in requests can be anything): drop idle peers whose
        breaker period is over (lock held)."""
        now = time.monotonic()
        for p in [p for p, s in self._peers.items()
                  if not s.in_flight and not s.queue and s.open_until <= now]:
            del self._peers[p]

    def _take(self, st: _Peer) -> tuple[list[Job], list[Skip]]:
        """Jobs that may start now and skips to call (lock held)."""
        ready: list[Job] = []
        skipped: list[Skip] = []
        now = time.monotonic()
        while st.queue and st.in_flight < self.max_in_flight:
            if st.open_until > now or st.probing:
                skipped.extend(s for _, s in st.queue)
                st.queue.clear()
                break
            job, _ = st.queue.popleft()
            if st.open_until:  # the period is over: this one job probes the peer
                st.probing = True
            st.in_flight += 1
            ready.append(job)
        return ready, skipped

    def _dispatch(self, peer: str, ready: list[Job], skipped: list[Skip]) -> None:
        for skip in skipped:
            self.skipped += 1
            skip("peer_down")
        for job in ready:
            self.pool.submit(self._run, peer, job)

    def _run(self, peer: str, job: Job) -> None:
        ok = False
        try:
            ok = job()
        finally:
            with self._lock:
                st = self._peers[peer]
                st.in_flight -= 1
                self._record(st, ok)
                ready, skipped = self._take(st)
                if not st.queue and not st.in_flight and not st.open_until:
                    del self._peers[peer]  # nothing to remember about a healthy idle peer
            self._dispatch(peer, ready, skipped)

    def _record(self, st: _Peer, ok: bool) -> None:
        st.probing = False
        if ok:
            st.failures, st.open_until = 0, 0.0
        else:
            st.failures += 1
            period = min(self.open_s * 2 ** (st.failures - 1), self.max_open_s)
            st.open_until = time.monotonic() + period

    def state(self) -> dict[str, dict]:
        """Peers with a story (open breaker, queued or running jobs), for /health."""
        now = time.monotonic()
        with self._lock:
            return {p: {"open_for_s": round(max(0.0, s.open_until - now), 3),
                        "failures": s.failures, "in_flight": s.in_flight,
                        "queued": len(s.queue)} for p, s in self._peers.items()}
