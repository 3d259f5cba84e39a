"""The benchmark's clients: conversations sent turn by turn, streamed, timed on the client.

TTFT is request sent -> first non-empty content delta; TPOT is (last delta - first delta) /
(completion tokens - 1). Each turn's history holds the model's real answers (re-tokenised by the
server's chat template next turn). `--clients` conversations run at once; a failed request ends
its conversation (the history cannot go on) and is reported.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field

import httpx

from duplexkv_bench.workload import Conversation

perf = time.perf_counter


@dataclass(frozen=True, slots=True)
class Target:
    mode: str  # off | on | ideal
    url: str  # router (off, on) or a single worker (ideal)
    model: str
    send_conversation_id: bool  # what turns reuse on at the router
    tag: str = ""  # makes conversation ids unique per run
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token


@dataclass(slots=True)
class Result:
    """One request. kv fields come from the response's `kv_stats` (P's leg via the router)."""

    mode: str
    conversation: str
    turn: int  # 1-based
    context_tokens: int = 0  # the server's prompt_tokens
    answer_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float = 0.0
    start_s: float = 0.0  # since the mode started
    local_hit_tokens: int = 0  # P's own prefix cache (or the single worker's)
    pulled_tokens: int = 0  # READ by P from D's retained history
    recomputed_tokens: int = 0  # computed by P (or the single worker)
    d_to_p_ms: float = 0.0
    prefill_ms: float = 0.0  # P's prefill compute
    p_to_d_tokens: int = 0  # READ by D from P (what D's own prefix cache did not hold)
    p_to_d_ms: float = 0.0
    p_leg_ms: float | None = None  # router: arrival -> P answered
    d_prefill_ms: float = 0.0  # D's compute before its first token
    pull_outcome: str = ""
    router_conversation: str = ""  # the router's view: none, miss, hit, expired, retried
    verify: str = ""  # the router's token check for a P that does not verify (vLLM): hit, ...
    placement: str = ""  # the router's: decode_local | prefill_pull | prefill_recompute
    has_kv_stats: bool = False
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class RequestFailed(Exception):
    pass


def read_kv_stats(r: Result, stats: dict | None) -> None:
    if not isinstance(stats, dict):
        return
    r.has_kv_stats = True
    if "prefill" in stats or "decode" in stats:  # the router's: both legs
        p, d = stats.get("prefill") or {}, stats.get("decode") or {}
        r.router_conversation = stats.get("conversation") or ""
        v = stats.get("verify") if isinstance(stats.get("verify"), dict) else {}
        r.verify = "/".join(str(v[k]) for k in ("outcome", "reason") if v.get(k))
        r.p_to_d_tokens = int(d.get("pulled_tokens", 0))
        r.p_to_d_ms = float(d.get("transfer_ms", 0.0))
        r.d_prefill_ms = float(d.get("prefill_ms", 0.0))
        r.p_leg_ms = stats.get("prefill_done_ms")
        r.placement = stats.get("placement") or ""
        if r.placement == "decode_local":  # no P leg: D reused its own history, computed the rest
            p, r.p_to_d_tokens, r.p_to_d_ms = d, 0, 0.0
    else:  # a worker's own
        p = stats
    r.local_hit_tokens = int(p.get("local_hit_tokens", 0))
    r.pulled_tokens = int(p.get("pulled_tokens", 0))
    r.recomputed_tokens = int(p.get("computed_tokens", 0))
    r.d_to_p_ms = float(p.get("transfer_ms", 0.0))
    r.prefill_ms = float(p.get("prefill_ms", 0.0))
    r.pull_outcome = p.get("pull_outcome") or ""


async def chat_turn(client: httpx.AsyncClient, target: Target, messages: list[dict],
                    max_tokens: int, conversation_id: str, r: Result) -> str:
    """Send one streamed turn, fill `r`, return the answer text."""
    body = {"model": target.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    if target.send_conversation_id:
        body["conversation_id"] = conversation_id
        headers["X-Session-ID"] = conversation_id
    elif target.mode == "off":  # plain P/D: the router recognises no conversation either
        body["conversation_id"] = ""
    parts: list[str] = []
    first = last = None
    t0 = perf()
    async with client.stream("POST", target.url + "/v1/chat/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RequestFailed(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                raise RequestFailed(f"error in stream: {json.dumps(obj['error'])[:300]}")
            if obj.get("kv_stats"):
                read_kv_stats(r, obj["kv_stats"])
            if obj.get("usage"):
                r.context_tokens = obj["usage"].get("prompt_tokens", 0)
                r.answer_tokens = obj["usage"].get("completion_tokens", 0)
            for choice in obj.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last = perf()
                    first = first or last
                    parts.append(content)
    end = perf()
    r.latency_ms = (end - t0) * 1e3
    r.ttft_ms = ((first or end) - t0) * 1e3
    if first is not None and last is not None and r.answer_tokens > 1:
        r.tpot_ms = (last - first) * 1e3 / (r.answer_tokens - 1)
    return "".join(parts)


class Runner:
    """Runs conversations against one target with `clients` at once."""

    def __init__(self, target: Target, clients: int = 1, idle_s: float = 0.0,
                 on_result: Callable[[Result], None] = lambda _r: None,
                 timeout_s: float = 1800) -> None:
        self.target, self.clients, self.idle_s = target, clients, idle_s
        self.on_result, self.timeout_s = on_result, timeout_s

    async def turns(self, client: httpx.AsyncClient, conv: Conversation, t_start: float,
                    record: bool = True) -> AsyncIterator[Result]:
        """The conversation's turns one at a time (a failed turn is the last)."""
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        cid = f"{self.target.tag}-{self.target.mode}-{conv.id}"
        for k, turn in enumerate(conv.turns):
            if k and self.idle_s:
                await asyncio.sleep(self.idle_s)
            messages.append({"role": "user", "content": turn.text})
            r = Result(self.target.mode, conv.id, k + 1, start_s=perf() - t_start)
            try:
                answer = await chat_turn(client, self.target, messages, turn.answer_tokens, cid,
                                         r)
            except (RequestFailed, httpx.HTTPError, ValueError) as e:
                r.error = f"{type(e).__name__}: {e}"
            if record:
                self.on_result(r)
            yield r
            if r.error:
                return
            messages.append({"role": "assistant", "content": answer})

    async def conversation(self, client: httpx.AsyncClient, conv: Conversation, t_start: float,
                           record: bool) -> list[Result]:
        return [r async for r in self.turns(client, conv, t_start, record)]

    def client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.clients + 4)
        return httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False)

    async def run(self, convs: list[Conversation], record: bool = True) -> list[Result]:
        queue = list(convs)
        results: list[Result] = []
        t_start = perf()
        async with self.client() as client:
            async def worker() -> None:
                while queue:
                    results.extend(await self.conversation(client, queue.pop(0), t_start,
                                                           record))

            await asyncio.gather(*(worker() for _ in range(max(1, self.clients))))
        return results

    def run_sync(self, convs: list[Conversation], record: bool = True) -> list[Result]:
        return asyncio.run(self.run(convs, record))
