"""The retention benchmark's request trace (retention.py's docstring describes it): per
conversation, when each turn comes, how long its history is, whether its client keeps it alive
between turns and deletes it at the end."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

BLOCK = 16
SYSTEM_TOKENS = 200


@dataclass(slots=True)
class Turn:
    t: float
    conv: int
    k: int  # 0-based turn index
    history: int  # tokens retained after this turn (prompt + answer, last token excluded)
    next_t: float  # when the conversation's next turn comes (inf: none)
    deleted_at: float = math.inf  # the client deletes the conversation then (after its last turn)
    kept_alive: bool = False  # its client keeps it alive until its next turn (keepalive)


@dataclass
class Trace:
    turns: list[Turn]
    tokens: dict[int, list[int]]  # conversation -> its token stream (prefixes are its histories)
    lease_s: float
    ttl_s: float

    def demand_blocks(self, step_s: float = 1.0) -> float:
        """Time-averaged blocks of histories that will be reused and can be: the next turn comes
        within the lease, or within the TTL while its client keeps it alive."""
        end = max(t.t for t in self.turns)
        events = []
        for t in self.turns:
            gap = t.next_t - t.t
            if gap <= self.ttl_s and (gap <= self.lease_s or t.kept_alive):
                events.append((t.t, blocks(t.history)))
                events.append((t.next_t, -blocks(t.history)))
        events.sort()
        area, level, last = 0.0, 0, 0.0
        for when, delta in events:
            area += level * (when - last)
            level, last = level + delta, when
        return area / end


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def make_trace(slots: int, minutes: float, seed: int, mean_turns: float = 8.0,
               pace_median_s: float = 10.0, pace_sigma: float = 1.0, jitter: float = 0.3,
               delete_share: float = 0.5, keepalive_share: float = 0.5, lease_s: float = 60.0,
               ttl_s: float = 480.0, max_history: int = 1 << 30,
               turn_tokens: tuple[int, int] = (64, 512)) -> Trace:
    rng = random.Random(seed)
    horizon = minutes * 60
    turns: list[Turn] = []
    tokens: dict[int, list[int]] = {}
    conv = 0
    for _ in range(slots):
        t = rng.uniform(0, 30)  # staggered starts
        while t < horizon:
            # its own pace (an agent's tool latency, a person's reading speed), jittered per turn
            pace = min(300.0, max(0.5, rng.lognormvariate(math.log(pace_median_s), pace_sigma)))
            n = max(2, min(64, int(rng.expovariate(1 / mean_turns)) + 1))
            keeps = rng.random() < keepalive_share
            history, mine = SYSTEM_TOKENS, []
            for k in range(n):
                history += rng.randint(*turn_tokens)
                gap = min(ttl_s, pace * rng.lognormvariate(0.0, jitter))
                more = (k + 1 < n and t + gap < horizon
                        and history + turn_tokens[1] <= max_history)
                nxt = t + gap if more else math.inf
                mine.append(Turn(t, conv, k, history, nxt, kept_alive=keeps and nxt < math.inf))
                if nxt == math.inf:
                    break
                t = nxt
            if rng.random() < delete_share:
                mine[-1].deleted_at = t + rng.uniform(0.5, 2)
            turns += mine
            stream = random.Random(seed * 1_000_003 + conv)
            tokens[conv] = [stream.randrange(1, 50000) for _ in range(history + 1)]
            conv += 1
            t += rng.uniform(5, 60)  # the next conversation on this slot
    turns.sort(key=lambda x: x.t)
    return Trace(turns, tokens, lease_s, ttl_s)


