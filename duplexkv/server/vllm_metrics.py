"""vLLM's Prometheus metrics (`vllm:*`, labels `model_name` and `engine`) for the concepts a worker
shares with vLLM, so that dashboards and schedulers written for vLLM (Grafana boards, llm-d's
scorers) read a worker unchanged. Names, types, label sets and buckets follow vLLM's v1
`PrometheusStatLogger` (vllm/v1/metrics/loggers.py); counters get `_total` on the wire, as there.

Where the meaning differs slightly, ours is stated here:
- `vllm:prefix_cache_queries` / `hits` count prompt tokens looked up / found in this worker's
  local prefix cache, once per request when it finishes (vLLM: when it is scheduled);
  `vllm:external_prefix_cache_queries` / `hits` count the tokens a request asked another worker
  for and the tokens actually pulled (vLLM: its KV connector's).
- `vllm:request_success{finished_reason}`: stop, length, abort (the client went away) and error.
- n > 1: each choice counts as a request (success, prompt and generation tokens, prefix-cache
  queries and hits, TTFT, e2e, queue time), as vLLM's child requests do; `vllm:request_params_n`
  is observed once per request.
- `vllm:inter_token_latency_seconds` (and its deprecated twin `vllm:time_per_output_token_seconds`)
  are measured where the server sees each output, so tokens that arrive together share the gap.
Our own `duplexkv_*` metrics stay as they are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINISHED_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine"]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VLLMMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 block_size: int, num_blocks: int, prefix_caching: bool, dtype: str) -> None:
        lv = (model_name, "0")
        m = {"registry": registry, "labelnames": LABELS}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, **m).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, **m).labels(*lv)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, buckets=buckets, **m).labels(*lv)

        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries (KV pulled "
            "from another worker), in terms of number of queried tokens.")
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits (KV pulled from "
            "another worker), in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=[*LABELS, "finished_reason"], registry=registry)
        self.success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request "
                                   "parameter.", (1, 2, 5, 10, 20))
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.",
                                            tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds. DEPRECATED: Use "
                              "vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
                      "engine"], registry=registry)
        info.labels(str(block_size), str(num_blocks), str(prefix_caching), dtype, "0").set(1)
        self._preemptions_seen = 0

    def token_gaps(self, gap_s: float, n_tokens: int) -> None:
        """`n_tokens` new tokens arrived `gap_s` after the previous output."""
        for _ in range(n_tokens):
            self.itl.observe(gap_s / n_tokens)
            self.tpot.observe(gap_s / n_tokens)

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, max_tokens: int,
                 local_hit: int, pulled: int, asked_remote: int) -> None:
        self.success[reason if reason in self.success else "error"].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(output_tokens)
        self.request_max_tokens.observe(max_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(local_hit)
        self.external_queries.inc(asked_remote)
        self.external_hits.inc(pulled)

    def timings(self, ttft_s: float, e2e_s: float, queue_s: float, output_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        if output_tokens > 1:
            self.request_tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))

    def update(self, running: int, waiting: int, blocks_in_use: int, blocks_total: int,
               preemptions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(blocks_in_use / blocks_total if blocks_total else 0.0)
        if preemptions > self._preemptions_seen:  # a counter from the engine's running total
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
