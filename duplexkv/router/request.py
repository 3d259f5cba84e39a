"""The client's request as the router sees it: cheap validation, conversation id, tenant.

The router rejects only what it can tell without a tokenizer, with the worker's own messages
(`duplexkv.server.protocol`), so a client sees the same 400 with or without the router; anything
else goes to the workers, whose 4xx are relayed as they are. `conversation_id` and any
`kv_transfer_params` are taken out of the body here: the router owns `kv_transfer_params`.

Before any of that the body must be strict JSON the router can pass on (issue 10): no NaN or
Infinity (nor a number that overflows to it), no integer too long to convert, at most `max_depth`
levels of nesting, and valid Unicode in every key and string (a lone surrogate escape such as
`"\\ud800"` decodes to a str that cannot be encoded again). Each is a 400 that names the field,
never the offending value. The Authorization header, forwarded to the workers, must be ASCII.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from duplexkv.server.errors import APIError, bad_request
from duplexkv.server.request_id import clean_request_id

Kind = Literal["completion", "chat"]
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
ENDPOINTS = {"completion": "completions", "chat": "chat_completions"}
ID_HEADERS = ("x-session-id", "x-conversation-id")
_MISSING = object()
DEFAULT_MAX_JSON_DEPTH = 64


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


def parse_client_request(raw: bytes, headers: Mapping[str, str], kind: Kind,
                         max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ClientRequest:
    """Raises APIError (400) for what a worker would reject anyway."""
    authorization = headers.get("authorization")
    if authorization is not None and not (authorization.isascii()
                                          and authorization.isprintable()):
        raise bad_request("The Authorization header must be printable ASCII.")
    body = parse_json(raw, max_depth)
    conv = _conversation_id(body.pop("conversation_id", None), headers)
    body.pop("kv_transfer_params", None)  # never trusted from a client
    _validate(body, kind)
    return ClientRequest(kind, body, body.get("stream") is True, body.get("model"), conv,
                         authorization, clean_request_id(headers.get("x-request-id")))


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def headers_too_large(limit: int) -> APIError:
    return APIError(431, f"The request headers are larger than the limit of {limit} bytes.",
                    code="request_header_fields_too_large")


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict:
    """A JSON object the router can re-encode and forward, or a 400 (the worker's messages for
    what the worker rejects too)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:  # deeper than the interpreter's stack allows
        raise _too_deep(max_depth, None) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    _check_tree(body, max_depth)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e999: valid JSON syntax, but no double holds it
        raise ValueError(f"the number {text[:40]} is out of range")
    return v


def _too_deep(max_depth: int, param: str | None) -> APIError:
    return bad_request(f"The request body is nested too deeply (more than {max_depth} levels).",
                       param)


def _bad_unicode(param: str | None) -> APIError:
    where = f" in `{param}`" if param else " in a key"
    return bad_request(f"The request body contains invalid Unicode (a lone surrogate){where}.",
                       param)


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


_SCALARS = frozenset((int, float, bool, type(None)))


def _check_tree(body: dict, max_depth: int) -> None:
    """Depth and Unicode of every value, without recursion; `param` paths are built only for
    containers and for the one bad string (token id lists stay cheap)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth, path.split(".")[0].split("[")[0] or None)
        if isinstance(node, dict):
            for k, v in node.items():
                if not _encodable(k):
                    raise _bad_unicode(path or None)
                if isinstance(v, str):
                    if not _encodable(v):
                        raise _bad_unicode(f"{path}.{k}" if path else k)
                elif isinstance(v, (dict, list)):
                    stack.append((v, depth + 1, f"{path}.{k}" if path else k))
        elif not _SCALARS.issuperset(map(type, node)):  # token ids: one pass in C
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if not _encodable(v):
                        raise _bad_unicode(f"{path}[{i}]")
                elif isinstance(v, (dict, list)):
                    stack.append((v, depth + 1, f"{path}[{i}]"))


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
