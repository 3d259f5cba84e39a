"""A chat-completions answer -> Anthropic's Messages API answer (pure; the worker and the router
share it, messages_api.py makes the request):

    JSON    `message_of`: {id "msg_…", type "message", role "assistant", model, content blocks
            (thinking when the answer has a reasoning trace, text, tool_use {id, name, input as
            an object}), stop_reason, stop_sequence, usage}
    stream  `MessageStream`: the chat stream's chunks, one at a time, -> Anthropic's events, in
            their order: message_start, per block content_block_start, content_block_delta
            (thinking_delta, text_delta, input_json_delta), content_block_stop, then
            message_delta (stop_reason, stop_sequence, usage) and message_stop
    errors  `error_body`: {"type": "error", "error": {"type", "message"}}

    finish_reason "tool_calls" (or a named call's "stop") -> "tool_use"; "length" ->
    "max_tokens"; "stop" with a stop string -> "stop_sequence" (and the string); else "end_turn"
    usage   input_tokens: the prompt tokens computed for this request (kv_stats: a worker's
            computed_tokens, on the router P's plus D's), cache_read_input_tokens: the rest of
            the prompt, reused (without kv_stats: prompt_tokens_details.cached_tokens);
            output_tokens. A stream's message_start knows no counts yet (0): its message_delta
            carries them all.
A tool call's arguments that are not a JSON object (a forced call cut by max_tokens) come back
as text. Tool call ids are the chat answer's (a client sending them back as tool_use blocks
rebuilds the chat history the router recognises). Our `kv_stats` rides along: on the message,
and on a stream's message_delta.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def message_id(chat_id: Any) -> str:
    tail = chat_id.removeprefix("chatcmpl-") if isinstance(chat_id, str) and chat_id else "0"
    return "msg_" + tail


def stop_of(finish: Any, stop_reason: Any, tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason."""
    if tool_use and finish in ("tool_calls", "stop"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def computed_tokens(kv_stats: Any) -> int | None:
    """The prompt tokens computed for this request: a worker's `computed_tokens`, or on the
    router the sum of its legs' (P's prefill, D's suffix); None when not reported."""
    if not isinstance(kv_stats, dict):
        return None
    if "computed_tokens" in kv_stats:
        return _count(kv_stats["computed_tokens"])
    legs = [kv_stats.get(k) for k in ("prefill", "decode")]
    legs = [leg for leg in legs if isinstance(leg, dict) and "computed_tokens" in leg]
    return sum(_count(leg["computed_tokens"]) for leg in legs) if legs else None


def usage_of(usage: Any, kv_stats: Any = None) -> dict:
    """input_tokens: the prompt tokens computed for this request (kv_stats), else those the
    answering worker did not find cached; cache_read_input_tokens: the rest of the prompt."""
    usage = usage if isinstance(usage, dict) else {}
    prompt, out = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details")
    computed = computed_tokens(kv_stats)
    if computed is None:
        computed = prompt - _count(details.get("cached_tokens") if isinstance(details, dict)
                                   else 0)
    computed = min(prompt, max(0, computed))
    return {"input_tokens": computed, "output_tokens": out, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": prompt - computed}


def _input(arguments: Any) -> dict | None:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        return None
    return args if isinstance(args, dict) else None


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _first(choices: Any) -> dict:
    """Choice 0 of a chat answer or chunk ({} when it has none)."""
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


def message_of(chat: dict, model: str | None = None) -> dict:
    """A chat answer's choice 0 as a Message."""
    choice = _first(chat.get("choices"))
    msg = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content: list[dict] = []
    if isinstance(msg.get("reasoning"), str) and msg["reasoning"]:
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
    text = msg.get("content") if isinstance(msg.get("content"), str) else ""
    calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else []
    uses = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            continue
        args = _input(fn.get("arguments"))
        if args is None:  # not a usable call: its text, as the model wrote it
            text += fn.get("arguments") or ""
            continue
        uses.append({"type": "tool_use", "id": _str(c.get("id")), "name": _str(fn.get("name")),
                     "input": args})
    if text:
        content.append({"type": "text", "text": text})
    content += uses
    reason, sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"),
                               bool(uses))
    out = {"id": message_id(chat.get("id")), "type": "message", "role": "assistant",
           "model": _str(chat.get("model")) or model or "", "content": content,
           "stop_reason": reason, "stop_sequence": sequence,
           "usage": usage_of(chat.get("usage"), chat.get("kv_stats"))}
    if chat.get("kv_stats") is not None:
        out["kv_stats"] = chat["kv_stats"]
    return out


def event(kind: str, body: dict) -> str:
    """One SSE event: `event:` and `data:` lines."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class MessageStream:
    """A chat stream's chunks (parsed `data:` objects) -> Anthropic's events (SSE text)."""

    model: str = ""
    started: bool = False
    finished: bool = False
    block: str | None = None  # the open block's type
    index: int = -1  # the open block's index (blocks are numbered from 0)
    call: int | None = None  # the open tool_use block's chat tool call index
    uses: int = 0
    finish: Any = None
    stop_reason: Any = None
    usage: dict = field(default_factory=dict)
    kv_stats: Any = None

    def _start(self, chunk: dict) -> list[str]:
        if self.started:
            return []
        self.started = True
        msg = {"id": message_id(chunk.get("id")), "type": "message", "role": "assistant",
               "model": _str(chunk.get("model")) or self.model, "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [event("message_start", {"message": msg})]

    def _open(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block, self.call = None, None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, chunk: dict) -> list[str]:
        """One chat chunk (`data:` object) -> the events it makes."""
        if self.finished:
            return []
        out = self._start(chunk)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if chunk.get("kv_stats") is not None:
            self.kv_stats = chunk["kv_stats"]
        choice = _first(chunk.get("choices"))
        if not choice or choice.get("index", 0) != 0:
            return out
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if isinstance(delta.get("reasoning"), str) and delta["reasoning"]:
            if self.block != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if isinstance(delta.get("content"), str) and delta["content"]:
            if self.block != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        calls = delta.get("tool_calls")
        for c in calls if isinstance(calls, list) else []:
            out += self._tool_call(c)
        if choice.get("finish_reason") is not None:
            self.finish, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _tool_call(self, c: Any) -> list[str]:
        if not isinstance(c, dict):
            return []
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        out = []
        if "id" in c or c.get("index", 0) != self.call or self.block != "tool_use":
            out = self._open({"type": "tool_use", "id": _str(c.get("id")),
                              "name": _str(fn.get("name")), "input": {}})
            self.call, self.uses = c.get("index", 0), self.uses + 1
        if isinstance(fn.get("arguments"), str) and fn["arguments"]:
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": fn["arguments"]}))
        return out

    def done(self) -> list[str]:
        """The chat stream's [DONE] (or its end): the message's last events."""
        if self.finished:
            return []
        out = self._start({}) + self._close()
        self.finished = True
        reason, sequence = stop_of(self.finish, self.stop_reason, self.uses > 0)
        body: dict = {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": usage_of(self.usage, self.kv_stats)}
        if self.kv_stats is not None:
            body["kv_stats"] = self.kv_stats
        return out + [event("message_delta", body), event("message_stop", {})]

    def error(self, status: int, message: str) -> list[str]:
        """An error the chat stream sent: Anthropic's error event ends the stream."""
        if self.finished:
            return []
        self.finished = True
        return [f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"]


__all__ = ["MessageStream", "error_body", "error_type", "event", "message_of", "usage_of"]
