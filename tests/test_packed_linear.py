"""The packed bf16 linear (native_amx.h on AMX, native_vdp.h by AVX-512 BF16 dot products
elsewhere): exact sums rounded once, and a row's bits independent of how many rows share the
product, where they sit, and how many threads run it.

Each kernel test runs for every kernel this CPU runs (both on AMX, `vdp` with avx512_bf16 only);
where neither runs every test but one skips and the engine keeps its oneDNN/BLAS paths
(tests/test_linear.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from duplexkv.layers import amx, native
from duplexkv.layers.linear import Linear


def _cpu_flags() -> set[str]:
    return set(next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("flags")), "").split())


def _cpu_kernels() -> list[str]:
    """The kernels this CPU's flags promise (what the build must then provide; AMX unless this
    run leaves it alone, `DUPLEXKV_AMX=0`)."""
    flags = _cpu_flags()
    return [name for name, needs in (("amx", {"amx_tile", "amx_bf16", "avx512_bf16"}),
                                     ("vdp", {"avx512_bf16"}))
            if needs <= flags and (name != "amx" or amx.AMX)]


KERNELS = _cpu_kernels()
needs_kernel = pytest.mark.skipif(not KERNELS, reason="this CPU has neither AMX nor avx512_bf16")
needs_amx = pytest.mark.skipif("amx" not in KERNELS, reason="this CPU has no AMX bf16")
each_kernel = pytest.mark.parametrize("kernel", KERNELS or ["none"])


@needs_kernel
def test_the_kernels_run_where_the_cpu_has_them():
    assert list(amx.kernels()) == KERNELS, "kernel not built or AMX tile state refused"


@needs_amx
def test_with_amx_left_alone_bf16_runs_the_avx512_kernels_as_without_amx(tiny_model_dir):
    """`DUPLEXKV_AMX=0` on an AMX CPU: the kernels, the decode stack and the attention a CPU
    with avx512_bf16 alone runs (how that CPU kind's path is measured and tested here)."""
    code = ("from duplexkv import LLM; from duplexkv.layers import amx, attention; "
            f"llm = LLM({str(tiny_model_dir)!r}, dtype='bfloat16', num_kv_blocks=16); "
            "print(amx.kernels(), llm.engine.runner.model.decode_stack.kernel, "
            "attention.kernel_runs(llm.engine.runner.model.embed_tokens.weight.dtype, 32))")
    for value, want in (("0", "('vdp',) vdp True"), ("1", "('amx', 'vdp') amx True")):
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "DUPLEXKV_AMX": value})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, value


