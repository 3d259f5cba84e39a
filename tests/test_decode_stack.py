"""A decode step through every layer in one native call (layers/decode_stack.py) computes what
the layer-by-layer path computes, to the bit: every step's logits are compared, for Qwen3 (q/k
norm) and Qwen2 (q/k/v biases, no q/k norm), for mirrors appended to and mirrors rebuilt from the
pool (a D worker's first step after a pull, a preempted sequence). In float32 everywhere the
kernels build; in bf16 where a packed bf16 kernel runs (AMX or AVX-512 BF16: `amx.kernels()`),
on the first of them, as a worker runs it."""

import os
import random
import subprocess
import sys

import pytest
import torch
from model_variants import step_logits, variant

from duplexkv import LLM, SamplingParams
from duplexkv.layers import amx, native
from duplexkv.layers.attention import AttnContext

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built here")
BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native.available() or not amx.kernels(), reason="no packed bf16 kernel runs here"))
DTYPES = ["float32", BF16]


def stack_spy(llm: LLM) -> list[bool]:
    """Records, per step, whether the model's decode stack took it."""
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None, "a float32 or packed bf16 model builds its decode stack"
    taken: list[bool] = []
    takes = stack.takes

    def spy(ids, positions, ctx):
        taken.append(takes(ids, positions, ctx))
        return taken[-1]

    stack.takes = spy
    return taken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_every_step_equals_the_layer_loop_bit_for_bit(arch, dtype, tiny_model_dir, tmp_path):
    d = variant(tiny_model_dir, tmp_path / arch, arch)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (9, 130, 301)]
    stacked = LLM(str(d), dtype=dtype, num_kv_blocks=128)
    assert stacked.engine.model_config.architecture == arch
    assert stacked.engine.runner.model.decode_stack.dtype == getattr(torch, dtype)
    taken = stack_spy(stacked)
    looped = LLM(str(d), dtype=dtype, num_kv_blocks=128)
    looped.engine.runner.model.decode_stack = None
    got, want = step_logits(stacked, prompts, 24)[1], step_logits(looped, prompts, 24)[1]
    assert len(got) == len(want) >= 24
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max().item()}"
    assert sum(taken) >= 23, taken  # every decode step (the prefill steps are the loop's)
    stacked.engine.check_integrity()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rebuilt_mirrors_give_the_same_step(dtype, tiny_model_dir):
    """The same decode batch run three times: on appended mirrors through the stack, then on
    mirrors rebuilt from the pool (their length no longer matches) through the stack and through
    the layer loop: the same logits and the same K/V written to the pool."""
    llm = LLM(str(tiny_model_dir), dtype=dtype, num_kv_blocks=128)
    eng = llm.engine
    rng = random.Random(5)
    for n in (40, 77, 200):
        eng.add_request([rng.randrange(3, 4000) for _ in range(n)],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    eng.step()
    taken = stack_spy(llm)
    batch = eng.scheduler.schedule()
    assert len(batch) == 3 and all(item.num_new_tokens == 1 for item in batch)
    runner, bs = eng.runner, eng.runner.block_size
    slots = [(item.seq.block_table[item.start // bs], item.start % bs) for item in batch]

    @torch.inference_mode()  # the pool and mirrors are inference tensors
    def run():
        """The step's logits and what it wrote to its pool slots (poisoned before), with the
        mirrors poisoned after: a rebuild must copy every position it reads from the pool."""
        for b, o in slots:
            runner.pool[b, :, :, o] = float("nan")
        logits = runner.run(batch)
        written = torch.stack([runner.pool[b, :, :, o].clone() for b, o in slots])
        for m in runner.mirrors.mirrors.values():
            m.kv.fill_(float("nan"))
        return logits, written

    appended, rebuilt = run(), run()
    model = runner.model
    stack, model.decode_stack = model.decode_stack, None
    looped = run()
    model.decode_stack = stack
    assert taken == [True, True]
    for got in (rebuilt, looped):
        assert torch.equal(appended[0], got[0]) and torch.equal(appended[1], got[1])
    assert not appended[0].isnan().any() and not appended[1].isnan().any()


class StackSpy:
    """Stands in for a model's decode stack, recording what each call takes."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, []

    def takes(self, *args) -> bool:
        return self.stack.takes(*args)

    def __call__(self, *args):
        self.calls.append(args)
        return self.stack(*args)


def captured_step(tiny_model_dir, dtype="float32"):
    """An engine's decode stack, and what it took for a decode step: (ids, the RoPE tables'
    function, pool, context)."""
    llm = LLM(str(tiny_model_dir), dtype=dtype, num_kv_blocks=64)
    eng = llm.engine
    eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=4, temperature=0,
                                                       ignore_eos=True))
    eng.step()
    eng.step()
    model = eng.runner.model
    stack = model.decode_stack
    model.decode_stack = spy = StackSpy(stack)
    eng.runner.run(eng.scheduler.schedule())
    model.decode_stack = stack
    assert len(spy.calls) == 1
    return stack, spy.calls[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slot_outside_the_pool_is_refused_before_the_kernel(dtype, tiny_model_dir):
    """The C side trusts the addresses it gets: a step whose slot lies past the pool is a
    ValueError, not a write into someone else's memory."""
    stack, (ids, tables, pool, ctx) = captured_step(tiny_model_dir, dtype)
    bad = AttnContext(ctx.seqs, [pool.shape[0]], ctx.offsets)
    with pytest.raises(ValueError, match="slot"):
        stack(ids, tables, pool, bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_outside_the_vocabulary_or_a_position_past_the_tables_is_refused(
        dtype, tiny_model_dir):
    """Nor a token id past the embedding's rows (a read past it), nor a position past the RoPE
    tables' rows."""
    stack, (ids, tables, pool, ctx) = captured_step(tiny_model_dir, dtype)
    vocab = stack.embed.shape[0]
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="token"):
            stack(torch.tensor([bad]), tables, pool, ctx)

    def short(upto):
        cos, sin = tables(upto)
        return cos[: upto - 1], sin[: upto - 1]

    with pytest.raises(ValueError, match="position"):
        stack(ids, short, pool, ctx)


@pytest.mark.parametrize(("dtype", "switch"), [
    ("float32", "DUPLEXKV_DECODE_STACK"),
    pytest.param("bfloat16", "DUPLEXKV_DECODE_STACK", marks=BF16.marks),
    # the loop's bf16 products and attention would be other kernels than the stack's
    pytest.param("bfloat16", "DUPLEXKV_AMX_LINEAR", marks=BF16.marks),
    pytest.param("bfloat16", "DUPLEXKV_AMX_ATTENTION", marks=BF16.marks),
    pytest.param("bfloat16", "DUPLEXKV_FUSED_SILU", marks=BF16.marks)])
def test_the_switch_turns_it_off(dtype, switch, tiny_model_dir):
    code = ("from duplexkv import LLM; "
            f"s = LLM({str(tiny_model_dir)!r}, dtype={dtype!r}, num_kv_blocks=16)"
            ".engine.runner.model.decode_stack; print(s and s.dtype)")
    for value, want in (("1", f"torch.{dtype}"), ("0", "None")):
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                           text=True, timeout=120, env={**os.environ, switch: value})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, (switch, value)
