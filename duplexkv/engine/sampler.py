"""Token sampling: logits processing (bans, logit_bias, penalties), a grammar's mask, greedy,
temperature, min-p, top-k, top-p, per-request seeded generators.

Each row is processed and sampled on its own, so one request's failure (reported as the
exception in its slot) never touches the others in the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from duplexkv.engine.grammar import constrain
from duplexkv.wire.sampling import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


@torch.inference_mode()  # logits are inference tensors: modify them in that mode
def process_row(row: torch.Tensor, p: SamplingParams, banned: list[int],
                prompt_ids: list[int], output_ids: list[int]) -> None:
    """Apply, in place on one row of logits [V]: logit_bias, penalties (vLLM's order and
    meaning: repetition over prompt + output, presence/frequency over the output), then bans
    (stop and eos tokens before min_tokens)."""
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if banned:
        row[banned] = float("-inf")


def sample_token(row: torch.Tensor, p: SamplingParams, banned: list[int], prompt_ids: list[int],
                 output_ids: list[int], generator: torch.Generator | None,
                 matcher: Any = None) -> int:
    """Process and sample one row of logits; with a grammar's `matcher`, under its mask
    (engine/grammar.py `constrain`)."""
    def process(r: torch.Tensor) -> None:
        process_row(r, p, banned, prompt_ids, output_ids)

    if matcher is None:
        process(row)
    else:
        constrain(row, matcher, process)
    return sample_row(row, p, generator)


@torch.inference_mode()
def sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one processed row of logits [V] (float32)."""
    if p.greedy:
        return int(row.argmax().item())
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    total = float(probs.sum())
    if not total > 0.0 or total != total or total == float("inf"):
        raise ValueError("no token can be sampled: every token is banned or has no probability")
    return int(torch.multinomial(probs, 1, generator=generator).item())
