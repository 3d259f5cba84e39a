"""`duplexkv up`: a router and N prefill + N decode workers on localhost, until Ctrl-C or SIGTERM.

Workers take free ports; the router takes --port (default 8000, or a free port when 8000 is
taken). Every process logs to its own file. A process that fails to start (or dies later) stops
the whole cluster and its log's last lines are printed. The router requires a client key:
--api-key (or $DUPLEXKV_API_KEY), else the one `up` keeps in a file only you can read
(launch/client_key.py: `export DUPLEXKV_API_KEY=$(cat ~/.cache/duplexkv/api-key)`);
--no-api-key opens it to every local user. The workers always require one of their own that only
the router holds (--worker-api-key, or a random one) and share a KV cluster secret
($DUPLEXKV_KV_SECRET, or a random one): on a shared host no other local user reaches the
router, a worker or the KV plane.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from duplexkv.engine.dtype import DTYPE_CHOICES
from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.http.auth import API_KEY_ENV, WORKER_API_KEY_ENV, keys_from
from duplexkv.kv.config import CONNECTORS
from duplexkv.launch import Cluster, ClusterSpec, LaunchError
from duplexkv.launch.client_key import KeyFileError, key_file, own_client_key
from duplexkv.router.placement import DEFAULT_MODE, MODES
from duplexkv.router.serve import worker_key

DEFAULT_PORT = 8000


class Shutdown(Exception):
    """SIGTERM (or SIGINT) arrived."""


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench",
                   help="model directory or preset (default: bench, made on first use)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="workers' dtype (default: auto, bfloat16 where the CPU computes it "
                        "natively, else float32)")
    p.add_argument("--kv-connector", choices=sorted(CONNECTORS), default="TcpConnector",
                   help="P<->D KV transport (default: TcpConnector, needs nothing extra)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the workers and the router log (default: a new temp dir)")
    p.add_argument("--kv-recompute-threshold", type=int, default=None, metavar="TOKENS",
                   help="pull when the verified gain reaches this many tokens (default: unset, "
                        "P decides by its measured cost model)")
    p.add_argument("--placement", choices=MODES, default=DEFAULT_MODE,
                   help="the router's turn placement: auto (default: a turn may prefill its "
                        "suffix on its own D) or prefill (every turn through P, pulling from D)")


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a router + prefill + decode workers on localhost",
                       description=__doc__.splitlines()[0])
    add_cluster_args(p)
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="N", help="decode workers")
    p.add_argument("--port", type=int, default=None,
                   help=f"router port (default {DEFAULT_PORT}, or a free one if it is taken)")
    p.add_argument("--host", default="127.0.0.1", help="router host")
    p.add_argument("--store", default="memory", metavar="URL",
                   help="conversation store: memory (default) or redis://host:port/db")
    p.add_argument("--no-bidirectional", dest="bidirectional", action="store_false",
                   help="plain P->D disaggregation: no D->P reuse of a conversation's history")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"the router's client key, repeatable (default: ${API_KEY_ENV}, "
                        "comma-separated; else the key `up` keeps in "
                        "~/.cache/duplexkv/api-key, made on first use, mode 0600)")
    p.add_argument("--no-api-key", action="store_true",
                   help="require no client key: any local user (any host, with --host "
                        "0.0.0.0) can use the router")
    p.add_argument("--worker-api-key", default=None, metavar="KEY",
                   help=f"the workers' key, sent by the router (default: ${WORKER_API_KEY_ENV}; "
                        "else a random one)")
    p.set_defaults(run=run_up)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def threshold_kv(threshold: int | None) -> dict:
    if threshold is not None and threshold < 0:
        raise ValueError("--kv-recompute-threshold must be >= 0")
    return {} if threshold is None else {"kv_recompute_threshold": threshold}


def spec_from_args(args: argparse.Namespace, **overrides) -> ClusterSpec:
    extra = ("--dtype", args.dtype) if args.dtype else ()
    kw = dict(model=args.model, connector=args.kv_connector, worker_args=extra,
              log_dir=args.log_dir, router_args=("--placement", args.placement),
              kv_extra=threshold_kv(args.kv_recompute_threshold))
    return ClusterSpec(**{**kw, **overrides})


@contextlib.contextmanager
def signals_as_shutdown() -> Iterator[None]:
    """SIGTERM and SIGINT raise Shutdown in the main thread while inside the block."""
    def handler(signum, _frame):
        raise Shutdown(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stop_quietly(cluster: Cluster) -> None:
    """Stop the cluster; further Ctrl-C / SIGTERM are ignored meanwhile (stragglers get SIGKILL
    after a timeout, so this always ends)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.stop(timeout_s=15)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def auth_headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def served_model(url: str, key: str | None = None) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=10,
                         headers=auth_headers(key)).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "default"


