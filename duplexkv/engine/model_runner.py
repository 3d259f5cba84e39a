"""Runs one scheduled step through the model: builds the flat inputs and attention context."""

from __future__ import annotations

import torch

from duplexkv.engine.kv_pool import DTYPE, allocate_pool
from duplexkv.engine.scheduler import ScheduledSeq
from duplexkv.layers import hugepages
from duplexkv.layers.attention import (
    AttnContext,
    build_seq_attn,
    mirror_block,
    reset_context,
    set_context,
)
from duplexkv.layers.staging import MirrorSet
from duplexkv.model.config import ModelConfig
from duplexkv.model.qwen3 import CausalLM, Rotary


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: str,
                 block_size: int, num_blocks: int, mirror_budget_bytes: int = 1 << 30) -> None:
        self.cfg = cfg
        self.dtype = DTYPE[dtype]
        self.block_size = block_size
        # its Linear and Embedding layers skip the random initialisation (the weights are
        # loaded next), so the model is built in place; the meta device was avoided on purpose:
        # to_empty and arithmetic on meta tensors import torch._dynamo and torch.fx (~4 s of a
        # worker's start-up)
        model = CausalLM(cfg).to(self.dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        # cast with the model: recompute the float32 table
        model.rotary.inv_freq = Rotary.frequencies(cfg.head_dim, cfg.rope_theta)
        model.load_hf_weights(weights)
        model.pack_linears()  # first: the weights it packs are released, not moved
        hugepages.move_parameters(model)  # before the decode stack takes their addresses
        model.build_decode_stack()
        self.model = model.eval()
        self.pool = allocate_pool(cfg, block_size, self.dtype, num_blocks)
        self.mirrors = MirrorSet(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                 mirror_budget_bytes)
        # the key block a mirror keeps zeroed past the context, for attention that reads it whole
        self.mirror_block = mirror_block(self.dtype, cfg.head_dim)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """Compute the batch; returns float32 logits for the sequences that sample, in order."""
        bs = self.block_size
        self.mirrors.drop_unless({item.seq.request_id for item in batch})
        ids, pos, blocks, offsets, seqs, sample_rows = [], [], [], [], [], []
        row = 0
        for item in batch:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            tokens = seq.token_ids(start, start + n)
            assert len(tokens) == n and n > 0
            p = range(start, start + n)
            ids.extend(tokens)
            pos.extend(p)
            blocks.extend(seq.block_table[i // bs] for i in p)
            offsets.extend(i % bs for i in p)
            mirror = self.mirrors.prepare(seq.request_id, start, start + n, self.mirror_block)
            seqs.append(build_seq_attn(row, n, start, seq.block_table, bs, mirror))
            row += n
            if item.samples:
                sample_rows.append(row - 1)
        set_context(AttnContext(seqs, blocks, offsets))
        try:
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.pool)
        finally:
            reset_context()
        for sa in seqs:
            if sa.mirror is not None:
                sa.mirror.length = sa.ctx_len
        if not sample_rows:
            return None
        return self.model.logits(sampled_rows(hidden, sample_rows))


def sampled_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of hidden [T, H] that sample, in order, without an OpenMP parallel region: a
    decode step's rows are all of them (no copy), and `index_select` gathers a few rows on the
    calling thread where `hidden[rows]` (aten::index) opens a parallel region from 8 rows on.
    With libgomp's default wait policy, that region's thread then spins on the other core through
    the LM head that follows (AMD EPYC Zen 4, 2 threads, 4k x 8 in-process: the LM head took 3.3
    ms instead of 2.1); with OMP_WAIT_POLICY=PASSIVE, as workers run, it still wakes a thread
    every step. docs/engine.md has the A/B."""
    if len(rows) == hidden.shape[0]:  # rows ascend strictly within [0, T): they are 0 .. T - 1
        assert rows[0] == 0 and rows[-1] == len(rows) - 1, rows
        return hidden
    return hidden.index_select(0, torch.tensor(rows))
