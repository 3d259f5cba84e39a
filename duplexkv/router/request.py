"""The client's request as the router sees it: cheap validation, conversation id, tenant.

The router rejects only what it can tell without a tokenizer, with the worker's own messages
(`duplexkv.server.protocol`), so a client sees the same 400 with or without the router; anything
else goes to the workers, whose 4xx are relayed as they are. `conversation_id` and any
`kv_transfer_params` are taken out of the body here: the router owns `kv_transfer_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from duplexkv.server.errors import bad_request
from duplexkv.server.protocol import parse_json

Kind = Literal["completion", "chat"]
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
ENDPOINTS = {"completion": "completions", "chat": "chat_completions"}
ID_HEADERS = ("x-session-id", "x-conversation-id")
_MISSING = object()


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: Kind
    body: dict  # without conversation_id / kv_transfer_params
    stream: bool
    model: str | None
    conversation_id: str | None
    authorization: str | None  # forwarded to the workers as it is
    request_id: str | None  # the client's X-Request-Id, if any

    @property
    def api_key(self) -> str | None:
        """The bearer token: the tenant namespace of conversations."""
        return api_key(self.authorization)

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]


def parse_client_request(raw: bytes, headers: Mapping[str, str], kind: Kind) -> ClientRequest:
    """Raises APIError (400) for what a worker would reject anyway."""
    body = parse_json(raw)
    conv = _conversation_id(body.pop("conversation_id", None), headers)
    body.pop("kv_transfer_params", None)  # never trusted from a client
    _validate(body, kind)
    return ClientRequest(kind, body, body.get("stream") is True, body.get("model"), conv,
                         headers.get("authorization"), headers.get("x-request-id"))


def api_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else authorization.strip()




def _conversation_id(value: Any, headers: Mapping[str, str]) -> str | None:
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise bad_request("`conversation_id` must be a string", "conversation_id")
        return str(value) or None
    for name in ID_HEADERS:
        if v := (headers.get(name) or "").strip():
            return v
    return None


def _get(body: dict, name: str, types: tuple[type, ...], what: str) -> Any:
    """The worker's typed getter (protocol._Fields.get): same checks, same messages."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise bad_request(f"`{name}` must be {what}, got {v!r}", name)
    if not isinstance(v, types):
        raise bad_request(f"`{name}` must be {what}, got {type(v).__name__}", name)
    return v


def _validate(body: dict, kind: Kind) -> None:
    """The worker's checks, in the worker's order, that need no tokenizer or model."""
    _get(body, "model", (str,), "a string")
    n = _get(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise bad_request(f"`n` must be 1 (only one choice per request is supported), got {n}",
                          "n")
    _get(body, "max_tokens", (int,), "an integer")
    if kind == "chat":
        _get(body, "max_completion_tokens", (int,), "an integer")
    _get(body, "stream", (bool,), "a boolean")
    options = _get(body, "stream_options", (dict,), "an object") or {}
    _get(options, "include_usage", (bool,), "a boolean")
    if kind == "completion":
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("`prompt` is required", "prompt")
        if not isinstance(prompt, str) and (not isinstance(prompt, list) or not prompt):
            raise bad_request("`prompt` must be a string or a non-empty list of token ids",
                              "prompt")
        return
    messages = body.get("messages")
    if messages is None:
        raise bad_request("`messages` is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of message objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"`messages[{i}]` must be an object", f"messages[{i}]")
