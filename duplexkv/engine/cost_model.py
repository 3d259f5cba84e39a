"""What a prefill costs on this worker: milliseconds for `n` new tokens after `c` cached ones.

    t(n, c) = a + b * n + k * n * (c + n / 2)        a: per-step overhead, b: per-token matmuls,
                                                     k: attention (each new token attends to the
                                                     c cached tokens and half of its own chunk)
The three coefficients are fitted by least squares (clamped non-negative) to samples: a short
calibration at start-up on the loaded model (`calibrate`: a few prompts of growing length run
through the engine in chunks, so each chunk is a sample at a known context; stops after a time
budget, so a tiny model calibrates in milliseconds and the bench model in about 2 s), then every
real prefill step that ran one prefill chunk alone (`observe`). The newest samples replace the
oldest calibration samples beyond `max_samples`, so the model follows the machine's load.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Sample:
    new_tokens: int
    context_tokens: int
    ms: float


@dataclass(frozen=True, slots=True)
class Coefficients:
    step_ms: float
    token_ms: float
    attention_ms: float  # per (new token x attended token)

    def predict(self, new_tokens: int, context_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        n, c = float(new_tokens), float(context_tokens)
        return self.step_ms + self.token_ms * n + self.attention_ms * n * (c + n / 2)


def _features(n: float, c: float) -> list[float]:
    return [1.0, n, n * (c + n / 2)]


class PrefillCostModel:
    """Thread-safe: the engine thread observes, readers on the same thread predict; /health
    reads the coefficients from the HTTP thread."""

    def __init__(self, max_samples: int = 256, refit_every: int = 8) -> None:
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._coef: Coefficients | None = None
        self._since_fit = 0
        self.refit_every = refit_every
        self.observed = 0  # real prefill steps seen (not calibration)
        self.calibration_ms = 0.0

    @property
    def ready(self) -> bool:
        return self._coef is not None

    @property
    def coefficients(self) -> Coefficients | None:
        return self._coef

    def add(self, sample: Sample, real: bool = True) -> None:
        if sample.new_tokens <= 0 or not sample.ms > 0:
            return
        with self._lock:
            self._samples.append(sample)
            self._since_fit += 1
            if real:
                self.observed += 1
            if self._coef is None or self._since_fit >= self.refit_every \
                    or len(self._samples) <= 2 * self.refit_every:
                self._fit()

    def observe(self, new_tokens: int, context_tokens: int, ms: float) -> None:
        self.add(Sample(new_tokens, context_tokens, ms))

    def fit(self) -> None:
        with self._lock:
            self._fit()

    def _fit(self) -> None:
        """Least squares on the samples, relative error (each row divided by its time, so a
        16k-token chunk does not drown the small ones), coefficients clamped at zero."""
        self._since_fit = 0
        if len(self._samples) < 3:
            if self._samples:  # too few for a shape: per-token cost only
                tok = sum(s.ms for s in self._samples) / sum(s.new_tokens for s in self._samples)
                self._coef = Coefficients(0.0, tok, 0.0)
            return
        x = np.array([_features(s.new_tokens, s.context_tokens) for s in self._samples])
        y = np.array([s.ms for s in self._samples])
        w = 1.0 / y
        coef = _nnls(x * w[:, None], y * w)
        self._coef = Coefficients(*(float(v) for v in coef))

    def predict_ms(self, new_tokens: int, context_tokens: int) -> float | None:
        """Predicted prefill time, or None before any sample."""
        if self._since_fit:
            self.fit()
        coef = self._coef
        return None if coef is None else coef.predict(new_tokens, context_tokens)

    def as_dict(self) -> dict:
        """The coefficients the next prediction uses (refitted first if samples came since)."""
        if self._since_fit:
            self.fit()
        coef = self._coef
        return {"samples": len(self._samples), "observed_prefills": self.observed,
                "calibration_ms": round(self.calibration_ms, 1),
                "coefficients": None if coef is None else {
                    "step_ms": coef.step_ms, "token_ms": coef.token_ms,
                    "attention_ms": coef.attention_ms},
                "predict_ms": None if coef is None else {
                    f"{n}@{c}": round(coef.predict(n, c), 2)
                    for n, c in ((256, 0), (2048, 0), (2048, 14336))}}


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: drop the most negative coefficient
    and refit until none is negative (exact enough for three columns)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef
