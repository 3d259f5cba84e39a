"""Which request fields a generation request may carry: the ones we honour, the ones we accept
because they change nothing here, the features we cannot honour (a 400 naming the field unless
the value is the feature's no-op), and everything else (logged, once per field name, and
ignored, as vLLM does).

Shared by the worker and the router (`duplexkv.http.openai`), so both answer a request the same.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from duplexkv.http.errors import bad_request
from duplexkv.http.features import NONE, Features

log = logging.getLogger("duplexkv.http")

# parsed by duplexkv.http.openai / chat_options, per endpoint (a chat field sent to completions
# is unknown there, as in vLLM)
_COMMON = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "stream",
           "stream_options", "return_token_ids", "kv_transfer_params", "n", "logprobs", "echo",
           "suffix", "best_of")
HONOURED = {
    "completion": frozenset((*_COMMON, "prompt")),
    "chat": frozenset((*_COMMON, "messages", "add_generation_prompt",
                       "tools", "tool_choice", "parallel_tool_calls", "documents",
                       "chat_template_kwargs", "top_logprobs")),
}
# no effect on the answer here: bookkeeping (user, metadata, ...), our router's conversation id,
# and `add_special_tokens` (the Qwen3 tokenizers we serve add no special tokens either way)
ACCEPTED = frozenset((
    "user", "metadata", "store", "service_tier", "request_id", "conversation_id", "session_id",
    "add_special_tokens", "length_penalty", "early_stopping"))

# feature -> (its no-op values, why it cannot be honoured)
_GUIDED = "guided decoding (structured output) is not supported"
_OLD = ("vLLM's old guided_* fields are not accepted (vLLM replaced them by "
        "`structured_outputs`, which workers honour)")
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "response_format": ((), _GUIDED + "; only {\"type\": \"text\"}"),
    "guided_json": ((), _OLD),
    "guided_regex": ((), _OLD),
    "guided_choice": ((), _OLD),
    "guided_grammar": ((), _OLD),
    "guided_decoding_backend": ((), _OLD),
    "guided_whitespace_pattern": ((), _OLD),
    "structured_outputs": ((), _GUIDED),
    "structural_tag": ((), _GUIDED),
    "functions": ((), "the legacy function-calling API is not supported; use `tools`"),
    "function_call": ((), "the legacy function-calling API is not supported; use `tools`"),
    "chat_template": ((), "a chat template from the request is not accepted (as vLLM without "
                          "--trust-request-chat-template)"),
    "continue_final_message": ((False,), "continuing the final message is not supported"),
    "include_stop_str_in_output": ((False,), "the stop string is never included"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always skipped"),
    "prompt_logprobs": ((), "logprobs are not returned"),
    "return_tokens_as_token_ids": ((False,), "logprobs are not returned"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported"),
    "allowed_token_ids": ((), "restricting the vocabulary is not supported"),
    "bad_words": ((), "bad words are not supported"),
    "priority": ((0,), "request priorities are not supported"),
    "reasoning_effort": ((), "reasoning effort is not supported"),
    "mm_processor_kwargs": ((), "multimodal input is not supported"),
    "prompt_embeds": ((), "prompt embeddings are not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "vllm_xargs": ((), "vLLM's extra sampling arguments are not supported"),
    "lora_request": ((), "LoRA adapters are not supported"),
}


# honoured when the server does guided decoding (duplexkv.http.structured)
STRUCTURED = frozenset(("response_format", "structured_outputs"))


def reject_unsupported(body: dict, features: Features = NONE) -> None:
    """A 400 naming the first field set to a feature this server cannot honour."""
    for name in sorted(body.keys() & UNSUPPORTED.keys()):
        if features.structured and name in STRUCTURED:
            continue
        v = body[name]
        allowed, why = UNSUPPORTED[name]
        if v is None or v in allowed or (name == "response_format" and _plain_text(v)):
            continue
        raise bad_request(f"`{name}` is not supported by this server: {why}", name)


def _plain_text(v: Any) -> bool:
    return isinstance(v, dict) and v.get("type") == "text"


class UnknownFields:
    """Logs each unknown field name the first time it is seen; at most `limit` names are kept
    (a client inventing names cannot grow memory or flood the log)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, body: dict, kind: str) -> None:
        unknown = body.keys() - HONOURED[kind] - ACCEPTED - UNSUPPORTED.keys()
        if not unknown:
            return
        with self._lock:
            new = sorted(unknown - self.seen)
            if not new or len(self.seen) > self.limit:
                return
            self.seen.update(new[: self.limit + 1 - len(self.seen)])
        names = ", ".join(repr(n[:64]) for n in new[:8]) + (" ..." if len(new) > 8 else "")
        log.warning("ignored unknown request field(s) %s (each name is logged once)%s", names,
                    "; further unknown names are not logged" if len(self.seen) > self.limit
                    else "")


unknown_fields = UnknownFields()
