"""The engine thread hands a step's outputs to the event loop with one wake-up per step, not one
per stream (engine/async_engine.py `_deliver_step`), and every stream still gets its own tokens
in order."""

from __future__ import annotations

import asyncio

from duplexkv.engine.async_engine import AsyncEngine
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.llm_engine import LLMEngine
from duplexkv.wire.sampling import SamplingParams

STREAMS, TOKENS = 4, 12


def _prompt(i: int) -> list[int]:
    return [5 + (7 * i + j) % 200 for j in range(9 + i)]


async def _one(eng: AsyncEngine, i: int) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    got: list[int] = []
    async for out in eng.generate(f"r{i}", _prompt(i), params):
        assert out.token_ids[: len(got)] == got  # in order, nothing skipped or repeated
        got = list(out.token_ids)
    return got


async def _together(eng: AsyncEngine) -> tuple[list[list[int]], int]:
    loop = asyncio.get_running_loop()
    wakeups = 0
    plain = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        nonlocal wakeups
        wakeups += 1
        return plain(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # this loop only
    try:
        return list(await asyncio.gather(*(_one(eng, i) for i in range(STREAMS)))), wakeups
    finally:
        del loop.call_soon_threadsafe


def test_a_step_wakes_the_loop_once_for_all_its_streams(tiny_model_dir):
    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                             num_kv_blocks=64, max_model_len=128)))
    steps_with_outputs = 0
    plain_step = eng.engine.step

    def step():
        nonlocal steps_with_outputs
        outs = plain_step()
        steps_with_outputs += bool(outs)
        return outs

    eng.engine.step = step
    eng.start()
    try:
        alone = [asyncio.run(_one(eng, i)) for i in range(STREAMS)]
        steps_with_outputs = 0
        together, wakeups = asyncio.run(_together(eng))
    finally:
        eng.shutdown()
    assert together == alone and all(len(t) == TOKENS for t in together)
    # the streams ran side by side: one wake-up per step (before: one per stream and step)
    assert steps_with_outputs < STREAMS * TOKENS
    assert wakeups <= steps_with_outputs, (wakeups, steps_with_outputs)