def examples(url: str, model: str, keyed: bool = False) -> str:
    """Copy-paste examples; with keys they read the key from $DUPLEXKV_API_KEY (never printed)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello! What can you do?"}],
            "max_tokens": 32}
    auth = f"-H \"Authorization: Bearer ${API_KEY_ENV}\" " if keyed else ""
    curl = (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' {auth}"
            f"-H 'X-Session-ID: my-conversation' \\\n  -d {shlex.quote(json.dumps(body))}")
    key = f'os.environ["{API_KEY_ENV}"]' if keyed else '"none"'
    py = (('import os\n' if keyed else '') +
          f'from openai import OpenAI\n'
          f'client = OpenAI(base_url="{url}/v1", api_key={key})\n'
          f'r = client.chat.completions.create(\n'
          f'    model="{model}", max_tokens=32,\n'
          f'    messages=[{{"role": "user", "content": "Hello! What can you do?"}}],\n'
          f'    extra_body={{"conversation_id": "my-conversation"}})  # turn N+1 reuses turn N\n'
          f'print(r.choices[0].message.content)')
    indented = "\n".join("  " + line for line in py.split("\n"))
    return f"curl:\n  {curl}\n\nopenai (Python):\n{indented}"


def run_up(args: argparse.Namespace) -> int:
    port = args.port
    if port is None:
        port = DEFAULT_PORT if port_free(args.host, DEFAULT_PORT) else 0
    keys = keys_from(args.api_key)
    key_note = ""
    if args.no_api_key:
        if keys:
            print("duplexkv: error: --no-api-key with --api-key (or $DUPLEXKV_API_KEY): "
                  "choose one", file=sys.stderr)
            return 2
        key_note = "no API key: every local user can use the router (--no-api-key)"
    elif not keys:
        try:
            keys = (own_client_key(),)
        except KeyFileError as e:
            print(f"duplexkv: error: {e}", file=sys.stderr)
            return 2
        key_note = (f"API key required: the one in {key_file()} (only you can read it): "
                    f"export {API_KEY_ENV}=$(cat {key_file()})")
    spec = spec_from_args(args, prefill=args.prefill, decode=args.decode, host=args.host,
                          port=port, store=args.store, bidirectional=args.bidirectional,
                          api_keys=keys, worker_api_key=worker_key(args.worker_api_key))
    cluster = Cluster(spec, on_event=lambda msg: print(msg, flush=True))
    print(f"starting {spec.prefill} prefill + {spec.decode} decode worker(s) of {spec.model} "
          f"({describe_dtype(args.dtype)}) and a router; logs in {cluster.log_dir}", flush=True)
    t0 = time.monotonic()
    try:
        with signals_as_shutdown():
            cluster.start()
            model = served_model(cluster.url, keys[0] if keys else None)
            print(f"\nduplexkv is up in {time.monotonic() - t0:.0f}s: router {cluster.url}  "
                  f"(model {model!r}, bidirectional KV "
                  f"{'on' if spec.bidirectional else 'off'}"
                  f"{f', {len(keys)} API key(s) required' if keys else ''})")
            for w in cluster.workers:
                print(f"  {w.name:10s} {w.url}  pid {w.proc.pid}")
            print(f"  {'router':10s} {cluster.url}  pid {cluster.router.proc.pid}")
            if key_note:
                print(f"\n{key_note}")
            print(f"\n{examples(cluster.url, model, bool(keys))}\n\nPress Ctrl-C to stop.",
                  flush=True)
            while (dead := cluster.dead()) is None:
                time.sleep(0.5)
            print(f"duplexkv: error: {dead.name} exited with code {dead.proc.returncode}; "
                  f"last lines of {dead.log}:\n{dead.tail()}", file=sys.stderr, flush=True)
            return 1
    except Shutdown as e:
        print(f"\n{e}: stopping the cluster ...", flush=True)
        return 0
    except LaunchError as e:
        print(f"duplexkv: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_quietly(cluster)
        print("stopped (router and workers exited)", flush=True)
