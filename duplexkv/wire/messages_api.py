"""Anthropic's Messages API (`POST /v1/messages`) request -> a chat-completions request body.

Pure and shared by the worker and the router: both run a Messages request as the chat request
this makes (the worker through its chat path, the router as a chat turn), then turn the chat
answer back (messages_answer.py). Anything this cannot honour is a `MessagesError` naming the
field (the HTTP layer makes it a 400 in Anthropic's error shape):

    model, max_tokens (required), temperature, top_p, top_k, stream; metadata, service_tier
                    and cache_control (caching is automatic here) accepted and ignored
    system          a string or text blocks (joined by "\\n") -> a system message first
    messages        role user | assistant, content a string or blocks:
        user        text -> a user message (consecutive text blocks joined by "\\n");
                    tool_result {tool_use_id, content: string | text blocks, is_error}
                    -> a tool message (is_error: the content prefixed "Error: ")
        assistant   text (joined as written), tool_use {id, name, input} -> tool_calls (input
                    as JSON text, as the hermes parser writes it), thinking -> the message's
                    reasoning (chat templates decide whether to render it),
                    redacted_thinking dropped
        image, document and other blocks: unsupported (a 400 naming them)
    stop_sequences -> stop;  tools {name, description, input_schema} -> function tools
    tool_choice     auto -> "auto", any -> "required", tool -> the named function, none;
                    disable_parallel_tool_use -> parallel_tool_calls false
    thinking        {type: enabled | adaptive | disabled} -> chat_template_kwargs.enable_thinking
    conversation_id our router's conversation id (an extension; Anthropic clients send none and
                    are recognised from their messages)
Any other field is a 400 (Anthropic's API rejects unknown fields too); value ranges (a
temperature, top_k) are checked by the chat request parser, with the same messages.
`count_request`: a count_tokens body (no max_tokens) -> what renders its prompt.
"""

from __future__ import annotations

import json
from typing import Any

FIELDS = frozenset(("model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
                    "top_p", "top_k", "stream", "metadata", "tools", "tool_choice", "thinking",
                    "service_tier", "cache_control", "conversation_id"))
UNSUPPORTED_BLOCKS = frozenset(("image", "document", "search_result", "container_upload",
                                "server_tool_use", "web_search_tool_result", "mcp_tool_use",
                                "mcp_tool_result", "code_execution_tool_result"))
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class MessagesError(ValueError):
    """A request this API cannot run: `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def chat_request(body: dict) -> dict:
    """A Messages request body -> the chat-completions body that runs it."""
    unknown = sorted(body.keys() - FIELDS)
    if unknown:
        raise MessagesError(f"`{unknown[0][:64]}`: unknown field (not part of the Messages API "
                            "this server implements)", unknown[0][:64])
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise MessagesError("`max_tokens` is required" if max_tokens is None else
                            "`max_tokens` must be an integer of at least 1", "max_tokens")
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise MessagesError("`messages` must be a non-empty list of messages", "messages")
    for i, m in enumerate(raw):
        messages += _message(m, f"messages[{i}]")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise MessagesError("`metadata` must be an object", "metadata")
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    for key in ("model", "temperature", "top_p", "top_k", "conversation_id"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise MessagesError("`stream` must be a boolean", "stream")
    if stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise MessagesError("`stop_sequences` must be a list of strings", "stop_sequences")
        chat["stop"] = stop
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice")))
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    return chat


def count_request(body: dict) -> dict:
    """A count_tokens body (a Messages request without max_tokens) -> what renders its prompt:
    {messages, tools, chat_template_kwargs, model} of the chat request."""
    if "max_tokens" in body:
        raise MessagesError("`max_tokens`: unknown field (count_tokens takes none)", "max_tokens")
    chat = chat_request({**body, "max_tokens": 1})
    return {k: chat[k] for k in ("model", "messages", "tools", "chat_template_kwargs")
            if k in chat}


def _system(v: Any) -> list[dict]:
    if v is None or v == "":
        return []
    if isinstance(v, str):
        return [{"role": "system", "content": v}]
    if not isinstance(v, list):
        raise MessagesError("`system` must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": "\n".join(_texts(v, "system"))}]


def _texts(blocks: list, where: str) -> list[str]:
    """Text blocks' texts (any other block: a 400 naming it)."""
    out = []
    for j, b in enumerate(blocks):
        kind = _kind(b, f"{where}[{j}]")
        if kind != "text":
            _unsupported(kind, f"{where}[{j}]", "only text blocks are accepted here")
        out.append(_string(b, "text", f"{where}[{j}]"))
    return out


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise MessagesError(f"`{where}` must be a content block (an object with a `type`)", where)
    return block["type"]


