"""Where the benchmark sends its requests: a given router/worker URL (checked first), or a
cluster and a single worker it launches itself, one after the other.

The API key, if any, comes from $DUPLEXKV_API_KEY only (its first key), never from a flag: the
command line is recorded in results.json. The client sends it; launched targets require it."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator

import httpx

from duplexkv.engine.dtype import cpu_bf16_status
from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.http.auth import API_KEY_ENV, WORKER_API_KEY_ENV, keys_from
from duplexkv.launch import Cluster, ClusterSpec, spawn, stop_all, wait_ready, worker_args
from duplexkv.model.registry import resolve_model
from duplexkv.up import threshold_kv
from duplexkv_bench.multiturn_config import BenchConfig

Log = Callable[[str], None]


class BenchError(ValueError):
    """The target is unreachable or misconfigured (one clear CLI error line)."""


def dtype_note(cfg: BenchConfig) -> str:
    """What the launched workers run, and whether this CPU has native bf16."""
    if cfg.url:
        return f"dtype: the target's (not launched here); this CPU's {cpu_bf16_status()}"
    return describe_dtype(cfg.dtype)


_OWN_KEY = secrets.token_urlsafe(24)  # a launched router's client key when none is set


def client_key() -> str:
    """$DUPLEXKV_API_KEY's first key, else this process's own random one: a router or worker
    the benchmark launches always requires a key (issue 32), and a target given by --url
    without a key ignores the one sent."""
    keys = keys_from(None)
    return keys[0] if keys else _OWN_KEY


def auth_headers() -> dict[str, str]:
    key = client_key()
    return {"authorization": f"Bearer {key}"} if key else {}


def check_target(url: str, what: str) -> str:
    """The served model's name; BenchError when `url` is not a healthy duplexkv or vLLM server."""
    try:
        health = httpx.get(url + "/health", timeout=10)
        models = httpx.get(url + "/v1/models", timeout=10, headers=auth_headers())
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the {what} at {url} ({e!r}); start one with `duplexkv "
                         f"up` or omit --url to let the benchmark launch its own") from None
    if health.status_code != 200:
        raise BenchError(f"the {what} at {url} is not healthy (GET /health -> "
                         f"{health.status_code}: {health.text[:300]})")
    try:
        return models.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url}/v1/models does not list a model ({models.status_code}: "
                         f"{models.text[:200]}); is it an OpenAI-compatible server?") from None


@contextlib.contextmanager
def given(url: str, what: str) -> Iterator[tuple[str, str]]:
    yield url, check_target(url, what)


@contextlib.contextmanager
def launched_cluster(cfg: BenchConfig, log: Log) -> Iterator[tuple[str, str]]:
    spec = ClusterSpec(model=cfg.model, connector=cfg.connector,
                       prefill_args=("--no-enable-prefix-caching",),
                       worker_args=cfg.worker_flags, log_dir=cfg.output_dir / "logs",
                       router_args=("--placement", cfg.placement),
                       kv_extra=threshold_kv(cfg.kv_recompute_threshold),
                       api_keys=(client_key(),))
    with Cluster(spec, on_event=log) as cluster:
        log(f"cluster up: router {cluster.url} (1 P without prefix caching, 1 D, placement "
            f"{cfg.placement})")
        yield cluster.url, check_target(cluster.url, "router")


@contextlib.contextmanager
def launched_worker(cfg: BenchConfig, log: Log) -> Iterator[tuple[str, str]]:
    resolve_model(cfg.model)
    w = spawn("ideal", worker_args(cfg.model, None, *cfg.worker_flags), cfg.output_dir / "logs",
              {API_KEY_ENV: client_key(), WORKER_API_KEY_ENV: None}, die_with_parent=True)
    try:
        wait_ready([w])
        log(f"single worker up: {w.url} (prefix caching on)")
        yield w.url, check_target(w.url, "worker")
    finally:
        stop_all([w])


def phases(cfg: BenchConfig, log: Log) -> list[tuple[tuple[str, ...], Callable]]:
    """(modes, target context) in running order."""
    pd = tuple(m for m in ("off", "on") if m in cfg.modes)
    out = []
    if cfg.url:
        if pd:
            out.append((pd, lambda: given(cfg.url, "router")))
        if "ideal" in cfg.modes:
            if cfg.ideal_url:
                out.append((("ideal",), lambda: given(cfg.ideal_url, "ideal worker")))
            else:
                log("[yellow]no --ideal-url: the ideal mode is skipped[/yellow]")
    else:
        if pd:
            out.append((pd, lambda: launched_cluster(cfg, log)))
        if "ideal" in cfg.modes:
            out.append((("ideal",), lambda: launched_worker(cfg, log)))
    return out
