/* dkv_f32_attention: float32 causal attention of prefill chunks on AVX-512 or AVX2, every
 * sequence of a step in one call (native.py `prefill_attention`; decode rows take dkv_decode_attn).
 * Longer than 300 lines: the two ISAs' tiles share the scratch, the task and its driver.
 *
 * AVX2 (16 registers of 8 floats): the same tasks, blocks and online softmax; a tile's scores go 16
 * keys at a time (6 rows x 2 vectors of accumulators, 2 key loads and 6 broadcasts per 12 FMAs)
 * into the probability buffer, then the tile's masking, maxima and exp2 (v8_exp2, v16_exp2's
 * polynomial) run over it; P . V 6 rows by 2 vectors. AMD EPYC Zen 2, 2 threads, bench model:
 * attention of a 2k prefill 390 -> 251 ms against PyTorch's flash kernel; in-process prefills
 * 0.76-0.84x (2k to 16k).
 *
 * Why: PyTorch's CPU flash kernel needs the KV heads expanded to every query head (a copy of the
 * context per layer), reads a cached prefix and the new tokens in two calls merged afterwards,
 * and wakes an OpenMP team that sleeps between regions; it ran the bench model's 8k prefill
 * attention at ~72 % of the float32 matmul rate. Here a KV head's G query heads share each key
 * and value block as they are read, and the work is plain register-tiled FMAs.
 *
 * A task is one KV head of one sequence and up to fp_rows(D) folded query rows (position-major,
 * then the group's heads), pre-scaled by scale * log2(e). Keys go in blocks of FP_BK from position 0:
 * the block is packed transposed (kt[d][key], 16 x 16 register transposes) so that six rows'
 * scores for 64 keys are 24 accumulators fed by broadcast query elements (four rows' 16 left the
 * score pass at ~160 GFLOP/s against P . V's ~215 on an AMD Zen 4: 4 key loads and 4 broadcasts
 * per 16 FMAs; six rows: an 8k layer 385 -> 370-379 ms, a 16k prefill 0.94x); then online
 * softmax in registers (the tile's row maxima by one shuffle tree, v16_rowmax8, the running maxima
 * and rescale factors one vector per tile; exp2 by v16_exp2, keys past the row's position masked
 * to exact zeros); then P . V with value rows read in place (D along the lanes), 6 rows by up to 4 vectors
 * of accumulators. Tiles whose rows all precede a block skip it. Tasks go to the pool costliest
 * first. float32 is not bound to chunking invariance (docs/engine.md): a row's result may differ
 * in the last bits from PyTorch's or from another split of the same prompt.
 */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FP_BUILT 1

#define FP_BK 64     /* keys per block: four vectors of scores per row (eight on AVX2) */
#define FP_QB 256    /* folded query rows per task, at most (fewer for large heads: fp_rows) */
#define FP_QD 16384  /* ... and at most this many query floats per task (64 KiB) */
#define FP_MR 6      /* rows per register tile of the scores (6 x 4 vectors) */
#define FP_PV_MR 6   /* rows per register tile of P . V (6 x 4 vectors) */
_Static_assert(FP_MR % FP_PV_MR == 0, "P . V tiles must cover the score tiles' rows exactly");
_Static_assert(FP_MR <= 8, "a score tile's row maxima are one vector of 8 lanes");
#define FP_MAX_D 256 /* head_dim: a multiple of 16 up to this */
#define FP_NEG (-1e30f)

struct fp_scratch { /* a thread's, for FP_MAX_D */
    float q[FP_QD];               /* the task's folded rows, scaled; zero rows past the last */
    float kt[FP_MAX_D * FP_BK];   /* the key block transposed: kt[d * FP_BK + key] */
    float p[FP_QB * FP_BK];       /* the block's probabilities */
    float acc[FP_QD];             /* output accumulators */
    float lvec[FP_QB * 16];       /* softmax denominators, 16 lanes per row */
    float m[FP_QB], alpha[FP_QB];
    int64_t pos[FP_QB];
} __attribute__((aligned(64)));
static __thread struct fp_scratch *fp_buf;

