"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> a typed `GenerateRequest`.

Validation is ours, not pydantic's, so every mistake becomes a 400 that names the field. A feature
we cannot honour (`response_format`, guided decoding, ...) is a 400 naming it; unknown fields are
logged once per name and ignored, as vLLM does (`request_fields`). A chat's `tools`,
`chat_template_kwargs` and `documents` go to the chat template (`chat_options`). The worker and the
router both validate with this module; the worker then turns the request into the engine's
`SamplingParams` (value ranges) and `KVTransferParams`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from duplexkv.http.chat_options import ChatOptions, parse_chat_options
from duplexkv.http.errors import bad_request
from duplexkv.http.request_fields import reject_unsupported, unknown_fields

Kind = Literal["completion", "chat"]
MAX_N = 128  # choices per request: OpenAI's limit (the engine's SamplingParams checks it too)
ROLES = ("system", "user", "assistant", "tool", "developer")  # developer is sent as system
_MISSING = object()


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    kind: Kind
    model: str | None  # None: the served model
    prompt: str | list[int] | None = None  # completions
    messages: list[dict] | None = None  # chat, normalised to text content
    add_generation_prompt: bool = True
    max_tokens: int | None = None  # None: fill the context, as vLLM does
    n: int = 1  # choices, each sampled on its own (seed + index), the prompt computed once
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
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
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM extension: token ids on each choice
    kv_transfer_params: dict | None = None  # typed by the worker (KVTransferParams)
    chat_options: ChatOptions = field(default_factory=ChatOptions)  # chat: tools, template kwargs

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """The engine's SamplingParams fields (the engine checks their ranges)."""
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
                    seed=self.seed, stop=list(self.stop),
                    stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                    min_tokens=self.min_tokens, n=self.n)


class _Fields:
    """Typed getters over a JSON object; each raises a 400 naming the field."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def get(self, name: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
        v = self.body.get(name, _MISSING)
        if v is _MISSING or v is None:
            return default
        if isinstance(v, bool) and bool not in types:
            raise bad_request(f"`{name}` must be {what}, got {v!r}", name)
        if not isinstance(v, types):
            raise bad_request(f"`{name}` must be {what}, got {type(v).__name__}", name)
        return v

    def integer(self, name: str, default: int | None = None) -> int | None:
        return self.get(name, (int,), "an integer", default)

    def number(self, name: str, default: float | None = None) -> float | None:
        v = self.get(name, (int, float), "a number", default)
        try:
            return None if v is None else float(v)
        except OverflowError:
            raise bad_request(f"`{name}` is out of range", name) from None

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, (bool,), "a boolean", default)

    def reject(self, name: str, allowed: tuple, what: str) -> None:
        """A feature we do not implement: fine when absent or at its no-op value."""
        v = self.body.get(name)
        if v is not None and v not in allowed:
            raise bad_request(f"`{name}` is not supported by this server ({what})", name)


def parse_request(body: dict, kind: Kind) -> GenerateRequest:
    f = _Fields(body)
    reject_unsupported(body)
    unknown_fields.note(body, kind)
    model = f.get("model", (str,), "a string")
    n = f.integer("n", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"`n` must be an integer in [1, {MAX_N}], got {n}", "n")
    f.reject("best_of", (1,), "only 1")
    f.reject("echo", (False,), "only false")
    f.reject("suffix", ("",), "no suffix")
    if kind == "completion":
        f.reject("logprobs", (), "logprobs are not returned")
    else:
        f.reject("logprobs", (False,), "logprobs are not returned")
        f.reject("top_logprobs", (0,), "logprobs are not returned")
    max_tokens = f.integer("max_tokens")
    if kind == "chat":
        max_tokens = f.integer("max_completion_tokens", max_tokens)
    stream = f.boolean("stream")
    options = f.get("stream_options", (dict,), "an object", {})
    include_usage = _Fields(options).get("include_usage", (bool,), "a boolean", False)
    kv = f.get("kv_transfer_params", (dict,), "an object or null")
    common: dict[str, Any] = {
        "kind": kind, "model": model, "max_tokens": max_tokens, "n": n,
        "temperature": f.number("temperature", 1.0), "top_p": f.number("top_p", 1.0),
        "top_k": f.integer("top_k", 0), "min_p": f.number("min_p", 0.0),
        "presence_penalty": f.number("presence_penalty", 0.0),
        "frequency_penalty": f.number("frequency_penalty", 0.0),
        "repetition_penalty": f.number("repetition_penalty", 1.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "seed": f.integer("seed"), "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body.get("stop_token_ids"), "stop_token_ids"),
        "ignore_eos": f.boolean("ignore_eos"), "min_tokens": f.integer("min_tokens", 0),
        "stream": stream, "include_usage": bool(stream and include_usage),
        "return_token_ids": f.boolean("return_token_ids"), "kv_transfer_params": kv}
    if kind == "completion":
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("`prompt` is required", "prompt")
        return GenerateRequest(prompt=_prompt(body["prompt"]), **common)
    if "messages" not in body or body["messages"] is None:
        raise bad_request("`messages` is required", "messages")
    return GenerateRequest(messages=parse_messages(body["messages"]),
                           add_generation_prompt=f.boolean("add_generation_prompt", True),
                           chat_options=parse_chat_options(body), **common)


def _logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's `{"token id as a string": bias}`; ids and values are range-checked later."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request("`logit_bias` must be an object mapping token ids to numbers",
                          "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        tok = k.strip() if isinstance(k, str) else ""
        if not (tok.isascii() and tok.isdigit() and len(tok) <= 10):
            raise bad_request(f"`logit_bias` key {k[:20]!r} is not a token id", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad_request(f"`logit_bias[{tok}]` must be a number", "logit_bias")
        out[int(tok)] = float(b)
    return out


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad_request("`stop` must be a string or a list of strings", "stop")


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _int_list(v: Any, name: str) -> list[int]:
    if v is None:
        return []
    if not _is_ids(v):
        raise bad_request(f"`{name}` must be a list of integers", name)
    return v


def _prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise bad_request("`prompt` must be a string or a non-empty list of token ids", "prompt")
    if _is_ids(v):
        return v
    if all(isinstance(p, str) for p in v) or all(_is_ids(p) for p in v):
        if len(v) == 1:
            return v[0]
        raise bad_request(f"batched prompts are not supported: got {len(v)} prompts, send one "
                          "prompt per request", "prompt")
    raise bad_request("`prompt` must be a string, a list of token ids, or a list holding one of "
                      "those", "prompt")


def parse_messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad_request("`messages` must be a non-empty list of message objects", "messages")
    return [_message(i, m) for i, m in enumerate(v)]


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"`{where}` must be an object", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"`{where}.role` must be one of {', '.join(ROLES)}, got {role!r}",
                          f"{where}.role")
    out: dict = {"role": "system" if role == "developer" else role,
                 "content": _content(m.get("content"), f"{where}.content")}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if isinstance(m.get("reasoning"), str) and "reasoning_content" not in out:
        out["reasoning_content"] = m["reasoning"]
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise bad_request(f"`{where}.tool_calls` must be a list of objects",
                              f"{where}.tool_calls")
        if calls:
            out["tool_calls"] = calls
    return out


def _content(v: Any, where: str) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(f"`{where}` must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"`{where}[{j}]`: only text content parts are supported, got "
                              f"{kind!r}", f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"`{where}[{j}].text` must be a string", f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


__all__ = ["GenerateRequest", "Kind", "parse_request", "parse_messages"]
