"""What a READ from each peer costs, as this reader has seen it: round-trip time and bandwidth.

    rtt        the peer's verify round trips (side channel), min over the last WINDOW
    bandwidth  bytes / time of the READs from it, max over the last WINDOW younger than
               `max_age_s` (config `kv_link_sample_max_age_s`, 60 s)
    stale      once every READ sample is older than `max_age_s`: the newest sample's bandwidth,
               doubled for each `max_age_s` of its age (2x at max_age_s, 4x at twice that, ...),
               capped by the prior
    prior      before a peer's first sample: `prior_rtt_ms`, `prior_gbps` (config)
    assumed    `assumed_gbps` > 0 replaces every measured bandwidth (a stand-in for a shaped link
               when none is at hand, e.g. on loopback; the multi-host harness shapes real ones)
Min and max filters (as BBR uses) because the samples are taken where the engine thread polls:
a READ that finished while a long prefill step ran looks slower than it was, never faster, and
the best recent sample is the link's. Bandwidth samples age out because they come only from
pulls: a link measured slow (congestion, or one READ that landed behind a long step) would
otherwise be declined for good and never measured again. An old sample is trusted less, not
forgotten: the stale estimate grows from it toward the prior, so the first turn whose pull pays
at the grown estimate re-measures the link; on a link that stayed slow that probe's READ takes
as many times longer than predicted as the estimate grew (2x per `max_age_s` waited), where a
return to the prior bet 10 Gbit/s at once (a 32 MiB READ over 20 Mbit/s ran into its read
timeout). A READ that runs into the read timeout is a sample too: the link is at most its bytes
over the time waited. RTT needs no age: every verify, pull or not, samples it. Updated from
kv-net threads (rtt) and the engine thread (bandwidth), read on the engine thread: guarded by a
lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 8
MAX_PEERS = 1024


@dataclass(slots=True)
class _Peer:
    rtts_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    reads: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (t, bytes/ms)


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    rtt_ms: float
    gbps: float
    measured: bool  # from this peer's samples (else the prior or the assumed bandwidth)

    def transfer_ms(self, nbytes: int) -> float:
        """Verify round trip + the READ of `nbytes`."""
        return self.rtt_ms + nbytes * 8 / (self.gbps * 1e6)


class LinkModel:
    def __init__(self, prior_rtt_ms: float = 1.0, prior_gbps: float = 10.0,
                 assumed_gbps: float = 0.0, max_age_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if prior_rtt_ms < 0 or prior_gbps <= 0 or assumed_gbps < 0 or max_age_s <= 0:
            raise ValueError("link priors must be positive")
        self.prior_rtt_ms, self.prior_gbps, self.assumed_gbps = prior_rtt_ms, prior_gbps, \
            assumed_gbps
        self.max_age_s, self.clock = max_age_s, clock
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.pop(next(iter(self._peers)))
            p = self._peers[peer] = _Peer()
        return p

    def observe_rtt(self, peer: str, ms: float) -> None:
        if ms >= 0:
            with self._lock:
                self._peer(peer).rtts_ms.append(ms)

    def observe_read(self, peer: str, nbytes: int, ms: float, replace: bool = False) -> None:
        """A READ of `nbytes` took `ms`; `replace` drops the peer's earlier samples first."""
        if nbytes > 0 and ms > 0:
            with self._lock:
                reads = self._peer(peer).reads
                if replace:
                    reads.clear()
                reads.append((self.clock(), nbytes / ms))

    def observe_timed_out_read(self, peer: str, nbytes: int, ms: float) -> None:
        """A READ of `nbytes` had not landed after `ms`: the link is slower than nbytes / ms, so
        that is a sample (an optimistic one), and it replaces the peer's others: a faster one
        from before says nothing about the link now. Without it a probe at the grown stale
        estimate that ran into the read timeout taught nothing, and later turns pulled again."""
        self.observe_read(peer, nbytes, ms, replace=True)

    def estimate(self, peer: str) -> LinkEstimate:
        with self._lock:
            p = self._peers.get(peer)
            rtt = min(p.rtts_ms) if p and p.rtts_ms else self.prior_rtt_ms
            now = self.clock()
            bw = max((v for t, v in p.reads if t >= now - self.max_age_s), default=0) * 8 / 1e6 \
                if p else 0
            newest = p.reads[-1] if p and p.reads else None
        if self.assumed_gbps > 0:
            return LinkEstimate(rtt, self.assumed_gbps, False)
        if bw > 0:
            return LinkEstimate(rtt, bw, True)
        if newest is None:
            return LinkEstimate(rtt, self.prior_gbps, False)
        t, v = newest  # stale: the newest sample, trusted less with its age
        grown = v * 8 / 1e6 * 2 ** ((now - t) / self.max_age_s)
        return LinkEstimate(rtt, min(self.prior_gbps, grown), False)

    def state(self) -> dict:
        with self._lock:
            peers = list(self._peers)
        return {"prior_rtt_ms": self.prior_rtt_ms, "prior_gbps": self.prior_gbps,
                "assumed_gbps": self.assumed_gbps or None, "sample_max_age_s": self.max_age_s,
                "peers": {k: {"rtt_ms": round(e.rtt_ms, 3), "gbps": round(e.gbps, 3),
                              "measured": e.measured}
                          for k in peers[:16] for e in (self.estimate(k),)}}
