"""Pull or recompute: the reader's decision once the holder has verified what it can give.

    policy        when                                   pulls when
    threshold     `kv_recompute_threshold` set            gain >= threshold (vLLM's rule)
                  explicitly, or a D leg (threshold 0)
    cost_model    otherwise (the default)                 predicted transfer < predicted recompute
    threshold     cost model not ready (no sample yet)    gain >= DEFAULT_THRESHOLD
predicted transfer = the peer's verify round trip + the READ's bytes / its bandwidth
(kv/link_model.py); predicted recompute = this worker's prefill of the gained tokens after its
local prefix hit (engine/cost_model.py). Both predictions are reported in `kv_stats.pull_decision`
whichever policy decided, so that a fixed threshold can be checked against the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplexkv.engine.cost_model import PrefillCostModel
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.link_model import LinkEstimate
from duplexkv.wire.kv_params import KVTransferParams

COST_MODEL = -1  # Pull.threshold meaning "decide by the cost model"
DEFAULT_THRESHOLD = 64  # the fixed rule, before the cost model has a sample


@dataclass(frozen=True, slots=True)
class Decision:
    pull: bool
    policy: str  # "threshold" | "cost_model"
    reason: str  # "" when pulling; else the decline reason ("threshold" | "cost_model")
    gain_tokens: int
    predicted_transfer_ms: float
    predicted_recompute_ms: float | None
    link_gbps: float
    link_rtt_ms: float
    link_measured: bool

    def as_dict(self) -> dict:
        rec = self.predicted_recompute_ms
        return {"policy": self.policy, "pull": self.pull, "reason": self.reason or None,
                "gain_tokens": self.gain_tokens,
                "predicted_transfer_ms": round(self.predicted_transfer_ms, 3),
                "predicted_recompute_ms": None if rec is None else round(rec, 3),
                "link_gbps": float(f"{self.link_gbps:.4g}"), "link_rtt_ms": round(self.link_rtt_ms, 3),
                "link_measured": self.link_measured}


def threshold_for(cfg: KVTransferConfig, p: KVTransferParams) -> int | None:
    """Tokens a pull must gain (COST_MODEL: the cost model decides), or None when these params
    ask for no pull."""
    if not p.has_remote_blocks:
        return None
    if p.do_remote_prefill:
        return 0  # D leg: P computed this prompt for us; take any gain
    if p.do_remote_decode and cfg.bidirectional_kv_xfer:
        t = cfg.kv_recompute_threshold
        return COST_MODEL if t is None else t
    return None


def decide(threshold: int, gain_tokens: int, local_tokens: int, nbytes: int,
           link: LinkEstimate, cost: PrefillCostModel) -> Decision:
    """`gain_tokens` (> 0) would be READ (`nbytes`) instead of prefilled after `local_tokens`."""
    transfer = link.transfer_ms(nbytes)
    recompute = cost.predict_ms(gain_tokens, local_tokens)
    if threshold == COST_MODEL and recompute is not None:
        pull, policy = transfer < recompute, "cost_model"
    else:
        limit = DEFAULT_THRESHOLD if threshold == COST_MODEL else threshold
        pull, policy = gain_tokens >= limit, "threshold"
    return Decision(pull, policy, "" if pull else policy, gain_tokens, transfer, recompute,
                    link.gbps, link.rtt_ms, link.measured)
