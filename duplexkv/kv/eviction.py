"""Which retained turn to give up under memory pressure: eviction by value, not by age.

An entry's value is what keeping it is worth per block per second it stays held:

    value = saved_tokens * p_reuse / (blocks * wait)

    saved_tokens  tokens a reuse would not recompute (the entry's tokens)
    p_reuse       the chance the conversation's next turn comes before the entry expires:
                  0 once it has been deleted; otherwise the observed continuation rate (turns
                  that were followed by another, over all that ended), times whether the
                  predicted next turn falls before the deadline the entry can reach (the lease
                  now; the TTL cap while the router renews it)
    wait          seconds until that predicted next turn (at least `MIN_WAIT_S`)

An entry the router keeps renewing (a turn of its conversation in flight, or its client's
keepalive) is certain to be wanted again: its chance is 1 and its deadline the cap.

The next turn is predicted from the conversation's own rhythm: D links each new entry to the
previous turn's by the chained block hashes (`Lineage`: the new history extends the old one), so
it knows the gaps between this conversation's turns; a conversation seen once uses the gaps of
all conversations (a decaying histogram of gaps: chance / wait is the expected 1 / wait over the
gaps longer than the entry's age). A conversation later than its own pace predicted is
predicted again one gap from now, with its chance halved per gap of lateness (recency).
Evicting the lowest value first approximates the offline optimum (Belady: evict what is used
furthest in the future) with predictions in place of the future, weighted by what a reuse saves.
`Conversations` is what the retention table keeps of all this (under its lock) and where it
picks the victim (`victim`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplexkv.kv.retained import Retained

MIN_WAIT_S = 0.05
LINEAGE_MAX = 8192  # conversations whose last entry D remembers (oldest first out)
OWN_GAPS = 8  # a conversation's latest gaps kept
BINS = 48  # the population's gap histogram: bin k holds gaps near BIN0 * 2**(k/2)
BIN0 = 0.25
DECAY = 0.998  # per observed gap: the histogram follows a changing workload
LATE_P = 0.05  # chance kept for a conversation later than every gap seen


def _bin(gap: float) -> int:
    return min(BINS - 1, max(0, round(2 * math.log2(max(gap, BIN0) / BIN0))))


CENTERS = [BIN0 * 2 ** (k / 2) for k in range(BINS)]


@dataclass(slots=True)
class Rhythm:
    """A conversation's turns as D saw them."""
    gaps: list[float] = field(default_factory=list)  # its latest gaps between turns (seconds)
    last_created: float = 0.0  # when its latest entry was made

    def observe(self, gap: float) -> None:
        self.gaps.append(gap)
        del self.gaps[:-OWN_GAPS]


@dataclass(slots=True)
class Population:
    """What all conversations did: the gaps for a conversation seen once, and how often a turn
    is followed by another."""
    continued: int = 0  # entries followed by a later turn of their conversation
    ended: int = 0  # entries that expired unused or were deleted
    weights: list[float] = field(default_factory=lambda: [0.0] * BINS)

    def observe_gap(self, gap: float) -> None:
        self.continued += 1
        self.weights = [w * DECAY for w in self.weights]
        self.weights[_bin(gap)] += 1.0

    @property
    def continuation(self) -> float:
        """Laplace-smoothed share of turns that were followed by another."""
        return (self.continued + 1) / (self.continued + self.ended + 2)


def next_turn(age: float, gaps, weights=None) -> tuple[float, float]:
    """(chance, wait) for an entry `age` old from weighted gap samples, such that chance / wait
    is the expected 1 / (time to the next turn) over the futures still open (the samples
    longer than the age): a likely quick return counts for more than its share of the mean.
    Later than every sample: a small chance, as late again as it already is."""
    total = alive = rate = 0.0
    for i, g in enumerate(gaps):
        w = 1.0 if weights is None else weights[i]
        if w <= 0:
            continue
        total += w
        if g > age:
            alive += w
            rate += w / max(g - age, MIN_WAIT_S)
    if total <= 0:
        return 1.0, max(age, 1.0)
    if alive <= 0:
        return LATE_P, max(age, MIN_WAIT_S)
    return 1.0, total / rate


