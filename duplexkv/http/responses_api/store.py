"""Stored responses: what `previous_response_id` continues, `GET /v1/responses/{id}` returns and
`GET /v1/responses/{id}/input_items` lists.

A stored response keeps the Response object, the whole chat history it ended (the chain's
messages, without its instructions, plus its own output as an assistant message), so a request
naming it sends that history + its own input, and the items it was generated from
(input_items.py). With router keys, responses are namespaced by the
API key that made them: the store key is a digest of (key, response id), so another key's id is
simply not found. Entries expire after `ttl_s` and the store keeps at most `max_entries` and
`max_bytes` of them (oldest first out); a response larger than `max_entry_bytes` is not stored.

`conversation_key` is where the router keeps the conversation's KV entry (its turn's store key):
a request naming this response continues that conversation (router/responses.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_TTL_S = 450.0  # the router's --conversation-ttl
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_MAX_ENTRY_BYTES = 16 << 20


def response_key(api_key: str | None, response_id: str) -> str:
    h = hashlib.sha256(b"duplexkv-response-v1\x00")
    h.update((api_key or "").encode())
    h.update(b"\x00")
    h.update(response_id.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:40]


class StoreSkipped(Exception):
    """The call was not made: the store is known to be failing (the router's breaker)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # the Response object
    history: list[dict]  # the chat messages it ended, its output included
    conversation_key: str | None = None  # the router's conversation entry for the next turn
    # the items it was generated from (input_items.py: the chain's inputs and outputs, then its
    # own input); None for an entry stored before they were kept
    items: list[dict] | None = None

    def dumps(self) -> str:
        return json.dumps({"response": self.response, "history": self.history,
                           "conversation_key": self.conversation_key, "items": self.items},
                          ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | bytes) -> StoredResponse:
        d = json.loads(raw)
        return cls(d["response"], d["history"], d.get("conversation_key"), d.get("items"))

    def chain_items(self) -> list[dict]:
        """What a response continuing this one was generated from before its own input: these
        items, then this response's output (without the items an older entry did not keep)."""
        return [*(self.items or []), *self.response.get("output", [])]


class ResponseStore(ABC):
    """Contract: `get` never returns an entry older than `ttl_s` nor one another API key
    stored; `put` returns False when the entry is larger than `max_entry_bytes` (not stored);
    `delete` says whether there was one."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self.max_bytes, self.max_entry_bytes = max_bytes, min(max_entry_bytes, max_bytes)

    @abstractmethod
    async def get(self, api_key: str | None, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    async def put(self, api_key: str | None, entry: StoredResponse) -> bool: ...

    @abstractmethod
    async def delete(self, api_key: str | None, response_id: str) -> bool: ...

    def held_here(self) -> int:
        return 0

    async def close(self) -> None:
        pass


class MemoryResponseStore(ResponseStore):
    """One process: an OrderedDict in put order (one TTL for all: put order = expiry order)."""

    def __init__(self, *args, clock=time.monotonic, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str, int]] = OrderedDict()
        self.bytes = 0

    async def get(self, api_key: str | None, response_id: str) -> StoredResponse | None:
        item = self._entries.get(response_key(api_key, response_id))
        if item is None or item[0] <= self._clock():
            return None
        return StoredResponse.loads(item[1])

    async def put(self, api_key: str | None, entry: StoredResponse) -> bool:
        raw = entry.dumps()
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > self.max_entry_bytes:
            return False
        key, now = response_key(api_key, entry.response["id"]), self._clock()
        self._drop(key)
        self._entries[key] = (now + self.ttl_s, raw, size)
        self.bytes += size
        while self._entries:
            k, (deadline, _, _) = next(iter(self._entries.items()))
            if deadline > now and len(self._entries) <= self.max_entries \
                    and self.bytes <= self.max_bytes:
                break
            self._drop(k)
        return True

    async def delete(self, api_key: str | None, response_id: str) -> bool:
        key = response_key(api_key, response_id)
        item = self._entries.get(key)
        self._drop(key)
        return item is not None and item[0] > self._clock()

    def _drop(self, key: str) -> None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.bytes -= item[2]

    def held_here(self) -> int:
        return len(self._entries)
