/* What the two bf16 causal attention kernels share (native_amx_attn.h on AMX tiles,
 * native_vdp_attn.h by AVX-512 BF16 dot products): the key blocks, a thread's scratch, the packed
 * layouts of a block's keys and values, the softmax step of a block, and a task's folding of its
 * query rows and its output. The arithmetic a row's bits depend on is described in
 * native_amx_attn.h; both kernels run these same steps, so they differ only in how the two
 * products of a block (Q . K^T and P . V) are computed, each from zero over pairs in order.
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)

#define AT_BK 64     /* keys per softmax step, blocks aligned to position 0 */
#define AT_NC (AT_BK / 16) /* columns of 16 keys per block (at_softmax_rows adds 4) */
_Static_assert(AT_NC == 4, "at_softmax_rows sums a block's 4 columns pairwise");
#define AT_QB 128    /* folded query rows per task (8 tiles) */
#define AT_MAX_D 256 /* head_dim: a multiple of 32 up to this */
#define AT_NEG (-1e30f)
/* Arithmetic whose rounding a row's bits depend on goes through builtins the compiler may not
 * reassociate, contract or replace (the build uses -ffast-math, under which GCC treats plain
 * vector + - * / as algebra): FMAs, and adds and divides with an explicit rounding mode. */
#define AT_ADD(a, b) _mm512_add_round_ps((a), (b), V16_RNE) /* V16_RNE: native_simd.h */
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

/* this thread's scratch (allocated once), or NULL if out of memory */
static struct at_scratch *at_scratch_get(void) {
    if (!at_buf) {
        at_buf = aligned_alloc(64, (sizeof(struct at_scratch) + 63) / 64 * 64);
        if (at_buf) memset(at_buf->p, 0, sizeof at_buf->p); /* padding rows' P: finite */
    }
    return at_buf;
}

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


/* P = 2^(s * scale - m) of the tile's real rows rounded to bf16 into w->p, zero for keys past a
 * row's position (`masked`: mk holds the rows' masks; else no key of the block is masked), and
 * l = l * alpha + the block's P (16 lanes, pairwise over the block's columns) */
static inline __attribute__((always_inline)) void
at_softmax_rows(const struct causal_job *j, struct at_scratch *w, int64_t t0, int real,
                const float *m_new, __mmask16 mk[16][AT_NC], const int masked) {
    const __m512 sl = _mm512_set1_ps(j->sl);
    for (int i = 0; i < real; i++) {
        const __m512 mn = _mm512_set1_ps(m_new[i]), alpha = _mm512_set1_ps(w->alpha[i]);
        __m512 p[AT_NC];
        for (int c = 0; c < AT_NC; c++) {
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(w->s + i * AT_BK + 16 * c), sl, mn);
            p[c] = masked ? _mm512_maskz_mov_ps(mk[i][c], v16_exp2(x)) : v16_exp2(x);
        }
        for (int c = 0; c < AT_NC; c += 2)
            _mm512_store_si512(w->p + i * AT_BK + 16 * c,
                               (__m512i)_mm512_cvtne2ps_pbh(p[c + 1], p[c]));
        /* pairwise, in registers (a loop over p[] went through the stack, a store and a reload
         * per add on each row's critical path) */
        const __m512 sum = AT_ADD(AT_ADD(p[0], p[1]), AT_ADD(p[2], p[3]));
        float *lv = w->lvec + (t0 + i) * 16;
        _mm512_store_ps(lv, _mm512_fmadd_ps(_mm512_load_ps(lv), alpha, sum));
    }
}

/* softmax step per row of the tile at t0 (rows past `real`: unchanged) over the scores w->s of the
 * key block at k0: new maxima, the rescaling factors w->alpha, P = 2^(s - m) rounded to bf16 into
 * w->p (zero for keys past the row's position), l = l * alpha + the block's P (16 lanes).
 * The same arithmetic for every row, masks from its position: each row's largest score per lane
 * over the block's columns, then the 16 rows' maxima across lanes by one shuffle tree per 8 rows
 * (v16_rowmax8: a maximum is exact, so it is the largest score whatever the order), times the
 * scale (rounding keeps the order), the new maxima and rescaling factors of the 16 rows in one
 * vector each. A tile whose every row reads the whole block builds no masks (all keys count).
 * Against a reduction per row (scalar maxima stored one by one, then reloaded as a vector): the
 * same bits, a causal prefill's attention 0.87-0.98x the time (bench shapes, 2k and 8k tokens,
 * AMX Xeon, 2 threads; on its AVX-512 BF16 kernel 0.94-0.99x). */
