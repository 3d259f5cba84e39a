"""What the engine tells the outside about itself, as values: its fixed capacity, and a snapshot
of its state (read on the engine thread, e.g. through `AsyncEngine.call`). `EngineViews` gives
the engine the public methods that return them."""

from __future__ import annotations

from dataclasses import dataclass

from duplexkv.engine.block_manager import BlockCounts, BlockManager
from duplexkv.engine.calibration import Calibration
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.cost_model import PrefillCostModel
from duplexkv.engine.grammar import Grammars
from duplexkv.engine.kv_transfer import KVConnectorBase
from duplexkv.engine.model_runner import ModelRunner
from duplexkv.engine.remote_kv import RemoteKV
from duplexkv.engine.scheduler import Scheduler
from duplexkv.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """Fixed at start-up: what the engine can hold and how it computes."""

    max_model_len: int
    max_num_seqs: int  # the batch bound
    num_kv_blocks: int
    block_size: int
    enable_prefix_caching: bool
    dtype: str

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state at one moment, between steps."""

    running: int
    waiting: int
    waiting_for_remote_kv: int
    blocks: BlockCounts
    block_size: int
    num_preemptions: int
    num_failed_requests: int = 0  # ended by an error of their own (sampling, a hook, a step)
    num_failed_steps: int = 0  # forward passes that raised (their requests failed)
    # the cost model's prediction (None before it has a sample): the prefill of every prompt
    # token queued or running, i.e. how long a request arriving now waits for its first token
    # (decode steps interleaved with it not counted); and the longest step that work makes.
    # The router's liveness probes of a loaded worker wait longer (router/liveness.py)
    expected_ttft_ms: float | None = None
    expected_step_ms: float | None = None

    def as_dict(self) -> dict:
        return {"running": self.running, "waiting": self.waiting,
                "waiting_for_remote_kv": self.waiting_for_remote_kv,
                "kv_blocks": self.blocks._asdict(), "block_size": self.block_size,
                "num_preemptions": self.num_preemptions,
                "num_failed_requests": self.num_failed_requests,
                "num_failed_steps": self.num_failed_steps,
                "expected_ttft_ms": _ms(self.expected_ttft_ms),
                "expected_step_ms": _ms(self.expected_step_ms)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


class EngineViews:
    """The engine's answers to the server (a mixin of LLMEngine, over these of its attributes);
    all but `capacity` on the engine thread."""

    config: EngineConfig
    bm: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Tokenizer
    grammars: Grammars
    requests: dict
    remote: RemoteKV
    costs: Calibration
    num_failed_requests: int
    num_failed_steps: int

    @property
    def connector(self) -> KVConnectorBase:
        return self.remote.connector

    @property
    def num_connector_errors(self) -> int:
        return self.remote.num_errors

    @property
    def cost_model(self) -> PrefillCostModel:
        return self.costs.model

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]
    def capacity(self) -> EngineCapacity:
        c = self.config
        return EngineCapacity(self.max_model_len, c.max_num_seqs, self.bm.num_blocks,
                              c.block_size, c.enable_prefix_caching, str(c.dtype))

    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        ttft, step = self._expected_prefill_ms()
        return EngineSnapshot(len(s.running), len(s.waiting), len(s.parked), self.bm.counts(),
                              self.config.block_size, s.num_preemptions,
                              self.num_failed_requests, self.num_failed_steps, ttft, step)

    def _expected_prefill_ms(self) -> tuple[float | None, float | None]:
        """(the prefill of all queued prompt tokens, its longest step) by the cost model."""
        model, s = self.costs.model, self.scheduler
        total, step, tokens, context = 0.0, 0.0, 0, 0
        for seq in (*s.running, *s.waiting):
            new = seq.num_prompt_tokens - seq.num_computed_tokens
            if new > 0:
                total += model.predict_ms(new, seq.num_computed_tokens) or 0.0
                tokens, context = tokens + new, max(context, seq.num_computed_tokens)
        if not model.ready:
            return None, None
        if tokens:
            step = model.predict_ms(min(tokens, s.budget), context) or 0.0
        return total, step

    def structures(self) -> dict:
        """Sizes of the engine's per-request maps and caches, for /debug/memory."""
        s, mirrors, seg = self.scheduler, self.runner.mirrors, self.tokenizer.segments.stats()
        return {"engine.requests": len(self.requests), "scheduler.waiting": len(s.waiting),
                "scheduler.running": len(s.running), "scheduler.parked": len(s.parked),
                "prefix_cache.hashes": len(self.bm.hash_to_block),
                "segments.entries": seg.entries, "segments.chars": seg.chars,
                "mirrors": len(mirrors.mirrors),
                "mirrors.mb": round(mirrors.used_bytes / (1 << 20), 1),
                "grammars.compiled": self.grammars.num_compiled}

    def debug_state(self) -> dict:
        """/debug/engine: the snapshot, the pool's invariants checked now, dtype, evictions."""
        try:
            self.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"violated: {e}"
        return {**self.snapshot().as_dict(), "integrity": integrity,
                "dtype": self.config.dtype, "num_evicted_blocks": self.bm.num_evicted}
