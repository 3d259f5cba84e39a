"""Attention over the paged KV pool, on the CPU.

Longer than 300 lines: the float32 paths and the chunking-invariant reduced-precision path share
the pool layout, the folding of query heads and the kernel-shape rules, and read best together.

The pool is one tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]: block b holds
K and V of `block_size` consecutive positions for every layer. A step's tokens are flattened
(all sequences back to back); per sequence the layer writes the new K/V into its slots, then
attends with `scaled_dot_product_attention`:

    seq tokens     0 ........ start-1 | start ...... start+n-1
                   already in pool    | new this step (queries)
    fresh prefill (start == 0): attend over the new K/V with is_causal (no gather)
    otherwise: queries attend to the cached prefix without a mask and to the new tokens with
    is_causal, and the two partial results are merged by their log-sum-exp (exactly the
    lower-right causal attention, but both halves run SDPA's fast kernel; a mask is 2-3x slower)

That is float32's way where our kernels are not built (and any dtype's where this torch lacks the
flash kernel with log-sum-exp). float32 prefill chunks on a CPU with AVX-512 or AVX2 run every
sequence of a step in one call of native_f32_prefill.h instead (`causal_kernel.f32_attention`: no
expanded KV heads, no merge; bench model, 8k tokens: ~0.8x SDPA's time on AVX-512, 2k ~0.65x on
AVX2), float32 decode rows
native_f32_attn.h; DUPLEXKV_F32_ATTENTION=0 keeps SDPA for prefill (A/B).
bf16/fp16 take a chunking-invariant path instead: on a CPU with AMX or `avx512_bf16`, bf16 runs
every sequence of a step in one call of our own kernel (native_amx_attn.h on AMX, else
native_vdp_attn.h by AVX-512 BF16 dot products; `_kernel_step`), invariant by construction;
elsewhere (fp16, bf16 on AVX2) `_blocked` below makes PyTorch's flash kernel invariant.

Grouped-query attention: where no mask is needed (the cached prefix, one-token decode) the
query heads of a KV group are folded into the query-length axis, [1, KVH, G * n, D], so the
kernel reads each KV head once and the prefix is never expanded to H heads (bf16, 1.85k new
over 13.7k cached: 121 ms per layer against 139 ms with repeat_interleave). Only the causal
block over the new tokens expands its (small) K/V.

Chunking-invariant in reduced precision (`_blocked`): reuse must not change an answer, so a query
row's output may not depend on which of its keys were computed in this step and which in an
earlier one (prefix cache, decode steps, chunked prefill, KV pulled from a peer), nor on how many
rows share the step. In float32 the paths above agree closely enough that greedy tokens never
differed; in bf16 the output is rounded to 8 bits of mantissa after a sum whose order followed the
split (one causal call over a whole prompt, two merged calls over a cached prefix and a suffix,
the kernel's own key blocks counted from wherever the call's keys began), and 3 of 20 turns of a
multi-turn test gave other tokens with reuse than without. So in bf16/fp16 every row is computed
one way, fixed by its position p alone: with a = p rounded down to a multiple of KEY_BLOCK,

    o_A, lse_A = flash(q_p, K[0 : a])                    unmasked, keys from position 0
    o_B, lse_B = flash(q_p, K[a : a + KEY_BLOCK])        masked to keys a .. p, zeros past the end
    o = o_A + (o_B - o_A) * sigmoid(lse_B - lse_A) in float32, rounded once (o_B when a == 0)

The rows of a step that share a key block share both calls (a whole prefill: two calls per
KEY_BLOCK rows; a decode row: two calls). The decode rows of several sequences in one step share
the masked call too, as one batch of diagonal blocks, and one merge (`_blocked_decode`; bf16,
bench model, OMP_WAIT_POLICY=PASSIVE as workers run: a step of 8 sequences at 4k context 63.5 ->
43.2 ms, of 2 23.9 -> 20.4 ms, of 1 unchanged). This holds bit for bit because PyTorch's CPU flash
kernel computes each query row independently of the other rows of the call (checked for 2 to 2048
rows and key lengths up to 4096; a lone row takes another path, hence MIN_ROWS); masked keys add
exact zeros whatever their (finite) values; every row meets the same key lengths (a and
KEY_BLOCK) whichever way its keys were split; and the merge rounds exactly but for the sigmoid,
which `_sigmoid_rows` keeps off ATen's scalar tail. The masks are additive (0 / -inf), a whole
block's kept per dtype and group. tests/test_attention_invariance.py checks rows across
chunkings (cache hits off the 32 grid, decode steps across a block edge, chunked prefill, gather
and mirror layouts) and greedy multi-turn conversations with and without reuse, in one engine and
between P and D workers. Cost (prefill ~1.1x, a decode step ~1.1x): docs/engine.md.

Bounded kernel shapes: in bf16/fp16 on CPUs with AMX the flash kernel runs on oneDNN brgemm
micro-kernels that PyTorch JIT-compiles for every new (query block, key block) shape and keeps in
a per-thread map that is never pruned (`cpublas` KernelCache). A server sees a new length almost
every step, so its RSS grew without end (bench/tiny, bf16: ~0.5 MB per new shape, 1.1 GB in a
150 s soak). Reduced-precision calls therefore only see lengths that are multiples of
`SHAPE_STEP`, or shorter than it: `_blocked` pads a block's query rows to a multiple of
SHAPE_STEP (a decode row: its G folded heads, at least MIN_ROWS), and its keys are multiples of
KEY_BLOCK (a) or KEY_BLOCK itself. (`_prefix_causal` and `_decode` round the same way with `step`
> 1, as bf16 ran them before the invariant path; float32 calls them with step 1.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from duplexkv.layers import amx, causal_kernel, native
from duplexkv.layers.staging import Mirror, fill_from_pool, kv_append


@dataclass(slots=True)
class SeqAttn:
    q_start: int  # row of the sequence's first new token in the flattened batch
    num_new: int
    start: int  # tokens already in the pool before this step
    block_ids: list[int]  # the sequence's block ids, the first `num_blocks` cover the context
    num_blocks: int
    mask: torch.Tensor | None  # [num_new, start + num_new] bool, only without the split kernel
    mirror: Mirror | None = None  # contiguous copy of the context (see staging.py)
    _table: torch.Tensor | None = None

    @property
    def ctx_len(self) -> int:
        return self.start + self.num_new

    @property
    def block_table(self) -> torch.Tensor:
        """int64 block ids covering start + num_new tokens, made when first asked: a decode
        step through the decode stack reads its context from the mirror and never asks (a
        list of 257 ids to a tensor took ~40 us per sequence and step: 0.3 ms of a 19 ms step
        at 4k x 8, AMD EPYC Zen 2)."""
        if self._table is None:
            self._table = torch.tensor(self.block_ids[: self.num_blocks], dtype=torch.long)
        return self._table


@dataclass(slots=True)
class AttnContext:
    seqs: list[SeqAttn]
    blocks: list[int]  # [T] block id of each new token
    offsets: list[int]  # [T] its offset inside the block
    _slots: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`blocks` and `offsets` as int64 tensors, made when first asked (a decode step through
        the decode stack never asks)."""
        if self._slots is None:
            self._slots = (torch.tensor(self.blocks, dtype=torch.long),
                           torch.tensor(self.offsets, dtype=torch.long))
        return self._slots


