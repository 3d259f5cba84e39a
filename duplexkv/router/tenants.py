"""Tenants of one router: a prefix-cache salt per client API key (vLLM's `cache_salt`).

With client keys, every leg of a request carries `cache_salt` = HMAC(router secret, SHA-256 of
the key that authenticated it), so the workers' prefix caches, D's retained turns and the pulls
between them (engine/block_manager.py `salted`, kv/retention.py) never mix two keys' KV: no
`kv_stats` count, no reuse and no verify tells one tenant about another's prompts, and params
read from the conversation store cannot make a worker read another key's blocks (the reader's
salt comes from the key the router authenticated, not from the params). A client's own
`cache_salt` partitions further inside its key. The key itself never leaves the router; the
secret is $DUPLEXKV_ROUTER_SECRET (set it to keep reuse across router restarts with a Redis
store), else a random one per process. `--share-kv-cache` turns salting off (tenants then share
the prefix cache; a client's own salt still passes through), as does running without keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

from duplexkv.http.auth import ROUTER_SECRET_ENV

SALT_FIELD = "cache_salt"
log = logging.getLogger(__name__)


class Salter:
    def __init__(self, secret: bytes | None = None, share: bool = False) -> None:
        self._key = hashlib.sha256(b"duplexkv-tenant-salt\x00" + (
            secret if secret else secrets.token_bytes(32))).digest()
        self.share = share

    def __repr__(self) -> str:
        return f"Salter(share={self.share})"

    @classmethod
    def from_env(cls, share: bool = False, shared_store: bool = False) -> Salter:
        """`shared_store`: keyed salts with a store that outlives this process (Redis)."""
        raw = os.environ.get(ROUTER_SECRET_ENV, "").strip()
        if not raw and shared_store and not share:
            log.warning("no $%s: the per-key cache salts are random for this router process, so "
                        "stored conversations reuse nothing after a restart or through another "
                        "router (set the same secret on every router of the store)",
                        ROUTER_SECRET_ENV)
        return cls(raw.encode() if raw else None, share)

    def salt(self, api_key: str, client_salt: str | None = None) -> str:
        """The key's salt (and the client's own salt inside it)."""
        tenant = hmac.new(self._key, hashlib.sha256(api_key.encode()).digest(),
                          hashlib.sha256).hexdigest()[:32]
        if not client_salt:
            return tenant
        return hmac.new(self._key, f"{tenant}\x00{client_salt}".encode(),
                        hashlib.sha256).hexdigest()[:32]

    def apply(self, body: dict, api_key: str | None) -> None:
        """Set the leg body's `cache_salt` for the key that authenticated the request."""
        if api_key is None or self.share:
            return  # one namespace (no keys) or shared by choice: the client's salt as sent
        client = body.get(SALT_FIELD)
        body[SALT_FIELD] = self.salt(api_key, client if isinstance(client, str) else None)
