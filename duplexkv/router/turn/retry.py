"""What a failed leg does next: the router's retry rules in one object, without I/O
(protocol.md 6).

    failure           P leg                                   D leg
    unreachable       another P, with the same params         another D
      (refused, connect timed out, marked down in flight: the worker answered nothing)
    transport         another P *                             another D
      (the call broke after it was sent; P: an answer that is not JSON)
    answer 4xx        relayed to the client as it is *        relayed to the client as it is
    answer 503        another P * (the worker is marked down) another D (marked down)
    other answer      another P *                             relayed to the client as it is
      (any other status; P: a 200 that is not a JSON object)
    mismatch          again as a plain miss, on any P         -
      (P's prompt does not start with the prefix the router verified, verify.py)

    * unless the leg carried D's stored params (a replay, or a release of D's blocks): then the
      leg runs again as a plain miss, on any P (D may be gone or unreachable); a miss carries
      no stored params, so a turn is retried as a miss at most once

    attempts       P: one per prefill worker plus one (the retry as a miss may pick the same P);
                   D: one per decode worker, each at most once; decode_local: its one D
    decode_local   the D that holds the history cannot serve (a 503 from the D leg: unreachable,
                   down, 503, a 200 that is not JSON): the turn runs through P as a miss
    exhausted      a 503 in OpenAI's shape naming the role and the last error (calls.no_worker)

D's 200 that is not JSON (a JSON request) is a 503 at once: D has decoded, nothing is retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from duplexkv.http.errors import APIError

if TYPE_CHECKING:
    from duplexkv.router.turn.calls import Relayed

UNREACHABLE, TRANSPORT, ANSWER, MISMATCH = "unreachable", "transport", "answer", "mismatch"


class Next(Enum):
    ELSEWHERE = "elsewhere"  # another worker of the role; this one is not asked again
    AS_MISS = "as_miss"  # again as a plain miss, on any worker of the role (this one too)
    RELAY = "relay"  # the worker's answer goes to the client as it is


@dataclass(frozen=True, slots=True)
class Failure:
    """How one attempt of a leg failed."""

    kind: str  # unreachable | transport | answer | mismatch
    detail: str = ""  # the client's 503 names the last one ("prefill[0]: ReadTimeout")
    status: int = 0  # answer: the worker's HTTP status
    reply: Relayed | None = None  # answer: the worker's answer, to relay


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    def prefill(self, failure: Failure, carried_stored: bool) -> Next:
        """After a failed P attempt; `carried_stored`: it carried D's stored params."""
        if failure.kind == UNREACHABLE:
            return Next.ELSEWHERE
        if failure.kind == MISMATCH or carried_stored:
            return Next.AS_MISS
        if failure.kind == ANSWER and 400 <= failure.status < 500:
            return Next.RELAY
        return Next.ELSEWHERE

    def decode(self, failure: Failure) -> Next:
        if failure.kind == ANSWER and failure.status != 503:
            return Next.RELAY
        return Next.ELSEWHERE

    def prefill_attempts(self, workers: int) -> int:
        return workers + 1

    def decode_attempts(self, workers: int) -> int:
        return workers

    def falls_back_to_prefill(self, error: APIError) -> bool:
        """A decode_local turn whose D leg failed with `error` runs through P as a miss."""
        return error.status == 503