def write_kv(pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             ctx: AttnContext) -> None:
    """This step's K/V [T, KVH, D] into their pool slots. (One `index_copy_` of a sequence's
    whole blocks was tried: no faster than this `index_put`, 2k-8k tokens, 1 and 2 threads.)"""
    blocks, offsets = ctx.slots
    pool[blocks, layer, 0, offsets] = k
    pool[blocks, layer, 1, offsets] = v


def _rebuild_mirror(m: Mirror, pool: torch.Tensor, s: SeqAttn, layer: int) -> None:
    """The layer's K/V of positions [0, start) copied from the pool into a mirror that must be
    rebuilt this step (new, preempted, pulled from a peer)."""
    if m.rebuild and s.start > 0:
        for kv in (0, 1):
            fill_from_pool(m.kv[layer, kv], pool, s.block_table, layer, kv, s.start)


def rebuild_mirrors(pool: torch.Tensor, ctx: AttnContext, num_layers: int) -> None:
    """Every layer of the mirrors this step must rebuild, at once (for a step that does not go
    through `append_mirrors` layer by layer: decode_stack.py)."""
    for s in ctx.seqs:
        if s.mirror is not None:
            for layer in range(num_layers):
                _rebuild_mirror(s.mirror, pool, s, layer)


def append_mirrors(pool: torch.Tensor, ctx: AttnContext, layer: int, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """This step's K/V [T, KVH, D] appended to every sequence's mirror (rebuilt first if needed),
    in one native call for all of them where the kernels are built (two tensor copies per
    sequence and layer otherwise)."""
    stores = []
    for s in ctx.seqs:
        m = s.mirror
        if m is None:
            continue
        _rebuild_mirror(m, pool, s, layer)
        if native.available():
            stores.append((m.kv[layer, 0], m.kv[layer, 1], s.q_start, s.num_new, s.start))
            continue
        rows = slice(s.q_start, s.q_start + s.num_new)
        for kv, x in ((0, k[rows]), (1, v[rows])):
            m.kv[layer, kv][:, s.start : s.ctx_len] = x.transpose(0, 1)  # [KVH, cap, D]
    if stores:
        kv_append(k, v, stores)


_CTX: AttnContext | None = None
# SDPA's CPU flash kernel, which also returns the log-sum-exp (None if this torch lacks it)
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
SHAPE_STEP = 32  # lengths the reduced-precision kernel sees are multiples of this (see above)
KEY_BLOCK = 512  # reduced precision: a query's keys go to the kernel in blocks of this, from 0
MIN_ROWS = 4  # reduced precision: at least this many query rows per kernel call (see _blocked)
# bf16 on AMX runs native_amx_attn.h, with avx512_bf16 alone native_vdp_attn.h;
# DUPLEXKV_AMX_ATTENTION=0 keeps `_blocked` (A/B, tests)
AMX_ATTENTION = os.environ.get("DUPLEXKV_AMX_ATTENTION", "1") != "0"
# float32 prefill chunks run native_f32_prefill.h where built; DUPLEXKV_F32_ATTENTION=0: SDPA
F32_ATTENTION = os.environ.get("DUPLEXKV_F32_ATTENTION", "1") != "0"


def shape_step(dtype: torch.dtype) -> int:
    """1 (no rounding) where the kernel keeps no per-shape code: float32 runs plain GEMMs."""
    return SHAPE_STEP if dtype in (torch.bfloat16, torch.float16) and _FLASH_LSE else 1


def invariant(dtype: torch.dtype) -> bool:
    """Whether attention in `dtype` takes a chunking-invariant path (`_kernel_step` or
    `_blocked`)."""
    return shape_step(dtype) > 1


def mirror_block(dtype: torch.dtype, head_dim: int) -> int:
    """The key block `_blocked` reads whole from a mirror (MirrorSet.prepare zeroes its tail),
    or 0 where attention reads only the context (float32, and bf16 on our kernels:
    `_kernel_step`)."""
    if not invariant(dtype) or kernel_runs(dtype, head_dim):
        return 0
    return KEY_BLOCK


def kernel_runs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention in `dtype` with this head size runs our bf16 kernel (`_kernel_step`:
    native_amx_attn.h on AMX, native_vdp_attn.h with avx512_bf16 alone)."""
    return (AMX_ATTENTION and dtype == torch.bfloat16 and head_dim % 32 == 0
            and head_dim <= amx.MAX_HEAD_DIM and bool(amx.kernels()))


def _pad_len(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Zero rows before/after along the length axis of [B, heads, len, D]."""
    return F.pad(x, (0, 0, before, after)) if before or after else x


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
           lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, from each part's output and log-sum-exp."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def set_context(ctx: AttnContext) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> AttnContext:
    assert _CTX is not None, "attention called outside a model step"
    return _CTX


def reset_context() -> None:
    global _CTX
    _CTX = None


def build_seq_attn(q_start: int, num_new: int, start: int, block_ids: list[int],
                   block_size: int, mirror: Mirror | None = None) -> SeqAttn:
    """The step's view of one sequence; `block_ids` is read when the table is first asked for,
    within the step (the scheduler does not change it meanwhile)."""
    ctx_len = start + num_new
    num_blocks = -(-ctx_len // block_size)
    if len(block_ids) < num_blocks:
        raise ValueError(f"{len(block_ids)} blocks for {ctx_len} tokens of {block_size}")
    mask = None
    if start > 0 and num_new > 1 and _FLASH_LSE is None:
        mask = torch.ones(num_new, ctx_len, dtype=torch.bool).tril(start)
    return SeqAttn(q_start, num_new, start, block_ids, num_blocks, mask, mirror)


def _gather(pool: torch.Tensor, s: SeqAttn, layer: int, kv: int, num_kv: int,
            head_dim: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of the sequence's blocks, contiguous as [tokens, KVH, D]."""
    return pool[s.block_table, layer, kv].view(-1, num_kv, head_dim)


def _fold(q: torch.Tensor, num_kv: int) -> torch.Tensor:
    """q [n, H, D] -> [1, KVH, G * n, D]: a group's query heads one after another."""
    n, h, d = q.shape
    return q.view(n, num_kv, h // num_kv, d).permute(1, 2, 0, 3).reshape(1, num_kv, -1, d)


def _prefix_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                   scale: float, step: int = 1) -> torch.Tensor:
    """Lower-right causal attention of q [n, H, D] over k/v [1, KVH, start + n, D] -> [n, H, D].
    With `step` > 1 every length passed to the kernel is a multiple of it (module docstring)."""
    n, h, d = q.shape
    num_kv = k.shape[1]
    group = h // num_kv
    aligned = start // step * step  # the prefix part without a mask; the rest joins the causal
    rest = start - aligned
    o1 = None
    if aligned:
        n_pad = -(-n // step) * step
        qf = _fold(F.pad(q, (0, 0, 0, 0, 0, n_pad - n)) if n_pad > n else q, num_kv)
        o1, lse1 = _FLASH_LSE(qf, k[:, :, :aligned], v[:, :, :aligned], scale=scale)[:2]
        # [KVH, G, n_pad] is head-major
        o1, lse1 = o1.reshape(1, h, n_pad, d)[:, :, :n], lse1.reshape(1, h, n_pad)[:, :, :n]
    kn, vn = k[:, :, aligned:], v[:, :, aligned:]  # the prefix's remainder + the new tokens
    if group > 1:
        kn, vn = kn.repeat_interleave(group, dim=1), vn.repeat_interleave(group, dim=1)
    qh = q.transpose(0, 1).contiguous()[None]  # [1, H, n, D]
    # `rest` dummy query rows in front make upper-left causal attention lower-right
    tail = -(-(rest + n) // step) * step - rest - n
    o2, lse2 = _FLASH_LSE(_pad_len(qh, rest, tail), _pad_len(kn, 0, tail),
                          _pad_len(vn, 0, tail), is_causal=True, scale=scale)[:2]
    o2, lse2 = o2[:, :, rest : rest + n], lse2[:, :, rest : rest + n]
    o = o2 if o1 is None else _merge(o1, lse1, o2, lse2)
    return o[0].transpose(0, 1).to(q.dtype)


def _decode(qh: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, scale: float,
            step: int) -> torch.Tensor:
    """One query per head (folded: qh [1, KVH, G, D]) over sk/sv [1, KVH, L, D]; with `step` > 1
    the keys go to the kernel as a multiple of `step` plus a remainder shorter than it."""
    length = sk.shape[2]
    aligned = length // step * step
    if step == 1 or aligned in (0, length):
        return F.scaled_dot_product_attention(qh, sk, sv, scale=scale)
    o1, lse1 = _FLASH_LSE(qh, sk[:, :, :aligned], sv[:, :, :aligned], scale=scale)[:2]
    o2, lse2 = _FLASH_LSE(qh, sk[:, :, aligned:], sv[:, :, aligned:], scale=scale)[:2]
    return _merge(o1, lse1, o2, lse2).to(qh.dtype)


_MASKS: dict[tuple, torch.Tensor] = {}  # additive causal masks of KEY_BLOCK keys (_diagonal_mask)


def _diagonal_mask(offset: int, rows: int, r_pad: int, group: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, group * r_pad, KEY_BLOCK] for queries folded as `_fold` lays them out: row i of a
    head (the query at block offset `offset` + i) sees keys 0 .. offset + i of the block (0), not
    the rest (-inf); padding rows see the whole block. A whole block's mask is kept."""
    key = (dtype, KEY_BLOCK, group)
    full = _MASKS.get(key)
    if full is None:
        kb = KEY_BLOCK
        base = torch.zeros(kb, kb, dtype=dtype).masked_fill_(
            torch.ones(kb, kb, dtype=torch.bool).triu_(1), float("-inf"))
        full = _MASKS[key] = base.repeat(group, 1)[None, None]
    if offset == 0 and rows == r_pad == KEY_BLOCK:
        return full
    part = full[0, 0, offset : offset + rows]
    return F.pad(part, (0, 0, 0, r_pad - rows)).repeat(group, 1)[None, None]


def _sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) elementwise, each element's value independent of x's size. ATen's vectorised
    loop leaves the last < 2 vectors of a run (and of each thread's share) to a scalar `exp`
    that rounds differently from the vector one (4 % of the values here): so the run is padded
    to a multiple of 64 and computed in slices below the parallel grain, all in vectors."""
    flat = x.reshape(-1)
    n = flat.numel()
    flat = F.pad(flat, (0, -n % 64))
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), 16384):
        torch.sigmoid(flat[i : i + 16384], out=out[i : i + 16384])
    return out[:n].view(x.shape)


def _blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
             scale: float) -> torch.Tensor:
    """Causal attention of q [n, H, D] (the tokens at positions start .. start + n - 1) over k/v
    [1, KVH, >= start + n, D] -> [n, H, D], each query row computed the same way whatever the
    split: the row at position p attends to the keys [0, a), a = p // KEY_BLOCK * KEY_BLOCK, in
    one unmasked kernel call, and to the KEY_BLOCK keys from a (zero-padded past the end) in a
    second one masked to [a, p]; the two are merged by log-sum-exp in float32 (module
    docstring). Rows of one key block share both calls; rows are padded to a multiple of
    SHAPE_STEP (decode: one row, its heads folded, padded to MIN_ROWS)."""
    n, h, d = q.shape
    num_kv = k.shape[1]
    group = h // num_kv
    kb = KEY_BLOCK
    out = torch.empty_like(q)  # first the masked part's output, then the merged one
    first = max(0, min(n, kb - start % kb if start < kb else 0))  # rows in key block 0: no merge
    o1s = q.new_empty(n - first, h, d)  # the unmasked part's output, rows `first` .. n - 1
    lse = torch.empty(2, n - first, h)  # log-sum-exp of the unmasked and masked parts
    lo = start
    while lo < start + n:
        a = lo // kb * kb  # the rows [lo, hi) all lie in the key block [a, a + kb)
        hi = min(start + n, a + kb)
        rows = hi - lo
        r_pad = 1 if rows == 1 else -(-rows // SHAPE_STEP) * SHAPE_STEP
        qb = q[lo - start : hi - start]
        f_pad = max(MIN_ROWS - group * r_pad, 0)  # the kernel rounds a lone row differently
        if r_pad == rows and not f_pad:
            qf = _fold(qb, num_kv)  # [1, KVH, G * r_pad, D]
        else:  # one copy into a zeroed buffer rather than pad, then fold
            qf = q.new_zeros(1, num_kv, group * r_pad + f_pad, d)
            qf[0, :, : group * r_pad].view(num_kv, group, r_pad, d)[:, :, :rows] = \
                qb.view(rows, num_kv, group, d).permute(1, 2, 0, 3)
        kd, vd = k[:, :, a : a + kb], v[:, :, a : a + kb]  # the diagonal block
        if kd.shape[2] < kb:
            kd, vd = _pad_len(kd, 0, kb - kd.shape[2]), _pad_len(vd, 0, kb - vd.shape[2])
        if rows == 1:  # decode: every folded row is this query's (or padding); no copy
            mask = _diagonal_mask(lo - a, 1, 1, 1, q.dtype).expand(1, 1, qf.shape[2], kb)
        else:
            mask = _diagonal_mask(lo - a, rows, r_pad, group, q.dtype)
        o2, lse2 = _FLASH_LSE(qf, kd, vd, attn_mask=mask, scale=scale)[:2]
        r = slice(lo - start, hi - start)
        out[r] = o2[0, :, : group * r_pad].reshape(h, r_pad, d)[:, :rows].transpose(0, 1)
        if a:
            o1, lse1 = _FLASH_LSE(qf, k[:, :, :a], v[:, :, :a], scale=scale)[:2]
            m = slice(r.start - first, r.stop - first)
            o1s[m] = o1[0, :, : group * r_pad].reshape(h, r_pad, d)[:, :rows].transpose(0, 1)
            lse[0, m] = lse1[0, :, : group * r_pad].reshape(h, r_pad)[:, :rows].t()
            lse[1, m] = lse2[0, :, : group * r_pad].reshape(h, r_pad)[:, :rows].t()
        lo = hi
    if first < n:
        out[first:] = _merge_rows(o1s, lse[0], out[first:], lse[1])
    return out


def _merge_rows(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                lse2: torch.Tensor) -> torch.Tensor:
    """Softmax over both parts of `_blocked`'s rows ([rows, H, D] outputs, [rows, H] log-sum-exps)
    in float32: o1 + (o2 - o1) * w, w = e^lse2 / (e^lse1 + e^lse2); every op but the sigmoid
    rounds exactly, the same for a row wherever it sits (one formula for prefill and decode)."""
    w = _sigmoid_rows(lse2 - lse1)[..., None]  # [rows, H, 1]
    o1f = o1.float()
    return o2.float().sub_(o1f).mul_(w).add_(o1f)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                    layer: int, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for this step's tokens -> output [T, H, D]."""
    ctx = get_context()
    write_kv(pool, layer, k, v, ctx)
    num_kv = k.shape[1]
    if kernel_runs(q.dtype, q.shape[-1]) and q.shape[1] % num_kv == 0:
        return _kernel_step(q, k, v, pool, layer, scale, ctx)
    group = q.shape[1] // num_kv
    step = shape_step(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype)  # contiguous: the native kernels write into it
    use_native = native.attention_ok(q, num_kv)
    inv = invariant(q.dtype)
    decode_rows, decode_k, decode_v = [], [], []  # one-token sequences for the native kernel
    inv_rows, inv_k, inv_v, inv_pos = [], [], [], []  # one-token sequences, invariant path
    f32_prefill = not inv and F32_ATTENTION and causal_kernel.f32_ok(q, num_kv)
    prefills: list[causal_kernel.Seq] = []  # float32 prefill chunks for the native kernel
    append_mirrors(pool, ctx, layer, k, v)
    for s in ctx.seqs:
        rows = slice(s.q_start, s.q_start + s.num_new)
        m = s.mirror
        if m is not None:
            sk, sv = m.kv[layer, 0, None, :, : s.ctx_len], m.kv[layer, 1, None, :, : s.ctx_len]
            if inv and s.num_new == 1 and m.clean >= -(-s.ctx_len // KEY_BLOCK) * KEY_BLOCK:
                # the whole key block of the row (zeros past the context: MirrorSet.prepare), so
                # `_blocked` reads it in place instead of padding a copy (a decode step at 4k,
                # bf16: ~0.1 ms per layer)
                sk, sv = m.kv[layer, 0, None], m.kv[layer, 1, None]
        else:
            if s.start == 0:
                sk, sv = k[rows], v[rows]
            else:
                sk = _gather(pool, s, layer, 0, num_kv, k.shape[-1])[: s.ctx_len]
                sv = _gather(pool, s, layer, 1, num_kv, k.shape[-1])[: s.ctx_len]
            # SDPA's fast CPU kernel needs 4-D [batch, heads, len, dim]; 3-D takes the math path
            sk, sv = sk.transpose(0, 1)[None], sv.transpose(0, 1)[None]  # [1, KVH, S, D]
        if f32_prefill and s.num_new > 1:  # every prefill chunk of the step at once, below
            prefills.append((sk[0], sv[0], s.q_start, s.num_new, s.start))
            continue
        if inv and s.num_new == 1:  # decode rows: all of the step's at once, below
            inv_rows.append(s.q_start)
            inv_k.append(sk)
            inv_v.append(sv)
            inv_pos.append(s.start)
            continue
        if inv:
            out[rows] = _blocked(q[rows], sk, sv, s.start, scale)
            continue
        if s.num_new == 1 and use_native:
            decode_rows.append(s.q_start)
            decode_k.append(sk[0])
            decode_v.append(sv[0])
            continue
        if s.num_new == 1:
            # one query: fold the query heads of a KV group into the query-length axis
            qh = q[rows].view(1, num_kv, group, -1)
            o = _decode(qh, sk, sv, scale, step)
            out[rows] = o.reshape(1, -1, o.shape[-1])
        elif s.start > 0 and _FLASH_LSE is not None:
            out[rows] = _prefix_causal(q[rows], sk, sv, s.start, scale, step)
        else:
            qh = q[rows].transpose(0, 1).contiguous()[None]  # [1, H, n, D]: contiguous is
            # markedly faster in the CPU flash kernel (bf16 8k: 490 vs 660 ms per layer)
            if group > 1:  # expand KV heads: enable_gqa would take SDPA's slow math path
                sk = sk.repeat_interleave(group, dim=1)
                sv = sv.repeat_interleave(group, dim=1)
            pad = -(-s.num_new // step) * step - s.num_new if s.mask is None else 0
            o = F.scaled_dot_product_attention(
                _pad_len(qh, 0, pad), _pad_len(sk, 0, pad), _pad_len(sv, 0, pad),
                attn_mask=s.mask, is_causal=s.mask is None, scale=scale)
            out[rows] = o[0, :, : s.num_new].transpose(0, 1)
    if prefills:
        causal_kernel.f32_attention(q.contiguous(), prefills, scale, out)
    if decode_rows:
        _native_decode(q, out, decode_rows, decode_k, decode_v, scale)
    if len(inv_rows) == 1:  # one sequence: its own call is cheaper than the batch's gathers
        r = slice(inv_rows[0], inv_rows[0] + 1)
        out[r] = _blocked(q[r], inv_k[0], inv_v[0], inv_pos[0], scale)
    elif inv_rows:
        _blocked_decode(q, out, inv_rows, inv_k, inv_v, inv_pos, scale)
    return out


def _kernel_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, layer: int,
              scale: float, ctx: AttnContext) -> torch.Tensor:
    """Every sequence of the step in one call of our bf16 kernel: each reads its keys from its
    mirror (appended first), from this step's K/V (a fresh prefill without one), or from a copy
    gathered from the pool."""
    append_mirrors(pool, ctx, layer, k, v)
    seqs = []
    for s in ctx.seqs:
        rows = slice(s.q_start, s.q_start + s.num_new)
        m = s.mirror
        if m is not None:
            sk, sv = m.kv[layer, 0], m.kv[layer, 1]  # [KVH, cap, D]
        elif s.start == 0:
            sk, sv = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, D] views
        else:
            sk = _gather(pool, s, layer, 0, k.shape[1], k.shape[-1])[: s.ctx_len].transpose(0, 1)
            sv = _gather(pool, s, layer, 1, k.shape[1], k.shape[-1])[: s.ctx_len].transpose(0, 1)
        seqs.append((sk, sv, s.q_start, s.num_new, s.start))
    return amx.attention(q.contiguous(), seqs, scale)


def _blocked_decode(q: torch.Tensor, out: torch.Tensor, rows: list[int], keys: list[torch.Tensor],
                    values: list[torch.Tensor], positions: list[int], scale: float) -> None:
    """out[rows] <- `_blocked` of each one-token sequence (q[rows[i]] at positions[i] over
    keys[i]/values[i] [1, KVH, > positions[i], D]), bit for bit, with fewer calls: the diagonal
    blocks of all sequences go to the kernel as one batch (it computes each (batch, head) item
    alone, as it computes each row alone), and the merge runs once over every row; only the
    unmasked call over a sequence's keys [0, a) stays one per sequence, its keys being its own."""
    b, (h, d) = len(rows), q.shape[1:]
    num_kv = keys[0].shape[1]
    group, kb = h // num_kv, KEY_BLOCK
    idx = torch.tensor(rows)
    qf = q.new_zeros(b, num_kv, max(group, MIN_ROWS), d)  # folded, padded as `_blocked` does
    qf[:, :, :group] = q[idx].view(b, num_kv, group, d)
    kd, vd = q.new_zeros(2, b, num_kv, kb, d).unbind(0)  # zero past each sequence's end
    mask = q.new_empty(b, 1, 1, kb)
    starts = [p // kb * kb for p in positions]
    for i, (p, a, k, v) in enumerate(zip(positions, starts, keys, values)):
        kd[i, :, : p + 1 - a] = k[0, :, a : p + 1]
        vd[i, :, : p + 1 - a] = v[0, :, a : p + 1]
        mask[i] = _diagonal_mask(p - a, 1, 1, 1, q.dtype)[0]
    o2, lse2 = _FLASH_LSE(qf, kd, vd, attn_mask=mask.expand(b, 1, qf.shape[2], kb),
                          scale=scale)[:2]
    o2 = o2[:, :, :group].reshape(b, h, d)
    merged = [i for i, a in enumerate(starts) if a]
    if merged:
        o1s = q.new_empty(len(merged), h, d)
        lse1s = lse2.new_empty(len(merged), h)
        for j, i in enumerate(merged):
            a = starts[i]
            o1, lse1 = _FLASH_LSE(qf[i : i + 1], keys[i][:, :, :a], values[i][:, :, :a],
                                  scale=scale)[:2]
            o1s[j] = o1[0, :, :group].reshape(h, d)
            lse1s[j] = lse1[0, :, :group].reshape(h)
        m = torch.tensor(merged)
        o2[m] = _merge_rows(o1s, lse1s, o2[m], lse2[:, :, :group].reshape(b, h)[m]).to(q.dtype)
    out[idx] = o2


def _native_decode(q: torch.Tensor, out: torch.Tensor, rows: list[int], keys: list[torch.Tensor],
                   values: list[torch.Tensor], scale: float) -> None:
    """out[rows] <- one-token attention of q[rows] over each row's keys/values, in one call."""
    if len(rows) == q.shape[0]:  # a pure decode step: rows are 0..B-1 in order
        out.copy_(native.decode_attention(q, keys, values, scale))
        return
    idx = torch.tensor(rows)
    out[idx] = native.decode_attention(q[idx], keys, values, scale)
