"""The attention fast paths against plain references: the folded-GQA prefix/causal split against
one masked SDPA call, the mirror rebuild against a gather, and the mirror buffers' budget."""

import pytest
import torch
import torch.nn.functional as F

from duplexkv import LLM, SamplingParams
from duplexkv.layers import attention
from duplexkv.layers.staging import MirrorSet, fill_from_pool


@pytest.mark.parametrize("step", [1, attention.SHAPE_STEP])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("start,n", [(1, 5), (37, 11), (64, 64), (100, 40)])
def test_prefix_causal_equals_masked_sdpa(heads, kv_heads, start, n, step):
    if attention._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash kernel with log-sum-exp")
    g = torch.Generator().manual_seed(start * 100 + n)
    d = 16
    q = torch.randn(n, heads, d, generator=g)
    k = torch.randn(1, kv_heads, start + n, d, generator=g)
    v = torch.randn(1, kv_heads, start + n, d, generator=g)
    got = attention._prefix_causal(q, k, v, start, d ** -0.5, step)
    group = heads // kv_heads
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
        attn_mask=mask, scale=d ** -0.5)[0].transpose(0, 1)
    assert got.shape == (n, heads, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 530])
def test_decode_split_at_shape_step_equals_one_call(length):
    if attention._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash kernel with log-sum-exp")
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, 2, 4, 16, generator=g)  # 2 KV heads, 4 query heads folded per group
    k, v = (torch.randn(1, 2, length, 16, generator=g) for _ in range(2))
    want = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    got = attention._decode(q, k, v, 0.25, attention.SHAPE_STEP)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_kernel_shapes_stay_bounded(tiny_model_dir, monkeypatch):
    """bf16 on an AMX CPU: the flash kernel JIT-compiles code per (query, key) length pair and
    never frees it, so RSS grew with every new length. The real engine, over 48 distinct prompt
    lengths and their decode steps, may pass the kernel only multiples of SHAPE_STEP (and decode
    remainders shorter than it)."""
    if attention._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash kernel with log-sum-exp")
    seen: set[tuple[int, int]] = set()
    real_sdpa, real_lse = F.scaled_dot_product_attention, attention._FLASH_LSE

    def record(q, k):
        seen.add((q.shape[-2], k.shape[-2]))

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: (record(q, k), real_sdpa(q, k, v, **kw))[1])
    monkeypatch.setattr(attention, "_FLASH_LSE",
                        lambda q, k, v, **kw: (record(q, k), real_lse(q, k, v, **kw))[1])
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=256)
    # 48 lengths 40..651, 13 apart (coprime with SHAPE_STEP: every remainder occurs); shorter
    # than the 40..1779 this took before, bf16 being emulated (slow) on CPUs without it
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(40 + 13 * i)] for i in range(48)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(0, 48, 4):  # a few at once: batched steps with mixed lengths
        llm.generate(prompts[i:i + 4], sp)
    step = attention.SHAPE_STEP
    odd = {s for s in seen if any(n % step and n >= step for n in s)}
    assert not odd, f"lengths not rounded to {step}: {sorted(odd)[:10]}"
    assert len(seen) <= 150, len(seen)  # unrounded: one new pair per prompt and decode step


def test_fill_from_pool_matches_gather_for_partial_blocks():
    pool = torch.randn(10, 3, 2, 4, 2, 8)  # blocks, layers, k/v, block size, kv heads, dim
    table = torch.tensor([7, 2, 9, 0])
    for num_tokens in (1, 4, 6, 16):
        dst = torch.zeros(2, 32, 8)
        fill_from_pool(dst, pool, table, 1, 1, num_tokens)
        want = pool[table, 1, 1].reshape(-1, 2, 8)[:num_tokens].transpose(0, 1)
        assert torch.equal(dst[:, :num_tokens], want)
        assert not dst[:, num_tokens:].any()


def test_mirror_buffers_are_reused_and_stay_in_budget():
    token_bytes = 2 * 2 * 2 * 8 * 4  # layers * k/v * kv heads * dim * float32
    ms = MirrorSet(2, 2, 8, torch.float32, budget_bytes=1024 * token_bytes)
    a = ms.prepare("a", 0, 300)  # capacity 512
    assert a is not None and a.capacity == 512 and not a.rebuild
    a.length = 300
    ptr = a.kv.data_ptr()
    ms.drop_unless(set())  # a finished: its buffer becomes the spare
    assert ms.used_bytes == 512 * token_bytes
    b = ms.prepare("b", 200, 260)  # fits the spare: no new allocation, rebuild from the pool
    assert b is not None and b.kv.data_ptr() == ptr and b.rebuild
    assert ms.spare is None
    c = ms.prepare("c", 0, 600)  # 1024 more would exceed the budget: gather instead
    assert c is None and "c" not in ms.mirrors
    b.length = 260
    assert ms.prepare("b", 260, 261) is b and not b.rebuild
    assert ms.used_bytes <= ms.budget_bytes


def test_a_mirror_s_current_key_block_is_never_stale_past_its_context():
    """A decode row may read its whole key block from the mirror, the keys past its context
    masked: those must be zeros, not a previous sequence's values or fresh memory (NaN would
    turn the masked zeros into NaN)."""
    ms = MirrorSet(1, 1, 8, torch.float32, budget_bytes=1 << 20)
    a = ms.prepare("a", 0, 700, block=512)
    a.kv[:, :, :, :700] = 1.0
    a.length = 700
    assert a.clean == 1024 and not a.kv[:, :, :, 700:1024].any()
    a.kv.fill_(float("nan"))  # as if another sequence's buffer held garbage
    ms.drop_unless(set())
    b = ms.prepare("b", 300, 301, block=512)  # takes the spare, NaN everywhere
    assert b.kv.data_ptr() == a.kv.data_ptr()
    assert not b.kv[:, :, :, 301:512].isnan().any() and b.clean == 512
    b.kv[:, :, :, :301] = 2.0
    b.length = 301
    b.kv[:, :, :, 512:].fill_(float("nan"))
    for pos in range(301, 520):  # decoding on, into the next key block
        ms.prepare("b", pos, pos + 1, block=512)
        b.kv[:, :, :, pos] = 3.0
        b.length = pos + 1
        block_end = (pos // 512 + 1) * 512
        assert not b.kv[:, :, :, : block_end].isnan().any(), pos
    grown = ms.prepare("b", 520, 1100, block=512)  # a new buffer: the copy, this step's
    assert grown.capacity == 2048 and grown.clean == 1536  # 580 tokens, then zeros
    assert (grown.kv[:, :, :, :301] == 2).all() and (grown.kv[:, :, :, 301:520] == 3).all()
    assert not grown.kv[:, :, :, 1100:1536].any()


def test_decode_without_mirrors_matches_mirrors(tiny_model_dir):
    """The gather path (mirror budget exhausted) and the mirror path give the same tokens,
    also for a prompt that hits the prefix cache mid-block (mirror rebuilt from the pool)."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt = list(range(5, 90))
    outs = []
    for budget in (1 << 30, 0):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
        llm.engine.runner.mirrors.budget_bytes = budget
        first = llm.generate([prompt], params)[0].token_ids
        again = llm.generate([prompt + [7, 8, 9]], params)[0]
        assert again.kv_stats.local_hit_tokens >= 80
        outs.append((first, again.token_ids))
        llm.engine.check_integrity()
    assert outs[0] == outs[1]
