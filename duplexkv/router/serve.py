"""`duplexkv router --prefill URL... --decode URL... --port N [--store URL] [--discovery URL]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from duplexkv.discovery.record import DISCOVERY_ENV, discovery_url
from duplexkv.flags import Accumulate
from duplexkv.http.connections import add_connection_args, limits_from, raise_open_files
from duplexkv.http.auth import API_KEY_ENV, WORKER_API_KEY_ENV, check_key, keys_from
from duplexkv.router.config import DEFAULT_CONVERSATION_TTL_S, RouterConfig
from duplexkv.router.placement import DEFAULT_MODE, MODES, PlacementConfig

log = logging.getLogger("duplexkv.router")


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="run the KV-cache-aware P/D router",
        description="Route OpenAI requests through prefill and decode workers, keeping each "
                    "conversation's KV on its decode worker for the next turn.")
    p.add_argument("--prefill", nargs="+", action=Accumulate, default=[], metavar="URL",
                   help="prefill worker base URLs, e.g. http://127.0.0.1:8100 (static; optional "
                        "with --discovery)")
    p.add_argument("--decode", nargs="+", action=Accumulate, default=[], metavar="URL",
                   help="decode worker base URLs (static; optional with --discovery)")
    p.add_argument("--discovery", nargs="?", const="", default=None, metavar="URL",
                   help="also learn workers from the registry at redis://[:password@]host:port/db "
                        "(workers started with the same --discovery join and leave without a "
                        f"restart; without URL: ${DISCOVERY_ENV}, which keeps a password off the "
                        "command line)")
    p.add_argument("--discovery-interval", type=float, default=1.0, metavar="S",
                   help="how often the registry is read (default 1 s: half the workers' default "
                        "heartbeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--store", default="memory", metavar="URL",
                   help="conversation store: 'memory' (default, this process only) or "
                        "redis://host:port/db (shared by every router using it)")
    p.add_argument("--conversation-ttl", type=float, default=DEFAULT_CONVERSATION_TTL_S,
                   metavar="S", help="forget a conversation's KV after S seconds; keep it below "
                                     "the decode workers' decoder_kv_blocks_ttl (default 480) "
                                     "minus a margin")
    p.add_argument("--max-conversations", type=int, default=100_000)
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S")
    p.add_argument("--health-timeout", type=float, default=10.0, metavar="S")
    p.add_argument("--affinity-slack", type=int, default=4,
                   help="keep a conversation on its decode worker unless it has this many more "
                        "requests in flight than the least loaded one")
    p.add_argument("--kv-recompute-threshold", type=int, default=64, metavar="TOKENS",
                   help="hand a vLLM prefill worker (which does not compare tokens) D's KV only "
                        "for a verified common prefix of at least this many tokens (default 64, "
                        "vLLM's own default; keep it at or above the workers' setting)")
    p.add_argument("--warmup-timeout", type=float, default=60.0, metavar="S",
                   help="open each vLLM prefill<->decode pair's NIXL channel with one tiny "
                        "exchange before the pair takes turns, so no first turn outlives P's "
                        "KV lease; a turn waits at most this long for it (0: no warm-up)")
    p.add_argument("--rewrite-remote-host", action=argparse.BooleanOptionalAction, default=True,
                   help="replace an empty/loopback remote_host in kv_transfer_params by the "
                        "worker's URL host (only when that host is not loopback)")
    p.add_argument("--upstream-http", choices=("fast", "httpcore"), default="fast",
                   help="HTTP/1.1 client transport to the workers: the router's lean asyncio "
                        "one (default) or httpx's stock httpcore")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="give up connecting to a worker after S seconds and try another (a "
                        "partitioned host answers nothing; default 5)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="N",
                   help="larger request bodies get a 413 (default 4 MiB)")
    p.add_argument("--max-header-bytes", type=int, default=32 << 10, metavar="N",
                   help="larger request headers (all together) get a 431 (default 32 KiB)")
    p.add_argument("--max-json-depth", type=int, default=64, metavar="N",
                   help="request bodies nested deeper get a 400 (default 64)")
    p.add_argument("--store-timeout", type=float, default=0.5, metavar="S",
                   help="connect and read timeout of each conversation store call (default 0.5)")
    p.add_argument("--store-breaker-period", type=float, default=5.0, metavar="S",
                   help="after a store failure, serve turns as misses without calling the store "
                        "for S seconds, then let one call probe it (default 5)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` from clients on every endpoint but "
                        "/health, /metrics and /version, and namespace conversations by the "
                        f"key; repeat for several keys (default: the comma-separated keys in "
                        f"${API_KEY_ENV}, else none: open, and conversation ids shared by all "
                        "clients)")
    p.add_argument("--worker-api-key", default=None, metavar="KEY",
                   help="the key the router sends to the workers (`Authorization: Bearer KEY` on "
                        f"every leg and /v1/models; default ${WORKER_API_KEY_ENV}, else none: "
                        "no Authorization header, never the client's)")
    p.add_argument("--share-kv-cache", action="store_true",
                   help="with --api-key: let every key's requests reuse every other key's cached "
                        "KV (default: a per-key cache_salt on every leg, docs/security.md)")
    p.add_argument("--lease-renew-period", type=float, default=10.0, metavar="S",
                   help="every S seconds, renew D's leases on the turns of active conversations "
                        "and fetch D's release notices; keep it well under D's "
                        "decoder_kv_lease_duration (default 10; D's lease defaults to 60)")
    p.add_argument("--keepalive-seconds", type=float, default=60.0, metavar="S",
                   help="how long POST /v1/conversations/{id}/keepalive keeps a conversation "
                        "active when its body names no `seconds` (default 60)")
    p.add_argument("--no-recognise", dest="recognise", action="store_false",
                   help="do not recognise a conversation from its messages: a chat request "
                        "without a conversation id runs as plain P/D")
    p.add_argument("--placement", choices=MODES, default=DEFAULT_MODE,
                   help="where a conversation's turn is prefilled: 'auto' (default: chosen per "
                        "turn, on the conversation's own D when it holds the history, the suffix "
                        "is small and D is not busy, else on a P worker pulling the history from "
                        "D) or 'prefill' (always on a P worker)")
    p.add_argument("--decode-local-max-tokens", type=int, default=4096, metavar="N",
                   help="with --placement auto: largest estimated new suffix D prefills itself")
    p.add_argument("--decode-local-max-outstanding", type=int, default=4, metavar="N",
                   help="with --placement auto: D takes a turn's prefill only while it has fewer "
                        "requests than this in flight")
    add_connection_args(p)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run_router)
    return p


def router_config(args: argparse.Namespace) -> RouterConfig:
    discovery = discovery_url(args.discovery)
    return RouterConfig(
        prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
        store=args.store, conversation_ttl_s=args.conversation_ttl,
        max_conversations=args.max_conversations, health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout, affinity_slack=args.affinity_slack,
        kv_recompute_threshold=args.kv_recompute_threshold,
        warmup_timeout_s=args.warmup_timeout,
        rewrite_remote_host=args.rewrite_remote_host, upstream_http=args.upstream_http,
        request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
        max_request_bytes=args.max_request_bytes,
        max_header_bytes=args.max_header_bytes, max_json_depth=args.max_json_depth,
        store_timeout_s=args.store_timeout, store_breaker_period_s=args.store_breaker_period,
        lease_renew_period_s=args.lease_renew_period, keepalive_s=args.keepalive_seconds,
        api_keys=keys_from(args.api_key), worker_api_key=worker_key(args.worker_api_key),
        share_kv_cache=args.share_kv_cache,
        discovery=discovery.url if discovery is not None else None,
        discovery_interval_s=args.discovery_interval, recognise=args.recognise,
        placement=PlacementConfig(args.placement, args.decode_local_max_tokens,
                                  args.decode_local_max_outstanding))


def worker_key(flag: str | None) -> str | None:
    """--worker-api-key, else $DUPLEXKV_WORKER_API_KEY, else None (no key on the legs)."""
    key = flag if flag is not None else os.environ.get(WORKER_API_KEY_ENV, "").strip() or None
    return None if key is None else check_key(key.strip(), "--worker-api-key")


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; bad settings raise ValueError (one CLI error line)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call otherwise
    cfg = router_config(args)
    # each client request holds an upstream connection to a worker: two descriptors
    limits = limits_from(args, raise_open_files(), per_connection=2)
    from duplexkv.http.uvicorn_server import bounded_server
    from duplexkv.router.app import build_app

    app = build_app(cfg)
    # the app answers headers over cfg.max_header_bytes with a 431 in OpenAI's shape; h11 refuses
    # (400) only what is far beyond that
    server = bounded_server(app, cfg.host, cfg.port, limits, lifespan="on",
                            h11_max_incomplete_event_size=max(64 << 10, 2 * cfg.max_header_bytes))
    asyncio.run(_serve(server, app))
    return 0 if server.started else 1


async def _serve(server, app) -> None:
    store = app.state.store
    try:
        await store.size()  # a configured Redis must answer at start
    except Exception as e:  # noqa: BLE001 - any client error: one CLI error line
        await store.close()
        raise ValueError(f"the conversation store {store.location()} is not reachable: {e}") \
            from None
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        pool = app.state.pool
        found = app.state.discovery
        log.info("router listening on http://%s:%d (prefill %s; decode %s; store %s; %s%s)", host,
                 port, " ".join(b.url for b in pool.prefill) or "-",
                 " ".join(b.url for b in pool.decode) or "-", app.state.store.location(),
                 app.state.auth_summary, f"; {found.describe()}" if found else "")
    await task
