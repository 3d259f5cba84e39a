/* bf16 causal attention on AMX tiles: one kernel for prefill chunks and decode steps alike.
 *
 * Why: reuse must not change an answer, so a query row's output may depend only on its position,
 * its query and the keys/values at positions 0 .. p, never on how the prompt was split into
 * chunks, which of its keys were pulled from a peer or decoded one by one, or which other rows
 * share the call (docs/engine.md, "chunking invariance"). PyTorch's flash kernel met that only
 * through a detour (two calls per key block of 512 and a merge, attention.py `_blocked`), and each
 * of its calls woke an OpenMP team that sleeps between regions. This kernel is invariant by
 * construction and runs every sequence of a step in one call on the native pool.
 *
 * Per query row at position p (its G query heads of one KV head folded into the rows of a tile):
 * keys go in blocks of AT_BK from position 0 (the same blocks whatever the call), keys past p
 * masked; per block, scores s = q . k (one TDPBF16PS per 32 dims, in order, from zero), scaled by
 * scale * log2(e); running max m, p = 2^(s - m) (v16_exp2, native_simd.h: the same
 * instructions for every row), l = l * alpha + p (16 lanes, in key order), P rounded to bf16,
 * the block's P . V (TDPBF16PS per 32 keys, from zero) added to the row's float32 accumulator
 * scaled by alpha (the softmax's own arithmetic in builtins -ffast-math may not rewrite); at
 * the end out = acc / l rounded once to bf16. A TDPBF16PS treats each row of its A tile alone, a
 * masked key contributes an exact zero (its P is zero and its packed V is zero past the context),
 * and a block none of a row's keys reach leaves the row exactly as it was (alpha = 2^0 = 1), so a
 * row's bits depend on nothing but its own inputs. Every row takes one code path (the masks are
 * computed, never branched on per row), and blocks are skipped only for tiles none of whose rows
 * reach them.
 *
 * Layout: q and out [T, H, D] (T: the step's tokens); a sequence's keys and values are read through
 * a base pointer per tensor with its own KV-head stride and row stride (a mirror [KVH, cap, D], the
 * step's own [n, KVH, D], or a gathered copy), only rows below start + n_new. A task is one KV
 * head of one sequence and up to AT_QB of its folded rows (position-major, then the group's
 * heads); it packs each key block once into the tiles' layouts (K as the B operand of Q . K^T:
 * a 16 x 16 transpose of 32-bit pairs; V as the B operand of P . V: pairs of keys interleaved)
 * and runs its query tiles over it. A task of one tile (a decode row's heads) computes K . Q^T
 * instead, K rows read in place, which gives the same bits (at_scores_t). K/V rows 256 ahead are
 * prefetched into L2. Tasks go to the pool costliest first.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#define AT_ZERO4(n)                                  \
    do {                                             \
        if ((n) > 0) _tile_zero(0);                  \
        if ((n) > 1) _tile_zero(1);                  \
        if ((n) > 2) _tile_zero(2);                  \
        if ((n) > 3) _tile_zero(3);                  \
    } while (0)

/* one tile (rows t0 .. t0 + 15 of the task) over the packed key block at k0; rows past `real`
 * are padding: their softmax is skipped (their P rows stay finite, and a tile row's products
 * never reach another row), their outputs never stored */
/* S^T = K . Q^T for the task's lone tile: K rows read in place as the A operand (no transpose of
 * K), the queries packed once as B; each 16 x 16 block of S^T transposed into S. TDPBF16PS adds
 * the same products in the same order whichever operand is A (q[2r] k[2r] + q[2r+1] k[2r+1] over
 * dim pairs r, from zero), so S is bit for bit that of Q . K^T (tested: a decode row equals the
 * same row of a whole prefill). */
