"""Side-channel messages, typed and bounded (msgspec over msgpack).

Every message a peer sends is decoded into one of these structs before anything acts on it: a
missing key, a wrong type, a non-finite or out-of-range number or an oversized list is a
`msgspec.ValidationError`, never a value that reaches engine state. The wire format is plain
msgpack: requests are arrays whose first element names the call, replies are maps.

    reader (REQ)                                    holder (ROUTER)
    ["meta"]                                   ->   MetaReply
    ["verify", req_id, [hash...], [token...], seed_tag]  ->   VerifyReply
    ["hb", [req_id...]]                        ->   HeartbeatReply
    (any request the holder cannot serve)      ->   ErrorReply
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

MAX_MESSAGE_BYTES = 64 << 20  # a verify of ~8M tokens; anything larger is dropped by ZMQ
MAX_TOKENS = 1 << 23
MAX_ID_CHARS = 256
_CLOCK = Annotated[float, Meta(ge=-1e12, le=1e12)]  # finite: NaN and inf fail the bounds
Name = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Count = Annotated[int, Meta(ge=0, le=1 << 31)]


class Meta_(msgspec.Struct, array_like=True, tag="meta", tag_field="kind"):
    """Ask for the holder's handshake."""


class Verify(msgspec.Struct, array_like=True, tag="verify", tag_field="kind"):
    """Which leading tokens of the reader's prompt the holder has (and claim them)."""
    request_id: Name
    hashes: Annotated[list[Annotated[bytes, Meta(max_length=64)]],
                      Meta(max_length=MAX_TOKENS // 16)]
    tokens: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 31)]], Meta(max_length=MAX_TOKENS)]
    # the tag of the reader's request's cache_salt (b"": none): must equal the entry's
    seed_tag: Annotated[bytes, Meta(max_length=32)] = b""


class Heartbeat(msgspec.Struct, array_like=True, tag="hb", tag_field="kind"):
    """Renew the leases of the entries a reader is reading."""
    request_ids: Annotated[list[Name], Meta(max_length=1024)]


Request = Union[Meta_, Verify, Heartbeat]


class MetaReply(msgspec.Struct, forbid_unknown_fields=False):
    engine_id: Name
    compat_hash: Annotated[str, Meta(max_length=128)]
    transport: Literal["nixl", "tcp"]
    transport_metadata: Annotated[bytes, Meta(max_length=1 << 20)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    num_blocks: Count
    block_bytes: Annotated[int, Meta(ge=1, le=1 << 34)]
    clock: _CLOCK


class VerifyReply(msgspec.Struct):
    matched: Count
    expiry: _CLOCK
    reason: Annotated[str, Meta(max_length=32)] = ""
    # the claim's capability: the READ must carry it (docs/protocol.md, sections 2 and 3)
    token: Annotated[bytes, Meta(max_length=16)] = b""
    # what the transport needs to READ exactly the claim's blocks (NIXL: partial agent
    # metadata for the claim's registration; TCP: empty)
    grant: Annotated[bytes, Meta(max_length=1 << 20)] = b""


class HeartbeatReply(msgspec.Struct):
    known: Count


class ErrorReply(msgspec.Struct):
    error: Annotated[str, Meta(max_length=4096)]


_request_decoder = msgspec.msgpack.Decoder(Request)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: object) -> bytes:
    return _encoder.encode(msg)


def decode_request(body: bytes) -> Request:
    """A holder's view of an incoming request; ValidationError/DecodeError if malformed."""
    return _request_decoder.decode(body)


def decode_reply(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """A reader's view of a reply: `kind`, or ErrorReply when the holder refused."""
    raw = msgspec.msgpack.decode(body)
    if isinstance(raw, dict) and "error" in raw:
        return msgspec.convert(raw, ErrorReply)
    return msgspec.convert(raw, kind)
