"""API keys, as vLLM's `--api-key`: shared by the worker and the router.

With keys configured, every request needs `Authorization: Bearer <one of the keys>`, except
`/health`, `/metrics` and `/version` (open, as in vLLM, for probes and scrapers). vLLM's keys guard
only the `/v1/...` paths; ours guard every other path too (`/tokenize`, `/detokenize`, `/debug/...`,
unknown paths): they cost the server work or show its state, and vLLM's own security guide warns
that its keys leave such endpoints open. Anything else, unknown
paths included, gets a 401 in OpenAI's error shape (`invalid_api_key`, as OpenAI answers) with
`WWW-Authenticate: Bearer`. The key is read from `Authorization: Bearer` (what OpenAI's clients send
and vLLM reads); on Anthropic's `/v1/messages` paths also, when that header is absent, from
`x-api-key` (what the anthropic SDK sends; its `anthropic-version` header is accepted and
ignored), and their 401 is in Anthropic's error shape (`authentication_error`), which the SDK
reads.

The presented token is hashed (SHA-256) and compared with every key's digest by
`hmac.compare_digest`, all keys each time, so the time taken says nothing about how much of a key
matched or which key it was. The key that matched is put in the request's scope (`api_key_of`):
the router namespaces conversations by it. No key is ever logged or put in an answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from duplexkv.http.errors import APIError
from duplexkv.wire.messages_answer import error_body

API_KEY_ENV = "DUPLEXKV_API_KEY"  # a worker's or a router's client keys
WORKER_API_KEY_ENV = "DUPLEXKV_WORKER_API_KEY"  # the key a router sends to its workers
ROUTER_SECRET_ENV = "DUPLEXKV_ROUTER_SECRET"  # the router's tenant salts (router/tenants.py)
OPEN_PATHS = frozenset(("/health", "/metrics", "/version"))
MESSAGES_PATHS = ("/v1/messages",)  # Anthropic's API: its error shape
_SCOPE_KEY = "duplexkv.api_key"


def invalid_api_key(missing: bool) -> APIError:
    message = ("You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
               if missing else "Incorrect API key provided.")
    return APIError(401, message)


def check_key(key: str, what: str = "--api-key") -> str:
    """A key as it can travel in an Authorization header; the error never shows the key."""
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{what}: a key must be non-empty printable ASCII without spaces")
    return key


def keys_from(flags: Iterable[str] | None, env_name: str = API_KEY_ENV,
              what: str = "--api-key") -> tuple[str, ...]:
    """The keys given on the command line (repeatable), else the environment variable's
    (comma-separated); surrounding spaces are dropped, duplicates kept once."""
    given = list(flags or ())
    raw = given if given else (os.environ.get(env_name) or "").split(",")
    what = what if given else f"${env_name}"
    keys = [k.strip() for k in raw]
    if given and not all(keys):
        raise ValueError(f"{what}: a key must be non-empty printable ASCII without spaces")
    return tuple(dict.fromkeys(check_key(k, what) for k in keys if k))


def bearer(key: str) -> str:
    return f"Bearer {key}"


def api_key_of(scope: Scope) -> str | None:
    """The key this request authenticated with; None when the app has no keys."""
    return scope.get(_SCOPE_KEY)


class APIKeyAuth:
    """ASGI middleware: a 401 in OpenAI's shape unless the request carries one of `keys` (or its
    path is open). With no keys it passes everything through."""

    def __init__(self, app: ASGIApp, keys: Iterable[str] = (),
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.open_paths = app, open_paths
        self._keys = tuple(keys)
        self._digests = tuple(_digest(k) for k in self._keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._digests or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        anthropic = scope["path"].startswith(MESSAGES_PATHS)
        token = _bearer_token(scope, anthropic)
        key = None if token is None else self._match(token)
        if key is None:
            err = invalid_api_key(token is None)
            answer = err.response({"WWW-Authenticate": "Bearer"})
            if anthropic:
                answer = JSONResponse(error_body(401, err.message), 401,
                                      {"WWW-Authenticate": "Bearer"})
            await answer(scope, receive, send)
            return
        scope[_SCOPE_KEY] = key
        await self.app(scope, receive, send)

    def _match(self, token: bytes) -> str | None:
        presented, found = _digest(token), -1
        for i, d in enumerate(self._digests):  # every key, every time
            if hmac.compare_digest(presented, d):
                found = i
        return self._keys[found] if found >= 0 else None


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _bearer_token(scope: Scope, x_api_key: bool = False) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header, as sent; without that
    header and with `x_api_key`, the first `x-api-key`'s; None if none."""
    api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
        if x_api_key and name == b"x-api-key" and api_key is None:
            api_key = value.strip() or None
    return api_key
