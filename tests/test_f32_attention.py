"""The float32 prefill attention kernel (native_f32_prefill.h, AVX-512 and AVX2 builds) against causal
attention in float64, over the shapes and layouts the engine gives it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duplexkv.layers import attention, causal_kernel, native

pytestmark = pytest.mark.skipif(
    not causal_kernel.f32_ok(torch.empty(1, 1, 64), 1),
    reason="the float32 prefill kernel is built for AVX-512 and AVX2 CPUs only (elsewhere: SDPA)")


def _reference(q, k, v, start, scale):
    """q [n, H, D] at positions start.. over k/v [KVH, >= start + n, D], float64, lower-right
    causal, a KV group's query heads adjacent."""
    n, h, d = q.shape
    kvh = k.shape[0]
    kk = k[:, : start + n].double().repeat_interleave(h // kvh, 0)  # [H, L, D]
    vv = v[:, : start + n].double().repeat_interleave(h // kvh, 0)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), kk, vv, attn_mask=mask,
                                       scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("kvh,group,d", [(2, 4, 64), (1, 2, 32), (1, 1, 16), (2, 3, 80),
                                         (1, 8, 128), (1, 4, 256)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 5), (0, 64), (0, 130), (37, 9), (64, 64),
                                     (300, 77), (5, 1)])
def test_rows_match_float64_over_mirror_layouts(kvh, group, d, start, n):
    g = torch.Generator().manual_seed(kvh + 10 * group + d + start + n)
    cap = start + n + 11
    kv = torch.randn(2, kvh, cap, d, generator=g)  # a mirror [KVH, cap, D] per K and V
    q = torch.randn(n + 3, kvh * group, d, generator=g)  # 3 other rows: not this sequence's
    out = torch.full_like(q, 7.0)
    causal_kernel.f32_attention(q, [(kv[0], kv[1], 2, n, start)], d**-0.5, out)
    ref = _reference(q[2 : 2 + n], kv[0], kv[1], start, d**-0.5)
    torch.testing.assert_close(out[2 : 2 + n].double(), ref, rtol=2e-5, atol=2e-5)
    assert (out[:2] == 7.0).all() and (out[2 + n :] == 7.0).all()  # only the sequence's rows


def test_a_step_of_sequences_in_one_call_with_token_major_keys():
    # fresh prefills read the step's own K/V [n, KVH, D] (head stride D, row stride KVH * D)
    g = torch.Generator().manual_seed(5)
    kvh, group, d = 2, 4, 64
    lens = [(0, 200), (120, 33), (0, 1), (7, 70)]
    t = sum(n for _, n in lens)
    q = torch.randn(t, kvh * group, d, generator=g)
    seqs, refs, row = [], [], 0
    for start, n in lens:
        kv = torch.randn(start + n, 2, kvh, d, generator=g)
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [KVH, L, D] strided views
        seqs.append((k, v, row, n, start))
        refs.append(_reference(q[row : row + n], k, v, start, 0.125))
        row += n
    out = causal_kernel.f32_attention(q, seqs, 0.125)
    row = 0
    for (start, n), ref in zip(lens, refs):
        torch.testing.assert_close(out[row : row + n].double(), ref, rtol=2e-5, atol=2e-5)
        row += n


def test_large_scores_stay_finite_and_exact_masking():
    # scores of hundreds (log2 units) must not overflow; a future key must weigh exactly zero
    g = torch.Generator().manual_seed(9)
    d = 64
    k = torch.randn(1, 100, d, generator=g) * 30
    v = torch.randn(1, 100, d, generator=g)
    q = torch.randn(100, 1, d, generator=g) * 30
    out = causal_kernel.f32_attention(q, [(k, v, 0, 100, 0)], 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], v[0, 0])  # row 0 sees key 0 only
    v2 = v.clone()
    v2[0, 50:] = 1e30  # changing keys/values after row 49 changes nothing before it
    out2 = causal_kernel.f32_attention(q, [(k, v2, 0, 100, 0)], 1.0)
    assert torch.equal(out[:50], out2[:50])


def test_what_does_not_fit_is_refused():
    q = torch.randn(4, 8, 64)
    kv = torch.randn(2, 10, 64)
    with pytest.raises(ValueError, match="float32 attention"):
        causal_kernel.f32_attention(q, [(kv, kv, 0, 4, 7)], 0.1)  # keys end before start + n
    with pytest.raises(ValueError, match="float32 attention"):
        causal_kernel.f32_attention(q, [(kv, kv, 2, 4, 0)], 0.1)  # rows past q's end
    with pytest.raises(ValueError, match="float32 attention"):
        causal_kernel.f32_attention(q.bfloat16(), [(kv.bfloat16(), kv.bfloat16(), 0, 4, 0)], 0.1)
    assert not causal_kernel.f32_ok(torch.randn(1, 8, 40), 2)  # D not a multiple of 16
    assert not causal_kernel.f32_ok(torch.randn(1, 8, 64).bfloat16(), 2)
