"""Admission checks, before a request is queued: a prompt (text, token ids or chat) becomes
token ids, and what could never be served (too long for the context or the KV pool, ids outside
the vocabulary, an empty prompt) is refused with the reason and the limit. `Admission` gives the
engine these checks as its public `tokenize` and `check_request`."""

from __future__ import annotations

from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.grammar import GrammarError, Grammars
from duplexkv.model.config import ModelConfig
from duplexkv.model.segment_cache import TooManyTokens
from duplexkv.model.tokenizer import Tokenizer
from duplexkv.wire.sampling import SamplingParams

Prompt = str | list[int] | list[dict]


class RequestRejected(ValueError):
    """The request can never be served as asked (too long, bad parameters); say why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def tokenize(tokenizer: Tokenizer, max_model_len: int, vocab_size: int, prompt: Prompt,
             add_generation_prompt: bool = True, template_kwargs: dict | None = None
             ) -> list[int]:
    """Prompt -> ids. A text far beyond the context is refused as soon as that is certain,
    without materialising its ids. `template_kwargs`: a chat's tools, documents and
    chat_template_kwargs, passed to the chat template."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        prompt = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    if isinstance(prompt, str):
        try:
            return tokenizer.encode(prompt, limit=max_model_len)
        except TooManyTokens as e:
            raise RequestRejected(
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your prompt has at least {e.at_least} tokens. Please reduce "
                f"the length of the prompt.", "prompt") from None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab_size})", "prompt")
        return list(prompt)
    raise RequestRejected("prompt must be a string, a list of token ids or chat messages")


def check_request(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                  vocab_size: int, blocks_needed: int, num_blocks: int) -> None:
    """Reject what could never be served, with the reason and the limit (`blocks_needed`: for
    the prompt and max_tokens)."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty", "prompt")
    outside = params.token_ids_outside(vocab_size)
    if outside is not None:
        raise RequestRejected(f"`{outside[0]}` names token id {outside[1]}, outside the "
                              f"vocabulary [0, {vocab_size})", outside[0])
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.")
    if blocks_needed > num_blocks:
        raise RequestRejected(
            f"the request needs {blocks_needed} KV blocks ({total} tokens) but "
            f"the KV pool has only {num_blocks}; raise --num-kv-blocks or "
            f"--kv-cache-memory")


class Admission:
    """The engine's admission checks (a mixin of LLMEngine, over these of its attributes)."""

    tokenizer: Tokenizer
    grammars: Grammars
    model_config: ModelConfig
    bm: BlockManager
    max_model_len: int

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True,
                 template_kwargs: dict | None = None) -> list[int]:
        """Prompt -> ids (engine/admission.py)."""
        return tokenize(self.tokenizer, self.max_model_len,
                                  self.model_config.vocab_size, prompt, add_generation_prompt,
                                  template_kwargs)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject what could never be served, with the reason and the limit."""
        check_request(num_prompt_tokens, params, self.max_model_len,
                                self.model_config.vocab_size,
                                self.bm.blocks_needed(num_prompt_tokens + params.max_tokens),
                                self.bm.num_blocks)
        if params.structured is not None:
            try:
                self.grammars.check(params.structured)
            except GrammarError as e:
                raise RequestRejected(str(e), params.structured.source) from None
