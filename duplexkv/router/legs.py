"""The two legs of a turn: request rewriting, `kv_transfer_params` handling, combined `kv_stats`.

    P leg   client body, stream=false, max_tokens=1, without max_completion_tokens /
            min_tokens / min_completion_tokens / stream_options / n (P computes the prompt
            once, as vLLM's proxy sends n=1), + a miss payload or D's stored params with the
            booleans forced (do_remote_decode=true, do_remote_prefill=false)
    D leg   client body + P's params (the client's own `stream` and `n`: D samples the choices)
    reply   D's answer without `kv_transfer_params`; its `kv_stats` replaced by one object that
            combines both legs and the router's timings
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from duplexkv.router.request import ClientRequest

P_LEG_DROPS = ("stream_options", "max_completion_tokens", "min_tokens", "min_completion_tokens",
               "n")


def prefill_body(req: ClientRequest, params: dict) -> dict:
    body = {k: v for k, v in req.body.items() if k not in P_LEG_DROPS}
    body.update(stream=False, max_tokens=1, kv_transfer_params=params)
    return body


def decode_body(req: ClientRequest, params: dict | None) -> dict:
    return {**req.body, "kv_transfer_params": params}


@lru_cache(maxsize=1024)
def _is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def rewrite_remote_host(params: dict | None, worker_url: str) -> dict | None:
    """A holder that reports an empty/loopback side-channel host cannot be reached from another
    machine: use the host of its HTTP URL instead, unless that is loopback too (protocol 5.4)."""
    if not isinstance(params, dict) or "remote_host" not in params:
        return params
    host = _url_host(worker_url)
    if not _is_loopback(host) and _is_loopback(params.get("remote_host")):
        return {**params, "remote_host": host}
    return params


def shares_our_clock(worker_url: str) -> bool:
    """A worker on this host (loopback URL) reads the same monotonic clock as the router's
    `time.perf_counter` (Linux CLOCK_MONOTONIC), so its `remote_blocks_expiry_time` can be
    compared with ours; another host's cannot."""
    return _is_loopback(_url_host(worker_url))


@lru_cache(maxsize=256)
def _url_host(url: str) -> str | None:
    return urlsplit(url).hostname


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(slots=True)
class TurnStats:
    """What the client sees as `kv_stats`: each worker's own report plus the router's view.

    A worker that sends no `kv_stats` (vLLM) is described by its `usage` instead: prompt,
    completion and `prompt_tokens_details.cached_tokens` (null when the worker does not report
    it); `source` says which of the two each leg's object came from."""

    conversation: str = "none"  # none | miss | hit | expired | retried | not_retained | mixed
    prefill: dict | None = None  # P's kv_stats (local_hit / pulled-from-D / computed) or usage
    decode: dict | None = None  # D's kv_stats (local_hit / pulled-from-P tokens) or usage
    prefill_done_ms: float | None = None  # router arrival -> P leg answered
    first_token_ms: float | None = None  # router arrival -> first token sent (streaming)
    prefill_source: str | None = None  # kv_stats | usage | None (the worker told nothing)
    decode_source: str | None = None
    retained: bool | None = None  # D returned params for the next turn (None: not known yet)

    # where the prefill ran and why (router/placement.py); None for turns without a conversation
    placement: str | None = None
    placement_reason: str | None = None
    suffix_estimate: int | None = None  # the router's estimate of the new tokens
    verify: dict | None = None  # a replay to a P that does not check tokens (router/verify.py)
    warmup_wait_ms: float | None = None  # waited for a P<->D channel warm-up (warmup.py)
    recognised: bool | None = None  # no conversation id: a stored turn matched the content

    def as_dict(self) -> dict:
        out = {"conversation": self.conversation, "prefill": self.prefill,
               "decode": self.decode, "prefill_done_ms": self.prefill_done_ms,
               "first_token_ms": self.first_token_ms,
               "source": {"prefill": self.prefill_source, "decode": self.decode_source},
               "retained": self.retained}
        if self.placement is not None:
            out.update(placement=self.placement, placement_reason=self.placement_reason,
                       suffix_estimate=self.suffix_estimate)
        if self.verify is not None:
            out["verify"] = self.verify
        if self.warmup_wait_ms is not None:
            out["warmup_wait_ms"] = self.warmup_wait_ms
        if self.recognised is not None:
            out["recognised"] = self.recognised
        return out


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_stats(usage: dict) -> dict:
    """An OpenAI/vLLM `usage` object -> the token counts kv_stats reports (typed, bounded)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": _count(usage.get("prompt_tokens")),
            "completion_tokens": _count(usage.get("completion_tokens")),
            "cached_tokens": _count(cached)}


def worker_stats(answer: dict) -> tuple[dict | None, str | None]:
    """A worker's answer (or chunk) -> (its stats, their source): its own kv_stats, else usage."""
    ks = answer.get("kv_stats")
    if isinstance(ks, dict):
        return ks, "kv_stats"
    usage = answer.get("usage")
    if isinstance(usage, dict):
        return usage_stats(usage), "usage"
    return None, None


def finish_json(d_json: dict, stats: TurnStats) -> tuple[dict, dict | None]:
    """D's non-stream answer -> (the client's answer, D's params)."""
    params = d_json.pop("kv_transfer_params", None)
    params = params if isinstance(params, dict) and params else None
    stats.decode, stats.decode_source = worker_stats(d_json)
    stats.retained = params is not None
    d_json["kv_stats"] = stats.as_dict()
    return d_json, params
