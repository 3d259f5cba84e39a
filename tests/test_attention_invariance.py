"""Reduced-precision attention is chunking-invariant: a query row's output is bit for bit the same
whether its keys were computed in this step or an earlier one (prefix cache, decode steps, chunked
prefill), and however many other rows share the step. Reuse may then never change an answer in
bfloat16, as it never did in float32 (bf16 is forced: the kernels run on any CPU, emulated where
the CPU lacks it)."""

import random

import pytest
import torch

from duplexkv import LLM, SamplingParams
from duplexkv.layers import attention
from duplexkv.layers.staging import MirrorSet

pytestmark = pytest.mark.skipif(attention._FLASH_LSE is None,
                                reason="this torch has no CPU flash kernel with log-sum-exp")

BLOCK = 16  # pool block size


def run_chunks(q, k, v, chunks, mirrors: bool):
    """Attention of the whole sequence (q [T, H, D], k/v [T, KVH, D]) computed chunk by chunk
    through `paged_attention`, as the engine's steps would (a 1-token chunk is a decode step)."""
    t, kvh, d = k.shape
    pool = torch.zeros(-(-t // BLOCK) + 2, 1, 2, BLOCK, kvh, d, dtype=q.dtype)
    block_ids = list(range(1, pool.shape[0]))[::-1]  # not in order: the gather must follow them
    ms = MirrorSet(1, kvh, d, q.dtype, budget_bytes=1 << 30 if mirrors else 0)
    out, start = [], 0
    for n in chunks:
        mirror = ms.prepare("seq", start, start + n)
        sa = attention.build_seq_attn(0, n, start, block_ids, BLOCK, mirror)
        p = range(start, start + n)
        attention.set_context(attention.AttnContext(
            [sa], [block_ids[i // BLOCK] for i in p], [i % BLOCK for i in p]))
        try:
            out.append(attention.paged_attention(q[p.start : p.stop], k[p.start : p.stop],
                                                 v[p.start : p.stop], pool, 0, d ** -0.5))
        finally:
            attention.reset_context()
        if mirror is not None:
            mirror.length = start + n
        start += n
    assert start == t
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", [
    (2, 1, 32, torch.bfloat16), (8, 2, 64, torch.bfloat16), (4, 4, 32, torch.bfloat16),
    (8, 2, 64, torch.float16)])
@pytest.mark.parametrize("kernel", ["amx", "flash"])
def test_reduced_precision_attention_rows_equal_across_chunkings(heads, kv_heads, dim, dtype,
                                                                  kernel, monkeypatch):
    """Both bf16 paths: the AMX kernel (native_amx_attn.h) where the CPU has it, PyTorch's flash
    kernel made invariant (`_blocked`) elsewhere."""
    if kernel == "amx" and not attention.kernel_runs(dtype, dim):
        pytest.skip("the AMX kernel does not run this dtype on this CPU")
    monkeypatch.setattr(attention, "AMX_ATTENTION", kernel == "amx")
    kb = attention.KEY_BLOCK
    t = 2 * kb + 90  # three key blocks
    g = torch.Generator().manual_seed(heads * 100 + dim)
    q, k, v = (torch.randn(t, h, dim, generator=g).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    whole = run_chunks(q, k, v, [t], mirrors=True)
    rest = lambda *c: [*c, t - sum(c)]  # noqa: E731
    chunkings = {
        "prefix + suffix (cache hit)": rest(37),
        "block-aligned prefix": rest(kb),
        "splits off the 32 grid": rest(33, 100, 1, kb - 5, 7),
        "decode steps across a block edge": rest(kb - 3, *[1] * 6),
        "many decode steps (merge weights of a lone row)": rest(kb + 10, *[1] * 48),
        "chunked prefill, 64 tokens": [64] * (t // 64) + ([t % 64] if t % 64 else []),
        "turns: prompt, decoded, prompt, decoded": rest(300, *[1] * 5, 250, *[1] * 4, 480),
    }
    for mirrors in (True, False):
        for name, chunks in chunkings.items():
            got = run_chunks(q, k, v, chunks, mirrors)
            bad = (got != whole).any(-1).any(-1).nonzero().flatten().tolist()
            assert not bad, f"{name} (mirrors {mirrors}): rows {bad[:8]}... differ"


def conversations(vocab: int, num: int, turns: int, seed: int = 1):
    rng = random.Random(seed)
    return [[[rng.randrange(10, vocab) for _ in range(rng.randrange(20, 90))]
             for _ in range(turns)] for _ in range(num)]


def test_bf16_reuse_gives_the_same_tokens_and_kv_as_whole_prompts(tiny_model_dir):
    """Multi-turn conversations in bf16: each turn's prompt is the history (earlier prompts and
    the tokens decoded for them) plus a new message. With the prefix cache the history's KV is
    reused (computed by earlier prefills and decode steps, and the turn's own suffix over it,
    in 4096- or 37-token chunks); without it every prompt is one whole prefill. Greedy tokens must
    agree on every turn (before the blocked attention, 3 of 20 turns differed), and the KV every
    layer keeps for a conversation's final history must equal that of one whole prefill of it."""
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    whole = LLM(str(tiny_model_dir), dtype="bfloat16", enable_prefix_caching=False,
                num_kv_blocks=256)
    reusing = {chunk: LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=512,
                          max_num_batched_tokens=chunk) for chunk in (4096, 37)}
    once = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=512)  # final histories
    vocab = whole.engine.model_config.vocab_size
    differ, kv_differ, hits, compared = [], [], 0, 0
    for c, conv in enumerate(conversations(vocab, num=6, turns=4)):
        hist = {chunk: [] for chunk in reusing}
        for turn, message in enumerate(conv):
            for chunk, llm in reusing.items():
                prompt = hist[chunk] + message
                got = llm.generate([prompt], sp)[0]
                want = whole.generate([prompt], sp)[0].token_ids
                if got.token_ids != want:
                    differ.append((c, turn, chunk))
                hits += got.kv_stats.local_hit_tokens
                hist[chunk] = prompt + list(got.token_ids)
        final = hist[4096][:-1]  # the last token's KV is only computed by the next step
        once.generate([final], SamplingParams(max_tokens=1, temperature=0))
        ref = once.engine.bm.match_prefix(final)
        for chunk, llm in reusing.items():
            mine = llm.engine.bm.match_prefix(final)
            n = min(len(ref), len(mine))
            compared += n
            if not torch.equal(llm.engine.runner.pool[mine[:n]], once.engine.runner.pool[ref[:n]]):
                kv_differ.append((c, chunk))
    assert hits > 2000 and compared > 40  # the history was reused; its KV was compared
    assert not differ, f"(conversation, turn, chunk) with other tokens: {differ}"
    assert not kv_differ, f"(conversation, chunk) whose KV differs: {kv_differ}"


def test_bf16_p_reading_d_history_gives_reuse_off_tokens(tiny_model_dir, tmp_path):
    """The issue's setting: bf16 workers, P without a prefix cache READs each conversation's
    history from D (KV of P's earlier prefills and of D's decode steps) and computes only the new
    message over it; D decodes from P's KV. Every turn's greedy tokens equal one bf16 engine
    computing the whole prompt with reuse off."""
    from workers import MISS, decode_leg, kv_config, prefill_leg, start_worker

    args = ("--num-kv-blocks", "128", "--max-model-len", "1024")
    kv = kv_config("TcpConnector", bidirectional_kv_xfer=True)
    p = start_worker(tiny_model_dir, tmp_path / "p.log", *args, "--no-enable-prefix-caching",
                     kv=kv, dtype="bfloat16")
    d = start_worker(tiny_model_dir, tmp_path / "d.log", *args, kv=kv, dtype="bfloat16")
    try:
        whole = LLM(str(tiny_model_dir), dtype="bfloat16", enable_prefix_caching=False,
                    num_kv_blocks=128)
        sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        differ, pulled = [], 0
        for c, conv in enumerate(conversations(whole.engine.model_config.vocab_size, num=5,
                                               turns=4, seed=2)):
            prompt, d_params = [], None
            for t, message in enumerate(conv):
                prompt = prompt + message
                body = {"prompt": prompt, "max_tokens": 20, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                to_p = dict(MISS) if d_params is None else {
                    **d_params, "do_remote_decode": True, "do_remote_prefill": False}
                pj = prefill_leg(p, "/v1/completions", body, to_p)
                r = decode_leg(d, "/v1/completions", body, pj["kv_transfer_params"])
                assert r.status_code == 200, r.text
                got = r.json()["choices"][0]["token_ids"]
                if got != whole.generate([prompt], sp)[0].token_ids:
                    differ.append((c, t))
                pulled += pj["kv_stats"]["pulled_tokens"]
                d_params = r.json()["kv_transfer_params"]
                prompt = prompt + got
        assert pulled > 1000  # the histories were read from D
        assert not differ, f"(conversation, turn) with other tokens: {differ}"
        p.assert_integrity()
        d.assert_integrity()
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", [
    (8, 2, 64, torch.bfloat16), (2, 1, 32, torch.bfloat16), (4, 4, 32, torch.float16)])
def test_a_decode_batch_gives_each_row_what_it_gets_alone(heads, kv_heads, dim, dtype):
    """Decode rows of many sequences in one step (their diagonal blocks in one kernel call, one
    merge) equal each sequence's row computed alone, bit for bit: positions inside the first key
    block (no merge), on both sides of block edges and deep in a later block."""
    kb = attention.KEY_BLOCK
    positions = [0, 5, kb - 1, kb, kb + 1, 700, 2 * kb - 1, 2 * kb, 2 * kb + 77]
    g = torch.Generator().manual_seed(7 + heads)
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    keys = [torch.randn(1, kv_heads, p + 1, dim, generator=g).to(dtype) for p in positions]
    values = [torch.randn(1, kv_heads, p + 1, dim, generator=g).to(dtype) for p in positions]
    alone = torch.cat([attention._blocked(q[i : i + 1], keys[i], values[i], p, dim ** -0.5)
                       for i, p in enumerate(positions)])
    for order in (list(range(len(positions))), list(range(len(positions)))[::-1]):
        out = torch.zeros_like(q)
        attention._blocked_decode(q, out, order, [keys[i] for i in order],
                                  [values[i] for i in order], [positions[i] for i in order],
                                  dim ** -0.5)
        bad = (out != alone).any(-1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad} differ from the row computed alone"