static void at_softmax(const struct causal_job *j, struct at_scratch *w, int64_t t0, int64_t k0,
                       int real) {
    const __m512 neg = _mm512_set1_ps(AT_NEG);
    __mmask16 mk[16][AT_NC];
    int64_t lim[16], least = AT_BK; /* the keys of the block each real row reads; the fewest */
    for (int i = 0; i < real; i++) {
        const int64_t n = w->pos[t0 + i] - k0 + 1;
        lim[i] = n < 0 ? 0 : n > AT_BK ? AT_BK : n;
        if (lim[i] < least) least = lim[i];
    }
    const int masked = least < AT_BK;
    __m512 mx[16];
    for (int i = 0; i < 16; i++) {
        mx[i] = neg;
        if (i >= real) continue;
        if (masked) {
            const uint64_t lo = _bzhi_u64(~0ull, (unsigned)(lim[i] < 64 ? lim[i] : 64));
            const uint64_t hi = _bzhi_u64(~0ull, (unsigned)(lim[i] > 64 ? lim[i] - 64 : 0));
            for (int c = 0; c < AT_NC; c++) {
                mk[i][c] = (__mmask16)((c < 4 ? lo : hi) >> (16 * (c & 3)));
                mx[i] = _mm512_mask_max_ps(mx[i], mk[i][c], mx[i],
                                           _mm512_load_ps(w->s + i * AT_BK + 16 * c));
            }
        } else {
            for (int c = 0; c < AT_NC; c++)
                mx[i] = _mm512_max_ps(mx[i], _mm512_load_ps(w->s + i * AT_BK + 16 * c));
        }
    }
    const __m512 lo8 = v16_rowmax8(mx), hi8 = v16_rowmax8(mx + 8); /* lanes 0-7 each */
    const __m512 bm = _mm512_mul_round_ps(_mm512_shuffle_f32x4(lo8, hi8, 0x44),
                                          _mm512_set1_ps(j->sl), V16_RNE);
    const __m512 mold = _mm512_loadu_ps(w->m + t0); /* max: bm if larger, else the old maximum */
    const __m512 mnew = _mm512_mask_max_ps(mold, (__mmask16)_bzhi_u32(0xffffu, (unsigned)real),
                                           bm, mold);
    float m_new[16] __attribute__((aligned(64)));
    _mm512_store_ps(m_new, mnew);
    _mm512_store_ps(w->alpha, v16_exp2(_mm512_sub_round_ps(mold, mnew, V16_RNE)));
    _mm512_storeu_ps(w->m + t0, mnew);
    if (masked)
        at_softmax_rows(j, w, t0, real, m_new, mk, 1);
    else
        at_softmax_rows(j, w, t0, real, m_new, mk, 0);
}

/* acc = acc * alpha + the block's P . V (w->ob, the tile's rows) for the tile's real rows */
static void at_acc_update(struct at_scratch *w, int64_t t0, int real, int64_t D) {
    const int64_t dcols = D / 16;
    for (int i = 0; i < real; i++) {
        const __m512 a = _mm512_set1_ps(w->alpha[i]);
        float *acc = w->acc + (t0 + i) * D;
        for (int64_t c = 0; c < dcols; c++)
            _mm512_store_ps(acc + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(acc + 16 * c), a,
                                                          _mm512_load_ps(w->ob + i * D + 16 * c)));
    }
}

/* a task's rows into the scratch: row i of the task (folded: position index * G + head in group,
 * rows past the task's repeat its last position, with zero queries) at w->qt + i * D */
static void at_fold(const struct causal_job *j, struct at_scratch *w, const struct causal_task *t,
                    int64_t padded) {
    const int64_t s = t->seq, H = j->H, G = j->G, D = j->D, rows = t->r1 - t->r0;
    const int64_t start = j->start[s], qrow = j->qrow[s];
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
}

/* a task's outputs: acc / l (l: the sum of the row's 16 lanes) rounded once to bf16 */
static void at_store(const struct causal_job *j, const struct at_scratch *w,
                     const struct causal_task *t) {
    const int64_t s = t->seq, H = j->H, G = j->G, D = j->D, rows = t->r1 - t->r0;
    const int64_t qrow = j->qrow[s];
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = t->r0 + i, pi = r / G, g = r % G;
        const float *lv = w->lvec + i * 16;
        const __m512 l = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_load_ps(lv)));
        uint16_t *o = (uint16_t *)j->out + ((qrow + pi) * H + t->kvh * G + g) * D;
        const float *acc = w->acc + i * D;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512 lo = _mm512_div_round_ps(_mm512_load_ps(acc + c), l, V16_RNE);
            const __m512 hi = _mm512_div_round_ps(_mm512_load_ps(acc + c + 16), l, V16_RNE);
            _mm512_storeu_si512(o + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* one tile's work over the packed block at k0: rows t0 .. t0 + real - 1 of the task; kt, krs: the
 * KV head's keys in place, for a lone tile whose K the caller left unpacked (else NULL) */
typedef void (*at_tile_fn)(const struct causal_job *j, struct at_scratch *w, int64_t t0,
                           int64_t k0, int real, const uint16_t *kt, int64_t krs, int64_t ctx);

/* A task: its rows folded, then every key block up to its last row's position packed and met by
 * each tile, then its outputs. With `lone_k` a task of one tile (decode rows) packs its queries
 * once instead of each block's keys, and `tile` reads the keys in place (native_amx_attn.h). */
static void at_task_walk(const struct causal_job *j, struct at_scratch *w,
                         const struct causal_task *t, at_tile_fn tile, int lone_k) {
    const int64_t s = t->seq, D = j->D, rows = t->r1 - t->r0;
    const int64_t padded = (rows + 15) / 16 * 16, ctx = j->start[s] + j->nnew[s];
    at_fold(j, w, t, padded);
    const int64_t last = w->pos[rows - 1];
    const uint16_t *k = (const uint16_t *)j->kbase[s] + t->kvh * j->khs[s];
    const uint16_t *v = (const uint16_t *)j->vbase[s] + t->kvh * j->vhs[s];
    const int lone = lone_k && padded == 16;
    if (lone) at_pack_k(w->qtp, w->qt, D, 0, 16, D);
    for (int64_t k0 = 0; k0 <= last; k0 += AT_BK) {
        const int64_t nv = ctx - k0 < AT_BK ? ctx - k0 : AT_BK;
        if (!lone) at_pack_k(w->kp, k, j->krs[s], k0, nv, D);
        at_pack_v(w->vp, v, j->vrs[s], k0, nv, D);
        for (int64_t t0 = 0; t0 < rows; t0 += 16)
            tile(j, w, t0, k0, rows - t0 < 16 ? (int)(rows - t0) : 16, lone ? k : NULL,
                 j->krs[s], ctx);
    }
    at_store(j, w, t);
}
#endif
