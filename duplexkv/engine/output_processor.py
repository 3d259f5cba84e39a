"""Sampled tokens -> what a client sees (as vLLM v1's OutputProcessor): the per-request state
(detokenizer, text so far, what was already sent), stop conditions (eos, stop token ids, stop
strings, min_tokens, max_tokens, the context's end), text held back while it may still become a
stop string, and the `RequestOutput` of each step. Choices of an n > 1 request (engine/parallel.py)
are requests here of their own, and their outputs carry the request's id and their `index`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from duplexkv.engine.grammar import Grammars, consume
from duplexkv.engine.sampler import make_generator
from duplexkv.engine.sequence import KVStats, Sequence
from duplexkv.model.tokenizer import IncrementalDetokenizer, Tokenizer
from duplexkv.wire.kv_params import KVTransferParams


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # generated text so far (stop strings removed)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    kv_stats: KVStats | None = None
    kv_transfer_params: KVTransferParams | None = None  # the connector's, on the final output
    error: str | None = None  # with finish_reason "error"
    # as vLLM: the stop string or stop token id that ended it; None for eos and length
    stop_reason: int | str | None = None
    index: int = 0  # the choice (n > 1: engine/parallel.py)


@dataclass(slots=True)
class ReqState:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    matcher: Any = None  # the grammar's llguidance.LLMatcher, with a structured output
    emitted_chars: int = 0  # text already returned as new_text
    text: str = ""
    sent_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or string, as vLLM reports it


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, grammars: Grammars) -> None:
        self.tokenizer, self.max_model_len, self.grammars = tokenizer, max_model_len, grammars

    def new_state(self, seq: Sequence) -> ReqState:
        """GrammarError when the request's structured output does not compile."""
        so = seq.params.structured
        return ReqState(seq, IncrementalDetokenizer(self.tokenizer), make_generator(seq.params),
                        None if so is None else self.grammars.matcher(so))

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sampler may not pick next: stop and eos tokens before min_tokens."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.tokenizer.eos_token_ids))

    def append(self, st: ReqState, tok: int) -> Stop | None:
        """Add a sampled token to the request's tokens and text; whether it ends the request (a
        stop string is cut from the text)."""
        seq, p = st.seq, st.seq.params
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if st.matcher is not None:  # before the token counts: a rejected one is never output
            consume(st.matcher, tok)
        seq.output_token_ids.append(tok)
        st.text += st.detok.push([tok])
        if st.matcher is not None and st.matcher.is_stopped():  # complete: nothing may follow
            return Stop("stop")
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
                return Stop("stop")
            if tok in p.stop_token_ids:
                return Stop("stop", tok)
            found = find_stop(st.text, p.stop) if p.stop else None
            if found is not None:
                st.text = st.text[:found[0]]
                return Stop("stop", found[1])
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return Stop("length")
        return None

    def output(self, st: ReqState, stop: Stop | None,
               kv_params: KVTransferParams | None = None) -> RequestOutput:
        """This step's output: the new tokens, and the new text but for a tail that may still
        turn into a stop string (held back until it cannot, or the request ends)."""
        seq = st.seq
        if stop is not None:
            visible = len(st.text)
        else:
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            visible = max(st.emitted_chars, len(st.text) - hold)
        new_text = st.text[st.emitted_chars : visible]
        st.emitted_chars = visible
        new_ids = seq.output_token_ids[st.sent_tokens :]
        st.sent_tokens = seq.num_output_tokens
        return RequestOutput(seq.output_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             st.text[:visible], new_ids, new_text, stop is not None,
                             None if stop is None else stop.reason, seq.stats, kv_params,
                             stop_reason=None if stop is None else stop.stop_reason,
                             index=seq.index)

    @staticmethod
    def error_output(st: ReqState, message: str) -> RequestOutput:
        seq = st.seq
        return RequestOutput(seq.output_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             st.text, [], "", True, "error", seq.stats, None, message,
                             index=seq.index)


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(where the earliest stop string starts, that string), or None."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found, key=lambda f: f[0]) if found else None