def _case(m, n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@needs_kernel
@each_kernel
@pytest.mark.parametrize("n,k", [(768, 512), (40, 32), (4096, 64), (64, 192), (100, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_output_is_the_exact_sum_rounded_once(kernel, n, k, bias):
    x, w, b = _case(37, n, k, n + k, bias)
    y = amx.linear(x, amx.pack(w), n, b, kernel=kernel)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 accumulation of bf16 products, one bf16 rounding: within 1 bf16 ulp of the exact
    tol = exact.abs() * 2 ** -7 + 1e-6 * k
    assert y.shape == (37, n) and y.dtype == torch.bfloat16
    assert bool(((y.double() - exact).abs() <= tol).all())


@needs_kernel
@each_kernel
@pytest.mark.parametrize("n,k", [(768, 512), (3072, 512), (512, 1536), (4096, 4096), (72, 64)])
def test_a_rows_bits_do_not_depend_on_the_batch_its_place_or_the_threads(kernel, n, k):
    # oneDNN's own bf16 linear differs here for K = 4096 at M <= 128 (it splits K for few rows)
    x, w, _ = _case(2100, n, k, 7)
    packed = amx.pack(w)
    whole = amx.linear(x, packed, n, kernel=kernel)
    for m in (1, 2, 3, 5, 6, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 129, 511, 1024):
        assert torch.equal(amx.linear(x[:m].contiguous(), packed, n, kernel=kernel), whole[:m]), m
        assert torch.equal(amx.linear(x[-m:].contiguous(), packed, n, kernel=kernel),
                           whole[-m:]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = amx.linear(x, packed, n, kernel=kernel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


@needs_kernel
@each_kernel
@pytest.mark.parametrize("n,k", [(32000, 512), (100, 64), (40, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_float_output_is_the_bf16_output_widened(kernel, n, k, bias):
    """The LM head asks for float32 logits: the kernel writes each bf16 result widened, the bits
    of `.float()` on the bf16 output, for any row count (N not a multiple of 32 included)."""
    x, w, b = _case(19, n, k, n + k, bias)
    packed = amx.pack(w)
    for m in (1, 2, 8, 19):
        xm = x[:m].contiguous()
        got = amx.linear(xm, packed, n, b, kernel=kernel, float_out=True)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.equal(got, amx.linear(xm, packed, n, b, kernel=kernel).float()), m
    with pytest.raises(ValueError):  # the fused gate/up has no float32 output
        amx.linear(x, amx.pack_gate_up(w[:64]), 64, silu=True, kernel=kernel, float_out=True)


@needs_kernel
def test_a_packed_lm_head_gives_float_logits_of_its_bf16_product():
    x, w, _ = _case(8, 96, 64, 11)
    lin = Linear(64, 96, bias=False).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    want = lin(x).float()
    assert lin.pack()
    assert torch.equal(lin(x, float_out=True), want)
    plain = Linear(64, 96, bias=False).to(torch.bfloat16)  # not packed: torch's product, widened
    plain.weight.data.copy_(w)
    assert torch.equal(plain(x, float_out=True), plain(x).float())


@needs_kernel
def test_a_packed_linear_module_matches_f_linear_and_releases_its_weight():
    x, w, b = _case(9, 200, 128, 3, bias=True)
    layer = Linear(128, 200, bias=True).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b.bfloat16())
    want = F.linear(x.float(), w.float(), b.bfloat16().float())
    assert layer.pack()
    assert layer.weight.numel() == 0  # the packed copy is the only one
    got = layer(x.view(3, 3, 128))  # leading dims are flattened and restored
    assert got.shape == (3, 3, 200)
    torch.testing.assert_close(got.view(9, 200).float(), want, rtol=2 ** -7, atol=1e-2)


def test_what_the_kernel_cannot_take_stays_on_the_other_paths():
    layer = Linear(48, 16, bias=False).bfloat16()  # in_features not a multiple of 32
    assert not layer.pack()
    assert not Linear(64, 16, bias=False).pack()  # float32 weights
    if amx.kernels():
        packed = amx.pack(torch.zeros(16, 64, dtype=torch.bfloat16))
        with pytest.raises(ValueError):
            amx.linear(torch.zeros(2, 64), packed, 16)  # float32 rows
        with pytest.raises(ValueError):
            amx.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 40)


@needs_kernel
def test_bench_model_bf16_reuse_gives_whole_prompt_tokens_and_kv(tmp_path_factory):
    """The bench model's projections (K = 512 and 1,536) were not row-invariant through oneDNN
    (another blocking above ~64 rows), so a reused history rounded differently from a whole
    prefill: 7 of 32 turns gave other tokens (4 conversations x 4 turns x 2 chunkings) on an AMX
    Xeon (on AMD Zen 4 oneDNN's bf16 rows happened to be invariant for these shapes). With every
    product on the packed kernel (AMX, or AVX-512 BF16 where there is no AMX), multi-turn reuse
    (prefix cache, 4096- and 100-token chunks) gives the tokens and the KV of one whole prefill of
    each prompt."""
    import random

    from duplexkv import LLM, SamplingParams
    from duplexkv.model.synth import make_model

    bench = str(make_model(tmp_path_factory.mktemp("models") / "bench", "bench", seed=0))
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    whole = LLM(bench, dtype="bfloat16", enable_prefix_caching=False, num_kv_blocks=256)
    reusing = {chunk: LLM(bench, dtype="bfloat16", num_kv_blocks=512,
                          max_num_batched_tokens=chunk) for chunk in (4096, 100)}
    once = LLM(bench, dtype="bfloat16", num_kv_blocks=256)
    rng = random.Random(1)
    differ, kv_differ, hits = [], [], 0
    for c in range(3):
        hist = {chunk: [] for chunk in reusing}
        for turn in range(3):
            message = [rng.randrange(10, 32000) for _ in range(rng.randrange(60, 400))]
            for chunk, llm in reusing.items():
                prompt = hist[chunk] + message
                got = llm.generate([prompt], sp)[0]
                if got.token_ids != whole.generate([prompt], sp)[0].token_ids:
                    differ.append((c, turn, chunk))
                hits += got.kv_stats.local_hit_tokens
                hist[chunk] = prompt + list(got.token_ids)
        final = hist[4096][:-1]
        once.generate([final], SamplingParams(max_tokens=1, temperature=0))
        ref = once.engine.bm.match_prefix(final)
        for chunk, llm in reusing.items():
            mine = llm.engine.bm.match_prefix(final)
            n = min(len(ref), len(mine))
            if n < 20 or not torch.equal(llm.engine.runner.pool[mine[:n]],
                                         once.engine.runner.pool[ref[:n]]):
                kv_differ.append((c, chunk))
    assert hits > 3000
    assert not differ, f"(conversation, turn, chunk) with other tokens: {differ}"
    assert not kv_differ, f"(conversation, chunk) whose KV differs: {kv_differ}"


@needs_kernel
@each_kernel
@pytest.mark.parametrize("inter,k", [(1536, 512), (192, 64), (48, 32)])
def test_fused_silu_gives_the_bits_of_the_product_then_the_silu_kernel(kernel, inter, k):
    """The gate/up projection with SiLU x up in its epilogue never writes the [M, 2 I] product;
    its result must be exactly what the plain product followed by the bf16 SiLU kernel gives,
    for every row count (decode steps and prefill chunks)."""
    x, w, _ = _case(700, 2 * inter, k, inter + k)
    fused_w, plain_w = amx.pack_gate_up(w), amx.pack(w)
    for m in (1, 7, 37, 700):
        xm = x[:m].contiguous()
        fused = amx.linear(xm, fused_w, 2 * inter, silu=True, kernel=kernel)
        plain = native.silu_mul(amx.linear(xm, plain_w, 2 * inter, kernel=kernel))
        assert fused.shape == (m, inter) and torch.equal(fused, plain), m
    gate, up = (x.double() @ w.double().T).split(inter, dim=1)
    ref = F.silu(gate) * up
    assert ((fused.double() - ref).abs() <= ref.abs() * 2 ** -6 + 0.05).all()


@needs_kernel
def test_a_gate_up_linear_packed_fused_computes_silu_mul_only():
    _, w, _ = _case(1, 96, 64, 5)
    lin = Linear(64, 96, bias=False).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    x = torch.randn(3, 64).bfloat16()
    want = native.silu_mul(lin(x))
    assert lin.pack(gate_up=True) and lin.gate_up
    assert torch.equal(lin.silu_mul(x), want)
    with pytest.raises(AssertionError):
        lin(x)  # its product is not kept: a caller must ask for silu_mul
    biased = Linear(64, 96, bias=True).to(torch.bfloat16)
    assert not biased.pack(gate_up=True) and not biased.gate_up  # no fused bias: stays plain
