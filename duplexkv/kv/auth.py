"""The KV plane's cluster secret and what is derived from it (docs/protocol.md, section 6).

One secret per cluster, shared by every worker: from the environment (`DUPLEXKV_KV_SECRET`) or
from a file named in `kv_connector_extra_config.auth_secret_file`, never from the command line.
It is never logged and never part of a repr. From it, with HMAC-SHA256 under distinct labels
(an HKDF-expand step):

    params key      `kv_signature` over the holder-issued fields of `kv_transfer_params`
    hello key       the TCP transport's HELLO challenge-response (both directions)
    CURVE keypairs  the side channel's server and client keys (ZMQ CURVE + a ZAP handler)

Without a secret the KV plane is loopback only: the side channel and the transport refuse a
non-loopback bind address, and readers pull nothing: params cannot be authenticated, and a
local process naming a holder of its own would feed D forged KV (its prefix cache then serves
it to everyone). `insecure_kv` (kv_connector_extra_config) restores the loopback-only trust of
unsigned params, for a single-user machine.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85

from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.kv.config import KVConfigError

ENV = "DUPLEXKV_KV_SECRET"
SIGNATURE_KEY = "kv_signature"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
NO_SECRET_FIX = (f"set {ENV} (the same value on every worker) or "
                 "kv_connector_extra_config.auth_secret_file")


class KVAuthError(KVConfigError):
    pass


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _derive(secret: bytes, label: str) -> bytes:
    prk = hmac.new(b"duplexkv-kv-auth-v1", secret, hashlib.sha256).digest()  # HKDF-extract
    return hmac.new(prk, label.encode() + b"\x01", hashlib.sha256).digest()  # HKDF-expand


@dataclass(frozen=True)
class KVAuth:
    """Keys derived from the cluster secret; `KVAuth(None)` is the loopback-only mode."""

    secret: bytes | None = field(default=None, repr=False)
    insecure: bool = False  # without a secret: trust unsigned params naming loopback holders
    params_key: bytes = field(init=False, repr=False)
    hello_key: bytes = field(init=False, repr=False)
    _curve: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s = self.secret
        # without a secret the HELLO still runs (one code path) under a public key: it then
        # authenticates nothing, which is why the transport is loopback only
        base = s if s is not None else b"duplexkv-no-secret"
        object.__setattr__(self, "params_key", _derive(base, "params"))
        object.__setattr__(self, "hello_key", _derive(base, "tcp-hello"))
        curve = {}
        if s is not None:
            for role in ("server", "client"):
                sk = zmq.utils.z85.encode(_derive(s, f"curve-{role}"))
                curve[role] = (zmq.curve_public(sk), sk)
        object.__setattr__(self, "_curve", curve)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    # kv_transfer_params -------------------------------------------------------------------
    def sign(self, fields: list) -> str:
        body = json.dumps(fields, separators=(",", ":")).encode()
        return hmac.new(self.params_key, body, hashlib.sha256).hexdigest()

    def verify(self, fields: list, signature: object) -> bool:
        if not isinstance(signature, str) or len(signature) != 64:
            return False
        return hmac.compare_digest(self.sign(fields), signature)

    def sign_params(self, p: KVTransferParams) -> str:
        return self.sign(signed_fields(p))

    def params_trusted(self, p: KVTransferParams) -> tuple[bool, str]:
        """May a reader connect where these params point? (before any connection is opened)"""
        if not self.enabled:
            if not self.insecure:
                return False, ("no cluster secret: unsigned params are not trusted (" +
                               NO_SECRET_FIX + "; or insecure_kv: true on a single-user host)")
            if not is_loopback(p.remote_host):
                return False, (f"params name host {p.remote_host!r}; without a cluster secret "
                               "only loopback holders are trusted")
            return True, ""
        if not self.verify(signed_fields(p), p.extra.get(SIGNATURE_KEY)):
            return False, ("params carry no valid kv_signature" if SIGNATURE_KEY in p.extra
                           else "params are not signed")
        return True, ""

    # ZMQ CURVE ----------------------------------------------------------------------------
    def curve_keys(self, role: str) -> tuple[bytes, bytes]:
        """(public, secret) Z85 keypair of `role` ("server" or "client")."""
        return self._curve[role]

    # TCP HELLO ----------------------------------------------------------------------------
    def hello_mac(self, direction: bytes, *parts: bytes) -> bytes:
        msg = direction + b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        return hmac.new(self.hello_key, msg, hashlib.sha256).digest()


def signed_fields(p: KVTransferParams) -> list:
    """What a holder vouches for: everything a reader acts on (where to connect, which entry
    and blocks, how many tokens, P's first token). Not the do_remote_* booleans: routers set
    those when they replay params."""
    return [p.remote_engine_id, p.remote_request_id, list(p.remote_block_ids),
            p.remote_num_tokens, p.remote_blocks_expiry_time, p.remote_host, p.remote_port,
            p.first_token_id]


def load(secret_file: str = "", insecure: bool = False) -> KVAuth:
    """The cluster secret: $DUPLEXKV_KV_SECRET, else the file, else none (loopback only; no
    pull unless `insecure`)."""
    raw: bytes | None = None
    env = os.environ.get(ENV)
    if env:
        raw = env.encode()
    elif secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1).strip()
        except OSError as e:
            raise KVAuthError(f"kv_connector_extra_config.auth_secret_file: cannot read "
                              f"{secret_file!r}: {e.strerror}") from None
    if raw is None:
        return KVAuth(None, insecure)
    if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        raise KVAuthError(f"the KV secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} "
                          f"bytes (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return KVAuth(raw)


def check_bind(auth: KVAuth, what: str, host: str) -> None:
    """Without a secret only loopback addresses may be bound (KVAuthError names the fix)."""
    if not auth.enabled and not is_loopback(host):
        raise KVAuthError(f"{what} {host!r} is not a loopback address, and the KV plane has no "
                          f"cluster secret: anyone who can reach it could read cached prompts. "
                          f"To listen beyond this machine, {NO_SECRET_FIX}.")
