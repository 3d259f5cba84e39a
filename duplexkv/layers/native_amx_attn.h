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

#define AT_BK 64     /* keys per softmax step, blocks aligned to position 0 */
#define AT_NC (AT_BK / 16) /* columns of 16 keys per block */
#define AT_QB 128    /* folded query rows per task (8 tiles) */
#define AT_MAX_D 256 /* head_dim: a multiple of 32 up to this */
#define AT_NEG (-1e30f)
/* Arithmetic whose rounding a row's bits depend on goes through builtins the compiler may not
 * reassociate, contract or replace (the build uses -ffast-math, under which GCC treats plain
 * vector + - * / as algebra): FMAs, and adds and divides with an explicit rounding mode. */
#define AT_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define AT_ADD(a, b) _mm512_add_round_ps((a), (b), AT_RNE)
#define AT_PF 256 /* rows ahead to prefetch K and V into L2 (never faults, even past the end) */

/* a thread's scratch, for AT_MAX_D */
struct at_scratch {
    uint16_t qt[AT_QB * AT_MAX_D];  /* the task's folded query rows, zero rows past the last */
    uint16_t qtp[16 * AT_MAX_D];    /* a lone tile's queries as the B operand (K . Q^T) */
    uint16_t kpad[16 * AT_MAX_D];   /* the last keys of a context, zero rows after them */
    float st[16 * 16];              /* one 16 x 16 block of K . Q^T */
    float acc[AT_QB * AT_MAX_D];    /* output accumulators */
    float lvec[AT_QB * 16];         /* softmax denominators, 16 lanes per row */
    float m[AT_QB];                 /* running maxima */
    int64_t pos[AT_QB];             /* each row's position */
    uint16_t kp[AT_BK * AT_MAX_D];  /* the key block, packed */
    uint16_t vp[AT_BK * AT_MAX_D];  /* the value block, packed */
    float s[16 * AT_BK];            /* one tile's scores */
    uint16_t p[16 * AT_BK];         /* one tile's probabilities, bf16 */
    float ob[16 * AT_MAX_D];        /* one tile's P . V of the block */
    float alpha[16];
} __attribute__((aligned(64)));
static __thread struct at_scratch *at_buf;

/* the keys [k0, k0 + AT_BK) below `nv` of one KV head into kp (zeros past nv):
 * kp[c][dc] (1 KiB tile) = [16 dim pairs r][16 keys n][2], key k0 + 16c + n, dims 32dc + 2r .. */
static void at_pack_k(uint16_t *kp, const uint16_t *k, int64_t rs, int64_t k0, int64_t nv,
                      int64_t D) {
    const int64_t dcs = D / 32;
    for (int64_t c = 0; c < AT_BK / 16 && 16 * c < nv; c++)
        for (int64_t dc = 0; dc < dcs; dc++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++) {
                const uint16_t *row = k + (k0 + 16 * c + n) * rs + 32 * dc;
                _mm_prefetch((const char *)(row + AT_PF * rs), _MM_HINT_T1); /* a later block */
                r[n] = 16 * c + n < nv ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
            }
            v16_transpose16(r);
            uint16_t *o = kp + (c * dcs + dc) * 512;
            for (int j = 0; j < 16; j++) _mm512_store_si512(o + 32 * j, r[j]);
        }
}

/* the values [k0, k0 + AT_BK) below `nv` into vp (zeros past nv):
 * vp[h][dcol] (1 KiB tile) = [16 key pairs][16 dims][2], keys k0 + 32h + 2r + t, dim 16 dcol + n */
