"""A circuit breaker for the conversation store: a hung or dead Redis costs at most one timeout
per period, never one per request.

    closed     every call goes through
    open       after a failure: calls are refused at once for `period_s`
    half open  the period is over: the next call probes the store (others are still refused
               while it runs); success closes the breaker, failure opens it for another period
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger("duplexkv.router")
T = TypeVar("T")


class BreakerOpen(Exception):
    """The call was not made: the breaker is open (the store failed recently)."""


@dataclass(slots=True)
class Breaker:
    name: str
    period_s: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    opened_at: float | None = None  # None: closed
    probing: bool = False
    last_error: str = ""
    opened: int = 0  # times it opened (for logs and tests)

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.probing else "open"

    @property
    def healthy(self) -> bool:
        return self.opened_at is None

    def allow(self) -> bool:
        """May a call be made now? In half open, only the first caller (the probe) may."""
        if self.opened_at is None:
            return True
        if self.probing or self.clock() - self.opened_at < self.period_s:
            return False
        self.probing = True
        return True

    def success(self) -> None:
        if self.opened_at is not None:
            log.info("%s is back: breaker closed", self.name)
        self.opened_at, self.probing, self.last_error = None, False, ""

    def failure(self, error: BaseException) -> None:
        if self.opened_at is None:
            self.opened += 1
            log.warning("%s failed (%r): breaker open, skipping it for %.1f s", self.name,
                        error, self.period_s)
        self.opened_at, self.probing, self.last_error = self.clock(), False, repr(error)

    def abandon(self) -> None:
        """The call was cancelled before it ended: it tells nothing; let the next one probe."""
        self.probing = False

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` if a call may be made now (else BreakerOpen), its outcome recorded: an
        exception opens the breaker, a result closes it, a cancellation tells nothing."""
        self.check()
        try:
            result = await call()
        except Exception as e:
            self.failure(e)
            raise
        except BaseException:  # cancelled (the client left): no verdict on the store
            self.abandon()
            raise
        self.success()
        return result

    def check(self) -> None:
        """Raise BreakerOpen unless a call may be made now."""
        if not self.allow():
            raise BreakerOpen(f"{self.name} is skipped after a failure ({self.last_error}); "
                              f"next try within {self.period_s:g} s")
