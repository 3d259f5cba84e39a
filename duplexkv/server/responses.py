"""Response bodies in OpenAI shapes, non-stream and SSE chunks, plus our top-level extensions.

    non-stream   {id, object, created, model, choices, usage, kv_stats, kv_transfer_params}
    stream       [chat: a role chunk per choice] -> text/content chunks -> a finish chunk per
                 choice (finish_reason, stop_reason, kv_stats; kv_transfer_params on the last)
                 -> [usage chunk, choices: []] -> data: [DONE]

n > 1 (vLLM's shape): `choices[i].index`, each choice with its own finish_reason, stop_reason,
text and token ids; a stream's chunks carry one choice each, interleaved. `usage` counts the prompt
once and the completion tokens of every choice. `kv_stats` is the request's: choice 0's (where
the prompt's KV came from: it computed or pulled it once) plus `choices`, every choice's own
(choices 1.. show the prompt blocks they took from choice 0 as `shared_tokens`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from duplexkv.engine.llm_engine import RequestOutput
from duplexkv.http.openai import Kind
from duplexkv.server.chat_output import ChoiceParser

DONE = "data: [DONE]\n\n"
# one encoder for every chunk: json.dumps builds a new one per call when given options
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(obj: dict) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


def cached_tokens(out: RequestOutput) -> int:
    s = out.kv_stats
    return 0 if s is None else s.local_hit_tokens + s.pulled_tokens


def usage(outs: list[RequestOutput]) -> dict:
    p, c = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(outs[0])}}


def kv_stats(outs: list[RequestOutput]) -> dict | None:
    """The request's kv_stats: choice 0's, and with n > 1 every choice's under `choices`."""
    first = outs[0].kv_stats
    if first is None:
        return None
    out = first.as_dict()
    if len(outs) > 1:
        out["choices"] = [{"index": o.index, **o.kv_stats.as_dict()} for o in outs
                          if o.kv_stats is not None]
    return out


@dataclass(slots=True)
class Formatter:
    kind: Kind
    response_id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # stream: per choice
    # chat with a reasoning or tool-call parser (server/chat_output.py): one parser per choice
    parser: Callable[[], ChoiceParser] | None = None
    parsers: dict[int, ChoiceParser] = field(default_factory=dict)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model}

    # non-stream
    def full(self, outs: list[RequestOutput]) -> dict:
        return {**self._head(self._object), "choices": [self._choice(o) for o in outs],
                "usage": usage(outs), "kv_stats": kv_stats(outs),
                "kv_transfer_params": _params(outs[0])}

    def _choice(self, out: RequestOutput) -> dict:
        if self.kind == "chat":
            message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
            if self.parser is not None:
                parser = self.parser()
                message, finish = parser.message(out.text), parser.finish_reason(finish)
            choice = {"index": out.index, "message": message, "logprobs": None,
                      "finish_reason": finish, "stop_reason": out.stop_reason}
        else:
            choice = {"index": out.index, "text": out.text, "logprobs": None,
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if self.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        return choice

    # stream
    def _chunk(self, index: int, delta: str | dict, finish_reason: str | None,
               role: bool = False) -> dict:
        """`delta`: new text, or (chat with parsers) the delta's parts."""
        if self.kind == "chat":
            d: dict = {"role": "assistant", "content": ""} if role else {}
            if isinstance(delta, dict):
                d.update(delta)
            elif delta:
                d["content"] = delta
            choice = {"index": index, "delta": d, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        body = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def start_chunks(self) -> list[str]:
        """Chat: the assistant role, one chunk per choice (vLLM's order)."""
        if self.kind != "chat":
            return []
        return [sse(self._chunk(i, "", None, role=True)) for i in range(self.n)]

    def finals(self) -> list[RequestOutput]:
        return [self.latest[i] for i in range(self.n)]

    def chunk(self, out: RequestOutput) -> str | None:
        """The SSE line(s) for one engine output (None when it carries nothing new)."""
        self.latest[out.index] = out
        if self.parser is not None and self.kind == "chat":
            return self._parsed_chunks(out)
        if not out.finished:
            if not out.new_text and not (self.return_token_ids and out.new_token_ids):
                return None
            body = self._chunk(out.index, out.new_text, None)
            if self.return_token_ids:
                body["choices"][0]["token_ids"] = out.new_token_ids
            return sse(body)
        return self._final_chunk(out, out.new_text, out.finish_reason)

    def _parsed_chunks(self, out: RequestOutput) -> str | None:
        """Chat through parsers: a chunk per delta part (reasoning/content, then each tool
        call piece, as vLLM sends them); the finish chunk carries the last part."""
        parser = self.parsers.setdefault(out.index, self.parser())  # type: ignore[misc]
        d = parser.feed(out.new_text, final=out.finished)
        parts = [{k: v for k, v in d.as_dict().items() if k != "tool_calls"}] + \
                [{"tool_calls": [tc]} for tc in d.tool_calls]
        parts = [p for p in parts if p]
        ids = out.new_token_ids if self.return_token_ids else None
        last = parts.pop() if out.finished and parts else {}
        lines = []
        for i, part in enumerate(parts):
            body = self._chunk(out.index, part, None)
            if ids is not None and i == 0:
                body["choices"][0]["token_ids"] = ids
            lines.append(sse(body))
        if out.finished:
            lines.append(self._final_chunk(out, last, parser.finish_reason(out.finish_reason),
                                           ids if not parts else []))
        elif not lines and ids:
            body = self._chunk(out.index, {}, None)
            body["choices"][0]["token_ids"] = ids
            lines.append(sse(body))
        return "".join(lines) or None

    def _final_chunk(self, out: RequestOutput, delta: str | dict, finish: str | None,
                     ids: list[int] | None = None) -> str:
        body = self._chunk(out.index, delta, finish)
        body["choices"][0]["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = out.new_token_ids if ids is None else ids
        known = [self.latest[i] for i in sorted(self.latest)]
        body["kv_stats"] = kv_stats(known) if 0 in self.latest else None
        last = len(self.latest) == self.n and all(o.finished for o in known)
        body["kv_transfer_params"] = _params(self.latest[0]) if last else None
        return sse(body)

    def usage_chunk(self) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        outs = self.finals()
        return sse({**self._head(obj), "choices": [], "usage": usage(outs),
                    "kv_stats": kv_stats(outs)})

    def error_chunk(self, error: dict) -> str:
        return sse(error)


def _params(out: RequestOutput) -> dict | None:
    p = out.kv_transfer_params
    return None if p is None else p.to_dict()
