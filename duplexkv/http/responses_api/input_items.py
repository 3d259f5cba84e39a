"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from, a page at
a time, in OpenAI's list shape (`openai.types.responses.ResponseItemList`):

    {"object": "list", "data": [items], "first_id", "last_id", "has_more"}

The items are the whole context the model saw, instructions aside (OpenAI does not list them
either): for a response that continued a chain (`previous_response_id`), the chain's inputs and
outputs first, in order, then the request's own input. A request's input is listed as OpenAI
normalises it (`listed`): a string is one user message with an `input_text` part, a message's
content a list of parts (`input_text`, or the assistant's `output_text`), every item has its
`type`, an `id` and (but reasoning) a `status`. A client's own item ids are kept; one that an
earlier item of the list already has (an agent that sends a previous answer's items back) gets a
new id, so every id names one item and pages by `after` / `before` stay well defined. A response
stored before items were kept (Redis across an upgrade) lists none, and one continuing it lists
that response's output, then its own input.

Query: `limit` 1-100 (20), `order` `desc` (the default, newest first) or `asc`, `after` (the page
after that item) / `before` (the page just before it), each an item id of this list (any other is
a 400 naming it), `include` accepted and ignored (no item here has the extra fields it asks
for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from duplexkv.http.errors import bad_request
from duplexkv.http.responses_api.output import new_id, output_text

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
ORDERS = ("desc", "asc")
# the fields each listed item keeps (its type's, as OpenAI's item objects have them)
FIELDS = {"message": ("id", "type", "role", "content", "status"),
          "function_call": ("id", "type", "call_id", "name", "arguments", "status"),
          "function_call_output": ("id", "type", "call_id", "output", "status"),
          "reasoning": ("id", "type", "summary", "content", "encrypted_content", "status")}
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}


def listed(value: Any) -> list[dict]:
    """A request's `input` (already checked by items.input_messages) -> its listed items."""
    if isinstance(value, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    out = []
    for item in value:
        kind = item.get("type", "message")
        it = {k: item[k] for k in FIELDS[kind] if item.get(k) is not None}
        it["type"] = kind
        if not isinstance(it.get("id"), str) or not it["id"]:
            it["id"] = new_id(ID_PREFIX[kind])
        if kind == "message":
            it["content"] = _parts(it["role"], it.get("content"))
        if kind == "reasoning":
            it.setdefault("summary", [])
        else:
            it.setdefault("status", "completed")
        out.append(it)
    return out


def _parts(role: str, content: Any) -> list[dict]:
    """A message's content (a string or text parts, checked) -> the parts its item lists: the
    assistant's as output_text (a refusal as it is), everyone else's as input_text."""
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    if role != "assistant":
        return [{"type": "input_text", "text": p.get("text", p.get("refusal", ""))}
                for p in parts]
    return [{"type": "refusal", "refusal": p["refusal"]} if p.get("type") == "refusal"
            else output_text(p["text"]) for p in parts]


def chained(*lists: list[dict]) -> list[dict]:
    """The lists one after the other, each id kept once: a repeated one is replaced by a new
    id (copies of those items; the others are shared)."""
    seen: set[str] = set()
    out = []
    for items in lists:
        for it in items:
            if it.get("id") in seen:
                it = {**it, "id": new_id(ID_PREFIX.get(it.get("type"), "item"))}
            seen.add(it["id"])
            out.append(it)
    return out


@dataclass(frozen=True, slots=True)
class ItemsQuery:
    limit: int = DEFAULT_LIMIT
    order: str = "desc"
    after: str | None = None
    before: str | None = None


def parse_query(params: Mapping[str, str]) -> ItemsQuery:
    """The query string -> an ItemsQuery, or a 400 naming the parameter."""
    raw = params.get("limit")
    limit = DEFAULT_LIMIT
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIMIT:
            raise bad_request(f"`limit` must be an integer from 1 to {MAX_LIMIT}, got "
                              f"{raw!r:.40}", "limit")
    order = params.get("order", "desc")
    if order not in ORDERS:
        raise bad_request(f"`order` must be \"desc\" or \"asc\", got {order!r:.40}", "order")
    return ItemsQuery(limit, order, params.get("after") or None, params.get("before") or None)


def page(items: list[dict], q: ItemsQuery) -> dict:
    """One page of `items` (in context order) for the query."""
    ordered = items if q.order == "asc" else items[::-1]
    index = {it["id"]: i for i, it in enumerate(ordered)}
    start, end = 0, len(ordered)
    for name, cursor in (("after", q.after), ("before", q.before)):
        if cursor is None:
            continue
        if cursor not in index:
            raise bad_request(f"`{name}`: this response lists no item {cursor!r:.80}", name)
        if name == "after":
            start = index[cursor] + 1
        else:
            end = index[cursor]
    window = ordered[start:end] if start < end else []
    # `before` alone: the page just before the cursor; else the page from the start (`after`)
    data = window[-q.limit:] if q.before is not None and q.after is None else window[:q.limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(window) > len(data)}
