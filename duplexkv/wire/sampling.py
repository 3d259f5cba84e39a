"""Per-request sampling settings (the OpenAI/vLLM knobs the engine honours), declared once.

`SamplingParams` is the wire vocabulary's declaration of these knobs: the engine samples with it,
and the OpenAI layer (http/openai.py) reads a request body's knobs by its fields (name, type,
default), in field order, so a knob added here is accepted there too.

Every value is checked here before it can reach a kernel: numbers must be finite and in range,
ids must be integers (their range against the vocabulary is checked by the engine, which knows
it). Ranges and meanings follow vLLM: a temperature below `SAMPLING_EPS` means greedy, penalties
are OpenAI's presence/frequency penalties on the generated tokens and vLLM's repetition penalty on
prompt and generated tokens, `min_p` drops tokens below that fraction of the top probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from duplexkv.wire.structured import StructuredOutput

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below this is greedy
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_STOP = 64  # stop strings / stop token ids per request
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_ID = 2**31 - 1
MIN_REPETITION_PENALTY = 0.01
# choices per request: OpenAI's documented limit. Each choice is a sequence of its own (its blocks
# beyond the shared prompt, a batch slot), so this also bounds one request's share of the engine
MAX_N = 128
MAX_SALT = 256


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # choices; choice i samples with seed + i (engine/parallel.py)
    # a grammar the output must match (response_format, structured_outputs, forced tool calls)
    structured: StructuredOutput | None = None
    # vLLM's prefix-cache isolation: requests share cached KV only with the same salt
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the field for any value the engine cannot honour."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={_short(getattr(self, name))}: "
                             f"{why}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (lo < v if lo_open else lo <= v) or not v <= hi:
                bad(name, f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", 0.0, 1.0, lo_open=True)
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_ID:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        # below ~0.01 dividing positive logits by it overflows float32 after temperature
        number("repetition_penalty", MIN_REPETITION_PENALTY, 2.0)
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        top = SEED_RANGE[1] - (self.n - 1)  # choice i samples with seed + i
        if self.seed is not None and (not is_int(self.seed)
                                      or not SEED_RANGE[0] <= self.seed <= top):
            bad("seed", f"must be an integer in [{SEED_RANGE[0]}, {top}]"
                        + (f" (with n={self.n}: choice i samples with seed + i)"
                           if self.n > 1 else ""))
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP \
                or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be a list of at most {MAX_STOP} non-empty strings")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP \
                or not all(is_int(t) and 0 <= t <= MAX_ID for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of at most {MAX_STOP} token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_SALT):
            bad("cache_salt", f"must be a non-empty string of at most {MAX_SALT} characters")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 1024:
            bad("logit_bias", "must map at most 1024 token ids to biases")
        for tok, b in self.logit_bias.items():
            if not is_int(tok) or not 0 <= tok <= MAX_ID:
                bad("logit_bias", f"key {_short(tok)} is not a token id")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                    or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"bias for token {tok} must be a number in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    def token_ids_outside(self, vocab_size: int) -> tuple[str, int] | None:
        """The first (field, id) that names a token outside [0, vocab_size), if any."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                return "stop_token_ids", t
        for t in self.logit_bias:
            if t >= vocab_size:
                return "logit_bias", t
        return None


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
