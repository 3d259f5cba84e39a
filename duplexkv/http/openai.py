"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> a typed `GenerateRequest`.

Validation is ours, not pydantic's, so every mistake becomes a 400 that names the field. A feature
we cannot honour is a 400 naming it (`response_format` and `structured_outputs` only where the
caller's `Features` honour them: the workers); unknown fields are
logged once per name and ignored, as vLLM does (`request_fields`). A chat's `tools`,
`chat_template_kwargs` and `documents` go to the chat template (`chat_options`). The worker and the
router both validate with this module; the worker then turns the request into the engine's
`SamplingParams` (value ranges) and `KVTransferParams`. The sampling knobs are read by the fields
of `SamplingParams` (duplexkv/wire/sampling.py), where they are declared once: here only their
JSON spelling (each field type's reader) and their types are checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from duplexkv.http.chat_options import ChatOptions, parse_chat_options
from duplexkv.http.errors import bad_request
from duplexkv.http.features import NONE, Features
from duplexkv.http.request_fields import reject_unsupported, unknown_fields
from duplexkv.http.structured import parse_structured
from duplexkv.http.tool_schema import forced_tool_output
from duplexkv.wire.sampling import MAX_N, SamplingParams
from duplexkv.wire.structured import StructuredOutput

Kind = Literal["completion", "chat"]
ROLES = ("system", "user", "assistant", "tool", "developer")  # developer is sent as system
_MISSING = object()
# /v1/completions without max_tokens: OpenAI's legacy default, and vLLM's (its CompletionRequest
# has max_tokens=16, a null one included); chat fills the rest of the context (vLLM)
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    kind: Kind
    model: str | None  # None: the served model
    prompt: str | list[int] | None = None  # completions
    messages: list[dict] | None = None  # chat, normalised to text content
    add_generation_prompt: bool = True
    # None: the endpoint's default (completions: 16, chat: the rest of the context; vLLM's)
    max_tokens: int | None = None
    # SamplingParams' other fields (n: choices, each sampled on its own with seed + index, the
    # prompt computed once), type-checked; their ranges are checked by SamplingParams
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM extension: token ids on each choice
    kv_transfer_params: dict | None = None  # typed by the worker (KVTransferParams)
    chat_options: ChatOptions = field(default_factory=ChatOptions)  # chat: tools, template kwargs
    # the grammar the output must follow: response_format / structured_outputs, or the forced
    # tool_choice's (http/tool_schema.py)
    structured: StructuredOutput | None = None

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """The engine's SamplingParams fields (the engine checks their ranges)."""
        return {"max_tokens": max_tokens, "structured": self.structured,
                **{k: type(v)(v) if isinstance(v, (list, dict)) else v
                   for k, v in self.sampling.items()}}


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


def parse_request(body: dict, kind: Kind, features: Features = NONE) -> GenerateRequest:
    """`features`: what the caller honours beyond plain generation (a worker's flags; the
    router passes them all on: `features.ROUTER`)."""
    f = _Fields(body)
    reject_unsupported(body, features)
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
    max_tokens = _max_tokens(f)
    stream = f.boolean("stream")
    options = f.get("stream_options", (dict,), "an object", {})
    include_usage = _Fields(options).get("include_usage", (bool,), "a boolean", False)
    kv = f.get("kv_transfer_params", (dict,), "an object or null")
    common: dict[str, Any] = {
        "kind": kind, "model": model, "max_tokens": max_tokens,
        "sampling": {"n": n, **_sampling(f)},
        "stream": stream, "include_usage": bool(stream and include_usage),
        "return_token_ids": f.boolean("return_token_ids"), "kv_transfer_params": kv}
    structured = parse_structured(body) if features.structured else None
    if kind == "completion":
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("`prompt` is required", "prompt")
        return GenerateRequest(prompt=_prompt(body["prompt"]), structured=structured, **common)
    if "messages" not in body or body["messages"] is None:
        raise bad_request("`messages` is required", "messages")
    options = parse_chat_options(body, features=features)
    forced = forced_tool_output(options)
    if forced is not None and structured is not None:
        raise bad_request(f"`tool_choice` {options.tool_choice.mode!r} forces the output's shape: "
                          "send no `response_format` or `structured_outputs` with it",
                          "tool_choice")
    return GenerateRequest(messages=parse_messages(body["messages"]),
                           add_generation_prompt=f.boolean("add_generation_prompt", True),
                           chat_options=options, structured=forced or structured, **common)


def _max_tokens(f: _Fields) -> int | None:
    """max_completion_tokens, else max_tokens (vLLM's and OpenAI's precedence), on both
    endpoints; each an integer >= 1 when given."""
    out = None
    for name in ("max_tokens", "max_completion_tokens"):
        v = f.integer(name)
        if v is not None:
            if v < 1:
                raise bad_request(f"`{name}` must be an integer >= 1, got {v}", name)
            out = v
    return out


# a SamplingParams field's type -> how its JSON value is read (None or absent: the default)
_READERS = {
    "int": lambda f, name, default: f.integer(name, default),
    "int | None": lambda f, name, default: f.integer(name, default),
    "float": lambda f, name, default: f.number(name, default),
    "bool": lambda f, name, default: f.boolean(name, default),
    "list[str]": lambda f, name, default: _stop(f.body.get(name)),
    "list[int]": lambda f, name, default: _int_list(f.body.get(name), name),
    "dict[int, float]": lambda f, name, default: _logit_bias(f.body.get(name)),
    "str | None": lambda f, name, default: f.get(name, (str,), "a string", default),
}
_KNOBS = [(k.name, _READERS[str(k.type)], k.default) for k in fields(SamplingParams)
          if k.name not in ("max_tokens", "n", "structured")]  # read with their own rules


def _sampling(f: _Fields) -> dict[str, Any]:
    """The body's sampling knobs by SamplingParams' fields, in their order."""
    return {name: read(f, name, default) for name, read, default in _KNOBS}


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