static void at_scores_t(const struct causal_job *j, struct at_scratch *w, const uint16_t *k,
                        int64_t rs, int64_t k0, int64_t ctx, int ncols) {
    const int64_t D = j->D, dcs = D / 32;
    for (int c = 0; c < ncols; c++) {
        const int64_t first = k0 + 16 * c;
        const uint16_t *a = k + first * rs;
        int64_t stride = rs;
        for (int n = 0; n < 16; n++) /* the same rows of a later block, as at_pack_k does */
            for (int64_t dc = 0; dc < dcs; dc++)
                _mm_prefetch((const char *)(a + (AT_PF + n) * rs + 32 * dc), _MM_HINT_T1);
        if (first + 16 > ctx) { /* a tile load reads 16 rows: the context's last ones, zeros */
            memset(w->kpad, 0, (size_t)(16 * D) * 2);
            for (int64_t n = 0; n < ctx - first; n++)
                memcpy(w->kpad + n * D, a + n * rs, (size_t)D * 2);
            a = w->kpad, stride = D;
        }
        _tile_zero(0);
        for (int64_t dc = 0; dc < dcs; dc++) {
            _tile_loadd(4, a + 32 * dc, stride * 2);
            _tile_loadd(5, w->qtp + dc * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, w->st, 64);
        __m512i r[16];
        for (int n = 0; n < 16; n++) r[n] = _mm512_load_si512(w->st + 16 * n);
        v16_transpose16(r);
        for (int q = 0; q < 16; q++) _mm512_store_si512(w->s + q * AT_BK + 16 * c, r[q]);
    }
}

static void at_tile_block(const struct causal_job *j, struct at_scratch *w, int64_t t0, int64_t k0,
                          int real, const uint16_t *kt, int64_t krs, int64_t ctx) {
    const int64_t D = j->D, dcs = D / 32, dcols = D / 16;
    int64_t maxlim = 0;
    for (int i = 0; i < 16; i++) {
        const int64_t lim = w->pos[t0 + i] - k0 + 1;
        if (lim > maxlim) maxlim = lim;
    }
    if (maxlim <= 0) return; /* no row reaches this block: every row would stay as it is */
    if (maxlim > AT_BK) maxlim = AT_BK;
    const int ncols = (int)((maxlim + 15) / 16), nhalves = (int)((maxlim + 31) / 32);
    /* scores S[16 rows][AT_BK keys], 4 columns of 16 keys at a time; columns past ncols are left
     * stale (masked below) */
    if (kt) at_scores_t(j, w, kt, krs, k0, ctx, ncols);
    for (int g = 0; !kt && g < ncols; g += 4) {
        const int nc = ncols - g < 4 ? ncols - g : 4;
        AT_ZERO4(nc);
        for (int64_t dc = 0; dc < dcs; dc++) {
            _tile_loadd(4, w->qt + t0 * D + 32 * dc, D * 2);
            const uint16_t *kb = w->kp + (g * dcs + dc) * 512;
            _tile_loadd(5, kb, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nc > 1) {
                _tile_loadd(6, kb + dcs * 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nc > 2) {
                _tile_loadd(7, kb + 2 * dcs * 512, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nc > 3) {
                _tile_loadd(5, kb + 3 * dcs * 512, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        float *sg = w->s + 16 * g;
        _tile_stored(0, sg, AT_BK * 4);
        if (nc > 1) _tile_stored(1, sg + 16, AT_BK * 4);
        if (nc > 2) _tile_stored(2, sg + 32, AT_BK * 4);
        if (nc > 3) _tile_stored(3, sg + 48, AT_BK * 4);
    }
    at_softmax(j, w, t0, k0, real);
    /* P . V for the block, 4 columns of 16 dims at a time, then acc = acc * alpha + that */
    for (int64_t g0 = 0; g0 < dcols; g0 += 4) {
        const int nd = dcols - g0 < 4 ? (int)(dcols - g0) : 4;
        AT_ZERO4(nd);
        for (int h = 0; h < nhalves; h++) {
            _tile_loadd(4, w->p + 32 * h, AT_BK * 2);
            const uint16_t *vb = w->vp + (h * dcols + g0) * 512;
            _tile_loadd(5, vb, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                _tile_loadd(6, vb + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nd > 2) {
                _tile_loadd(7, vb + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nd > 3) {
                _tile_loadd(5, vb + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, w->ob + 16 * g0, D * 4);
        if (nd > 1) _tile_stored(1, w->ob + 16 * (g0 + 1), D * 4);
        if (nd > 2) _tile_stored(2, w->ob + 16 * (g0 + 2), D * 4);
        if (nd > 3) _tile_stored(3, w->ob + 16 * (g0 + 3), D * 4);
    }
    at_acc_update(w, t0, real, D);
}

static void at_tasks(void *ctx, int64_t t0, int64_t t1) {
    struct causal_job *j = ctx;
    struct at_scratch *w = at_scratch_get();
    if (!w) {
        atomic_store(&j->failed, 1);
        return;
    }
    struct amx_cfg cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t t = t0; t < t1; t++) at_task_walk(j, w, &j->tasks[t], at_tile_block, 1);
    _tile_release();
}


/* Attention of the step's query rows q [T, H, D] (bf16) for `nseq` sequences into out [T, H, D]:
 * sequence s has n_new[s] rows from row q_row[s], at positions start[s] .. start[s] + n_new[s]
 * - 1, and its keys (positions 0 .. start[s] + n_new[s] - 1) at kbase[s] + h * khs[s] +
 * position * krs[s] (elements) for KV head h, its values likewise at vbase[s] with vhs[s] and
 * vrs[s]. 0, or -1 (unsupported shape, no memory). */
int dkv_amx_attention(CAUSAL_ARGS(uint16_t)) {
    if (!dkv_amx_init() || D % 32 || D <= 0 || D > AT_MAX_D || KVH <= 0 || H % KVH || nseq <= 0)
        return -1;
    return causal_run(at_tasks, AT_QB, CAUSAL_PASS);
}
#else
int dkv_amx_attention(CAUSAL_ARGS(uint16_t)) {
    CAUSAL_UNUSED;
    return -1;
}
#endif