def _string(block: dict, key: str, where: str, required: bool = True) -> str:
    v = block.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and key in ("id", "name", "tool_use_id") and not v):
        raise MessagesError(f"`{where}.{key}` must be a{' non-empty' if key != 'text' else ''} "
                            "string", f"{where}.{key}")
    return v


def _unsupported(kind: str, where: str, why: str = "") -> None:
    if kind in UNSUPPORTED_BLOCKS:
        raise MessagesError(f"`{where}`: {kind!r} blocks are not supported by this server (text "
                            "and tools only)", where)
    raise MessagesError(f"`{where}`: unknown or misplaced block type {kind[:40]!r}"
                        + (f" ({why})" if why else ""), where)


def _message(m: Any, where: str) -> list[dict]:
    if not isinstance(m, dict):
        raise MessagesError(f"`{where}` must be an object", where)
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise MessagesError(f"`{where}.role` must be \"user\" or \"assistant\", got "
                            f"{str(role)[:40]!r}", f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise MessagesError(f"`{where}.content` must be a string or a list of content blocks",
                            f"{where}.content")
    where = f"{where}.content"
    return _user(content, where) if role == "user" else [_assistant(content, where)]


def _user(blocks: list, where: str) -> list[dict]:
    """Tool results become tool messages; text between them a user message each."""
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_string(b, "text", at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(b, at))
        else:
            _unsupported(kind, at, "a user message holds text and tool_result blocks")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(b: dict, where: str) -> dict:
    call_id = _string(b, "tool_use_id", where)
    content = b.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_texts(content, f"{where}.content"))
    else:
        raise MessagesError(f"`{where}.content` must be a string or a list of text blocks",
                            f"{where}.content")
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise MessagesError(f"`{where}.is_error` must be a boolean", f"{where}.is_error")
    return {"role": "tool", "tool_call_id": call_id,
            "content": "Error: " + text if is_error else text}


def _assistant(blocks: list, where: str) -> dict:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_string(b, "text", at))
        elif kind == "thinking":
            thinking.append(_string(b, "thinking", at))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append(_tool_use(b, at))
        else:
            _unsupported(kind, at, "an assistant message holds text, thinking and tool_use "
                                   "blocks")
    out: dict = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_use(b: dict, where: str) -> dict:
    call_id, name = _string(b, "id", where), _string(b, "name", where)
    args = b.get("input")
    if not isinstance(args, dict):
        raise MessagesError(f"`{where}.input` must be an object", f"{where}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise MessagesError("`tools` must be a list of tools", "tools")
    out = []
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise MessagesError(f"`{where}` must be an object", where)
        if t.get("type") not in (None, "custom"):
            raise MessagesError(f"`{where}.type` {str(t['type'])[:40]!r}: server tools are not "
                                "supported (only custom tools: name, description, input_schema)",
                                f"{where}.type")
        name = _string(t, "name", where)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise MessagesError(f"`{where}.input_schema` must be an object (a JSON schema)",
                                f"{where}.input_schema")
        fn: dict = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = _string(t, "description", where)
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(v: Any) -> dict:
    if v is None:
        return {}
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise MessagesError("`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"tool\" | "
                            "\"none\"}", "tool_choice")
    out: dict = {"tool_choice": TOOL_CHOICES.get(kind)}
    if kind == "tool":
        name = v.get("name")
        if not isinstance(name, str) or not name:
            raise MessagesError("`tool_choice.name` must be a non-empty string",
                                "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    parallel = v.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise MessagesError("`tool_choice.disable_parallel_tool_use` must be a boolean",
                            "tool_choice.disable_parallel_tool_use")
    if parallel:
        out["parallel_tool_calls"] = False
    return out


def _thinking(v: Any) -> bool | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise MessagesError("`thinking` must be {\"type\": \"enabled\" | \"adaptive\" | "
                            "\"disabled\"}", "thinking")
    return kind != "disabled"


__all__ = ["MessagesError", "chat_request", "count_request"]
