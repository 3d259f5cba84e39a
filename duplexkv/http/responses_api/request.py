"""A Responses request -> the chat-completions body it runs as.

    input          a string (one user message) or a list of items -> chat messages (items.py)
    instructions   a leading system message (not carried to a later response: OpenAI's rule)
    tools          Responses' flat {type: function, name, description, parameters, strict}
                   -> chat's {type: function, function: {...}}; built-in tools are a 400
    tool_choice    "auto" | "none" | "required" | {type: function, name}
    text.format    text | json_object | json_schema {name, schema, strict} -> response_format
    max_output_tokens -> max_tokens; temperature, top_p, parallel_tool_calls, stream as they are

Everything else OpenAI defines that we cannot honour (background, conversation, prompt
templates, max_tool_calls, logprobs, reasoning effort, ...) is a 400 naming the field, and so is
an unknown field. Bookkeeping fields (metadata, user, include, prompt_cache_key, ...) are
accepted; metadata and user are echoed in the Response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from duplexkv.http.errors import bad_request
from duplexkv.http.responses_api.input_items import listed
from duplexkv.http.responses_api.items import input_messages

# our extensions, passed to the chat request as they are (the chat parser checks them)
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "conversation_id", "chat_template_kwargs")
ACCEPTED = ("include", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
            "safety_identifier", "service_tier", "stream_options", "metadata", "user")
HONOURED = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
            "stream", "tools", "tool_choice", "parallel_tool_calls", "text", "store",
            "previous_response_id", "truncation", "reasoning", "background", "top_logprobs",
            "max_tool_calls")
MAX_METADATA_KEYS = 16


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str | None
    input_messages: list[dict]  # the request's own input, as chat messages
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    chat: dict  # the chat body's fields other than messages
    echo: dict = field(default_factory=dict)  # what the Response repeats of the request
    input_items: list[dict] = field(default_factory=list)  # the input as listed (input_items.py)

    def chat_body(self, history: list[dict]) -> dict:
        """The chat request: instructions, then `history` (the stored chain), then the input."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**self.chat, "messages": head + history + self.input_messages}


def parse_responses_request(body: dict) -> ResponsesRequest:
    """400 (naming the field) for anything we cannot honour."""
    for name in body:
        if name not in HONOURED and name not in ACCEPTED and name not in PASSED:
            raise bad_request(f"`{name}` is not supported by this server's Responses API", name)
    _only(body, "background", (False,), "background responses are not supported")
    _only(body, "top_logprobs", (0,), "logprobs are not returned")
    _only(body, "max_tool_calls", (), "a bound on tool calls is not supported")
    _only(body, "truncation", ("disabled",), "only \"disabled\"")
    _reasoning(body.get("reasoning"))
    model = _typed(body, "model", str, "a string")
    prev = _typed(body, "previous_response_id", str, "a string")
    instructions = _typed(body, "instructions", str, "a string")
    if "input" not in body or body["input"] is None:
        raise bad_request("`input` is required", "input")
    messages = input_messages(body["input"])
    if not messages and prev is None:
        raise bad_request("`input` must not be empty", "input")
    for name, kind, what in (("max_output_tokens", int, "an integer"),
                             ("temperature", (int, float), "a number"),
                             ("top_p", (int, float), "a number"),
                             ("parallel_tool_calls", bool, "a boolean")):
        _typed(body, name, kind, what)  # their values are the chat parser's to check
    stream = _typed(body, "stream", bool, "a boolean") or False
    store = _typed(body, "store", bool, "a boolean")
    chat: dict = {k: body[k] for k in PASSED if body.get(k) is not None}
    if model is not None:
        chat["model"] = model
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    fmt = _response_format(text)
    if fmt is not None:
        chat["response_format"] = fmt
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    echo = {"instructions": instructions, "metadata": _metadata(body.get("metadata")),
            "user": _typed(body, "user", str, "a string"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": prev, "store": store is not False,
            "text": {"format": (text or {}).get("format") or {"type": "text"}}}
    return ResponsesRequest(model, messages, instructions, prev, store is not False, stream,
                            chat, echo, listed(body["input"]))


def _typed(body: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise bad_request(f"`{name}` must be {what}", name)
    return v


def _only(body: dict, name: str, allowed: tuple, why: str) -> None:
    v = body.get(name)
    if v is not None and v not in allowed:
        raise bad_request(f"`{name}` is not supported by this server ({why})", name)


def _reasoning(v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad_request("`reasoning` must be an object", "reasoning")
    for key, value in v.items():
        if value is not None:
            raise bad_request(f"`reasoning.{key}` is not supported by this server (the "
                              "model's reasoning is what its chat template asks for)",
                              f"reasoning.{key}")


def _metadata(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(s, str) and len(s) <= 512
            for k, s in v.items()):
        raise bad_request(f"`metadata` must be an object of at most {MAX_METADATA_KEYS} string "
                          "values (keys up to 64 characters, values up to 512)", "metadata")
    return v


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request("`tools` must be a list of tool objects", "tools")
    out = []
    for i, tool in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"`{where}` must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(f"`{where}.type` {tool.get('type')!r:.40} is not supported by "
                              "this server: only function tools (no built-in tools)",
                              f"{where}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v  # the chat parser checks the value
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"name\": ...} (built-in tools are not "
                      "supported)", "tool_choice")


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("`text` must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("`text.verbosity` is not supported by this server (only \"medium\")",
                          "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "description", "strict")
                if fmt.get(k) is not None}
        if not isinstance(spec.get("schema"), dict):
            raise bad_request("`text.format.schema` must be an object", "text.format.schema")
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
                      "text.format")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
