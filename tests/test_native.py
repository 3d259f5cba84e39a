"""The native float32 decode kernels against PyTorch's own results, and their build fallback."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from duplexkv.layers import native
from duplexkv.layers.staging import kv_append

F32_TESTS = Path(__file__).with_name("test_f32_attention.py")  # run again in the Haswell build


@pytest.fixture(autouse=True)
def _kernels_loaded():
    """The kernels' entry points expect their `*_ok` check to have loaded the library first; a
    test run alone (`-k`) must not depend on an earlier test having done it."""
    native.available()


def test_the_kernels_build_here():
    # CI has a C compiler: a silent fallback to the PyTorch paths would hide every test below
    assert native.available(), "native kernels did not build (see the log's warning)"


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 12, 15, 16])  # every tile shape
@pytest.mark.parametrize("n,k", [(64, 64), (67, 192), (4096, 32), (5, 16), (67, 512)])
def test_linear_matches_torch(m, n, k):  # k 512: rows long enough to prefetch the next block
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    assert native.linear_ok(x, w)
    # against the float64 product: float32 sums of k terms in any order sit ~1e-6 * sqrt(k) away
    exact = F.linear(x.double(), w.double()).float()
    tol = 1e-5 * max(1.0, (k / 192) ** 0.5)  # 1e-5 up to the 192-term rows, as against F.linear
    torch.testing.assert_close(native.linear(x, w), exact, rtol=tol, atol=tol)


def test_linear_refuses_what_it_cannot_take():
    w = torch.randn(16, 24)
    assert not native.linear_ok(torch.randn(2, 24), w)  # K not a multiple of 16
    assert not native.linear_ok(torch.randn(2, 16).bfloat16(), torch.randn(4, 16).bfloat16())
    assert not native.linear_ok(torch.randn(16, 2).t(), torch.randn(4, 16))  # x not contiguous


def _sdpa(q, k, v, scale):
    """q [H, D] over k/v [KVH, L, D], heads of a KV group adjacent (the engine's fold)."""
    kvh = k.shape[0]
    qh = q.view(1, kvh, q.shape[0] // kvh, q.shape[1])
    return F.scaled_dot_product_attention(qh, k[None], v[None], scale=scale).reshape(q.shape)


@pytest.mark.parametrize("kvh,group,d", [(1, 2, 32), (2, 4, 64), (4, 1, 16), (1, 16, 128),
                                         (2, 3, 80), (1, 7, 48), (1, 16, 16)])
def test_decode_attention_matches_sdpa_over_mixed_lengths(kvh, group, d):
    # groups and head sizes that take every register-block shape of the P.V pass (4, 2 and 1
    # queries by 4, 2 and 1 vectors of a row on 16-float vectors, by 3, 2 and 1 on 8-float ones)
    g = torch.Generator().manual_seed(kvh * 100 + group * 10 + d)
    lengths = [1, 7, 8, 15, 16, 17, 255, 256, 257, 1000]  # around the 8/16-key and 256-key blocks
    cap = max(lengths) + 5
    mirrors = [torch.randn(2, kvh, cap, d, generator=g) for _ in lengths]  # [K/V, KVH, cap, D]
    keys = [m[0, :, :n] for m, n in zip(mirrors, lengths)]
    values = [m[1, :, :n] for m, n in zip(mirrors, lengths)]
    q = torch.randn(len(lengths), kvh * group, d, generator=g)
    scale = d**-0.5
    out = native.decode_attention(q, keys, values, scale)
    for i in range(len(lengths)):
        torch.testing.assert_close(out[i], _sdpa(q[i], keys[i], values[i], scale),
                                   rtol=1e-5, atol=1e-6)


def test_decode_attention_reads_token_major_gathers():
    # the engine's gathered context is [L, KVH, D]: heads are D floats apart, rows KVH * D
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
    q = torch.randn(1, 8, 64, generator=g)
    out = native.decode_attention(q, [k.transpose(0, 1)], [v.transpose(0, 1)], 0.125)
    ref = _sdpa(q[0], k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), 0.125)
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", ["rising", "falling", "spikes"])
def test_decode_attention_follows_a_maximum_that_moves(shape):
    # the one-pass kernel's online softmax rescales a query's sum and accumulators whenever a
    # block of keys brings a new maximum: scores that rise along the keys (a new maximum in every
    # block, the older weights scaled to nothing), fall (the first block's maximum holds) or
    # jump between blocks and chunks, against float64
    g = torch.Generator().manual_seed(3)
    kvh, group, d, n = 2, 4, 64, 1500
    k, v = torch.randn(kvh, n, d, generator=g), torch.randn(kvh, n, d, generator=g)
    ramp = torch.linspace(0.05, 4.0, n)
    if shape == "rising":
        k *= ramp[None, :, None]
    elif shape == "falling":
        k *= ramp.flip(0)[None, :, None]
    else:
        k[:, torch.randint(0, n, (40,), generator=g)] *= 8.0
    q = torch.randn(1, kvh * group, d, generator=g)
    scale = d**-0.5
    out = native.decode_attention(q, [k], [v], scale)
    ref = _sdpa(q[0].double(), k.double(), v.double(), scale)
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=2e-6)


