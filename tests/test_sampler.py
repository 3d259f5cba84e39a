"""The sampler draws each token with the probability temperature, top-k, min-p and top-p give it,
and a large vocabulary is neither sorted whole nor drawn from by torch.multinomial (both took
milliseconds per row at Qwen's 151,936 tokens)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from duplexkv.engine.sampler import greedy, greedy_rows, nucleus, race, sample_row, sample_token
from duplexkv.wire.sampling import SamplingParams


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Each token's probability after the processing, by the textbook steps: a full sort."""
    row = logits / p.temperature
    if 0 < p.top_k < row.shape[0]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row.double(), dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p <= p.top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p * keep)
    return probs / probs.sum()


def frequencies(draw, n: int, size: int) -> torch.Tensor:
    counts = torch.zeros(size, dtype=torch.float64)
    for _ in range(n):
        counts[draw()] += 1
    return counts / n


def assert_close(freq: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    for tok, (f, e) in enumerate(zip(freq.tolist(), expected.tolist())):
        if e == 0:
            assert f == 0, f"token {tok} of probability 0 drawn ({f:.4f})"
        else:  # five standard deviations of a binomial count: a seeded run, so never flaky
            assert abs(f - e) <= 5 * math.sqrt(e * (1 - e) / n) + 1e-9, (tok, f, e)


@torch.inference_mode()
def test_greedy_picks_what_torch_argmax_picks():
    # ties: the first index; a NaN counts as the largest (its first); banned tokens at -inf;
    # a strided row and a bfloat16 one take the same answer
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 32000, generator=g)
    rows[1, 7] = rows[1, 9] = float("nan")
    rows[2] = float("-inf")
    rows[2, 5] = rows[2, 6] = 3.0
    rows[3] = 1.0
    rows[4, 100:] = rows[4, :100].max() + 1
    for r in [*rows, rows[:, 3], rows[5].bfloat16()]:
        assert greedy(r) == int(r.argmax())
    assert greedy_rows(rows) == [int(r.argmax()) for r in rows]  # the batch's at once
    assert sample_row(rows[2].clone(), SamplingParams(temperature=0), None) == 5


@torch.inference_mode()
@pytest.mark.parametrize("change", ["none", "ban", "logit_bias", "repetition", "presence"])
def test_greedy_sampling_applies_every_processing_before_the_argmax(change):
    """A greedy row with nothing to process takes the argmax straight away; a ban, a logit
    bias or a penalty still moves the pick off the top token."""
    row = torch.zeros(100)
    row[7], row[3] = 5.0, 4.0
    kw, banned = {"temperature": 0}, []
    if change == "ban":
        banned = [7]
    elif change == "logit_bias":
        kw["logit_bias"] = {7: -10.0}
    elif change == "repetition":
        kw["repetition_penalty"] = 2.0
    elif change == "presence":
        kw["presence_penalty"] = 2.0
    before = row.clone()
    tok = sample_token(row, SamplingParams(**kw), banned, [1], [7], None)
    assert tok == (7 if change == "none" else 3)
    assert change != "none" or torch.equal(row, before)  # nothing to process: untouched


def test_race_draws_each_entry_with_its_share():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(24, generator=gen) * 1.5, dim=-1)
    probs[[3, 17]] = 0.0
    probs = probs * 0.7  # shares, not a distribution: race normalises
    n = 30000
    freq = frequencies(lambda: race(probs, gen), n, 24)
    assert_close(freq, probs.double() / probs.double().sum(), n)


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                                {"temperature": 1.3, "top_k": 12, "top_p": 0.8},
                                {"temperature": 0.9, "min_p": 0.05, "top_p": 0.95}])
def test_sample_row_draws_each_token_with_its_processed_probability(kw):
    p = SamplingParams(**kw)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, generator=gen) * 2
    n = 12000
    freq = frequencies(lambda: sample_row(logits.clone(), p, gen), n, 40)
    assert_close(freq, reference(logits, p), n)


def test_nucleus_keeps_what_a_full_sort_keeps_on_both_paths():
    gen = torch.Generator().manual_seed(3)
    paths = {"candidates": 0, "whole sort": 0}
    for trial in range(60):
        size = 3000 if trial % 2 else 5000
        scale = [0.05, 1.0, 3.0, 8.0][trial % 4]
        probs = torch.softmax(torch.randn(size, generator=gen) * scale, dim=-1)
        top_p = [0.5, 0.9, 0.99, 0.999][(trial // 4) % 4]
        kept, ids = nucleus(probs, top_p)
        paths["whole sort" if kept.shape[0] == size else "candidates"] += 1
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p <= top_p
        want = {int(t): float(v) for t, v, k in zip(idx, sorted_p, keep) if k and v > 0}
        got = {int(t): float(v) for t, v in zip(ids, kept) if v > 0}
        assert got == want, (trial, len(got), len(want))
    assert min(paths.values()) > 5, paths  # both ways of finding the nucleus were checked


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        self.seen.append((str(func), first.numel() if isinstance(first, torch.Tensor) else 0))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                                {"temperature": 0.7, "top_p": 0.95, "top_k": 40}])
def test_a_large_vocabulary_is_neither_sorted_whole_nor_drawn_by_multinomial(kw):
    vocab = 151936
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(vocab, generator=gen) * 4
    with Ops() as ops:
        tok = sample_row(logits, SamplingParams(**kw), gen)
    assert 0 <= tok < vocab
    assert not [op for op, numel in ops.seen if "sort" in op and numel == vocab], ops.seen
    assert not [op for op, _ in ops.seen if "multinomial" in op], ops.seen


def test_sampler_cost_bench_prints_a_row_per_setting(tmp_path, capsys):
    from pathlib import Path

    from duplexkv_bench import sampler_cost

    out = tmp_path / "rows.json"
    tree = str(Path(__file__).resolve().parents[1])
    assert sampler_cost.main(["--vocab", "300", "--rounds", "1", "--old", tree,
                              "--json", str(out)]) == 0
    rows = __import__("json").loads(out.read_text())
    assert len(rows) == len(sampler_cost.SETTINGS)
    assert all(r["old"] > 0 and r["this"] > 0 and r["vocab"] == 300 for r in rows)
    assert "this / old" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sampler_cost.main(["--old", str(tmp_path)])  # no sampler there: a message, not a trace
