"""Responses input items -> chat messages (a request's `input`, and a stored response's output
when a later request continues it):

    message {role: user|assistant|system|developer, content: a string or
             input_text/output_text parts}       -> a chat message (parts joined by "\\n")
    function_call {call_id, name, arguments}     -> a tool call of the assistant message before
                                                    it (a new one if there is none)
    function_call_output {call_id, output}       -> a `tool` message
    reasoning {content | summary}                -> `reasoning` of the next assistant message

Any other item (item references, built-in tools' calls, images, files) is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from duplexkv.http.errors import bad_request

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def input_messages(v: Any) -> list[dict]:
    """`input` (a string or a list of items) -> chat messages."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise bad_request("`input` must be a string or a list of input items", "input")
    out: list[dict] = []
    reasoning: list[str] = []
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"`{where}` must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            msg = {"role": _role(item, where), "content": _joined(item.get("content"), f"{where}.content")}
            if msg["role"] == "assistant" and reasoning:
                msg["reasoning"], reasoning = "\n".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where),
                                 "arguments": _str(item, "arguments", where, empty=True)}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning:
                last["reasoning"], reasoning = "\n".join(reasoning), []
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": _joined(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            texts = _part_texts(item.get("content"), f"{where}.content") \
                or _part_texts(item.get("summary"), f"{where}.summary") or []
            reasoning += [t for t in texts if t]
        else:
            raise bad_request(f"`{where}.type` {kind!r:.40} is not supported by this server "
                              "(message, function_call, function_call_output and reasoning "
                              "items are)", f"{where}.type")
    return out


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"`{where}.role` must be one of {', '.join(ROLES)}, got {role!r:.40}",
                          f"{where}.role")
    return role


def _str(item: dict, key: str, where: str, empty: bool = False) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (not v and not empty):
        raise bad_request(f"`{where}.{key}` must be a non-empty string", f"{where}.{key}")
    return v


def _joined(value: Any, at: str) -> str:
    """A string, or a list of text parts joined by newlines (`at`: the field, for the 400)."""
    if isinstance(value, str):
        return value
    texts = _part_texts(value, at)
    if texts is None:
        raise bad_request(f"`{at}` must be a string or a list of text parts", at)
    return "\n".join(texts)


def _part_texts(parts: Any, where: str) -> list[str] | None:
    """The texts of a list of text parts (None: not a list); any other part is a 400."""
    if parts is None or not isinstance(parts, list):
        return None
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"`{where}[{j}]`: only text parts are supported, got {kind!r:.40}",
                              f"{where}[{j}]")
        texts.append(part["text"])
    return texts
