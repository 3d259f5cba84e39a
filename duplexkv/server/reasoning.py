"""`--reasoning-parser`: a reasoning model's `<think>…</think>` trace out of its text, into the
field vLLM 0.32 uses, `reasoning` (in the message and in stream deltas); the rest is `content`.

    deepseek_r1  reasoning from the start (a leading `<think>` is dropped: the template may have
                 put it in the prompt) to `</think>`; without `</think>` all of it is reasoning
    qwen3        the same, and a `<tool_call>` also ends the reasoning; with
                 `chat_template_kwargs.enable_thinking: false` there is no reasoning at all

Streaming and non-streaming run the same splitter (`feed`), so both give the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplexkv.server.text_split import find_first, held_back

THINK_START, THINK_END, TOOL_CALL = "<think>", "</think>", "<tool_call>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


@dataclass(slots=True)
class ReasoningSplitter:
    name: str
    enabled: bool = True  # qwen3 with enable_thinking false: everything is content
    state: str = "start"  # start -> think -> content
    buf: str = ""

    @property
    def _ends(self) -> tuple[str, ...]:
        return (THINK_END, TOOL_CALL) if self.name == "qwen3" else (THINK_END,)

    def feed(self, text: str, final: bool = False) -> Split:
        if not self.enabled or self.state == "content":
            return Split(content=text)
        self.buf += text
        out = Split()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_START):
                self.buf = head[len(THINK_START):]
            elif THINK_START.startswith(head) and not final:
                return out  # maybe a `<think>` still arriving
            self.state = "think"
        found = find_first(self.buf, self._ends)
        if found is not None:
            i, tag = found
            out.reasoning = self.buf[:i]
            out.content = self.buf[i + len(tag):] if tag == THINK_END else self.buf[i:]
            self.buf, self.state = "", "content"
            return out
        keep = 0 if final else held_back(self.buf, self._ends)
        out.reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out


def make_splitter(name: str | None, template_kwargs: dict) -> ReasoningSplitter | None:
    if name is None:
        return None
    return ReasoningSplitter(name, enabled=not (name == "qwen3" and
                                                template_kwargs.get("enable_thinking") is False))


__all__ = ["PARSERS", "ReasoningSplitter", "Split", "make_splitter"]
