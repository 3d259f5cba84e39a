"""The assistant message D produced, as the router sees it pass (recognise.py stores the next
turn's key with it): a JSON answer's choice 0 message, or choice 0 of a stream put back together
(content deltas joined; tool calls by index, their arguments joined). Reasoning is not kept:
recognition ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def json_answer(answer: dict) -> dict | None:
    """Choice 0's message of a JSON chat answer (None when it has none)."""
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    return message if isinstance(message, dict) else None


@dataclass(slots=True)
class StreamedAnswer:
    """Choice 0 of D's stream, one chunk's choice at a time (`feed`)."""

    parts: list[str] = field(default_factory=list)
    calls: dict[int, dict] = field(default_factory=dict)
    broken: bool = False  # a delta it cannot read: nothing is stored

    def feed(self, choice: dict) -> None:
        if choice.get("index", 0) != 0:
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if isinstance(content, str):
            self.parts.append(content)
        calls = delta.get("tool_calls")
        if calls is None:
            return
        if not isinstance(calls, list):
            self.broken = True
            return
        for c in calls:
            self._call(c)

    def _call(self, c: Any) -> None:
        index = c.get("index", 0) if isinstance(c, dict) else None
        fn = c.get("function", {}) if isinstance(c, dict) else None
        if not isinstance(index, int) or not isinstance(fn, dict):
            self.broken = True
            return
        call = self.calls.setdefault(index, {"id": None, "type": "function",
                                             "function": {"name": "", "arguments": ""}})
        for k in ("id", "type"):
            if isinstance(c.get(k), str):
                call[k] = c[k]
        for k in ("name", "arguments"):
            if isinstance(fn.get(k), str):
                call["function"][k] += fn[k]

    def message(self) -> dict | None:
        if self.broken:
            return None
        msg: dict = {"role": "assistant", "content": "".join(self.parts)}
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg
