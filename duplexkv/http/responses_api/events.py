"""A chat SSE stream -> the Responses streaming events, in OpenAI's shapes and order:

    response.created, response.in_progress                        (status in_progress)
    per output item, in the order the answer produces them:
      reasoning  output_item.added, content_part.added (reasoning_text),
                 reasoning_text.delta ..., reasoning_text.done, content_part.done,
                 output_item.done
      message    output_item.added, content_part.added (output_text), output_text.delta ...,
                 output_text.done, content_part.done, output_item.done
      a call     output_item.added (function_call), function_call_arguments.delta ...,
                 function_call_arguments.done, output_item.done
    response.completed (response.incomplete when cut by max_output_tokens), with usage

Each event is `event: <type>` + `data: <json>` with a `sequence_number` counting from 0; there
is no `[DONE]` (OpenAI sends none). A chat error event becomes an `error` event and ends the
stream. An item is closed when the next kind starts (a call closes the message before it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from duplexkv.http.responses_api.output import (
    ResponseShape,
    call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
)
from duplexkv.http.responses_api.request import dumps


@dataclass(slots=True)
class _Open:
    kind: str  # reasoning | message | call
    item: dict
    index: int  # output_index
    text: str = ""  # reasoning/message text or call arguments
    chat_index: int = -1  # a call's index in the chat stream


@dataclass(slots=True)
class ResponseEvents:
    shape: ResponseShape
    seq: int = 0
    output: list[dict] = field(default_factory=list)
    current: _Open | None = None
    usage: Any = None
    kv_stats: Any = None
    finish_reason: Any = None
    failed: bool = False

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    def start(self) -> list[str]:
        r = self.shape.response([], "in_progress")
        return [self._event("response.created", response=r),
                self._event("response.in_progress", response=r)]

    def feed_event(self, event: str) -> list[str]:
        """One chat SSE event (its lines without the blank line) -> the events it makes."""
        data = "\n".join(line[5:].lstrip() for line in event.splitlines()
                         if line.startswith("data:"))
        if not data or data == "[DONE]":
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            return []
        return self.feed(chunk) if isinstance(chunk, dict) else []

    def feed(self, chunk: dict) -> list[str]:
        """One chat chunk (or error event) -> the Responses events it makes."""
        if "error" in chunk and not chunk.get("choices"):
            self.failed = True
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            code = err.get("code")
            return self._close() + [self._event(
                "error", code=str(code) if code is not None else None,
                message=str(err.get("message", "error")), param=err.get("param"))]
        if isinstance(chunk.get("model"), str):
            self.shape.model = chunk["model"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("kv_stats"), dict):
            self.kv_stats = chunk["kv_stats"]
        out: list[str] = []
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                out += self._text("reasoning", reasoning)
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._text("message", delta["content"])
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    out += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[str]:
        """The closing events once the chat stream ended (nothing after an error)."""
        if self.failed:
            return []
        out = self._close()
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            out += self._open("message", message_item("", status="in_progress")) + self._close()
        r = self.response()
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=r)]

    def response(self) -> dict:
        return self.shape.response(self.output, "completed", self.usage, self.finish_reason,
                                   self.kv_stats)

    # items
    def _open(self, kind: str, item: dict, chat_index: int = -1) -> list[str]:
        out = self._close()
        self.current = _Open(kind, item, len(self.output), chat_index=chat_index)
        out.append(self._event("response.output_item.added", output_index=self.current.index,
                               item=item))
        if kind != "call":
            part = output_text("") if kind == "message" else {"type": "reasoning_text",
                                                                "text": ""}
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self.current.index, content_index=0, part=part))
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.current is None or self.current.kind != kind:
            item = (message_item("", status="in_progress") if kind == "message" else
                    {**reasoning_item("", status="in_progress"), "content": []})
            out += self._open(kind, item)
        cur = self.current
        cur.text += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(name, item_id=cur.item["id"], output_index=cur.index,
                               content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict) -> list[str]:
        out = []
        index = call.get("index", 0)
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        if self.current is None or self.current.kind != "call" \
                or self.current.chat_index != index:
            call_id, name = call.get("id"), fn.get("name")
            item = call_item(call_id if isinstance(call_id, str) and call_id else new_id("call"),
                             name if isinstance(name, str) else "", "", status="in_progress")
            out += self._open("call", item, index)
        cur = self.current
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            cur.text += args
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=cur.item["id"], output_index=cur.index, delta=args))
        return out

    def _close(self) -> list[str]:
        cur, self.current = self.current, None
        if cur is None:
            return []
        item_id, i, out = cur.item["id"], cur.index, []
        if cur.kind == "call":
            item = {**cur.item, "arguments": cur.text, "status": "completed"}
            out.append(self._event("response.function_call_arguments.done", item_id=item_id,
                                   output_index=i, arguments=cur.text))
        else:
            if cur.kind == "message":
                status = "incomplete" if self.finish_reason == "length" else "completed"
                item, part = message_item(cur.text, item_id, status), output_text(cur.text)
                done = "response.output_text.done"
                extra: dict = {"logprobs": []}
            else:
                item = reasoning_item(cur.text, item_id)
                part, done, extra = item["content"][0], "response.reasoning_text.done", {}
            out.append(self._event(done, item_id=item_id, output_index=i, content_index=0,
                                   text=cur.text, **extra))
            out.append(self._event("response.content_part.done", item_id=item_id,
                                   output_index=i, content_index=0, part=part))
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=i, item=item))
        return out
