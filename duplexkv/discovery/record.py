"""The registration a worker keeps in Redis, its key, its signature, and the discovery URL.

    key     duplexkv:workers:<id>       id: 32 hex digits, random per worker process
    index   duplexkv:workers:index      sorted set: id -> the record's expiry (ms, worker clock);
                                        what routers read instead of scanning the keyspace (a
                                        Redis shared with 100k conversations stays one read)
    value   JSON (msgspec): v, id, role, url, model, capacity, heartbeat_s, seq, issued_at, sig
    TTL     TTL_HEARTBEATS (3) heartbeats: the key outlives two missed heartbeats, then Redis
            drops it (a worker killed without deregistering)

Signature. With a discovery secret (`DUPLEXKV_DISCOVERY_SECRET`, else the KV cluster secret
`DUPLEXKV_KV_SECRET`; never from the command line), `sig` is HMAC-SHA256 under a key derived from
it (label "duplexkv-discovery-v1", distinct from every KV-plane key) over the record's canonical
JSON without `sig`. A router with a secret accepts only records it can verify, whose `id` is the
one in the key, and whose `issued_at` is not older than the TTL plus MAX_CLOCK_SKEW_S: whoever can
write to Redis can then neither add a worker nor change a worker's URL, only replay a genuine
record for a short while. Without a secret Redis is trusted as the conversation store is.

The Redis URL may hold a password (`redis://:password@host:6379/0`): only `redact(url)` is ever
logged or shown.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import msgspec

VERSION = 1
KEY_PREFIX = "duplexkv:workers:"
INDEX_KEY = KEY_PREFIX + "index"
INDEX_FORGET_S = 600.0  # index entries whose record expired this long ago are pruned
DISCOVERY_ENV = "DUPLEXKV_DISCOVERY"  # the URL, when not given on the command line
SECRET_ENV = "DUPLEXKV_DISCOVERY_SECRET"
KV_SECRET_ENV = "DUPLEXKV_KV_SECRET"  # the KV plane's cluster secret (duplexkv/kv/auth.py)
MIN_SECRET_BYTES = 16
TTL_HEARTBEATS = 3  # the key's TTL in heartbeats
STALE_HEARTBEATS = 2  # a router drops a record whose seq has not moved for this many heartbeats
MAX_CLOCK_SKEW_S = 30.0  # between a signing worker's clock and a router's
MAX_RECORD_BYTES = 4096
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.1, 60.0
ROLES = ("prefill", "decode", "both")
_ID = re.compile(r"[0-9a-f]{32}")
_SCHEMES = ("redis", "rediss", "unix")

Role = Literal["prefill", "decode", "both"]


class RegistrationError(ValueError):
    """A record the router does not accept; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Capacity(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    max_num_seqs: int  # the engine's batch bound
    kv_blocks: int  # KV pool blocks
    block_size: int
    max_model_len: int


class Registration(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    id: str
    role: Role
    url: str  # the worker's advertised HTTP base URL
    model: str  # served model name
    capacity: Capacity
    heartbeat_s: float
    seq: int  # +1 every heartbeat: a router sees a live worker's record change
    issued_at: float  # the worker's wall clock (seconds since the epoch)
    v: int = VERSION
    sig: str = ""

    def key(self, prefix: str = KEY_PREFIX) -> str:
        return prefix + self.id

    def ttl_ms(self) -> int:
        return int(self.heartbeat_s * TTL_HEARTBEATS * 1000)

    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.role == "both" else (self.role,)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Registration)


def new_worker_id() -> str:
    return secrets.token_hex(16)


def _payload(reg: Registration) -> bytes:
    return _encoder.encode(msgspec.structs.replace(reg, sig=""))


def encode(reg: Registration, key: bytes | None) -> bytes:
    """The value to store: signed when there is a key."""
    if key is not None:
        reg = msgspec.structs.replace(reg, sig=hmac.new(key, _payload(reg), "sha256").hexdigest())
    return _encoder.encode(reg)


def decode(raw: bytes, redis_key: str, key: bytes | None, now: float,
           prefix: str = KEY_PREFIX) -> Registration:
    """A stored value -> a checked Registration, or RegistrationError naming why not."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RegistrationError("malformed", f"{len(raw)} bytes")
    try:
        reg = _decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise RegistrationError("malformed", str(e)[:200]) from None
    if reg.v != VERSION:
        raise RegistrationError("malformed", f"version {reg.v}")
    if not _ID.fullmatch(reg.id) or redis_key != prefix + reg.id:
        raise RegistrationError("malformed", "the id is not the key's")
    if not MIN_HEARTBEAT_S <= reg.heartbeat_s <= MAX_HEARTBEAT_S or reg.seq < 0:
        raise RegistrationError("malformed", "heartbeat or seq out of range")
    if key is not None:
        want = hmac.new(key, _payload(reg), "sha256").hexdigest()
        if not reg.sig or not hmac.compare_digest(want, reg.sig):
            raise RegistrationError("unsigned" if not reg.sig else "bad_signature",
                                    "the router's discovery secret does not verify it")
        if reg.issued_at < now - reg.heartbeat_s * TTL_HEARTBEATS - MAX_CLOCK_SKEW_S:
            raise RegistrationError("too_old", "issued before its TTL (a replay?)")
    try:
        url = check_worker_url(reg.url)
    except ValueError as e:
        raise RegistrationError("malformed", str(e)) from None
    if not reg.model or len(reg.model) > 256:
        raise RegistrationError("malformed", "model name")
    return msgspec.structs.replace(reg, url=url)


def check_worker_url(url: str) -> str:
    """An http(s)://host:port base URL without credentials, path, query or fragment; returned
    without a trailing slash."""
    parts = urlsplit(url.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    if parts.username or parts.password or parts.path or parts.query or parts.fragment:
        raise ValueError(f"a worker URL is scheme://host:port only: {url!r}")
    if parts.port is None:
        raise ValueError(f"a worker URL needs its port: {url!r}")
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("", "0.0.0.0", "::")


# --- the discovery URL and the secret ---
@dataclass(frozen=True, slots=True)
class DiscoveryURL:
    """A redis://, rediss:// or unix:// URL; `shown` is the only form logged or displayed."""

    url: str = field(repr=False)
    shown: str

    @classmethod
    def parse(cls, text: str, what: str = "--discovery") -> DiscoveryURL:
        text = text.strip()
        parts = urlsplit(text)
        if parts.scheme not in _SCHEMES or not (parts.hostname or parts.path):
            raise ValueError(f"{what} must be a redis://[:password@]host:port/db URL "
                             f"(or rediss://, unix://), got {redact(text)!r}")
        return cls(text, redact(text))

    def __str__(self) -> str:
        return self.shown


def redact(url: str) -> str:
    """The URL with any user name and password replaced by `***` (and the query dropped: it can
    carry `password=`)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return "<unparseable URL>"


def discovery_url(flag: str | None) -> DiscoveryURL | None:
    """None (no --discovery) -> None; `--discovery URL` -> URL; a bare `--discovery` (the flag's
    const "") -> $DUPLEXKV_DISCOVERY, which keeps a password off the command line."""
    if flag is None:
        return None
    if flag:
        return DiscoveryURL.parse(flag, "--discovery")
    text = os.environ.get(DISCOVERY_ENV, "").strip()
    if not text:
        raise ValueError(f"--discovery without a URL reads ${DISCOVERY_ENV}, which is not set")
    return DiscoveryURL.parse(text, f"${DISCOVERY_ENV}")


def secret_key() -> bytes | None:
    """The signing key derived from $DUPLEXKV_DISCOVERY_SECRET, else $DUPLEXKV_KV_SECRET, else
    None (records are neither signed nor checked)."""
    for env in (SECRET_ENV, KV_SECRET_ENV):
        value = os.environ.get(env, "")
        if value:
            raw = value.encode()
            if len(raw) < MIN_SECRET_BYTES:
                raise ValueError(f"${env} must be at least {MIN_SECRET_BYTES} bytes")
            prk = hmac.new(b"duplexkv-discovery-v1", raw, hashlib.sha256).digest()
            return hmac.new(prk, b"registration\x01", hashlib.sha256).digest()
    return None


def secret_source() -> str | None:
    """Which variable the key comes from (for logs; never its value)."""
    return next((f"${e}" for e in (SECRET_ENV, KV_SECRET_ENV) if os.environ.get(e)), None)
