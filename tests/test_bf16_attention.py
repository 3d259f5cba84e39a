"""The bf16 attention kernels (native_amx_attn.h on AMX tiles, native_vdp_attn.h by AVX-512 BF16
dot products): as accurate as PyTorch's flash kernel, and a query row's bits depend on nothing but
its own query, keys and values: not on the split of its keys into steps, the other rows or
sequences of the call, the thread count or the memory layout, and never on memory past the
context. Each test runs for every kernel the CPU runs; skipped on CPUs with neither."""

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from duplexkv.layers import amx, attention
from test_packed_linear import each_kernel, needs_kernel

pytestmark = needs_kernel


def _qkv(n, heads, kv_heads, dim, seed, ctx=None):
    g = torch.Generator().manual_seed(seed)
    ctx = n if ctx is None else ctx
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    k = torch.randn(kv_heads, ctx, dim, generator=g).bfloat16()
    v = torch.randn(kv_heads, ctx, dim, generator=g).bfloat16()
    return q, k, v


def _exact(q, k, v, start):
    """float64 causal attention of q [n, H, D] at positions start .. over k/v [KVH, >=, D]."""
    n, h, d = q.shape
    group = h // k.shape[0]
    out = torch.empty(n, h, d, dtype=torch.float64)
    pos = torch.arange(start, start + n)[:, None]
    for head in range(h):
        kk, vv = k[head // group, : start + n].double(), v[head // group, : start + n].double()
        s = (q[:, head].double() @ kk.T) * d ** -0.5
        s = s.masked_fill(torch.arange(start + n)[None] > pos, float("-inf"))
        out[:, head] = torch.softmax(s, -1) @ vv
    return out


@pytest.mark.parametrize("heads,kv_heads,dim,start,n", [
    (8, 2, 64, 0, 600), (8, 2, 64, 3000, 200), (2, 1, 32, 0, 300), (4, 1, 128, 70, 500),
    (8, 8, 64, 0, 1), (16, 1, 32, 40, 3)])
@each_kernel
def test_as_accurate_as_pytorchs_flash_kernel(kernel, heads, kv_heads, dim, start, n):
    q, k, v = _qkv(n, heads, kv_heads, dim, heads + dim + start, ctx=start + n)
    got = amx.attention(q, [(k, v, 0, n, start)], dim ** -0.5, kernel=kernel)
    group = heads // kv_heads
    qh = F.pad(q.transpose(0, 1)[None], (0, 0, start, 0)).contiguous()
    flash = F.scaled_dot_product_attention(
        qh, k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None],
        is_causal=True)[0, :, start:].transpose(0, 1)
    exact = _exact(q, k, v, start)
    err, ref = (got.double() - exact).abs(), (flash.double() - exact).abs()
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert err.mean() <= 1.1 * ref.mean() + 1e-6, (err.mean(), ref.mean())
    assert err.max() <= 2 * ref.max() + 2 ** -9, (err.max(), ref.max())


@each_kernel
def test_a_rows_bits_do_not_depend_on_the_chunking_the_batch_threads_or_layout(kernel):
    heads, kv_heads, dim, t = 8, 2, 64, 1500
    attend = functools.partial(amx.attention, kernel=kernel)
    q, k, v = _qkv(t, heads, kv_heads, dim, 5)
    scale = dim ** -0.5
    whole = attend(q, [(k, v, 0, t, 0)], scale)
    rng = random.Random(3)
    # prompt split into chunks at random points (prefix cache, chunked prefill), and into chunks
    # of at most 16 folded rows (a lone tile, whose scores are K . Q^T, not Q . K^T)
    small = [0, 3, 7, 8, 12, 13, 77, 80, 81, t]
    for cuts in [small] + [[0, *sorted(rng.sample(range(1, t), 7)), t] for _ in range(6)]:
        parts = [attend(q[a:b].contiguous(), [(k, v, 0, b - a, a)], scale)
                 for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts
    # decode rows of several sequences in one call, in any order, beside a prefill chunk
    rows = [0, 3, 63, 64, 65, 511, 1023, 1499]
    other_q, other_k, other_v = _qkv(40, heads, kv_heads, dim, 9)
    qs = torch.cat([other_q, q[rows[::-1]]]).contiguous()
    seqs = [(other_k, other_v, 0, 40, 0)] + [(k, v, 40 + i, 1, p)
                                            for i, p in enumerate(rows[::-1])]
    got = attend(qs, seqs, scale)
    assert torch.equal(got[40:], whole[rows[::-1]])
    assert torch.equal(got[:40], attend(other_q, [(other_k, other_v, 0, 40, 0)], scale))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend(q, [(k, v, 0, t, 0)], scale), whole)
    finally:
        torch.set_num_threads(threads)
    # token-major [L, KVH, D] storage (a gathered copy, the step's own K/V), V of another stride
    kt = k.transpose(0, 1).contiguous()
    vt = torch.cat([v.transpose(0, 1), v.transpose(0, 1)], dim=-1)[..., :dim]
    got = attend(q, [(kt.transpose(0, 1), vt.transpose(0, 1), 0, t, 0)], scale)
    assert torch.equal(got, whole)


@each_kernel
def test_memory_past_the_context_is_never_read(kernel):
    """A mirror's buffer past the context may hold another sequence's KV or fresh memory."""
    attend = functools.partial(amx.attention, kernel=kernel)
    q, k, v = _qkv(100, 8, 2, 64, 11, ctx=100)
    clean = attend(q, [(k, v, 0, 100, 0)], 0.125)
    kn, vn = (torch.full((2, 300, 64), float("nan")).bfloat16() for _ in range(2))
    kn[:, :100], vn[:, :100] = k, v
    got = attend(q, [(kn, vn, 0, 100, 0)], 0.125)
    assert torch.equal(got, clean)
    one = attend(q[99:].contiguous(), [(kn, vn, 0, 1, 99)], 0.125)
    assert torch.equal(one, clean[99:])


def test_bad_shapes_are_refused():
    q, k, v = _qkv(10, 8, 2, 64, 1)
    with pytest.raises(ValueError):
        amx.attention(q.float(), [(k, v, 0, 10, 0)], 0.125)
    with pytest.raises(ValueError):  # keys shorter than the positions
        amx.attention(q, [(k[:, :5], v[:, :5], 0, 10, 0)], 0.125)
    with pytest.raises(ValueError):  # rows past q
        amx.attention(q, [(k, v, 5, 10, 0)], 0.125)
    with pytest.raises(ValueError):
        amx.attention(q, [], 0.125)
    with pytest.raises(MemoryError):  # head size not a multiple of 32: the kernel refuses it
        amx.attention(q[..., :48].contiguous(), [(k[..., :48], v[..., :48], 0, 10, 0)], 0.125)
    assert not attention.kernel_runs(torch.bfloat16, 48)  # so the engine never sends it there


def test_engine_attention_takes_the_kernel_for_bf16():
    assert attention.kernel_runs(torch.bfloat16, 64)
    assert not attention.kernel_runs(torch.float32, 64)
    assert attention.mirror_block(torch.bfloat16, 64) == 0  # the kernel never reads past
