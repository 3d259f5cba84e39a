"""The one place where `serve` attaches KV transfer to an engine."""

from __future__ import annotations

import argparse
import atexit
import logging
from collections.abc import Callable

from fastapi import FastAPI

from duplexkv.engine.async_engine import AsyncEngine
from duplexkv.kv.config import KVTransferConfig

log = logging.getLogger("duplexkv.serve")


def attach_kv_transfer(aeng: AsyncEngine, kv_config: dict | None, args: argparse.Namespace
                       ) -> tuple[Callable[[], dict] | None, tuple, Callable[[FastAPI], None]]:
    """Wire the KV connector into `aeng` per `--kv-transfer-config`. Returns the function whose
    dict is merged into /health, the Prometheus collectors to add and the function that adds
    the connector's routes to the app (None, (), a no-op without a config). Bad settings raise
    ValueError."""
    cfg = KVTransferConfig.parse(kv_config)
    if cfg is None:
        return None, (), lambda app: None
    from duplexkv.kv.connector import KVConnector  # imports the transport libraries
    from duplexkv.kv.metrics import KVCollector

    from duplexkv.kv.addresses import is_loopback

    if not is_loopback(args.host) and is_loopback(cfg.side_channel_host):
        log.warning("HTTP listens on %s but the KV plane advertises %s: only workers on this "
                    "host can exchange KV with this one (every cross-host pull would recompute). "
                    "For P/D across hosts set VLLM_NIXL_SIDE_CHANNEL_HOST to this host's address "
                    "(and DUPLEXKV_KV_SECRET on every worker)", args.host, cfg.side_channel_host)
    connector = KVConnector(cfg, aeng.engine)
    aeng.engine.attach_connector(connector)
    atexit.register(connector.close)
    from duplexkv.server import retention_route

    return ((lambda: {"kv_transfer": connector.health()}), (KVCollector(connector),),
            lambda app: retention_route.add_route(app, aeng, connector))
