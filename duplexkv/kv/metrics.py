"""Prometheus view of the KV connector: pulls, declines by reason, retention and releases."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class KVCollector(Collector):
    def __init__(self, connector) -> None:
        self.c = connector

    def collect(self):
        c = self.c.reader.counters
        yield CounterMetricFamily("duplexkv_kv_pulls", "Completed KV READs from other workers",
                                  value=c.pulls)
        yield CounterMetricFamily("duplexkv_kv_pull_tokens", "Tokens of KV READ from other workers",
                                  value=c.pulled_tokens)
        yield CounterMetricFamily("duplexkv_kv_pull_bytes", "Bytes of KV READ from other workers",
                                  value=c.pulled_bytes)
        yield CounterMetricFamily("duplexkv_kv_pull_seconds", "Time spent in KV READs",
                                  value=c.transfer_ms / 1e3)
        yield CounterMetricFamily("duplexkv_kv_prefill_first_tokens", "Decode legs that emitted "
                                  "P's greedy first token instead of recomputing the last prompt "
                                  "token", value=c.prefill_first_tokens)
        declined = CounterMetricFamily("duplexkv_kv_pull_declined",
                                       "Remote KV not used, by reason", labels=["reason"])
        for reason in ("threshold", "cost_model", "mismatch", "expired", "failed", "stalled",
                       "no_room", "unknown",
                       "local_hit", "bad_reply", "unreachable", "peer_down", "untrusted",
                       *c.declined):
            if reason not in {m.labels["reason"] for m in declined.samples}:
                declined.add_metric([reason], c.declined.get(reason, 0))
        yield declined
        decisions = CounterMetricFamily(
            "duplexkv_kv_pull_decisions", "Pull-or-recompute decisions after a verify, by policy "
            "(cost_model, threshold) and decision (pull, decline)", labels=["policy", "decision"])
        for policy in ("cost_model", "threshold"):
            for decision in ("pull", "decline"):
                decisions.add_metric([policy, decision],
                                     c.decisions.get(f"{policy}:{decision}", 0))
        yield decisions
        yield CounterMetricFamily("duplexkv_kv_pull_predicted_transfer_seconds",
                                  "Predicted transfer time of the pulls taken (compare with "
                                  "duplexkv_kv_pull_seconds, the actual)",
                                  value=c.predicted_transfer_ms / 1e3)
        yield CounterMetricFamily("duplexkv_kv_pull_predicted_recompute_seconds",
                                  "Predicted recompute time of the pulls declined",
                                  value=c.predicted_recompute_ms / 1e3)
        retained = CounterMetricFamily("duplexkv_kv_retained", "Finished requests whose blocks "
                                       "were kept for another worker", labels=["kind"])
        for kind, n in self.c.holder.counters.items():
            retained.add_metric([kind], n)
        yield retained
        st = self.c.retained.stats()
        yield CounterMetricFamily("duplexkv_kv_retained_renewals", "Leases of retained turns "
                                  "renewed by the router (their conversation was active)",
                                  value=st["renewals"])
        released = CounterMetricFamily("duplexkv_kv_retained_released",
                                       "Retained entries released, by why (read, notified, "
                                       "expired: lease ran out, capped: TTL reached, pressure: "
                                       "evicted by value, deleted, abort)", labels=["why"])
        for why, n in st["released"].items():
            released.add_metric([why], n)
        yield released
        local = CounterMetricFamily("duplexkv_kv_decode_local", "Turns sent to this worker "
                                    "to prefill their suffix over its own retained history, by "
                                    "outcome", labels=["outcome"])
        for outcome, n in self.c.local.counters.items():
            local.add_metric([outcome], n)
        yield local
        yield GaugeMetricFamily("duplexkv_kv_retained_entries", "Entries held for other workers",
                                value=st["entries"])
        yield GaugeMetricFamily("duplexkv_kv_retained_blocks", "Blocks held for other workers",
                                value=st["blocks"])
