"""`--tool-call-parser hermes`: tool calls out of a model's text, in the Hermes / Qwen format the
chat template teaches (duplexkv/model/synth.py):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call becomes `{"id": "chatcmpl-tool-…", "type": "function", "function": {"name",
"arguments"}}` (arguments as JSON text); the text outside the calls stays `content`. A call whose
body is not a JSON object with a string `name` (and an object `arguments`, or none) is left in
`content` as written: malformed output is never an error. A last call the model did not close
(max_tokens) is parsed as vLLM's Hermes parser does.

Streaming runs the same parser on the deltas: content is passed on as it comes (but for a tail
that may begin `<tool_call>`), and a call is sent when its `</tool_call>` arrives, as vLLM sends
them: one delta with the call's index, id, type and name, then one with its arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from duplexkv.server.text_split import held_back

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict]:
        """vLLM's streamed shape: the header, then the arguments."""
        return [{"index": index, "id": self.id, "type": "function",
                 "function": {"name": self.name}},
                {"index": index, "function": {"arguments": self.arguments}}]


def parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json allows
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class HermesParser:
    in_call: bool = False
    buf: str = ""

    def feed(self, text: str, final: bool = False) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if not self.in_call:
                i = self.buf.find(START)
                if i < 0:
                    keep = 0 if final else held_back(self.buf, (START,))
                    out.content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.content += self.buf[:i]
                self.buf, self.in_call = self.buf[i + len(START):], True
            j = self.buf.find(END)
            if j < 0 and not final:
                return out
            body = self.buf if j < 0 else self.buf[:j]
            self.buf, self.in_call = ("" if j < 0 else self.buf[j + len(END):]), False
            call = parse_call(body)
            if call is None:  # malformed: the text as the model wrote it
                out.content += START + body + ("" if j < 0 else END)
            else:
                out.calls.append(call)
            if j < 0:
                return out


__all__ = ["HermesParser", "PARSERS", "Parsed", "ToolCall", "parse_call", "tool_call_id"]
