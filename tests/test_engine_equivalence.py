"""The engine's fast paths (prefix cache, chunked prefill, batching, preemption) must not change
outputs: each is compared with the plain path of the same engine (float32, greedy)."""

import random

import pytest

from duplexkv import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n, lo, hi, seed, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=8).engine.model_config.vocab_size


def one_at_a_time(llm, ps, params=GREEDY):
    return [llm.generate([p], params)[0].token_ids for p in ps]


def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir, vocab):
    base = prompts(1, 70, 70, 1, vocab)[0]
    followups = [base + tail for tail in prompts(3, 1, 40, 2, vocab)] + [base, base[:48]]
    plain = LLM(str(tiny_model_dir), dtype="float32", enable_prefix_caching=False,
                num_kv_blocks=64)
    cached = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    want = one_at_a_time(plain, [base] + followups)
    got = one_at_a_time(cached, [base] + followups)
    assert got == want
    # the follow-ups really hit the cache: at least the 4 full blocks of `base`
    out = cached.generate([base + [5, 6, 7]], GREEDY)[0]
    assert out.kv_stats.local_hit_tokens >= 64
    cached.engine.check_integrity()


def test_chunked_prefill_equals_one_shot(tiny_model_dir, vocab):
    ps = prompts(4, 40, 150, 3, vocab)
    one_shot = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=4096,
                   enable_prefix_caching=False, num_kv_blocks=64)
    chunked = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=16,
                  enable_prefix_caching=False, num_kv_blocks=64)
    odd = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=37,
              enable_prefix_caching=False, num_kv_blocks=64)
    want = one_at_a_time(one_shot, ps)
    assert one_at_a_time(chunked, ps) == want
    assert one_at_a_time(odd, ps) == want


def test_concurrent_requests_with_preemption_match_sequential(tiny_model_dir, vocab):
    ps = prompts(12, 10, 80, 4, vocab)
    ref = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    want = one_at_a_time(ref, ps)
    # 20 blocks of 16 tokens cannot hold 12 sequences of up to 104 tokens: forces preemption
    small = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=20,
                max_num_batched_tokens=64)
    outs = small.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check_integrity()
    assert small.engine.bm.counts().in_use == 0


def test_seeded_sampling_is_reproducible(tiny_model_dir, vocab):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    p = prompts(1, 20, 20, 5, vocab)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7,
                        ignore_eos=True)
    a = llm.generate([p], sp)[0].token_ids
    b = llm.generate([p], sp)[0].token_ids
    # other seeds: the tiny model is peaked enough that one other seed may draw the same 16
    others = [llm.generate([p], SamplingParams(max_tokens=16, temperature=0.8, seed=s,
                                               ignore_eos=True))[0].token_ids for s in range(8, 12)]
    assert a == b and any(a != c for c in others)


def test_min_tokens_masks_stop_and_eos_tokens(tiny_model_dir, vocab):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    p = prompts(1, 30, 30, 6, vocab)[0]
    first = llm.generate([p], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    out = llm.generate([p], SamplingParams(max_tokens=4, temperature=0, min_tokens=2,
                                           stop_token_ids=[first]))[0]
    assert out.token_ids[0] != first and len(out.token_ids) >= 2
    # without min_tokens the same stop token ends the request at once
    out = llm.generate([p], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first]))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
