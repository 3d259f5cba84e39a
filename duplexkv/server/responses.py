"""Response bodies in OpenAI shapes, non-stream and SSE chunks, plus our top-level extensions.

    non-stream   {id, object, created, model, choices, usage, kv_stats, kv_transfer_params}
    stream       [chat: role chunk] -> text/content chunks -> finish chunk (finish_reason,
                 stop_reason, kv_stats, kv_transfer_params) -> [usage chunk, choices: []]
                 -> data: [DONE]
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from duplexkv.engine.llm_engine import RequestOutput
from duplexkv.http.openai import Kind

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def cached_tokens(out: RequestOutput) -> int:
    s = out.kv_stats
    return 0 if s is None else s.local_hit_tokens + s.pulled_tokens


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(out)}}


def kv_stats(out: RequestOutput) -> dict | None:
    return None if out.kv_stats is None else out.kv_stats.as_dict()


@dataclass(slots=True)
class Formatter:
    kind: Kind
    response_id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model}

    # non-stream
    def full(self, out: RequestOutput) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": out.finish_reason,
                      "stop_reason": out.stop_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None,
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if self.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        return {**self._head(self._object), "choices": [choice], "usage": usage(out),
                "kv_stats": kv_stats(out), "kv_transfer_params": _params(out)}

    # stream
    def _chunk(self, delta: str, finish_reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            d: dict = {"role": "assistant", "content": ""} if role else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        body = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def start_chunk(self) -> str | None:
        return sse(self._chunk("", None, role=True)) if self.kind == "chat" else None

    def chunk(self, out: RequestOutput) -> str | None:
        """The SSE line for one engine output (None when it carries nothing new)."""
        if not out.finished:
            if not out.new_text and not (self.return_token_ids and out.new_token_ids):
                return None
            body = self._chunk(out.new_text, None)
            if self.return_token_ids:
                body["choices"][0]["token_ids"] = out.new_token_ids
            return sse(body)
        body = self._chunk(out.new_text, out.finish_reason)
        body["choices"][0]["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = out.new_token_ids
        body["kv_stats"] = kv_stats(out)
        body["kv_transfer_params"] = _params(out)
        return sse(body)

    def usage_chunk(self, out: RequestOutput) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage(out),
                    "kv_stats": kv_stats(out)})

    def error_chunk(self, error: dict) -> str:
        return sse(error)


def _params(out: RequestOutput) -> dict | None:
    p = out.kv_transfer_params
    return None if p is None else p.to_dict()
