"""What a worker reports of its own load, as the router last read it: our workers' /health
(`waiting`, `running`, and the engine's cost-model predictions `expected_ttft_ms`, the prefill of
every queued prompt token, and `expected_step_ms`, the longest step of that work), a vLLM
worker's /metrics (`vllm:num_requests_waiting`, `vllm:num_requests_running`; no predictions).
The liveness probes (liveness.py) wait longer for a worker that says it is loaded: its /health
answers between engine steps and its HTTP loop shares the CPU with the load of every client, not
only the router's legs."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

_VLLM = re.compile(r"^vllm:num_requests_(waiting|running)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$",
                   re.MULTILINE)
MAX_QUEUE = 1 << 20


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    waiting: int = 0
    running: int = 0
    expected_ttft_s: float = 0.0
    expected_step_s: float = 0.0
    at: float = 0.0  # time.monotonic() of the report (0: none yet)

    @property
    def queued(self) -> int:
        return self.waiting + self.running

    def as_dict(self) -> dict:
        return {"waiting": self.waiting, "running": self.running,
                "expected_ttft_s": round(self.expected_ttft_s, 3),
                "expected_step_s": round(self.expected_step_s, 3),
                "age_s": round(time.monotonic() - self.at, 3) if self.at else None}


def _count(v) -> int:
    return int(min(max(v, 0), MAX_QUEUE)) if isinstance(v, int | float) \
        and not isinstance(v, bool) and v == v else 0


def _seconds(ms) -> float:
    return min(max(float(ms), 0.0), 3600e3) / 1e3 if isinstance(ms, int | float) \
        and not isinstance(ms, bool) and ms == ms else 0.0


def from_health(body: object) -> WorkerLoad | None:
    """Our worker's /health JSON -> its load (None when it does not report one: a worker whose
    engine was too busy to answer, or another server)."""
    if not isinstance(body, dict) or "waiting" not in body:
        return None
    return WorkerLoad(_count(body.get("waiting")), _count(body.get("running")),
                      _seconds(body.get("expected_ttft_ms")),
                      _seconds(body.get("expected_step_ms")), time.monotonic())


def from_vllm_metrics(text: str) -> WorkerLoad | None:
    """vLLM's /metrics -> its queue (summed over label sets), None when it has no such gauge."""
    seen: dict[str, float] = {}
    for kind, value in _VLLM.findall(text):
        try:
            seen[kind] = seen.get(kind, 0.0) + float(value)
        except ValueError:
            continue
    if not seen:
        return None
    return WorkerLoad(_count(seen.get("waiting", 0.0)), _count(seen.get("running", 0.0)),
                      at=time.monotonic())
