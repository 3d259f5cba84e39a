"""One client request as a turn: what it is (frozen) and what it reports while it runs.

    Turn        the client's request, its id (the client's X-Request-Id, else a fresh one) and
                its arrival on the router's clock; records the steps fill in: `stats` (the
                answer's kv_stats, legs.TurnStats), `waited` (time spent waiting for workers:
                the router's own overhead is the rest) and `kept` (where D's params went)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from duplexkv.router.legs import TurnStats
from duplexkv.router.request import ClientRequest


@dataclass(slots=True)
class WorkerWait:
    """Seconds a turn has spent waiting for workers (calls.py adds each call's time)."""

    seconds: float = 0.0


@dataclass(slots=True)
class KeptAt:
    """The store key the D leg left the conversation's entry under (None: nothing kept; a
    recognised conversation's key moves with every turn): a Responses chain continues there."""

    key: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    req: ClientRequest
    request_id: str  # on every leg (X-Request-Id) and every answer, error or not
    arrival: float  # time.perf_counter() when the request reached the router
    stats: TurnStats = field(default_factory=TurnStats)
    waited: WorkerWait = field(default_factory=WorkerWait)
    kept: KeptAt = field(default_factory=KeptAt)

    @classmethod
    def start(cls, req: ClientRequest, arrival: float) -> Turn:
        return cls(req, req.request_id or uuid.uuid4().hex, arrival)

    def overhead(self, now: float, also_waited: float = 0.0) -> float:
        """Router time from arrival to `now` not spent waiting for workers (`also_waited`: a
        wait not counted in `waited`, such as a stream's first bytes)."""
        return max(0.0, now - self.arrival - self.waited.seconds - also_waited)
