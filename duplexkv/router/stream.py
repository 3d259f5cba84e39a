"""D's SSE stream -> the client, one event at a time (no batching: each event is sent as soon as
its terminating blank line arrives).

Every event is scanned for `kv_transfer_params` (the last non-null one is kept: vLLM puts it on
the finish chunk, others on a trailing chunk) and the key is removed; D's `kv_stats` is replaced
by the combined one, which is also added to the finish chunk when D sent none (and, from a D
without kv_stats, to its `include_usage` chunk, with D's usage as the decode stats). Events that
carry neither pass through as bytes, unparsed.

With `on_choice` every event is parsed and its choice 0 handed to it (the answer's text, for a
conversation recognised from its content: conversation/answer.py).

With `tokens` (a D that is not ours, router/verify.py) or `collect` (a stream the router may
continue on another D, turn/migrate.py) the stream's `prompt_token_ids` (vLLM's first chunk) and
choice 0's `token_ids` are collected, and removed unless the client asked for them; `head` keeps
the first chunk's id, object, created and model (a continuation's chunks carry them).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from duplexkv.router.legs import TurnStats, dumps, usage_stats
from duplexkv.router.verify import MAX_TOKENS_KEPT, held_sequence, token_list

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_USAGE = re.compile(rb'"usage":\s*\{')
_TOKEN_IDS = b'token_ids"'
DONE = b"data: [DONE]"


class StreamRelay:
    def __init__(self, stats: TurnStats, arrival: float,
                 clock: Callable[[], float] = time.perf_counter, tokens: bool = False,
                 strip_tokens: bool = True, collect: bool = False,
                 on_choice: Callable[[dict], None] | None = None) -> None:
        self.stats = stats
        self.arrival = arrival
        self.clock = clock
        self.params: dict | None = None
        self.first_token_at: float | None = None
        self.stats_sent = False
        self.done = False
        self.error = False  # D sent an error event
        self._buf = b""
        self.tokens, self.strip_tokens = tokens, strip_tokens
        self.collecting = tokens or collect
        self.head: dict = {}
        self._prompt_ids: list[int] | None = None
        self._output_ids: list[int] | None = [] if self.collecting else None
        self.on_choice = on_choice  # every event's choice 0 (conversation/answer.py)

    @property
    def prompt_ids(self) -> list[int] | None:
        return self._prompt_ids

    @property
    def output_ids(self) -> list[int] | None:
        """Choice 0's tokens so far (None: not collected, or not in full)."""
        return self._output_ids

    def drop_partial(self) -> None:
        """Forget an event D left unfinished (its stream broke)."""
        self._buf = b""

    def held(self, params: dict | None) -> list[int] | None:
        """D's sequence whose KV it holds (None unless collected in full)."""
        if not self.tokens:
            return None
        return held_sequence(self._prompt_ids, self._output_ids, params)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Bytes from D -> the complete events to send now (each with its blank line)."""
        self._buf += chunk
        out = []
        while m := _EVENT_END.search(self._buf):
            event, self._buf = self._buf[:m.start()], self._buf[m.end():]
            if event.strip():
                out.append(self._rewrite(event) + b"\n\n")
        return out

    def flush(self) -> list[bytes]:
        """What is left when D closes without a final blank line."""
        event, self._buf = self._buf, b""
        return [self._rewrite(event) + b"\n\n"] if event.strip() else []

    def _rewrite(self, event: bytes) -> bytes:
        if event.startswith(DONE):
            self.done = True
            return event
        if event.startswith(b'data: {"error"'):
            self.error = True
            return event
        needs_parse = (self.first_token_at is None or self.on_choice is not None
                       or b'"kv_' in event
                       or (b'"finish_reason"' in event and b'"finish_reason":null' not in event)
                       or (self.collecting and _TOKEN_IDS in event)
                       or (self.stats.decode_source != "kv_stats"
                           and _USAGE.search(event) is not None))
        if not needs_parse:
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data:"):
                lines[i] = self._rewrite_data(line[5:].strip())
        return b"\n".join(lines)

    def _rewrite_data(self, payload: bytes) -> bytes:
        try:
            obj = json.loads(payload)
        except ValueError:
            return b"data: " + payload
        if not isinstance(obj, dict):
            return b"data: " + payload
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        if self.on_choice is not None and first:
            self.on_choice(first)
        if self.first_token_at is None and _has_token(first):
            self.first_token_at = self.clock()
            self.stats.first_token_ms = round((self.first_token_at - self.arrival) * 1e3, 3)
        changed = self._collect(obj, choices) if self.collecting else False
        stats = self.stats
        if "kv_transfer_params" in obj:
            params = obj.pop("kv_transfer_params")
            if isinstance(params, dict) and params:
                self.params = params
            changed = True
        if self.params is not None or first.get("finish_reason") is not None:
            stats.retained = self.params is not None
        if "kv_stats" in obj:
            if isinstance(obj["kv_stats"], dict):
                stats.decode, stats.decode_source = obj["kv_stats"], "kv_stats"
            obj["kv_stats"] = stats.as_dict()
            self.stats_sent = changed = True
        elif stats.decode_source != "kv_stats" and isinstance(obj.get("usage"), dict):
            # a worker without kv_stats (vLLM): its usage; the include_usage chunk (after the
            # finish chunk) repeats the combined kv_stats with it
            stats.decode, stats.decode_source = usage_stats(obj["usage"]), "usage"
            if self.stats_sent or first.get("finish_reason") is not None or not choices:
                obj["kv_stats"] = stats.as_dict()
                self.stats_sent = changed = True
        elif first.get("finish_reason") is not None and not self.stats_sent:
            obj["kv_stats"] = stats.as_dict()
            self.stats_sent = changed = True
        return b"data: " + (dumps(obj) if changed else payload)

    def _collect(self, obj: dict, choices: list) -> bool:
        """Take the chunk's token ids (choice 0 only: the D leg learns with n=1); -> whether
        the chunk was changed (ids removed)."""
        prompt = obj.get("prompt_token_ids")
        if prompt is not None and self._prompt_ids is None:
            self._prompt_ids = token_list(prompt)
        changed = False
        if self.strip_tokens and "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
            changed = True
        for c in choices:
            if not isinstance(c, dict) or "token_ids" not in c:
                continue
            ids = c["token_ids"]
            if c.get("index", 0) == 0 and self._output_ids is not None:
                new = token_list(ids)
                if new is None or len(self._output_ids) + len(new) > MAX_TOKENS_KEPT:
                    self._output_ids = None  # not collected in full: nothing is stored
                else:
                    self._output_ids.extend(new)
            if self.strip_tokens:
                del c["token_ids"]
                changed = True
        return changed


def _has_token(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                    or delta.get("tool_calls")):
        return True
    return bool(choice.get("text")) or choice.get("finish_reason") is not None


