"""The router's side of D's retention, one HTTP call per D per period (`POST /v1/kv/retention`,
behind the worker's API key like every non-probe path):

    request  renew     retained-turn ids whose conversation is active (a turn in flight, or
                       kept alive by its client): each lease goes to now + the lease, never past
                       the TTL cap
             delete    ids of conversations that are over: released at once (no new claim; a READ
                       already claimed completes first)
             since     the last release generation the router has seen
    reply    held      renewed id -> seconds until its expiry
             unknown   renew/delete ids D does not hold (released already)
             released  ids D released after `since` (read, expired, capped, deleted, evicted)
             generation, reset (true: the log no longer reaches back to `since`)

The ids are D's `remote_request_id`s: 128 random bits after the request id, never shown to
clients (the router keeps them in its store). No address or block id comes in: an id only names
an entry in D's table, and the worst a forged call does is renew or release an entry whose id
it somehow knows. These types are shared by the worker and the router (no engine import).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

MAX_IDS = 4096
Id = Annotated[str, Meta(max_length=256)]
Ids = Annotated[list[Id], Meta(max_length=MAX_IDS)]


class SyncRequest(msgspec.Struct, forbid_unknown_fields=True):
    renew: Ids = []
    delete: Ids = []
    since: Annotated[int, Meta(ge=-1, le=1 << 62)] = -1


class SyncReply(msgspec.Struct):
    generation: int
    held: dict[str, float] = {}
    unknown: list[str] = []
    released: list[str] = []
    reset: bool = False


def decode_request(body: bytes) -> SyncRequest:
    """ValidationError/DecodeError for anything but a well-formed, bounded request."""
    return msgspec.json.decode(body, type=SyncRequest)


def decode_reply(body: bytes) -> SyncReply:
    return msgspec.json.decode(body, type=SyncReply)


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)
