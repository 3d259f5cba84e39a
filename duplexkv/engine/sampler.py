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


def modifies(p: SamplingParams, banned: list[int]) -> bool:
    """Whether `process_row` changes a row under these parameters and bans."""
    return bool(banned or p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty)


@torch.inference_mode()  # logits are inference tensors: modify them in that mode
def process_row(row: torch.Tensor, p: SamplingParams, banned: list[int],
                prompt_ids: list[int], output_ids: list[int]) -> None:
    """Apply, in place on one row of logits [V]: logit_bias, penalties (vLLM's order and
    meaning: repetition over prompt + output, presence/frequency over the output), then bans
    (stop and eos tokens before min_tokens). `modifies` gates it, as it gates sample_token's
    greedy shortcut, so a processing added here without it would not run on either path."""
    if not modifies(p, banned):
        return
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
                 matcher: Any = None, top: int | None = None) -> int:
    """Process and sample one row of logits; with a grammar's `matcher`, under its mask
    (engine/grammar.py `constrain`). `top`: the row's `greedy` pick if known (`greedy_rows`)."""
    if matcher is None and p.greedy and not modifies(p, banned):
        # the common case, without the two calls' inference-mode switches
        return greedy(row) if top is None else top

    def process(r: torch.Tensor) -> None:
        process_row(r, p, banned, prompt_ids, output_ids)

    if matcher is None:
        process(row)
    else:
        constrain(row, matcher, process)
    return sample_row(row, p, generator)


def greedy(row: torch.Tensor) -> int:
    """The most probable token: the first index of the row's largest value (a NaN counts as the
    largest, as in torch.argmax). numpy's argmax took 7 us for a 32000-float row where torch's took
    47 (one call per sampled row each step; AMD EPYC Zen 2, 2 threads, OMP_WAIT_POLICY=PASSIVE)."""
    if row.dtype == torch.float32 and row.dim() == 1:
        return int(row.numpy().argmax())
    return int(row.argmax().item())


def greedy_rows(logits: torch.Tensor) -> list[int] | None:
    """`greedy` of every row of float32 logits [B, V] at once (None for other logits): one numpy
    call instead of one per row (8 rows of 32,000: ~0.15 -> ~0.06 ms, AMD EPYC Zen 2)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] < 2:
        return None
    return logits.numpy().argmax(axis=1).tolist()


# how many of the most probable tokens a top-p nucleus is looked for among, in turn, before the
# whole vocabulary is sorted: Qwen's 151,936 probabilities took 12-35 ms to sort, their top 256
# 0.3 ms, top 4,096 1.0 ms, top 32,768 ~2 ms (AMD EPYC Zen 4, 2 threads)
NUCLEUS_CANDIDATES = (256, 4096, 32768)


@torch.inference_mode()
def sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one processed row of logits [V] (float32)."""
    if p.greedy:
        return greedy(row)
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    ids = None  # the token id of each entry of probs; None: entry i is token i
    if p.top_p < 1.0:
        probs, ids = nucleus(probs, p.top_p)
    total = float(probs.sum())
    if not total > 0.0 or total != total or total == float("inf"):
        raise ValueError("no token can be sampled: every token is banned or has no probability")
    j = race(probs, generator)
    return j if ids is None else int(ids[j])


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most probable tokens whose mass reaches top_p: (their probabilities,
    descending, the rest of the candidates 0; their token ids). A token is kept when the mass
    before it is at most top_p. When the k most probable tokens hold more than top_p, every token
    past them is dropped (the mass before each is more), so the nucleus is found among them; the
    whole vocabulary is sorted only when none of `NUCLEUS_CANDIDATES` holds that much."""
    for k in NUCLEUS_CANDIDATES:
        if k >= probs.shape[0]:
            break
        sorted_p, ids = torch.topk(probs, k)  # descending
        cum = sorted_p.cumsum(-1)
        if float(cum[-1]) > top_p:
            return sorted_p.masked_fill(cum - sorted_p > top_p, 0.0), ids
    sorted_p, ids = torch.sort(probs, descending=True)
    cum = sorted_p.cumsum(-1)
    return sorted_p.masked_fill(cum - sorted_p > top_p, 0.0), ids


def race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Entry i with probability probs[i] / sum(probs): the first of independent exponential clocks
    with rates probs[i] to ring, i.e. argmax probs[i] / E_i with E_i ~ Exp(1), as vLLM samples
    (torch.multinomial took 3-8 ms for one draw over 151,936 tokens on the same CPU). E_i = -log
    U_i, U_i uniform in [0, 1) (`exponential_` took 3.1 ms for those 151,936, uniform_ and log
    0.9): never 0 (U < 1), and infinite (U = 0) only clamped to the largest float, so a token of
    probability 0 is never drawn and a lone token of positive probability always is."""
    clocks = torch.empty_like(probs).uniform_(generator=generator).log_().neg_()
    clocks.clamp_(max=torch.finfo(probs.dtype).max)
    return int((probs / clocks).argmax())
