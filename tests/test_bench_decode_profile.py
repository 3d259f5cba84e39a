"""`duplexkv bench decode_profile` on the tiny preset: the decode stack times exactly the steps run
while profiling is on, and the bench prints and writes every part of every case."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from duplexkv import LLM, SamplingParams
from duplexkv.cli import main
from duplexkv.layers import amx, decode_stack, native
from duplexkv_bench.decode_profile import measure, preset_shape

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels (no compiler)")
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native.available() or not amx.kernels(), reason="no packed bf16 kernel runs here"))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stack_times_the_steps_run_while_profiling_is_on(dtype: str) -> None:
    llm = LLM("tiny", dtype=dtype, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(2):
        engine.add_request([rng.randrange(3, 200) for _ in range(40)],
                           SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # profiling off: not counted
    assert decode_stack.profile(True).steps == 0
    for _ in range(5):
        engine.step()
    got = decode_stack.profile(False)
    assert got.steps == 5
    assert set(got.part_ms) == set(decode_stack.PARTS)
    assert all(ms >= 0 for ms in got.part_ms.values())
    for part in ("qkv", "attention", "o", "gate_up", "down"):
        assert got.part_ms[part] > 0, part
    # bf16 computes SiLU in the gate/up product
    assert (got.part_ms["silu"] > 0) == (dtype == "float32")
    assert 0 < sum(got.part_ms.values()) <= got.call_ms
    engine.step()  # off again
    assert decode_stack.profile(False).steps == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_profile_prints_and_writes_every_part(dtype: str, tmp_path: Path, capfd) -> None:
    out = tmp_path / "profile.json"
    assert main(["bench", "decode_profile", "--preset", "tiny", "--dtype", dtype, "--contexts",
                 "64", "--batches", "1", "2", "--steps", "4", "--json", str(out)]) == 0
    printed = capfd.readouterr().out
    assert f"tiny, {dtype} (--dtype {dtype}" in printed
    for part in (*decode_stack.PARTS, "stack other", "LM head", "engine", "**step**"):
        assert printed.count(f"| {part} |") == 2, part
    written = json.loads(out.read_text())
    assert written["dtype"] == dtype
    cases = written["cases"]
    assert [(c["context"], c["batch"]) for c in cases] == [(64, 1), (64, 2)]
    for c in cases:
        assert c["ms"]["step"] > 0 and c["ms"]["attention"] > 0 and c["ms"]["LM head"] > 0
        # the parts add up to the step: the stack's rest and the engine are what is left
        assert sum(v for k, v in c["ms"].items() if k != "step") == pytest.approx(c["ms"]["step"])
        # K and V x 2 layers x 1 KV head x 32 x (64 + 5 warm + 4 / 2 steps) x batch x its bytes
        size = 4 if dtype == "float32" else 2
        assert c["bytes"]["attention"] == 2 * 2 * 1 * 32 * (64 + 5 + 2) * c["batch"] * size
        # the parts' bytes are the floor `bench vs_vllm` divides by, split
        assert sum(c["bytes"].values()) == pytest.approx(
            preset_shape("tiny").decode_bytes(64 + 5 + 2, c["batch"], dtype))


def test_the_lm_head_counts_only_the_measured_steps() -> None:
    """The steps that finish the requests after the measured ones also compute logits; their
    time once went into the LM head's figure (divided by the measured steps: 30 % too high at 50
    steps of batch 8), and out of the engine's."""
    llm = LLM("tiny", dtype="float32", enable_prefix_caching=False)
    model = llm.engine.runner.model
    real, calls, took_ms = model.logits, [], []

    def slow_logits(hidden):  # a head that takes 20 ms a call or more (a sleep overruns)
        t = time.perf_counter()
        calls.append(hidden.shape[0])
        time.sleep(0.02)
        out = real(hidden)
        took_ms.append((time.perf_counter() - t) * 1000)
        return out

    model.logits = slow_logits
    ms = measure(llm, 64, 2, 4, 0, preset_shape("tiny").vocab)
    assert "logits" not in vars(model)  # the bench took its wrapper (and this one) away
    assert len(calls) > 4 + 5  # more steps ran than were measured: warm ones, the tail
    # the mean of some calls (the measured steps'), not their sum over fewer steps
    assert 20 <= min(took_ms) <= ms["LM head"] <= max(took_ms) + 1, (ms, took_ms)
    assert ms["engine"] >= 0, ms  # the step's rest, once negative


@pytest.mark.parametrize("argv", [["--batches", "17"], ["--steps", "0"], ["--contexts", "0"],
                                  ["--json", "/nonexistent-dir/x.json"]])
def test_decode_profile_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode_profile", *argv])
    assert e.value.code == 2
