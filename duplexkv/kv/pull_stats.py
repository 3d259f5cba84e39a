"""What the reader's pulls did, counted for `/health` (`kv_transfer.counters`) and `/metrics`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from duplexkv.kv.pull_decision import Decision


@dataclass(slots=True)
class PullCounters:
    pulls: int = 0  # READs that landed
    pulled_tokens: int = 0  # tokens they gained past the local prefix hit
    pulled_bytes: int = 0
    transfer_ms: float = 0.0  # verify + READ of the landed pulls
    verify_ms: float = 0.0
    read_ms: float = 0.0
    declined: dict[str, int] = field(default_factory=dict)  # by reason
    prefill_first_tokens: int = 0  # D legs that emitted P's first token
    decisions: dict[str, int] = field(default_factory=dict)  # "policy:pull|decline"
    predicted_transfer_ms: float = 0.0  # of the pulls taken
    predicted_recompute_ms: float = 0.0  # of the pulls declined

    def decided(self, dec: Decision) -> None:
        key = f"{dec.policy}:{'pull' if dec.pull else 'decline'}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if dec.pull:
            self.predicted_transfer_ms += dec.predicted_transfer_ms
        elif dec.predicted_recompute_ms is not None:
            self.predicted_recompute_ms += dec.predicted_recompute_ms

    def declined_for(self, reason: str) -> None:
        self.declined[reason] = self.declined.get(reason, 0) + 1

    def landed(self, gained: int, nbytes: int, verify_ms: float, read_ms: float,
               total_ms: float, first_token: bool) -> None:
        self.pulls += 1
        self.verify_ms += verify_ms  # the pull's two phases
        self.read_ms += read_ms
        self.pulled_tokens += gained
        self.pulled_bytes += nbytes
        self.transfer_ms += total_ms
        self.prefill_first_tokens += first_token

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