def test_decode_attention_refuses_what_does_not_fit():
    # the kernel reads raw pointers: a misfit must be an error, never a read past the tensors
    q, kv = torch.randn(2, 8, 64), torch.randn(2, 100, 64)
    bad = [([kv], [kv]),  # one K/V pair for two queries
           ([kv, kv], [kv, kv[:, :50]]),  # K and V of different lengths
           ([kv, torch.randn(4, 100, 64)], [kv, torch.randn(4, 100, 64)]),  # other KV heads
           ([kv, torch.randn(2, 64, 100).transpose(1, 2)],  # last axis not contiguous
            [kv, torch.randn(2, 64, 100).transpose(1, 2)]),
           ([kv, kv.double()], [kv, kv.double()])]
    for keys, values in bad:
        with pytest.raises(ValueError, match="native decode attention"):
            native.decode_attention(q, keys, values, 0.125)
    kv40 = torch.randn(2, 100, 40)  # a head size the kernel's vectors do not divide
    with pytest.raises(ValueError, match="native decode attention"):
        native.decode_attention(torch.randn(2, 8, 40), [kv40, kv40], [kv40, kv40], 0.125)
    assert not native.attention_ok(torch.randn(1, 8, 40), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_append_writes_each_sequences_rows_into_its_store(dtype):
    """One call appends a step's K/V rows (V a strided view into the fused projection, as the
    model passes it) to several sequences' mirrors [KVH, cap, D], each at its own position."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(12, (8 + 2 * 2) * 32, generator=g).to(dtype)
    k = qkv[:, 8 * 32 : 10 * 32].contiguous().view(12, 2, 32)
    v = qkv[:, 10 * 32 :].view(12, 2, 32)
    stores = [torch.randn(2, 2, 40, 32, generator=g).to(dtype) for _ in range(3)]
    want = [st.clone() for st in stores]
    plan = [(0, 1, 7), (1, 10, 0), (11, 1, 39)]  # (first row, rows, position)
    kv_append(k, v, [(st[0], st[1], r, n, p) for st, (r, n, p) in zip(stores, plan)])
    for w, (r, n, p) in zip(want, plan):
        w[0][:, p : p + n] = k[r : r + n].transpose(0, 1)
        w[1][:, p : p + n] = v[r : r + n].transpose(0, 1)
    for st, w in zip(stores, want):
        assert torch.equal(st, w)
    with pytest.raises(ValueError, match="kv_append"):  # past the store's capacity
        kv_append(k, v, [(stores[0][0], stores[0][1], 0, 2, 39)])
    with pytest.raises(ValueError, match="kv_append"):  # rows past the step's
        kv_append(k, v, [(stores[0][0], stores[0][1], 11, 2, 0)])
    with pytest.raises(ValueError, match="kv_append"):  # another dtype
        kv_append(k, v, [(stores[0][0].double(), stores[0][1].double(), 0, 1, 0)])


@pytest.mark.parametrize("m", [1, 3, 16])
def test_add_rmsnorm_matches_torch_and_leaves_the_sum_in_the_residual(m):
    g = torch.Generator().manual_seed(m)
    x, res, w = torch.randn(m, 512, generator=g), torch.randn(m, 512, generator=g), \
        torch.randn(512, generator=g)
    assert native.rows_ok(x)
    torch.testing.assert_close(native.add_rmsnorm(x, None, w, 1e-6),
                               F.rms_norm(x, (512,), w, 1e-6), rtol=1e-5, atol=1e-5)
    want_sum = x + res
    out = native.add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(res, want_sum)  # the residual stream, updated in place
    torch.testing.assert_close(out, F.rms_norm(want_sum, (512,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("m,heads,kv_heads,d", [(1, 8, 2, 64), (5, 2, 1, 32), (16, 4, 4, 128)])
def test_qk_norm_rope_matches_the_models_torch_path(norm, m, heads, kv_heads, d):
    from duplexkv.model.qwen3 import Rotary, apply_rope

    g = torch.Generator().manual_seed(m * 10 + d)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=g)
    w = torch.randn(heads + kv_heads, d, generator=g) if norm else None
    cos, sin = Rotary(d, 1e6, 4096)(torch.randint(0, 4000, (m,), generator=g), torch.float32)
    q, k = native.qk_norm_rope(qkv, w, cos, sin, heads, kv_heads, d, 1e-6)
    qk = qkv[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d)
    if norm:
        qk = F.rms_norm(qk, (d,), None, 1e-6) * w
    want = apply_rope(qk, cos, sin)
    torch.testing.assert_close(q, want[:, :heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want[:, heads:], rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_torch():
    gu = torch.randn(7, 2 * 192) * 4
    gate, up = gu.split(192, dim=-1)
    torch.testing.assert_close(native.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_elementwise_kernels_refuse_what_does_not_fit():
    assert native.rows_ok(torch.randn(300, 64))  # float32: any number of rows too
    assert not native.rows_ok(torch.randn(2, 40))  # not a multiple of 16
    assert not native.rows_ok(torch.randn(2, 64).half())
    assert native.rows_ok(torch.randn(300, 64).bfloat16())  # bf16: any number of rows
    assert not native.rows_ok(torch.randn(2, 40).bfloat16())
    assert not native.rows_ok(torch.randn(64, 2).t())
    with pytest.raises(ValueError):  # mixed dtypes
        native.add_rmsnorm(torch.randn(2, 64).bfloat16(), None, torch.ones(64), 1e-6)
    with pytest.raises(ValueError):
        native.add_rmsnorm(torch.randn(2, 64), torch.randn(3, 64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError):
        native.add_rmsnorm(torch.randn(2, 64), None, torch.ones(32), 1e-6)
    with pytest.raises(ValueError):  # x itself not contiguous
        native.add_rmsnorm(torch.randn(64, 2).t(), None, torch.ones(2), 1e-6)
    with pytest.raises(ValueError):
        native.silu_mul(torch.randn(64, 4).t())
    with pytest.raises(ValueError):
        native.silu_mul(torch.randn(2, 63))
    cos = sin = torch.zeros(2, 16)
    with pytest.raises(ValueError):  # qkv is not (2 + 2 * 1) heads of 32
        native.qk_norm_rope(torch.randn(2, 96), None, cos, sin, 2, 1, 32, 1e-6)
    with pytest.raises(ValueError):  # tables of the wrong width
        native.qk_norm_rope(torch.randn(2, 128), None, cos[:, :8], sin, 2, 1, 32, 1e-6)


def test_float32_elementwise_kernels_take_a_prefill_chunks_rows():
    """float32 rows of any count (a prefill chunk's, on the pool's threads): the model's PyTorch
    results to float32 rounding, and a row's bits whatever rows share the call."""
    from duplexkv.model.qwen3 import Rotary, apply_rope

    g = torch.Generator().manual_seed(5)
    m, hidden, heads, kv_heads, d, inter = 700, 512, 8, 2, 64, 384
    x, res = torch.randn(m, hidden, generator=g), torch.randn(m, hidden, generator=g)
    w = torch.rand(hidden, generator=g) + 0.5
    assert native.rows_ok(x)
    stream = res.clone()
    out = native.add_rmsnorm(x, stream, w, 1e-6)
    torch.testing.assert_close(stream, x + res)
    torch.testing.assert_close(out, F.rms_norm(x + res, (hidden,), w, 1e-6), rtol=1e-5, atol=1e-5)
    gu = torch.randn(m, 2 * inter, generator=g) * 4
    act = native.silu_mul(gu)
    torch.testing.assert_close(act, F.silu(gu[:, :inter]) * gu[:, inter:], rtol=1e-5, atol=1e-6)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=g)
    wqk = torch.rand(heads + kv_heads, d, generator=g) + 0.5
    cos, sin = Rotary(d, 1e6, 32768)(torch.randint(0, 32000, (m,), generator=g), torch.float32)
    q, k = native.qk_norm_rope(qkv, wqk, cos, sin, heads, kv_heads, d, 1e-6)
    qk = qkv[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d)
    want = apply_rope(F.rms_norm(qk, (d,), None, 1e-6) * wqk, cos, sin)
    torch.testing.assert_close(q, want[:, :heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want[:, heads:], rtol=1e-5, atol=1e-5)
    for rows in (slice(0, 1), slice(5, 21), slice(33, 600)):
        assert torch.equal(native.add_rmsnorm(x[rows].contiguous(), res[rows].clone(), w, 1e-6),
                           out[rows])
        assert torch.equal(native.silu_mul(gu[rows].contiguous()), act[rows])
        q2, k2 = native.qk_norm_rope(qkv[rows].contiguous(), wqk, cos[rows], sin[rows], heads,
                                     kv_heads, d, 1e-6)
        assert torch.equal(q2, q[rows]) and torch.equal(k2, k[rows])


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    a = torch.where(a < 0, -32768 - a, a)  # sign-magnitude to a monotonic integer line
    b = torch.where(b < 0, -32768 - b, b)
    return int((a - b).abs().max())


def test_bf16_elementwise_kernels_round_as_torchs_bf16_ops_and_keep_a_rows_bits():
    """bf16, any row count (prefill chunks on the pool's threads): within one bf16 ulp of the
    model's PyTorch path (float32 sums in another order), and a row's bits whatever rows share
    the call or where it sits (reuse relies on it: docs/engine.md)."""
    from duplexkv.model.qwen3 import Rotary, apply_rope

    g = torch.Generator().manual_seed(11)
    m, hidden, heads, kv_heads, d, inter = 700, 512, 8, 2, 64, 384
    x = torch.randn(m, hidden, generator=g).bfloat16()
    res = torch.randn(m, hidden, generator=g).bfloat16()
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    assert native.rows_ok(x)
    stream = res.clone()
    out = native.add_rmsnorm(x, stream, w, 1e-6)
    assert torch.equal(stream, x + res)  # the residual sum, rounded as torch rounds it
    assert _bf16_ulps(out, F.rms_norm(x + res, (hidden,), w, 1e-6)) <= 1
    assert _bf16_ulps(native.add_rmsnorm(x, None, w, 1e-6), F.rms_norm(x, (hidden,), w, 1e-6)) <= 1

    gu = (torch.randn(m, 2 * inter, generator=g) * 4).bfloat16()
    gate, up = gu.split(inter, dim=-1)
    act = native.silu_mul(gu)
    assert _bf16_ulps(act, F.silu(gate) * up) <= 2  # an ulp of silu, then the product

    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    wqk = (torch.rand(heads + kv_heads, d, generator=g) + 0.5).bfloat16()
    cos, sin = Rotary(d, 1e6, 32768)(torch.randint(0, 32000, (m,), generator=g), torch.bfloat16)
    q, k = native.qk_norm_rope(qkv, wqk, cos, sin, heads, kv_heads, d, 1e-6)
    qk = qkv[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d)
    want = apply_rope(F.rms_norm(qk, (d,), None, 1e-6) * wqk, cos, sin)
    assert _bf16_ulps(q, want[:, :heads]) <= 2 and _bf16_ulps(k, want[:, heads:]) <= 2

    for rows in (slice(0, 1), slice(5, 8), slice(100, 117), slice(699, 700), slice(33, 600)):
        part = res[rows].clone()
        assert torch.equal(native.add_rmsnorm(x[rows].contiguous(), part, w, 1e-6), out[rows])
        assert torch.equal(native.silu_mul(gu[rows].contiguous()), act[rows])
        q2, k2 = native.qk_norm_rope(qkv[rows].contiguous(), wqk, cos[rows], sin[rows], heads,
                                     kv_heads, d, 1e-6)
        assert torch.equal(q2, q[rows]) and torch.equal(k2, k[rows])


@pytest.mark.parametrize("d", [64, 128, 48])  # 16 lanes at a time (d % 32 == 0), and the loop
def test_bf16_rope_rounds_each_step_exactly_as_torch_keeping_denormals(d):
    """bf16 RoPE without a q/k norm: bf16(bf16(x1 c) - bf16(x2 s)) and bf16(bf16(x2 c) + bf16(x1 s))
    bit for bit as torch's float32 products and roundings give them, denormals kept (an
    instruction that flushes them, VCVTNEPS2BF16, would not be exact)."""
    g = torch.Generator().manual_seed(d)
    m, heads, kv_heads = 33, 4, 2
    scale = torch.logspace(-38, 4, m).unsqueeze(1)  # rows from denormal products to large ones
    qkv = (torch.randn(m, (heads + 2 * kv_heads) * d, generator=g) * scale).bfloat16()
    qkv[0, :8] = torch.tensor([1e-39, -1e-39, 5e-40, 0.0, -0.0, 1.0, float("inf"), -3e38])
    cos = torch.randn(m, d // 2, generator=g).bfloat16()
    sin = torch.randn(m, d // 2, generator=g).bfloat16()
    q, k = native.qk_norm_rope(qkv, None, cos, sin, heads, kv_heads, d, 1e-6)
    x = qkv[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def bf(t):
        return t.bfloat16().float()

    want = torch.cat([bf(x1 * c) - bf(x2 * s), bf(x2 * c) + bf(x1 * s)], dim=-1).bfloat16()
    assert (want.float().abs() < 1.2e-38).logical_and(want.float() != 0).any()  # denormals
    got = torch.cat([q, k], dim=1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_residual_add_rounds_exactly_as_torch_keeping_denormals():
    """The residual stream of bf16 add + RMSNorm is torch's bf16 sum bit for bit, denormal sums
    included (16 lanes at a time on AVX-512 BF16 CPUs; a flushing conversion would zero them)."""
    g = torch.Generator().manual_seed(5)
    m, n = 9, 512
    scale = torch.logspace(-39, 2, m).unsqueeze(1)
    x = (torch.randn(m, n, generator=g) * scale).bfloat16()
    res = (torch.randn(m, n, generator=g) * scale).bfloat16()
    want = (x.float() + res.float()).bfloat16()
    assert (want.float().abs() < 1.2e-38).logical_and(want.float() != 0).any()  # denormals
    stream = res.clone()
    native.add_rmsnorm(x, stream, torch.ones(n).bfloat16(), 1e-6)
    assert torch.equal(stream.view(torch.int16), want.view(torch.int16))


def test_kernels_called_from_many_threads_at_once_are_right():
    """The kernels' thread pool runs one job at a time; callers that find it busy run alone."""
    from concurrent.futures import ThreadPoolExecutor

    assert native.available()
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(1000, 256, generator=g), torch.randn(4, 256, generator=g)
    want = native.linear(x, w)  # alone; float32 sums of 256 terms, whatever BLAS's order:
    assert torch.allclose(want.double(), x.double() @ w.double().T, rtol=0, atol=1e-4)
    # (F.linear itself was 1.9e-5 off on an AMD EPYC Zen 4, outside the 1e-5 once asked here)

    def work(_):  # each row is summed by one thread in one order: the same bits under contention
        return all(torch.equal(native.linear(x, w), want) for _ in range(200))
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))


def test_a_forked_child_runs_the_kernels():
    """A child forked after the pool started has none of its helper threads: its jobs must not
    wait for them (they would spin forever)."""
    import time

    assert native.available()
    x, w = torch.randn(2, 64), torch.randn(4096, 64)
    want = F.linear(x, w)
    native.linear(x, w)  # the parent's helpers are up
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = torch.allclose(native.linear(x, w), want, rtol=1e-5, atol=1e-5)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's kernel call did not return")


def _run_checks_in_a_build_for(march: str, tmp_path: Path, also: list[Path]) -> None:
    """The float32 checks of this file (and the files in `also`) in a process of its own whose
    kernels are built with `-march=march` instead of for this CPU."""
    code = ("import sys, pytest\nfrom duplexkv.layers import native\n"
            f"native.COMPILE_FLAGS[native.COMPILE_FLAGS.index('-march=native')] = '-march={march}'\n"
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', "
            "'(decode or linear or rmsnorm or rope or silu) and not build and not engine'])"
            + "".join(f" or pytest.main(['-q', '-p', 'no:cacheprovider', {str(f)!r}])" for f in also)
            + ")\n")
    env = {**os.environ, "DUPLEXKV_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and (tmp_path / "kernels").is_dir()


def test_the_avx2_build_is_right_on_a_cpu_with_more(tmp_path):
    """The kernels are built for the CPU they run on, so a machine with AVX-512 never runs their
    8-float paths (AVX2 CPUs, the project's AMD kind). Build them for Haswell here too and run the
    float32 checks above and the float32 prefill attention's (tests/test_f32_attention.py) against
    it, in a process of its own."""
    if platform.machine() != "x86_64" or "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU's own build is the AVX2 (or non-x86) one: the tests above ran it")
    _run_checks_in_a_build_for("haswell", tmp_path, [F32_TESTS])


def test_a_build_without_avx2_is_right_too(tmp_path):
    """Builds without AVX2 (8-float vectors, no FMA: e.g. x86-64-v2) keep the three-pass decode
    attention, which AVX2 and AVX-512 builds no longer run (native_f32_attn.h): the float32
    checks above against it (their prefill attention is PyTorch's there)."""
    if platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU's own build has no AVX2: the tests above ran it")
    _run_checks_in_a_build_for("x86-64-v2", tmp_path, [])


def test_loading_the_kernels_keeps_denormals():
    # -ffast-math at link time would switch the whole process to flush-to-zero
    assert native.available()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def test_without_a_compiler_the_engine_falls_back(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "DUPLEXKV_CACHE_DIR": str(tmp_path)}
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from duplexkv.layers import native\nprint(native.available())\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "native decode kernels unavailable" in r.stderr and "no-such-cc" in r.stderr


def test_engine_tokens_equal_the_pytorch_paths(tiny_model_dir):
    """Greedy tokens with the kernels equal those without (the same engine, PyTorch's linear and
    SDPA), for a batch whose steps mix prefill chunks with decode rows and for mirror-less
    sequences (gathered context)."""
    import random

    from duplexkv import LLM, SamplingParams

    rng = random.Random(7)
    ps = [[rng.randrange(3, 4000) for _ in range(rng.randint(20, 300))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = {}
    for mode in ("native", "torch", "no-mirrors"):
        llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=64,
                  num_kv_blocks=256)
        if mode == "no-mirrors":
            llm.engine.runner.mirrors.budget_bytes = 0
        lib = native.library()
        native._lib = None if mode == "torch" else lib
        try:
            outs[mode] = [o.token_ids for o in llm.generate(ps, params)]
        finally:
            native._lib = lib
    assert outs["native"] == outs["torch"] == outs["no-mirrors"]


def test_the_build_digest_reads_every_file_the_compiler_reads():
    """A kernel header left out of SOURCES would not change the build's digest: an edit to it
    would keep loading the old library from the cache."""
    import re

    seen, todo = set(), [native.SOURCE.name]
    while todo:
        name = todo.pop()
        seen.add(name)
        text = native.SOURCE.with_name(name).read_text()
        todo += [h for h in re.findall(r'#include "([^"]+)"', text) if h not in seen]
    assert seen == {p.name for p in native.SOURCES}
