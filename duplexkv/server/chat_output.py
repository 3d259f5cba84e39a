"""A chat choice's text -> OpenAI's message parts: `reasoning` (--reasoning-parser), `content`,
and `tool_calls` (--tool-call-parser for tool_choice "auto"; the guided output of a forced
`tool_choice`), for a whole answer and for stream deltas alike (one `feed` for both).

    text ──▶ ReasoningSplitter ──reasoning──▶ `reasoning`
                    └──content──▶ auto: HermesParser ──▶ `content`, `tool_calls`
                                  named: the text is the call's arguments (streamed as they come)
                                  required: the text is [{"name", "parameters"}, ...], read at
                                            the end (malformed: left as content)
                                  none: `content`

finish_reason is "tool_calls" when "auto" parsed a call or "required" made them (vLLM's rule;
a named call keeps "stop").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Literal

from duplexkv.http.chat_options import ChatOptions
from duplexkv.server.reasoning import ReasoningSplitter, make_splitter
from duplexkv.server.tool_parser import HermesParser, ToolCall, tool_call_id

Mode = Literal["none", "auto", "named", "required"]


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        """A stream delta (only the parts it carries, as vLLM)."""
        d: dict = {}
        if self.reasoning:
            d["reasoning"] = self.reasoning
        if self.content:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


@dataclass(slots=True)
class ChoiceParser:
    mode: Mode = "none"
    function: str | None = None  # named
    reasoning: ReasoningSplitter | None = None
    hermes: HermesParser = field(default_factory=HermesParser)
    calls: list[ToolCall] = field(default_factory=list)
    guided: str = ""  # named / required: the output so far
    named_id: str = ""

    def feed(self, text: str, final: bool = False) -> Delta:
        out = Delta()
        content = text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            out.reasoning, content = split.reasoning, split.content
        if self.mode == "auto":
            parsed = self.hermes.feed(content, final)
            out.content = parsed.content
            for call in parsed.calls:
                out.tool_calls += call.deltas(len(self.calls))
                self.calls.append(call)
        elif self.mode == "named":
            self._named(content, out)
        elif self.mode == "required":
            self.guided += content
            if final:
                self._required(out)
        else:
            out.content = content
        return out

    def _named(self, text: str, out: Delta) -> None:
        if not text:
            return
        self.guided += text
        if not self.named_id:
            self.named_id = tool_call_id()
            out.tool_calls.append({"index": 0, "id": self.named_id, "type": "function",
                                   "function": {"name": self.function, "arguments": text}})
        else:
            out.tool_calls.append({"index": 0, "function": {"arguments": text}})

    def _required(self, out: Delta) -> None:
        try:
            items = json.loads(self.guided)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str)
                and isinstance(c.get("parameters"), dict) for c in items):
            out.content = self.guided  # e.g. cut by max_tokens
            return
        for c in items:
            call = ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            out.tool_calls += call.deltas(len(self.calls))
            self.calls.append(call)

    def finish_reason(self, reason: str | None) -> str | None:
        if self.calls and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason

    def message(self, text: str) -> dict:
        """The whole answer's message (`text`: the choice's full text)."""
        d = self.feed(text, final=True)
        calls = [c.as_dict() for c in self.calls]
        if self.mode == "named" and self.guided:
            calls = [{"id": self.named_id, "type": "function",
                      "function": {"name": self.function, "arguments": self.guided}}]
        content: str | None = d.content
        if calls and self.mode in ("named", "required"):
            content = ""  # vLLM's forced calls: an empty string
        elif not d.content.strip() and (calls or d.reasoning):
            content = None
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning"] = d.reasoning or None
        if calls:
            msg["tool_calls"] = calls
        return msg


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """A worker's output parsers (its flags): `tool_parser` for tool_choice "auto"."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def for_request(self, options: ChatOptions,
                    guided: bool = False) -> Callable[[], ChoiceParser] | None:
        """A parser factory for each choice of a chat request; None: the text is the content.
        `guided`: a JSON grammar shapes the whole output from its first token (a JSON
        structured output, a forced tool call), so no reasoning is looked for in it."""
        mode = options.tool_choice.mode
        if mode == "auto" and self.tool_parser is None:
            mode = "none"
        reasoning = None if guided else self.reasoning_parser
        if mode == "none" and reasoning is None:
            return None
        name, kwargs = options.tool_choice.name, options.template_kwargs
        return lambda: ChoiceParser(mode, name, make_splitter(reasoning, kwargs))


__all__ = ["ChatParsing", "ChoiceParser", "Delta"]
