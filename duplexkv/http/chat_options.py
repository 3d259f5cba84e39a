"""What a chat request adds to the chat template: `tools`, `tool_choice`, `documents` and
`chat_template_kwargs`, validated as vLLM's server does.

They reach the template as HF's `apply_chat_template(messages, tools=..., documents=...,
**chat_template_kwargs)` passes them (e.g. Qwen3's `enable_thinking`). Only what we can honour is
accepted:

- `tool_choice` "none" (or absent without tools): the tools are rendered into the prompt and the
  model's text comes back as it is, as vLLM does with "none".
- "auto" (also the default when tools are given, as in vLLM) needs the model's tool calls parsed out
  of its text: a worker started with `--enable-auto-tool-choice --tool-call-parser` does it
  (server/tool_parser.py; the router passes it on to them); without those flags it is a 400 naming
  `tool_choice`, as in vLLM, rather than an answer whose tool calls are left in `content`.
- "required" or a named function force a call by guided decoding (`Features.structured`: the
  workers; http/tool_schema.py makes the grammar).
- `chat_template_kwargs` may not set what the server passes itself (`messages`, `tools`,
  `add_generation_prompt`, ...) nor `chat_template` (a template from the request is refused, as
  vLLM does without `--trust-request-chat-template`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from duplexkv.http.errors import bad_request
from duplexkv.http.features import NONE, Features

RESERVED_TEMPLATE_KWARGS = frozenset(("messages", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tokenize"))
MAX_TEMPLATE_KWARG_CHARS = 64


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"] = "none"
    name: str | None = None  # named: the function


@dataclass(frozen=True, slots=True)
class ChatOptions:
    tools: list[dict] | None = None
    documents: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True

    def render_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Tokenizer.apply_chat_template` (besides messages and
        add_generation_prompt)."""
        return {**self.template_kwargs, "tools": self.tools, "documents": self.documents}


def parse_chat_options(body: dict, generate: bool = True,
                       features: Features = NONE) -> ChatOptions:
    """`generate=False` for /tokenize, which renders the prompt only (no `tool_choice`)."""
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools, features) if generate else ToolChoice()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    return ChatOptions(tools, _documents(body.get("documents")),
                       _template_kwargs(body.get("chat_template_kwargs")), choice,
                       parallel is not False)


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request("`tools` must be a list of tool objects", "tools")
    for i, tool in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"`{where}` must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(f"`{where}.type` must be \"function\", got {tool.get('type')!r:.40}",
                              f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"`{where}.function` must be an object", f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"`{where}.function.name` must be a non-empty string",
                              f"{where}.function.name")
        for key, kind, what in (("description", str, "a string"),
                                ("parameters", dict, "an object"), ("strict", bool, "a boolean")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad_request(f"`{where}.function.{key}` must be {what}",
                                  f"{where}.function.{key}")
    return v or None


def _tool_choice(v: Any, tools: list[dict] | None, features: Features) -> ToolChoice:
    if v is None:
        choice = ToolChoice("auto" if tools else "none")  # vLLM's default
    elif isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise bad_request(f"`tool_choice` must be \"none\", \"auto\", \"required\" or a "
                              f"named function, got {v!r:.40}", "tool_choice")
        choice = ToolChoice(v)  # type: ignore[arg-type]
    elif isinstance(v, dict) and v.get("type") == "function":
        fn = v.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request("`tool_choice.function.name` must be a non-empty string",
                              "tool_choice")
        choice = ToolChoice("named", name)
    else:
        raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice.mode == "none":
        return choice
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice.mode == "auto" and not features.auto_tools:
        raise bad_request(
            "`tool_choice` \"auto\" (the default when `tools` are given) needs the server "
            "started with --enable-auto-tool-choice --tool-call-parser NAME (as vLLM). Send "
            "`tool_choice: \"none\"` to have the tools rendered into the prompt and the model's "
            "text returned as it is.", "tool_choice")
    if choice.mode in ("required", "named") and not features.structured:
        raise bad_request(
            f"`tool_choice` {choice.mode!r} is not supported by this server: forcing a tool "
            "call needs guided decoding. Send `tool_choice: \"none\"` to have the tools "
            "rendered into the prompt.", "tool_choice")
    if choice.mode == "named" and choice.name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"`tool_choice` names the function {choice.name!r:.80}, which is not "
                          "in `tools`", "tool_choice")
    return choice


def _documents(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(d, dict) for d in v):
        raise bad_request("`documents` must be a list of objects", "documents")
    return v or None


def _template_kwargs(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    for key in v:
        if not key.isidentifier() or len(key) > MAX_TEMPLATE_KWARG_CHARS:
            raise bad_request(f"`chat_template_kwargs` key {key[:MAX_TEMPLATE_KWARG_CHARS]!r} is "
                              "not a template variable name", "chat_template_kwargs")
        if key in RESERVED_TEMPLATE_KWARGS:
            what = ("a chat template from the request is not accepted" if key == "chat_template"
                    else "the server sets it from the request")
            raise bad_request(f"`chat_template_kwargs.{key}` cannot be set: {what}",
                              f"chat_template_kwargs.{key}")
    return dict(v)


__all__ = ["ChatOptions", "ToolChoice", "parse_chat_options"]