#if defined(__AVX512F__)
/* keys [k0, k0 + nv) of one KV head (row stride rs) -> kt, zero columns from nv to FP_BK */
static void fp_pack_k(float *kt, const float *k, int64_t rs, int64_t k0, int64_t nv, int64_t D) {
    for (int64_t c = 0; c < FP_BK; c += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = c + n < nv ? _mm512_loadu_si512(k + (k0 + c + n) * rs + d0)
                                  : _mm512_setzero_si512();
            v16_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_si512(kt + (d0 + i) * FP_BK + c, r[i]);
        }
}

/* P . V of mr rows from t0 for vectors d0 .. d0 + nd - 1 of the row: the rows' accumulators
 * rescaled by alpha, then the block's nv value rows added (mr, nd: compile-time, so the mr * nd
 * accumulators stay in registers) */
static inline __attribute__((always_inline)) void
fp_pv(struct fp_scratch *w, int64_t t0, const float *v, int64_t vrs, int64_t nv, int64_t d0,
      int64_t D, const int mr, const int nd) {
    __m512 acc[FP_PV_MR][4];
    for (int r = 0; r < mr; r++) {
        const __m512 a = _mm512_set1_ps(w->alpha[t0 + r]);
        for (int c = 0; c < nd; c++)
            acc[r][c] = _mm512_mul_ps(_mm512_load_ps(w->acc + (t0 + r) * D + d0 + 16 * c), a);
    }
    for (int64_t j = 0; j < nv; j++) {
        __m512 vv[4];
        for (int c = 0; c < nd; c++) vv[c] = _mm512_loadu_ps(v + j * vrs + d0 + 16 * c);
        for (int r = 0; r < mr; r++) {
            const __m512 b = _mm512_set1_ps(w->p[(t0 + r) * FP_BK + j]);
            for (int c = 0; c < nd; c++) acc[r][c] = _mm512_fmadd_ps(b, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nd; c++)
            _mm512_store_ps(w->acc + (t0 + r) * D + d0 + 16 * c, acc[r][c]);
}

/* P . V of rows t0 .. t0 + mr - 1 over every vector of the row (mr: compile-time) */
static inline __attribute__((always_inline)) void
fp_pv_rows(struct fp_scratch *w, int64_t t0, const float *v, int64_t vrs, int64_t nv, int64_t D,
           const int mr) {
    for (int64_t d0 = 0; d0 < D;) {
        const int64_t left = (D - d0) / 16;
        if (left >= 4) fp_pv(w, t0, v, vrs, nv, d0, D, mr, 4), d0 += 64;
        else if (left >= 2) fp_pv(w, t0, v, vrs, nv, d0, D, mr, 2), d0 += 32;
        else fp_pv(w, t0, v, vrs, nv, d0, D, mr, 1), d0 += 16;
    }
}

/* one tile's scores for the block and its softmax step (p, alpha, m, l) */
static void fp_scores(struct fp_scratch *w, int64_t t0, int64_t k0, int64_t D) {
    __m512 s[FP_MR][4];
    for (int r = 0; r < FP_MR; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float *kd = w->kt + d * FP_BK;
        const __m512 k0v = _mm512_load_ps(kd), k1v = _mm512_load_ps(kd + 16),
                     k2v = _mm512_load_ps(kd + 32), k3v = _mm512_load_ps(kd + 48);
        for (int r = 0; r < FP_MR; r++) {
            const __m512 b = _mm512_set1_ps(w->q[(t0 + r) * D + d]);
            s[r][0] = _mm512_fmadd_ps(b, k0v, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(b, k1v, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(b, k2v, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(b, k3v, s[r][3]);
        }
    }
    /* the block's last key is past the tile's first row: mask keys past each row's position
     * (and past the context: implied) to exact zeros; elsewhere no mask is needed */
    const int diag = w->pos[t0] < k0 + FP_BK - 1;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 neg = _mm512_set1_ps(FP_NEG);
    __mmask16 keep[FP_MR][4];
    __m512 mx[8];
#pragma GCC unroll 6
    for (int r = 0; r < FP_MR; r++) {
        if (diag) {
            const int64_t lim = w->pos[t0 + r] - k0;
            for (int c = 0; c < 4; c++) {
                const int64_t top = lim - 16 * c < -1 ? -1 : lim - 16 * c > 15 ? 15 : lim - 16 * c;
                keep[r][c] =
                    _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32((int)top), _MM_CMPINT_LE);
                s[r][c] = _mm512_mask_mov_ps(neg, keep[r][c], s[r][c]);
            }
        }
        mx[r] = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    }
    for (int r = FP_MR; r < 8; r++) mx[r] = mx[FP_MR - 1];
    /* the tile's rows at once, lane r for row r: the running maxima, the rescale factors */
    const __mmask16 tile = (__mmask16)((1u << FP_MR) - 1);
    const __m512 mo = _mm512_maskz_loadu_ps(tile, w->m + t0);
    const __m512 mn = _mm512_max_ps(mo, v16_rowmax8(mx));
    const __m512 alpha = v16_exp2(_mm512_sub_ps(mo, mn));
    _mm512_mask_storeu_ps(w->m + t0, tile, mn);
    _mm512_mask_storeu_ps(w->alpha + t0, tile, alpha);
#pragma GCC unroll 6
    for (int r = 0; r < FP_MR; r++) {
        const int64_t i = t0 + r;
        const __m512i ri = _mm512_set1_epi32(r);
        const __m512 mv = _mm512_permutexvar_ps(ri, mn);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            __m512 e = v16_exp2(_mm512_sub_ps(s[r][c], mv));
            if (diag) e = _mm512_maskz_mov_ps(keep[r][c], e);
            _mm512_store_ps(w->p + i * FP_BK + 16 * c, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_store_ps(w->lvec + i * 16,
                        _mm512_fmadd_ps(_mm512_load_ps(w->lvec + i * 16),
                                        _mm512_permutexvar_ps(ri, alpha), sum));
    }
}

#else /* AVX2: 8-float vectors, 16 registers (helpers: native_simd.h) */

/* keys [k0, k0 + nv) of one KV head (row stride rs) -> kt, zero columns from nv to FP_BK */
static void fp_pack_k(float *kt, const float *k, int64_t rs, int64_t k0, int64_t nv, int64_t D) {
    for (int64_t c = 0; c < FP_BK; c += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int n = 0; n < 8; n++)
                r[n] = c + n < nv ? _mm256_loadu_ps(k + (k0 + c + n) * rs + d0)
                                  : _mm256_setzero_ps();
            v8_transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_store_ps(kt + (d0 + i) * FP_BK + c, r[i]);
        }
}

/* P . V of FP_PV_MR rows from t0 over the block's nv value rows, two vectors of the row at a time
 * (6 x 2 accumulators) */
static void fp_pv_rows(struct fp_scratch *w, int64_t t0, const float *v, int64_t vrs, int64_t nv,
                       int64_t D, const int mr) {
    (void)mr;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m256 acc[FP_PV_MR][2];
        for (int r = 0; r < FP_PV_MR; r++) {
            const __m256 a = _mm256_set1_ps(w->alpha[t0 + r]);
            for (int c = 0; c < 2; c++)
                acc[r][c] = _mm256_mul_ps(_mm256_load_ps(w->acc + (t0 + r) * D + d0 + 8 * c), a);
        }
        for (int64_t j = 0; j < nv; j++) {
            const __m256 v0 = _mm256_loadu_ps(v + j * vrs + d0),
                         v1 = _mm256_loadu_ps(v + j * vrs + d0 + 8);
            for (int r = 0; r < FP_PV_MR; r++) {
                const __m256 b = _mm256_broadcast_ss(w->p + (t0 + r) * FP_BK + j);
                acc[r][0] = _mm256_fmadd_ps(b, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(b, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < FP_PV_MR; r++)
            for (int c = 0; c < 2; c++)
                _mm256_store_ps(w->acc + (t0 + r) * D + d0 + 8 * c, acc[r][c]);
    }
}

/* one tile's scores for the block (16 keys at a time: 6 x 2 accumulators), into p, then its
 * softmax step (p, alpha, m, l) */
static void fp_scores(struct fp_scratch *w, int64_t t0, int64_t k0, int64_t D) {
    for (int64_t c0 = 0; c0 < FP_BK; c0 += 16) {
        __m256 s[FP_MR][2];
        for (int r = 0; r < FP_MR; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m256 ka = _mm256_load_ps(w->kt + d * FP_BK + c0),
                         kb = _mm256_load_ps(w->kt + d * FP_BK + c0 + 8);
            for (int r = 0; r < FP_MR; r++) {
                const __m256 b = _mm256_broadcast_ss(w->q + (t0 + r) * D + d);
                s[r][0] = _mm256_fmadd_ps(b, ka, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(b, kb, s[r][1]);
            }
        }
        for (int r = 0; r < FP_MR; r++)
            for (int c = 0; c < 2; c++)
                _mm256_store_ps(w->p + (t0 + r) * FP_BK + c0 + 8 * c, s[r][c]);
    }
    /* as the AVX-512 tile: keys past a row's position (the block's last key is past the tile's
     * first row) masked to exact zeros */
    const int diag = w->pos[t0] < k0 + FP_BK - 1;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float mo[8] = {0}, mn[8] = {0};
    for (int r = 0; r < FP_MR; r++) {
        float *pr = w->p + (t0 + r) * FP_BK;
        __m256 mx = _mm256_set1_ps(FP_NEG);
        for (int c = 0; c < FP_BK; c += 8) {
            __m256 x = _mm256_load_ps(pr + c);
            if (diag) {
                const __m256i keep = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32((int)(w->pos[t0 + r] - k0 - c + 1)), lane);
                x = _mm256_blendv_ps(_mm256_set1_ps(FP_NEG), x, _mm256_castsi256_ps(keep));
                _mm256_store_ps(pr + c, x);
            }
            mx = _mm256_max_ps(mx, x);
        }
        const float top = v8_hmax(mx);
        mo[r] = w->m[t0 + r];
        mn[r] = mo[r] > top ? mo[r] : top;
    }
    /* the tile's rescale factors in one vector, lane r for row r */
    float alpha[8] __attribute__((aligned(32)));
    _mm256_store_ps(alpha, v8_exp2(_mm256_sub_ps(_mm256_loadu_ps(mo), _mm256_loadu_ps(mn))));
    for (int r = 0; r < FP_MR; r++) {
        const int64_t i = t0 + r;
        float *pr = w->p + i * FP_BK;
        const __m256 mv = _mm256_set1_ps(mn[r]);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < FP_BK; c += 8) {
            __m256 e = v8_exp2(_mm256_sub_ps(_mm256_load_ps(pr + c), mv));
            if (diag) {
                const __m256i keep = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32((int)(w->pos[i] - k0 - c + 1)), lane);
                e = _mm256_and_ps(e, _mm256_castsi256_ps(keep));
            }
            _mm256_store_ps(pr + c, e);
            sum = _mm256_add_ps(sum, e);
        }
        w->m[i] = mn[r];
        w->alpha[i] = alpha[r];
        _mm256_store_ps(w->lvec + i * 16, _mm256_fmadd_ps(_mm256_load_ps(w->lvec + i * 16),
                                                          _mm256_set1_ps(alpha[r]), sum));
    }
}
#endif

/* Both ISAs, in the build's vectors (vf: VL floats, native_kernels.c). A folded row scaled by sl
 * into the scratch (src NULL: a row of zeros, past the task's last). */
static inline void fp_fold_row(float *dst, const float *src, float sl, int64_t D) {
    for (int64_t d = 0; d < D; d += VL) *(vf *)(dst + d) = src ? loadv(src + d) * sl : (vf){0};
}

/* a row's output: its accumulators over the sum of its denominator lanes (VL of the 16) */
static inline void fp_out_row(float *o, const float *acc, const float *lvec, int64_t D) {
    const float inv = 1.0f / hsumv(loadv(lvec));
    for (int64_t d = 0; d < D; d += VL) *(vf *)(o + d) = loadv(acc + d) * inv;
}

static void fp_task_run(const struct causal_job *j, struct fp_scratch *w,
                        const struct causal_task *t) {
    const int64_t s = t->seq, H = j->H, G = j->G, D = j->D, rows = t->r1 - t->r0;
    const int64_t padded = (rows + FP_MR - 1) / FP_MR * FP_MR, start = j->start[s];
    const int64_t qrow = j->qrow[s], ctx = start + j->nnew[s];
    for (int64_t i = 0; i < padded; i++) { /* fold: row r = position index * G + head in group */
        const int64_t r = t->r0 + (i < rows ? i : rows - 1), pi = r / G, g = r % G;
        w->pos[i] = start + pi;
        w->m[i] = FP_NEG;
        memset(w->lvec + i * 16, 0, 64);
        memset(w->acc + i * D, 0, (size_t)D * 4);
        const float *src = (const float *)j->q + ((qrow + pi) * H + t->kvh * G + g) * D;
        fp_fold_row(w->q + i * D, i < rows ? src : NULL, j->sl, D);
    }
    const int64_t last = w->pos[rows - 1];
    const float *k = (const float *)(intptr_t)j->kbase[s] + t->kvh * j->khs[s];
    const float *v = (const float *)(intptr_t)j->vbase[s] + t->kvh * j->vhs[s];
    for (int64_t k0 = 0; k0 <= last; k0 += FP_BK) {
        const int64_t nv = ctx - k0 < FP_BK ? ctx - k0 : FP_BK;
        fp_pack_k(w->kt, k, j->krs[s], k0, nv, D);
        int64_t from = padded; /* the first tile reaching k0 (rows in position order) */
        for (int64_t t0 = 0; t0 < padded; t0 += FP_MR)
            if (w->pos[t0 + FP_MR - 1] >= k0) {
                if (from == padded) from = t0;
                fp_scores(w, t0, k0, D);
            }
        /* P . V from the first tile reaching k0, FP_PV_MR rows at a time (padded and `from` are
         * multiples of FP_MR, so of FP_PV_MR: no rows are left over) */
        const float *vb = v + k0 * j->vrs[s];
        for (int64_t t0 = from; t0 < padded; t0 += FP_PV_MR)
            fp_pv_rows(w, t0, vb, j->vrs[s], nv, D, FP_PV_MR);
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = t->r0 + i, pi = r / G, g = r % G;
        fp_out_row((float *)j->out + ((qrow + pi) * H + t->kvh * G + g) * D, w->acc + i * D,
                   w->lvec + i * 16, D);
    }
}

static void fp_tasks(void *ctx, int64_t t0, int64_t t1) {
    struct causal_job *j = ctx;
    if (!fp_buf) fp_buf = aligned_alloc(64, (sizeof(struct fp_scratch) + 63) / 64 * 64);
    if (!fp_buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = t0; t < t1; t++) fp_task_run(j, fp_buf, &j->tasks[t]);
}

/* folded rows per task for head size D: FP_QB, fewer where they would pass FP_QD floats, a
 * multiple of FP_MR (a task's rows are padded to whole tiles within the scratch's FP_QB) */
static inline int64_t fp_rows(int64_t D) {
    const int64_t r = FP_QD / D < FP_QB ? FP_QD / D : FP_QB;
    return r / FP_MR * FP_MR;
}


#endif

int dkv_f32_attention_ok(void) {
#if defined(FP_BUILT)
    return 1;
#else
    return 0;
#endif
}

/* Attention of the query rows q [T, H, D] (float32) of `nseq` sequences into out [T, H, D]
 * (only those rows are written): sequence s has n_new[s] rows from row q_row[s], at positions
 * start[s] .. start[s] + n_new[s] - 1, its keys (positions 0 .. start[s] + n_new[s] - 1) at
 * kbase[s] + h * khs[s] + position * krs[s] (floats) for KV head h, its values likewise at
 * vbase[s] with vhs[s] and vrs[s]. 0, or -1 (unsupported shape, no memory). */
int dkv_f32_attention(CAUSAL_ARGS(float)) {
#if defined(FP_BUILT)
    if (D % 16 || D <= 0 || D > FP_MAX_D || KVH <= 0 || H % KVH || nseq <= 0) return -1;
    return causal_run(fp_tasks, fp_rows(D), CAUSAL_PASS);
#else
    CAUSAL_UNUSED;
    return -1;
#endif
}
