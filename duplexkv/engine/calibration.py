"""The engine's prefill cost model (engine/cost_model.py), kept current: fitted once at start-up on
this model and machine (`calibrate`), then refitted from every step that prefilled one chunk alone
(`observe`). The KV connector asks it whether pulling beats recomputing."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from duplexkv.engine.cost_model import PrefillCostModel, Sample
from duplexkv.engine.scheduler import ScheduledSeq
from duplexkv.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from duplexkv.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
# (prompt length, chunk) in the order they are tried
PLAN = [(16, 16), (64, 64), (256, 128), (512, 256), (1024, 512), (2048, 512), (4096, 1024),
        (8192, 2048)]


class Calibration:
    def __init__(self) -> None:
        self.model = PrefillCostModel()
        self.calibrating = False

    def observe(self, batch: list[ScheduledSeq], dt_ms: float) -> None:
        """One chunk prefilled alone is a cost sample (calibration's samples are not 'real')."""
        if len(batch) == 1 and batch[0].seq.in_prefill:
            self.model.add(Sample(batch[0].num_new_tokens, batch[0].start, dt_ms),
                           real=not self.calibrating)

    def calibrate(self, engine: LLMEngine, budget_s: float) -> None:
        """Random prompts of growing length, prefilled in chunks (each chunk a sample at a known
        context) with the prefix cache off, until the next prompt would pass `budget_s`."""
        assert not engine.has_unfinished(), "calibrate before serving"
        rng = random.Random(0)
        bm, sched = engine.bm, engine.scheduler
        saved = bm.enable_prefix_caching, sched.budget
        cap = min(engine.max_model_len - 1, (bm.num_blocks - 1) * bm.block_size)
        t0 = time.perf_counter()
        self.calibrating = True
        bm.enable_prefix_caching = False
        try:
            for i, (length, chunk) in enumerate(PLAN):
                length = min(length, cap)
                predicted = self.model.predict_ms(length, 0) or 0.0
                if i > 1 and (time.perf_counter() - t0) * 1e3 + predicted > budget_s * 1e3:
                    break
                sched.budget = min(chunk, saved[1])
                ids = [rng.randrange(engine.model_config.vocab_size) for _ in range(length)]
                engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0),
                                   f"calibration-{i}")
                while engine.has_unfinished():
                    engine.step()
                if i == 0:  # the first forward pass pays one-off costs: not a sample
                    self.model = PrefillCostModel()
                if length == cap:
                    break
        finally:
            bm.enable_prefix_caching, sched.budget = saved
            self.calibrating = False
        self.model.fit()
        self.model.calibration_ms = (time.perf_counter() - t0) * 1e3
        log.info("prefill cost model calibrated in %.0f ms: %s",
                 self.model.calibration_ms, self.model.as_dict()["predict_ms"])
