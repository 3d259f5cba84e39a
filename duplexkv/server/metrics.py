"""Prometheus metrics of one worker app (its own CollectorRegistry, so apps never clash): ours
(`duplexkv_*`) and, given the engine, vLLM's names for the concepts we share (`vllm_metrics`).

With n > 1, ours count the HTTP request once (its prompt once, the tokens of all its choices,
the prefix hits and computed tokens of all its choices); vLLM's count each choice as a request,
as vLLM's engine does (each choice is a child request there, vllm/v1/engine/parallel_sampling.py),
and `vllm:request_params_n` observes n once per request."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from duplexkv.engine.output_processor import RequestOutput
from duplexkv.engine.state import EngineCapacity, EngineSnapshot
from duplexkv.server.vllm_metrics import VLLMMetrics

TTFT_SOURCES = ("pulled", "local_hit", "recomputed")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0)


@dataclass(slots=True)
class ChoiceTimes:
    """When the server saw one choice's first output, its last with new tokens, its end."""

    first: float
    last: float
    finished: float | None = None


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, engine: EngineCapacity | None = None) -> None:
        self.registry = r = CollectorRegistry()
        m = {"registry": r}
        self.vllm = None if engine is None else VLLMMetrics(
            r, model_name, engine.max_model_len, engine.block_size, engine.num_kv_blocks,
            engine.enable_prefix_caching, engine.dtype)
        self.requests = Counter("duplexkv_requests", "Generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], **m)
        self.prompt_tokens = Counter("duplexkv_prompt_tokens", "Prompt tokens of finished requests",
                                     **m)
        self.generation_tokens = Counter("duplexkv_generation_tokens", "Generated tokens", **m)
        self.prefix_hit_tokens = Counter("duplexkv_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the local prefix cache", **m)
        self.pulled_tokens = Counter("duplexkv_kv_pulled_tokens",
                                     "Prompt tokens whose KV was pulled from another worker", **m)
        self.computed_tokens = Counter("duplexkv_prompt_computed_tokens",
                                       "Prompt tokens computed by prefill", **m)
        self.ttft = Histogram("duplexkv_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, **m)
        self.ttft_by_source = Histogram(
            "duplexkv_time_to_first_token_by_source_seconds", "Time to first token by where the "
            "prompt's KV came from: pulled (some pulled from another worker), local_hit (some "
            "from the local prefix cache, none pulled), recomputed (all computed)",
            ["source"], buckets=LATENCY_BUCKETS, **m)
        for source in TTFT_SOURCES:
            self.ttft_by_source.labels(source)
        self.e2e = Histogram("duplexkv_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, **m)
        self.running = Gauge("duplexkv_num_requests_running", "Requests in the running batch", **m)
        self.waiting = Gauge("duplexkv_num_requests_waiting",
                             "Requests waiting (queued or for remote KV)", **m)
        self.kv_blocks = Gauge("duplexkv_kv_blocks", "KV blocks by state", ["state"], **m)
        self.preemptions = Gauge("duplexkv_num_preemptions", "Preemptions since start", **m)
        self.failed_requests = Gauge("duplexkv_engine_failed_requests", "Requests the engine "
                                     "ended with an error of their own, since start", **m)
        self.failed_steps = Gauge("duplexkv_engine_failed_steps", "Forward passes that failed "
                                  "(their requests ended with an error), since start", **m)
        self.engine_alive = Gauge("duplexkv_engine_alive", "1 while the engine thread runs", **m)
        self.info = Gauge("duplexkv_model_info", "Served model", ["model"], **m)
        self.info.labels(model_name).set(1)

    def record_finished(self, endpoint: str, outcome: str, finals: list[RequestOutput] | None,
                        max_tokens: int = 0, n: int = 1) -> None:
        """A request ended: `finals` are its choices' final outputs (None: no answer)."""
        self.requests.labels(endpoint, outcome).inc()
        if finals is None:
            if self.vllm is not None:
                self.vllm.success["abort" if outcome == "aborted" else "error"].inc(n)
            return
        self.prompt_tokens.inc(len(finals[0].prompt_token_ids))
        if self.vllm is not None:
            self.vllm.request_n.observe(len(finals))
        for out in finals:
            self.generation_tokens.inc(len(out.token_ids))
            s = out.kv_stats
            if s is not None:
                self.prefix_hit_tokens.inc(s.local_hit_tokens)
                self.pulled_tokens.inc(s.pulled_tokens)
                self.computed_tokens.inc(s.computed_tokens)
            if self.vllm is not None:
                n_prompt = len(out.prompt_token_ids)
                local = s.local_hit_tokens if s is not None else 0
                asked = n_prompt - local if s is not None and s.pull_outcome else 0
                self.vllm.finished(out.finish_reason or "error", n_prompt, len(out.token_ids),
                                   max_tokens, local, s.pulled_tokens if s is not None else 0,
                                   asked)

    def record_timings(self, arrival: float, ttft_s: float, e2e_s: float,
                       finals: list[RequestOutput],
                       choices: dict[int, ChoiceTimes] | None = None) -> None:
        """A finished request's latencies: ours for the request (its first token of any
        choice), vLLM's for each choice (`choices`: when the server saw each one's outputs)."""
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        s = finals[0].kv_stats  # choice 0 carries where the prompt's KV came from
        source = ("recomputed" if s is None or (not s.pulled_tokens and not s.local_hit_tokens)
                  else "pulled" if s.pulled_tokens else "local_hit")
        self.ttft_by_source.labels(source).observe(ttft_s)
        if self.vllm is None:
            return
        for out in finals:
            t = (choices or {}).get(out.index)
            c_ttft = ttft_s if t is None else t.first - arrival
            c_e2e = e2e_s if t is None or t.finished is None else t.finished - arrival
            cs = out.kv_stats
            self.vllm.timings(c_ttft, c_e2e, (cs.queue_ms / 1e3) if cs is not None else 0.0,
                              len(out.token_ids))

    def record_rejected(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def update(self, alive: bool, snap: EngineSnapshot | None) -> None:
        """Refresh the gauges (`snap` is None when the engine did not answer)."""
        self.engine_alive.set(1 if alive else 0)
        if snap is None:
            return
        self.running.set(snap.running)
        self.waiting.set(snap.waiting + snap.waiting_for_remote_kv)
        b = snap.blocks
        for state, n in (("used", b.in_use), ("free", b.free), ("cached", b.cached_free)):
            self.kv_blocks.labels(state).set(n)
        self.preemptions.set(snap.num_preemptions)
        self.failed_requests.set(snap.num_failed_requests)
        self.failed_steps.set(snap.num_failed_steps)
        if self.vllm is not None:
            self.vllm.update(snap.running, snap.waiting + snap.waiting_for_remote_kv, b.in_use,
                             b.total, snap.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