static void at_pack_v(uint16_t *vp, const uint16_t *v, int64_t rs, int64_t k0, int64_t nv,
                      int64_t D) {
    const int64_t dcols = D / 16;
    __m512i lo_idx, hi_idx; /* (a[n], b[n]) pairs of the chunk's dims 0..15 and 16..31 */
    {
        uint16_t lo[32], hi[32];
        for (int n = 0; n < 16; n++) lo[2 * n] = n, lo[2 * n + 1] = 32 + n, hi[2 * n] = 16 + n,
                                      hi[2 * n + 1] = 48 + n;
        lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    }
    for (int64_t h = 0; h < AT_BK / 32 && 32 * h < nv; h++)
        for (int r = 0; r < 16; r++) {
            const int64_t ka = 32 * h + 2 * r, kb = ka + 1;
            const uint16_t *a = v + (k0 + ka) * rs, *b = v + (k0 + kb) * rs;
            for (int64_t c = 0; c < D; c += 32) { /* the same rows of a later block */
                _mm_prefetch((const char *)(a + AT_PF * rs + c), _MM_HINT_T1);
                _mm_prefetch((const char *)(b + AT_PF * rs + c), _MM_HINT_T1);
            }
            for (int64_t c = 0; c < D / 32; c++) {
                const __m512i va = ka < nv ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
                const __m512i vb = kb < nv ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
                uint16_t *o = vp + ((h * dcols + 2 * c) * 16 + r) * 32;
                _mm512_store_si512(o, _mm512_permutex2var_epi16(va, lo_idx, vb));
                _mm512_store_si512(o + 512, _mm512_permutex2var_epi16(va, hi_idx, vb));
            }
        }
}

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
    /* softmax step per row: the same instructions for every row, masks from its position; first
     * each row's new maximum (the largest score times the scale: rounding keeps the order),
     * then the 16 rows' rescaling factors in one vector */
    const __m512 sl = _mm512_set1_ps(j->sl), neg = _mm512_set1_ps(AT_NEG);
    __mmask16 mk[16][AT_NC];
    float m_new[16] __attribute__((aligned(64)));
    for (int i = real; i < 16; i++) m_new[i] = w->m[t0 + i];
    for (int i = 0; i < real; i++) {
        int64_t lim = w->pos[t0 + i] - k0 + 1;
        lim = lim < 0 ? 0 : lim > AT_BK ? AT_BK : lim;
        const uint64_t lo = _bzhi_u64(~0ull, (unsigned)(lim < 64 ? lim : 64));
        const uint64_t hi = _bzhi_u64(~0ull, (unsigned)(lim > 64 ? lim - 64 : 0));
        __m512 mx = neg;
        for (int c = 0; c < AT_NC; c++) {
            mk[i][c] = (__mmask16)((c < 4 ? lo : hi) >> (16 * (c & 3)));
            mx = _mm512_mask_max_ps(mx, mk[i][c], mx, _mm512_load_ps(w->s + i * AT_BK + 16 * c));
        }
        const float bm = _mm512_reduce_max_ps(mx) * j->sl, m_old = w->m[t0 + i];
        m_new[i] = bm > m_old ? bm : m_old;
    }
    const __m512 mnew = _mm512_load_ps(m_new), mold = _mm512_loadu_ps(w->m + t0);
    _mm512_store_ps(w->alpha, v16_exp2(_mm512_sub_round_ps(mold, mnew, AT_RNE)));
    _mm512_storeu_ps(w->m + t0, mnew);
    for (int i = 0; i < real; i++) {
        const __m512 mn = _mm512_set1_ps(m_new[i]), alpha = _mm512_set1_ps(w->alpha[i]);
        __m512 p[AT_NC];
        for (int c = 0; c < AT_NC; c++) {
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(w->s + i * AT_BK + 16 * c), sl, mn);
            p[c] = _mm512_maskz_mov_ps(mk[i][c], v16_exp2(x));
        }
        for (int c = 0; c < AT_NC; c += 2)
            _mm512_store_si512(w->p + i * AT_BK + 16 * c,
                               (__m512i)_mm512_cvtne2ps_pbh(p[c + 1], p[c]));
        for (int c = 1; c < AT_NC; c *= 2) /* pairwise: ((p0 + p1) + (p2 + p3)) + (...) */
            for (int e = 0; e < AT_NC; e += 2 * c) p[e] = AT_ADD(p[e], p[e + c]);
        float *lv = w->lvec + (t0 + i) * 16;
        _mm512_store_ps(lv, _mm512_fmadd_ps(_mm512_load_ps(lv), alpha, p[0]));
    }
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
    for (int i = 0; i < real; i++) {
        const __m512 a = _mm512_set1_ps(w->alpha[i]);
        float *acc = w->acc + (t0 + i) * D;
        for (int64_t c = 0; c < dcols; c++)
            _mm512_store_ps(acc + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(acc + 16 * c), a,
                                                          _mm512_load_ps(w->ob + i * D + 16 * c)));
    }
}

