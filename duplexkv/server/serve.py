"""`duplexkv serve MODEL --port N ...`: one OpenAI-compatible worker (flag names follow vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import fields

from duplexkv.engine.config import EngineConfig
from duplexkv.engine.dtype import DTYPE_CHOICES
from duplexkv.engine.process_env import apply_worker_env
from duplexkv.flags import Accumulate
from duplexkv.http.connections import add_connection_args, limits_from, raise_open_files
from duplexkv.server.chat_flags import add_chat_parsing_args, chat_parsing
from duplexkv.server.discovery import DiscoverySpec, add_discovery_args, run_registration

log = logging.getLogger("duplexkv.serve")
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run an OpenAI-compatible worker",
                              description="Serve MODEL over the OpenAI API (vLLM-compatible).")
    p.add_argument("model", help="a model directory, a preset name (tiny, bench) or a Hugging "
                                 "Face repo id already in the local HF cache (never downloaded)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", nargs="+", action=Accumulate,
                   default=None, metavar="NAME",
                   help="the model's name(s) in the API; requests may use any, responses carry "
                        "the first (default: MODEL as given, as vLLM)")
    p.add_argument("--revision", default=None,
                   help="for a hub id: the branch, tag or commit in the cache (default main)")
    p.add_argument("--tokenizer", default=None, metavar="DIR_OR_ID",
                   help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--tokenizer-revision", default=None)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a jinja chat template file, or the template itself (default: the "
                        "tokenizer's)")
    p.add_argument("--generation-config", default=_DEFAULTS["generation_config"],
                   metavar="auto|vllm|DIR",
                   help="sampling defaults for requests that omit them: 'auto' (default) reads "
                        "the model's generation_config.json, 'vllm' ignores it, or a directory "
                        "holding one")
    p.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"])
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=_DEFAULTS["dtype"],
                   help="auto (default): bfloat16 where it is faster than float32 (AMX, Arm "
                        "bf16), else float32; half = float16, float = float32")
    p.add_argument("--max-model-len", type=int, default=None)
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--num-kv-blocks", type=int, default=None)
    mem.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                     default=_DEFAULTS["kv_cache_memory_gib"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS["enable_prefix_caching"])
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_DEFAULTS["max_num_batched_tokens"])
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"])
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"])
    p.add_argument("--kv-transfer-config", type=_json_object, default=None, metavar="JSON",
                   help='e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'')
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="largest request body accepted (413 above it; default: 32 bytes per "
                        "token of max-model-len + 4 MiB)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every endpoint but /health, "
                        "/metrics and /version; repeat for several keys (default: the "
                        "comma-separated keys in $DUPLEXKV_API_KEY, else none)")
    p.add_argument("--cost-calibration-s", type=float, default=2.0, metavar="S",
                   help="time budget of the prefill cost model's start-up calibration (the KV "
                        "pull decision); 0 skips it (the model then learns from real prefills)")
    add_connection_args(p)
    add_chat_parsing_args(p)
    add_discovery_args(p)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run_serve)
    return p


def served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name, else the model argument as given (vLLM's default)."""
    names = tuple(dict.fromkeys(args.served_model_name or (args.model,)))
    for n in names:
        if not n.strip() or len(n) > 256:
            raise ValueError(f"--served-model-name {n!r}: a name must be 1-256 characters")
    return names


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        seed=args.seed, revision=args.revision, tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision, chat_template=args.chat_template,
        generation_config=args.generation_config)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; bad settings raise ValueError (one CLI error line)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # before anything imports torch (OpenMP and oneDNN read them when they load)
    set_env = apply_worker_env()
    if set_env:
        log.info("environment defaults set (a variable set by the user wins; an empty one keeps "
                 "the library's default): %s", " ".join(f"{k}={v}" for k, v in set_env.items()))
    config = engine_config(args)
    names = served_names(args)
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1024")
    from duplexkv.http.auth import keys_from

    api_keys = keys_from(args.api_key)
    parsing = chat_parsing(args)
    discovery = DiscoverySpec.from_args(args)
    limits = limits_from(args, raise_open_files())
    # heavy imports only once the arguments are known to be good
    from duplexkv.engine.async_engine import AsyncEngine
    from duplexkv.engine.llm_engine import LLMEngine
    from duplexkv.http.uvicorn_server import bounded_server
    from duplexkv.server.app import build_app
    from duplexkv.server.kv_hook import attach_kv_transfer

    engine = LLMEngine(config)
    if args.cost_calibration_s > 0:
        engine.calibrate(args.cost_calibration_s)
    aeng = AsyncEngine(engine)
    aeng.start()
    try:
        kv_health, collectors, add_kv_routes = attach_kv_transfer(aeng, args.kv_transfer_config,
                                                                args)
        registration: dict = {}  # the registrar, once the server listens

        def health_extra() -> dict:
            out = kv_health() if kv_health is not None else {}
            if "registrar" in registration:
                out["discovery"] = registration["registrar"].health()
            return out

        app = build_app(aeng, names, health_extra, collectors, args.max_request_bytes, api_keys,
                        parsing)
        add_kv_routes(app)
        server = bounded_server(app, args.host, args.port, limits, lifespan="off")
        keys = f"; {len(api_keys)} API key(s) required" if api_keys else ""
        join = None if discovery is None else (
            lambda host, port: registration.setdefault(
                "registrar", discovery.registrar(engine.capacity(), names[0], host, port)))
        what = f"{' | '.join(names)} ({engine.model_dir}, {engine.config.dtype}{keys})"
        asyncio.run(_serve(server, what, aeng, join))
        if aeng.dead:
            log.error("exiting because the engine died: %s", aeng.dead)
            return 1
        return 0 if server.started else 1
    finally:
        aeng.shutdown()
        log.info("engine stopped")


async def _serve(server, what: str, aeng, join=None) -> None:
    """`join(host, port)` -> a Registrar to run while the server listens (--discovery)."""
    loop = asyncio.get_running_loop()

    def stop(reason: str) -> None:  # the engine died: answer in-flight clients, then exit 1
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    aeng.on_dead = stop
    if aeng.dead:
        server.should_exit = True
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        log.info("serving %s on http://%s:%d", what, host, port)
        if join is not None:
            registration = asyncio.create_task(run_registration(join(host, port), server))
            try:
                await task
            finally:
                server.should_exit = True  # also when the server ended by itself
                await registration
            return
    await task
