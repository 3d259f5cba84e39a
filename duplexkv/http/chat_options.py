"""What a chat request adds to the chat template: `tools`, `tool_choice`, `documents` and
`chat_template_kwargs`, validated as vLLM's server does.

They reach the template as HF's `apply_chat_template(messages, tools=..., documents=...,
**chat_template_kwargs)` passes them (e.g. Qwen3's `enable_thinking`). Only what we can honour is
accepted:

- `tool_choice` "none" (or absent without tools): the tools are rendered into the prompt and the
  model's text comes back as it is, as vLLM does with "none".
- "auto" (also the default when tools are given, as in vLLM) needs the model's tool calls parsed out
  of its text (vLLM's `--enable-auto-tool-choice --tool-call-parser`), and "required" or a named
  function need guided decoding; we do neither, so each is a 400 naming `tool_choice` (vLLM without
  those flags refuses "auto" the same way) rather than an answer whose tool calls are left in
  `content`.
- `chat_template_kwargs` may not set what the server passes itself (`messages`, `tools`,
  `add_generation_prompt`, ...) nor `chat_template` (a template from the request is refused, as
  vLLM does without `--trust-request-chat-template`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duplexkv.http.errors import bad_request

RESERVED_TEMPLATE_KWARGS = frozenset(("messages", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tokenize"))
MAX_TEMPLATE_KWARG_CHARS = 64


@dataclass(frozen=True, slots=True)
class ChatOptions:
    tools: list[dict] | None = None
    documents: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def render_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Tokenizer.apply_chat_template` (besides messages and
        add_generation_prompt)."""
        return {**self.template_kwargs, "tools": self.tools, "documents": self.documents}


def parse_chat_options(body: dict, generate: bool = True) -> ChatOptions:
    """`generate=False` for /tokenize, which renders the prompt only (no `tool_choice`)."""
    tools = _tools(body.get("tools"))
    if generate:
        _tool_choice(body.get("tool_choice"), tools)
    return ChatOptions(tools, _documents(body.get("documents")),
                       _template_kwargs(body.get("chat_template_kwargs")))


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


def _tool_choice(v: Any, tools: list[dict] | None) -> None:
    if v is None:
        choice = "auto" if tools else "none"  # vLLM's default
    elif isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise bad_request(f"`tool_choice` must be \"none\", \"auto\", \"required\" or a "
                              f"named function, got {v!r:.40}", "tool_choice")
        choice = v
    elif isinstance(v, dict) and v.get("type") == "function":
        choice = "named"
    else:
        raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice == "none":
        return
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        raise bad_request(
            "`tool_choice` \"auto\" (the default when `tools` are given) is not supported by "
            "this server: it does not parse tool calls out of the model's text (vLLM's "
            "--enable-auto-tool-choice --tool-call-parser). Send `tool_choice: \"none\"` to have "
            "the tools rendered into the prompt and the model's text returned as it is.",
            "tool_choice")
    what = '"required"' if choice == "required" else "naming a function"
    raise bad_request(
        f"`tool_choice` {what} is not "
        "supported by this server: forcing a tool call needs guided decoding, which it does not "
        "do. Send `tool_choice: \"none\"` to have the tools rendered into the prompt.",
        "tool_choice")


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


__all__ = ["ChatOptions", "parse_chat_options"]