static void at_task_run(const struct causal_job *j, struct at_scratch *w,
                        const struct causal_task *t) {
    const int64_t s = t->seq, H = j->H, G = j->G, D = j->D, rows = t->r1 - t->r0;
    const int64_t padded = (rows + 15) / 16 * 16, start = j->start[s], qrow = j->qrow[s];
    const int64_t ctx = start + j->nnew[s];
    for (int64_t i = 0; i < padded; i++) { /* fold: row r = position index * G + head in group */
        const int64_t r = t->r0 + (i < rows ? i : rows - 1), pi = r / G, g = r % G;
        w->pos[i] = start + pi;
        w->m[i] = AT_NEG;
        memset(w->lvec + i * 16, 0, 64);
        memset(w->acc + i * D, 0, (size_t)D * 4);
        if (i < rows)
            memcpy(w->qt + i * D, (const uint16_t *)j->q + ((qrow + pi) * H + t->kvh * G + g) * D,
                   (size_t)D * 2);
        else
            memset(w->qt + i * D, 0, (size_t)D * 2);
    }
    const int64_t last = w->pos[rows - 1];
    const uint16_t *k = (const uint16_t *)j->kbase[s] + t->kvh * j->khs[s];
    const uint16_t *v = (const uint16_t *)j->vbase[s] + t->kvh * j->vhs[s];
    /* a lone tile (decode rows) meets each key once: K . Q^T spares packing K (at_scores_t) */
    const int lone = padded == 16;
    if (lone) at_pack_k(w->qtp, w->qt, D, 0, 16, D);
    for (int64_t k0 = 0; k0 <= last; k0 += AT_BK) {
        const int64_t nv = ctx - k0 < AT_BK ? ctx - k0 : AT_BK;
        if (!lone) at_pack_k(w->kp, k, j->krs[s], k0, nv, D);
        at_pack_v(w->vp, v, j->vrs[s], k0, nv, D);
        for (int64_t t0 = 0; t0 < padded; t0 += 16)
            at_tile_block(j, w, t0, k0, rows - t0 < 16 ? (int)(rows - t0) : 16,
                          lone ? k : NULL, j->krs[s], ctx);
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = t->r0 + i, pi = r / G, g = r % G;
        const float *lv = w->lvec + i * 16;
        const __m512 l = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_load_ps(lv)));
        uint16_t *o = (uint16_t *)j->out + ((qrow + pi) * H + t->kvh * G + g) * D;
        const float *acc = w->acc + i * D;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512 lo = _mm512_div_round_ps(_mm512_load_ps(acc + c), l, AT_RNE);
            const __m512 hi = _mm512_div_round_ps(_mm512_load_ps(acc + c + 16), l, AT_RNE);
            _mm512_storeu_si512(o + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

static void at_tasks(void *ctx, int64_t t0, int64_t t1) {
    struct causal_job *j = ctx;
    if (!at_buf) {
        at_buf = aligned_alloc(64, (sizeof(struct at_scratch) + 63) / 64 * 64);
        if (at_buf) memset(at_buf->p, 0, sizeof at_buf->p); /* padding rows' P: finite */
    }
    if (!at_buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    struct amx_cfg cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t t = t0; t < t1; t++) at_task_run(j, at_buf, &j->tasks[t]);
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
