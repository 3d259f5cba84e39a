"""The worker pool: per-backend health and load, and the P/D choice (health.py checks them).

    choose P   least outstanding requests among healthy prefill workers
    choose D   the conversation's D (its prefix cache already holds the history, so the P->D read
               shrinks to the new tail) unless it is down or has `affinity_slack` more requests in
               flight than the least loaded D; otherwise the least loaded
    ties       fewest picks so far, which spreads an idle pool round robin
    suspect    a worker that failed a leg is chosen only when no sound healthy one of its role
               is left, until a probe clears it (router/liveness.py)
    warm       a healthy worker none of whose NIXL channels is open yet (router/warmup.py) is
               picked only when no warm healthy one of its role is left; a D whose channel with
               the turn's P is still being opened, only when no other warm D is left
    health     health.py: a refused connection marks a worker down at once, `unhealthy_after`
               failed checks in a row otherwise; one good check marks it up
    abandon    a leg in flight to a worker is abandoned when the worker is marked down (again):
               an unreachable host (link down, partition) answers nothing, and a request on a
               pooled connection would otherwise wait for --request-timeout
    in flight  `outstanding` counts a worker's legs in flight; only `InFlight` (`in_flight(b)`)
               changes it, +1 when a leg starts and -1 exactly once when it ends, however it
               ends (answered, failed, cancelled; a streamed answer when its stream closes)
When every worker of a role is marked down the router still tries them (a mark can be stale):
the client gets an error only when none answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from duplexkv.router.worker_load import WorkerLoad

log = logging.getLogger("duplexkv.router")
RTT_SAMPLES = 16  # /health answers remembered per worker (~30 s of health checks)


@dataclass(slots=True, eq=False)
class Backend:
    url: str
    role: str  # "prefill" | "decode"
    name: str = ""  # what clients see: role and index, e.g. "prefill[0]" (never the URL)
    healthy: bool = True  # optimistic until the first check says otherwise
    outstanding: int = 0
    picks: int = 0
    failed_checks: int = 0
    errors: int = 0
    last_error: str = ""
    last_check: float = 0.0
    models: tuple[str, ...] = ()
    max_model_len: int | None = None  # /v1/models' (ours and vLLM's): a continuation's limit
    kind: str | None = None  # who serves it (/v1/models `owned_by`: "duplexkv", "vllm", ...)
    block_size: int | None = None  # a vLLM worker's KV block (its /metrics), for verify.py
    kv_warning: str = ""  # a KV plane that workers on other hosts cannot reach
    warm: bool = True  # False while its NIXL channels are being opened (router/warmup.py)
    suspect: bool = False  # failed a leg; chosen last until a probe clears it (liveness.py)
    _down: asyncio.Event | None = None  # set by the next mark_down; legs in flight wait on it
    # how long its /health took lately (health checks and probes): a probe's timeout scales
    # with it (router/liveness.py), so a worker slow to answer under load is not given up on
    _rtts: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    last_progress: float = 0.0  # time.monotonic() of its last answer or stream event
    load: WorkerLoad = field(default_factory=WorkerLoad)  # what it last reported (worker_load.py)

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    down_at: float = 0.0  # time.monotonic() when it was last marked down

    def note_rtt(self, started: float) -> None:
        """A /health call that began at `started` (time.monotonic()) was answered now; one
        that began before the worker was last marked down says nothing of its load (a check
        sent into a cut link is answered when the link is back)."""
        if started > self.down_at:
            self._rtts.append(time.monotonic() - started)

    def recent_rtt(self) -> float:
        """The slowest /health answer of the last RTT_SAMPLES (0 before any)."""
        return max(self._rtts, default=0.0)

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("%s (%s) is down: %s", self.name, self.url, reason)
        self.healthy = False
        self.last_error = reason
        self.down_at = time.monotonic()
        self._rtts.clear()
        if self._down is not None:
            self._down.set()
            self._down = None

    def went_down(self) -> asyncio.Event:
        """An event set the next time this worker is marked down (from now on)."""
        if self._down is None:
            self._down = asyncio.Event()
        return self._down

    def note_error(self, last_error: str = "") -> None:
        """A call to this worker failed (`last_error`: what /health shows, when it says more)."""
        self.errors += 1
        if last_error:
            self.last_error = last_error

    def view(self) -> BackendView:
        return BackendView(self.url, self.name, self.kind, self.healthy, self.outstanding)

    def mark_up(self) -> None:
        if not self.healthy:
            log.info("%s (%s) is up again", self.name, self.url)
        self.healthy = True
        self.suspect = False
        self.failed_checks = 0
        self.last_error = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "role": self.role, "healthy": self.healthy,
                "outstanding": self.outstanding, "picks": self.picks, "errors": self.errors,
                "warm": self.warm, "suspect": self.suspect, "last_error": self.last_error or None,
                "kv_warning": self.kv_warning or None,
                "reported_load": self.load.as_dict() if self.load.at else None,
                "last_check_age_s": round(time.monotonic() - self.last_check, 3)
                if self.last_check else None}


@dataclass(frozen=True, slots=True)
class BackendView:
    """A worker as a decision sees it at one moment (turn/plan.py): facts, no live object."""

    url: str
    name: str
    kind: str | None
    healthy: bool
    outstanding: int


class InFlight:
    """One leg's share of its worker's `outstanding`: +1 when made, -1 exactly once (`release`).

    As a context manager (`with in_flight(b) as leg:`) it is given back when the block ends,
    whatever ends it (a return, an exception, a cancellation), unless the block called `keep()`
    and then returned normally: a streamed answer's leg stays counted until its stream closes,
    and its closer calls `release()`."""

    __slots__ = ("backend", "held", "kept")

    def __init__(self, backend: Backend) -> None:
        self.backend, self.held, self.kept = backend, True, False
        backend.outstanding += 1

    def keep(self) -> InFlight:
        """Hand the count on past the block (to be `release()`d by the new owner)."""
        self.kept = True
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self.backend.outstanding -= 1

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None or not self.kept:
            self.release()


def in_flight(b: Backend) -> InFlight:
    """Count a leg to `b` in `b.outstanding` for a `with` block (see InFlight)."""
    return InFlight(b)


@dataclass(slots=True)
class BackendPool:
    prefill: list[Backend]
    decode: list[Backend]
    affinity_slack: int = 4
    unhealthy_after: int = 2
    by_url: dict[tuple[str, str], Backend] = field(default_factory=dict)
    # (P url, D url) of the pairs whose channel is being opened (router/warmup.py keeps it)
    cold_pairs: Collection[tuple[str, str]] = field(default_factory=frozenset)

    @classmethod
    def from_urls(cls, prefill: Iterable[str], decode: Iterable[str], **kw) -> BackendPool:
        pool = cls([Backend(u, "prefill", f"prefill[{i}]") for i, u in enumerate(prefill)],
                   [Backend(u, "decode", f"decode[{i}]") for i, u in enumerate(decode)], **kw)
        pool.by_url = {(b.role, b.url): b for b in pool.all}
        return pool

    @property
    def all(self) -> list[Backend]:
        return self.prefill + self.decode

    def decode_at(self, url: str | None) -> Backend | None:
        """The decode worker at `url` while it is in the pool (a conversation's D may have left)."""
        return self.by_url.get(("decode", url)) if url else None

    @staticmethod
    def _least_loaded(candidates: list[Backend]) -> Backend | None:
        if not candidates:
            return None
        return min(candidates, key=lambda b: (b.outstanding, b.picks))

    def _candidates(self, backends: list[Backend], exclude: set[Backend]) -> list[Backend]:
        left = [b for b in backends if b not in exclude]
        healthy = [b for b in left if b.healthy]
        sound = [b for b in healthy if not b.suspect]
        return [b for b in sound if b.warm] or sound or healthy or left

    def has_alternative(self, b: Backend) -> bool:
        """Whether another healthy worker of b's role could take its legs."""
        return any(o is not b and o.healthy for o in (self.prefill if b.role == "prefill"
                                                       else self.decode))

    def choose_prefill(self, exclude: set[Backend] = frozenset()) -> Backend | None:
        return self.pick(self._least_loaded(self._candidates(self.prefill, exclude)))

    def choose_decode(self, preferred_url: str | None = None,
                      exclude: set[Backend] = frozenset(),
                      prefill: Backend | None = None) -> tuple[Backend | None, bool]:
        """-> (D, whether it is the preferred one); D's whose channel with `prefill` is still
        warming are left out while another candidate is there."""
        candidates = self._candidates(self.decode, exclude)
        if prefill is not None and self.cold_pairs:
            candidates = [d for d in candidates
                          if (prefill.url, d.url) not in self.cold_pairs] or candidates
        least = self._least_loaded(candidates)
        pref = self.by_url.get(("decode", preferred_url)) if preferred_url else None
        if (pref is not None and least is not None and pref in candidates and pref.healthy
                and not pref.suspect
                and pref.outstanding <= least.outstanding + self.affinity_slack):
            return self.pick(pref), True
        return self.pick(least), False

    @staticmethod
    def pick(b: Backend | None) -> Backend | None:
        """Count a choice of `b` (ties between equally loaded workers go to the least picked)."""
        if b is not None:
            b.picks += 1
        return b

    def models(self) -> list[str]:
        """Model names the healthy workers serve (learned by the health checks)."""
        seen: dict[str, None] = {}
        for b in self.all:
            if b.healthy:
                seen.update(dict.fromkeys(b.models))
        return list(seen)

    def state(self) -> dict:
        return {"prefill": [b.as_dict() for b in self.prefill],
                "decode": [b.as_dict() for b in self.decode]}
