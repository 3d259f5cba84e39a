"""`duplexkv router --discovery redis://...`: the registry watcher wired to the router's pool.

The router reads the registry every `--discovery-interval` (1 s: half the workers' default 2 s
heartbeat) and hands each snapshot to `Membership`. With a discovery secret
(`DUPLEXKV_DISCOVERY_SECRET`, else `DUPLEXKV_KV_SECRET`) it accepts only records signed with it;
without one, whoever can write to the registry can add a worker (docs/security.md).
A registry that is down at start does not stop the router: it serves its static workers (if
any) and keeps polling.
"""

from __future__ import annotations

import logging

from duplexkv.discovery.record import DiscoveryURL, secret_key, secret_source
from duplexkv.discovery.watcher import Watcher
from duplexkv.router.backends import BackendPool
from duplexkv.router.config import RouterConfig
from duplexkv.router.membership import Membership
from duplexkv.router.metrics import RouterMetrics

log = logging.getLogger("duplexkv.router")


class Discovery:
    def __init__(self, url: DiscoveryURL, key: bytes | None, interval_s: float,
                 pool: BackendPool, metrics: RouterMetrics) -> None:
        self.url = url
        self.membership = Membership(pool, metrics, url.shown, key is not None, interval_s)
        self.watcher = Watcher(url, key, interval_s, self.membership.apply,
                               self.membership.failed, timeout_s=min(1.0, interval_s * 2))

    @classmethod
    def configure(cls, cfg: RouterConfig, pool: BackendPool,
                  metrics: RouterMetrics) -> Discovery | None:
        if not cfg.discovery:
            return None
        url = DiscoveryURL.parse(cfg.discovery)
        key = secret_key()
        if key is None:
            log.warning("discovery: no secret ($DUPLEXKV_DISCOVERY_SECRET or $DUPLEXKV_KV_SECRET):"
                        " every record in %s is trusted; whoever can write there can add a "
                        "worker", url)
        else:
            log.info("discovery: accepting only records signed with the key from %s",
                     secret_source())
        return cls(url, key, cfg.discovery_interval_s, pool, metrics)

    def start(self) -> None:
        self.watcher.start()

    async def stop(self) -> None:
        await self.watcher.stop()

    def describe(self) -> str:
        return f"discovery {self.url}"
