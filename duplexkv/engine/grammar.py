"""Guided decoding: a request's `StructuredOutput` compiled by llguidance into a matcher whose
token mask the sampler applies before it samples (engine/llm_engine.py `_process`), and which
consumes every token the request appends (engine/output_processor.py).

llguidance computes a mask lazily from the grammar's lexer and parser state in ~0.1 ms a token
here (no vocabulary-wide precompilation), needs only the `tokenizers` JSON, and has no Python
dependencies. One `LLTokenizer` per engine is made on first use (~15 ms tiny, ~110 ms bench).
Grammars are compiled on the worker's prepare threads (`check`: a bad one is a 400 there) and
kept (the last 64 constraints); the engine thread gives each choice a copy (`matcher`), so a large
schema never stalls the other requests' steps.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import torch

from duplexkv.model.tokenizer import Tokenizer
from duplexkv.wire.structured import StructuredOutput

ANY_JSON_OBJECT = {"type": "object"}
CACHE_SIZE = 64  # compiled grammars kept: agents send the same tool schemas turn after turn
_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it cannot take."""


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for `so`."""
    if so.kind in ("json", "json_object"):
        schema = json.loads(so.spec) if so.kind == "json" else ANY_JSON_OBJECT
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": so.any_whitespace})
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(so.spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
    return llguidance.LLMatcher.grammar_from_lark(so.spec)


class Grammars:
    """Grammar matchers over one model's tokenizer (`vocab_size`: the logits' width)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # compiled matchers in their start state, by constraint, most recently used last
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.backend_json(), n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll

    @property
    def num_compiled(self) -> int:
        return len(self._cache)

    def _compiled(self, so: StructuredOutput) -> str:
        try:
            return grammar_text(so)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"`{so.source}`: {_first_line(e)}") from None

    def check(self, so: StructuredOutput) -> None:
        """Compile `so` (on a prepare thread, so that the engine thread only copies it); raise
        GrammarError naming the request field when it does not compile."""
        with self._lock:
            if so in self._cache:
                self._cache.move_to_end(so)
                return
        m = llguidance.LLMatcher(self.ll_tokenizer, self._compiled(so))
        if m.is_error():
            raise GrammarError(f"`{so.source}` cannot be compiled: {_first_line(m.get_error())}")
        with self._lock:
            self._cache[so] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one choice: a copy of the compiled one."""
        with self._lock:
            compiled = self._cache.get(so)
        if compiled is None:  # not checked first (offline use), or evicted meanwhile
            self.check(so)
            with self._lock:
                compiled = self._cache.get(so)
        if compiled is None:
            raise GrammarError(f"`{so.source}` could not be kept compiled")
        return compiled.deep_copy()


@torch.inference_mode()
def apply_mask(row: torch.Tensor, matcher: llguidance.LLMatcher) -> None:
    """Set, in place, the logits of every token the grammar forbids next to -inf."""
    raw = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    allowed = ((raw.unsqueeze(1) >> _BITS) & 1).flatten()[: row.shape[0]].bool()
    if not bool(allowed.any()):
        raise GrammarError(f"the grammar allows no token: {_first_line(matcher.get_error())}")
    row.masked_fill_(~allowed, float("-inf"))


@torch.inference_mode()
def constrain(row: torch.Tensor, matcher: llguidance.LLMatcher,
              process: Callable[[torch.Tensor], None]) -> None:
    """The grammar's mask, then `process` (logit_bias, penalties, the stop and eos bans before
    min_tokens). Where the bans leave no token the grammar allows (e.g. it must end but
    min_tokens bans eos), the grammar wins: its mask alone."""
    apply_mask(row, matcher)
    kept = row.clone()
    process(row)
    if bool(row.max() == float("-inf")):
        row.copy_(kept)


def consume(matcher: llguidance.LLMatcher, tok: int) -> None:
    if not matcher.consume_token(tok):
        raise GrammarError(f"the grammar rejected token {tok}: {_first_line(matcher.get_error())}")


def _first_line(e: object) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]


__all__ = ["GrammarError", "Grammars", "apply_mask", "constrain", "consume", "grammar_text"]
