"""Router configuration (frozen; built once from the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from duplexkv.router.placement import PlacementConfig

DEFAULT_CONVERSATION_TTL_S = 450.0  # vLLM's sample proxy: below D's decoder_kv_blocks_ttl (480 s)


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port` (no trailing slash)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) worker URL: {url!r}")
    return url


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    store: str = "memory"  # or redis://host:port/db
    # a stored entry must die before D frees the blocks (decoder_kv_blocks_ttl, 480 s by default)
    conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S
    max_conversations: int = 100_000
    health_interval_s: float = 2.0
    health_timeout_s: float = 10.0  # a busy worker answers /health between engine steps
    unhealthy_after: int = 2  # consecutive failed checks (a refused connection counts at once)
    # keep a conversation on its D unless that D has this many more requests in flight than the
    # least loaded one
    affinity_slack: int = 4
    # a P that does not verify tokens (vLLM) is handed D's KV only when the verified prefix is
    # at least this long (vLLM's own kv_recompute_threshold default; router/verify.py)
    kv_recompute_threshold: int = 64
    # a vLLM worker that comes up first opens a NIXL channel with each partner (warmup.py); a
    # turn waits at most this long for it while no worker of a role is warm (0: no warm-up)
    warmup_timeout_s: float = 60.0
    rewrite_remote_host: bool = True  # only when a holder reports an empty/loopback host
    upstream_http: str = "fast"  # "fast" (router.transport) or "httpcore" (httpx's default)
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    # client input bounds (issue 10): larger is a 413 / 431 / 400 in OpenAI's error shape
    max_request_bytes: int = 4 << 20
    max_header_bytes: int = 32 << 10  # all header names and values together
    max_json_depth: int = 64
    # the conversation store (Redis): per-call socket timeouts, then a circuit breaker that skips
    # the store (turns run as misses) for this long after a failure before one call probes it
    store_timeout_s: float = 0.5
    store_breaker_period_s: float = 5.0
    # conversation lifecycle (conversation/lifecycle.py): how often D's leases of active
    # conversations are renewed (and its release notices fetched), and a keepalive's default length
    lease_renew_period_s: float = 10.0
    keepalive_s: float = 60.0
    # API keys (never in a repr or a log): the clients' (none: the router is open and conversation
    # ids are shared by every client), and the one the router sends to the workers (none: no
    # Authorization header on the legs, never the client's)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    worker_api_key: str | None = field(default=None, repr=False)
    # with client keys, tenants share the workers' prefix cache (router/tenants.py)
    share_kv_cache: bool = False
    # worker discovery (duplexkv/discovery): the registry's redis:// URL (it may hold a password:
    # never in a repr or a log, only its redacted form) and how often the router reads it
    discovery: str | None = field(default=None, repr=False)
    discovery_interval_s: float = 1.0
    # a chat request without a conversation id continues the conversation its messages extend
    # (conversation/recognise.py)
    recognise: bool = True
    # where each turn's prefill runs (router/placement.py)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def worker_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else {}

    def __post_init__(self) -> None:
        if not self.discovery and (not self.prefill or not self.decode):
            raise ValueError("the router needs at least one --prefill and one --decode worker, "
                             "or --discovery redis://host:port/db to learn them from a registry")
        if self.discovery_interval_s <= 0:
            raise ValueError("--discovery-interval must be > 0")
        object.__setattr__(self, "prefill", tuple(normalize_url(u) for u in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_url(u) for u in self.decode))
        if self.conversation_ttl_s <= 0:
            raise ValueError("--conversation-ttl must be > 0")
        if self.max_conversations < 1:
            raise ValueError("--max-conversations must be >= 1")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health check interval and timeout must be > 0")
        if self.unhealthy_after < 1 or self.affinity_slack < 0:
            raise ValueError("--unhealthy-after must be >= 1 and --affinity-slack >= 0")
        if self.upstream_http not in ("fast", "httpcore"):
            raise ValueError("--upstream-http must be 'fast' or 'httpcore'")
        if self.max_request_bytes < 1024 or self.max_header_bytes < 1024:
            raise ValueError("--max-request-bytes and --max-header-bytes must be >= 1024")
        if self.max_json_depth < 2:
            raise ValueError("--max-json-depth must be >= 2")
        if self.kv_recompute_threshold < 0:
            raise ValueError("--kv-recompute-threshold must be >= 0")
        if not 0 <= self.warmup_timeout_s <= 3600:
            raise ValueError("--warmup-timeout must be in [0, 3600] seconds (0: no warm-up)")
        if self.lease_renew_period_s <= 0 or not 0 < self.keepalive_s <= self.conversation_ttl_s:
            raise ValueError("--lease-renew-period must be > 0 and --keepalive-seconds in "
                             "(0, --conversation-ttl]")
        if self.store_timeout_s <= 0 or self.store_breaker_period_s <= 0:
            raise ValueError("--store-timeout and --store-breaker-period must be > 0")
        if not (self.store == "memory" or self.store.startswith(("redis://", "rediss://",
                                                                   "unix://"))):
            raise ValueError(f"--store must be 'memory' or a redis:// URL, got {self.store!r}")
