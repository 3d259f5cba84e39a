"""The engine's side of `EngineHost` (engine/kv_transfer.py): the few operations its KV connector
may use, as public methods of the engine (a mixin of LLMEngine over its block manager, scheduler,
runner, output processor and cost model). Engine thread only."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.calibration import Calibration
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.cost_model import PrefillCostModel
from duplexkv.engine.kv_transfer import KVLayout
from duplexkv.engine.model_runner import ModelRunner
from duplexkv.engine.output_processor import OutputProcessor
from duplexkv.engine.scheduler import Scheduler
from duplexkv.engine.sequence import Sequence
from duplexkv.model.config import ModelConfig


class HostOps:
    config: EngineConfig
    model_config: ModelConfig
    fingerprint: bytes
    block_bytes: int
    bm: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    outputs: OutputProcessor
    costs: Calibration

    def kv_layout(self) -> KVLayout:
        return KVLayout(self.fingerprint, self.config.block_size, self.bm.num_blocks,
                        self.block_bytes, self.model_config.vocab_size)

    def kv_pool(self) -> torch.Tensor:
        return self.runner.pool

    def blocks_needed(self, num_tokens: int) -> int:
        return self.bm.blocks_needed(num_tokens)

    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks

    def pin(self, block_ids: Seq[int]) -> None:
        self.bm.pin(block_ids)

    def unpin(self, block_ids: Seq[int]) -> None:
        self.bm.unpin(block_ids)

    def is_private_block(self, block_id: int) -> bool:
        block = self.bm.blocks[block_id]
        return not block.hash and block.ref_count == 1

    def reserve_for_remote_kv(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        return self.scheduler.reserve_for_remote_kv(seq, num_tokens)

    def adopt_prefix(self, seq: Sequence, block_ids: list[int], num_tokens: int) -> None:
        self.scheduler.adopt_prefix(seq, block_ids, num_tokens)

    def prefill_cost_model(self) -> PrefillCostModel:
        return self.costs.model

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sampler may not pick next: stop and eos tokens before min_tokens."""
        return self.outputs.banned_tokens(seq)
