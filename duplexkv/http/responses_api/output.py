"""A chat completion -> a Response object, in OpenAI's shape (`openai.types.responses.Response`).

    choice 0's message   reasoning     -> a `reasoning` item (reasoning_text content)
                         content       -> a `message` item with one `output_text` part
                         tool_calls    -> one `function_call` item each (call_id = the call's id)
    finish_reason        "length"      -> status "incomplete", incomplete_details
                                          {reason: "max_output_tokens"}; else "completed"
    usage                prompt/completion tokens -> input/output tokens (cached: the prompt's
                         tokens whose KV was reused)

Our own `kv_stats` (the worker's, or the router's of both legs) is kept as an extra top-level
field, as on a chat answer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [output_text(text)] if status != "in_progress" else []}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def usage(chat_usage: Any) -> dict | None:
    if not isinstance(chat_usage, dict):
        return None
    p, c = (v if isinstance(v, int) and not isinstance(v, bool) else 0
            for v in (chat_usage.get("prompt_tokens"), chat_usage.get("completion_tokens")))
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) else 0
    return {"input_tokens": p,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + c}


def items_of(message: dict, finish_reason: Any) -> list[dict]:
    """A chat message -> its output items (reasoning, message, function calls)."""
    items = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(reasoning))
    content = message.get("content")
    calls = message.get("tool_calls")
    calls = [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    if (isinstance(content, str) and content) or not calls:  # an answer always has a message
        items.append(message_item(content if isinstance(content, str) else "",
                                  status="incomplete" if finish_reason == "length"
                                  else "completed"))
    for c in calls:
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        items.append(call_item(_text(c.get("id")) or new_id("call"), _text(fn.get("name")),
                               _text(fn.get("arguments"))))
    return items


@dataclass(slots=True)
class ResponseShape:
    """What a Response carries besides its output: its id, model, creation time and the
    request's echoed fields."""

    response_id: str
    model: str
    echo: dict
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, output: list[dict], status: str, chat_usage: Any = None,
                 finish_reason: Any = None, kv_stats: Any = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if status == "completed" and incomplete is not None:
            status = "incomplete"
        body = {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None, "incomplete_details": incomplete,
                "model": self.model, "output": output, "usage": usage(chat_usage),
                "background": False, "reasoning": {"effort": None, "summary": None},
                "truncation": "disabled", "service_tier": "auto", **self.echo}
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
        if kv_stats is not None:
            body["kv_stats"] = kv_stats
        return body

    def from_chat(self, chat: dict) -> dict:
        """A chat-completions JSON answer -> the Response."""
        choices = chat.get("choices")
        first = choices[0] if isinstance(choices, list) and choices \
            and isinstance(choices[0], dict) else {}
        message = first.get("message") if isinstance(first.get("message"), dict) else {}
        finish = first.get("finish_reason")
        if isinstance(chat.get("model"), str):
            self.model = chat["model"]
        return self.response(items_of(message, finish), "completed", chat.get("usage"), finish,
                             chat.get("kv_stats"))
