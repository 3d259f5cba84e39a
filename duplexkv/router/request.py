"""The client's request as the router sees it: cheap validation, conversation id, tenant.

The router rejects only what it can tell without a tokenizer, with the worker's own messages
(`duplexkv.http.openai`), so a client sees the same 400 with or without the router; anything
else goes to the workers, whose 4xx are relayed as they are. Guided decoding and tool calls
(`response_format`, `structured_outputs`, `tools`, `tool_choice`) are checked for shape only and
forwarded unchanged to both legs: whether a schema compiles, and whether D parses tool calls
(tool_choice "auto"), is the workers' to say. `conversation_id` and any
`kv_transfer_params` are taken out of the body here: the router owns `kv_transfer_params`.

Before any of that the body must be strict JSON the router can pass on (issue 10): no NaN or
Infinity (nor a number that overflows to it), no integer too long to convert, at most `max_depth`
levels of nesting, and valid Unicode in every key and string (a lone surrogate escape such as
`"\\ud800"` decodes to a str that cannot be encoded again). Each is a 400 that names the field,
never the offending value.

The client's Authorization header is checked by `duplexkv.http.auth` (when the router has keys)
and never forwarded: the legs carry the router's own worker key, if any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from duplexkv.http.body import DEFAULT_MAX_JSON_DEPTH, parse_json
from duplexkv.http.errors import bad_request
from duplexkv.http.features import ROUTER
from duplexkv.http.openai import parse_request
from duplexkv.http.request_id import clean_request_id

Kind = Literal["completion", "chat"]
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
ENDPOINTS = {"completion": "completions", "chat": "chat_completions"}
ID_HEADERS = ("x-session-id", "x-conversation-id")


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: Kind
    body: dict  # without conversation_id / kv_transfer_params
    stream: bool
    model: str | None
    conversation_id: str | None
    # the router key this request authenticated with: the namespace of its conversations; None
    # when the router has no keys (one namespace shared by every client)
    api_key: str | None
    request_id: str | None  # the client's X-Request-Id, if any
    # `conversation_id: ""`: the request continues no conversation (nothing is recognised from
    # its content either: conversation/recognise.py)
    unlinked: bool = False
    # a store key the Responses API names (the conversation of a previous_response_id chain:
    # router/responses.py); only without a conversation id
    conversation_key: str | None = None
    responses_api: bool = False  # a /v1/responses request run as this chat turn

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    @property
    def endpoint(self) -> str:
        """The metrics' endpoint label."""
        return "responses" if self.responses_api else ENDPOINTS[self.kind]


def parse_client_request(raw: bytes, headers: Mapping[str, str], kind: Kind,
                         max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                         api_key: str | None = None,
                         translate: Callable[[dict], dict] | None = None) -> ClientRequest:
    """Raises APIError (400) for what a worker would reject anyway. `api_key`: the key the
    request authenticated with (`duplexkv.http.auth.api_key_of`). `translate`: another API's
    body -> the `kind` request that runs it (Anthropic's Messages -> chat, http/messages.py)."""
    body = parse_json(raw, max_depth)
    if translate is not None:
        body = translate(body)
    return client_request(body, headers, kind, api_key)


def client_request(body: dict, headers: Mapping[str, str], kind: Kind,
                   api_key: str | None = None, conversation_key: str | None = None,
                   responses_api: bool = False) -> ClientRequest:
    """`body` parsed: as parse_client_request. `conversation_key`: the store key of the
    conversation it continues, used when it names no conversation id (router/responses.py)."""
    unlinked = body.get("conversation_id") == ""
    conv = _conversation_id(body.pop("conversation_id", None), headers)
    body.pop("kv_transfer_params", None)  # never trusted from a client
    # the worker's own validation: the same 400s with or without us; tools, tool_choice,
    # response_format and structured_outputs are checked for shape and passed on as they are
    parse_request(body, kind, ROUTER)
    unlinked = unlinked and conv is None
    return ClientRequest(kind, body, body.get("stream") is True, body.get("model"), conv,
                         api_key, clean_request_id(headers.get("x-request-id")), unlinked,
                         conversation_key if conv is None and not unlinked else None,
                         responses_api)


def _conversation_id(value: Any, headers: Mapping[str, str]) -> str | None:
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise bad_request("`conversation_id` must be a string", "conversation_id")
        return str(value) or None
    for name in ID_HEADERS:
        if v := (headers.get(name) or "").strip():
            return v
    return None