@dataclass(slots=True)
class Lineage:
    """Last full-block hash of a released entry -> its conversation's rhythm, so the entry the
    next turn leaves (whose hashes continue the same chain) inherits it, whether the previous
    one was reused, evicted or expired."""
    max_entries: int = LINEAGE_MAX
    _by_hash: OrderedDict = field(default_factory=OrderedDict)

    def released(self, last_hash: bytes, rhythm: Rhythm) -> None:
        self._by_hash[last_hash] = rhythm
        self._by_hash.move_to_end(last_hash)
        while len(self._by_hash) > self.max_entries:
            self._by_hash.popitem(last=False)

    def find(self, hashes: list[bytes]) -> Rhythm | None:
        """The rhythm of the longest earlier turn whose blocks prefix `hashes` (taken)."""
        for h in reversed(hashes):
            r = self._by_hash.pop(h, None)
            if r is not None:
                return r
        return None


def value(*, tokens: int, blocks: int, created: float, expiry: float, cap: float,
          renewed: bool, deleted: bool, rhythm: Rhythm, pop: Population, now: float) -> float:
    """Tokens saved per block-second held (module docstring); higher is kept longer."""
    if deleted or blocks <= 0:
        return 0.0
    age = max(now - created, 0.0)
    if rhythm.gaps:  # its own pace: the mean of its latest gaps
        gap = max(sum(rhythm.gaps) / len(rhythm.gaps), MIN_WAIT_S)
        if age <= gap:
            p, wait = 1.0, gap - age
        else:  # late: expected one gap from now, half as likely per gap of lateness
            p, wait = math.pow(0.5, (age - gap) / gap), gap
    else:  # seen once: the population's gaps still open at this age
        p, wait = next_turn(age, CENTERS, pop.weights)
    if renewed:  # its client keeps it alive (or a turn is in flight): it is coming back
        p = max(p, 1.0)
    p *= pop.continuation
    deadline = cap if renewed else expiry
    if now + wait > deadline:
        p *= 0.1  # it would expire first unless renewed
    return tokens * p / (blocks * max(wait, MIN_WAIT_S))


@dataclass(slots=True)
class Conversations:
    """What D learns of its conversations from the retained turns' lives, and what it does with
    that under pressure: the victim. `lease_s` is a "ttl" entry's renewable lease (an entry
    renewed within it counts as kept alive by the router)."""
    lease_s: float
    lineage: Lineage = field(default_factory=Lineage)
    population: Population = field(default_factory=Population)
    linked: int = 0  # entries recognised as a later turn of a conversation seen before

    def turn(self, hashes: list[bytes], now: float) -> Rhythm:
        """The rhythm of a new "ttl" entry made now: its conversation's, one more gap observed,
        when its hashes continue an earlier turn's; else a new conversation's."""
        r = self.lineage.find(hashes)
        if r is not None:
            self.linked += 1
            gap = max(now - r.last_created, 0.0)
            r.observe(gap)
            self.population.observe_gap(gap)
        else:
            r = Rhythm()
        r.last_created = now
        return r

    def released(self, e: Retained, why: str) -> None:
        """A "ttl" entry went: an unused end counts against continuation, and unless its
        conversation was deleted, its next turn may still come and inherit the rhythm."""
        if why in ("expired", "capped", "deleted"):
            self.population.ended += 1
        if why != "deleted" and e.hashes:
            self.lineage.released(e.hashes[-1], e.rhythm)

    def value(self, e: Retained, now: float) -> float:
        """What keeping `e` is worth per block-second (module docstring)."""
        renewed = e.renewed_at > 0 and now - e.renewed_at < self.lease_s
        return value(tokens=len(e.token_ids), blocks=len(e.block_ids), created=e.created,
                     expiry=e.expiry, cap=e.cap, renewed=renewed, deleted=e.deleted,
                     rhythm=e.rhythm, pop=self.population, now=now)

    def victim(self, entries: Iterable[Retained], now: float, policy: str) -> Retained | None:
        """The unclaimed entry to release under memory pressure. "value": the one worth least
        (P's leases are never chosen while a "ttl" entry is left: a P lease is a request's
        prefill that D is about to READ); otherwise ("oldest", the policy before eviction by
        value and the retention benchmark's baseline) the oldest of `entries` (oldest first)."""
        if policy != "value":
            return next((e for e in entries if not e.claimed(now)), None)
        best, best_key = None, None
        for e in entries:
            if e.claimed(now):
                continue
            key = (e.kind != "ttl", self.value(e, now) if e.kind == "ttl" else 0.0)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return best
