/* bf16 element-wise kernels of a layer (RMSNorm with the residual add, q/k norm + RoPE, SiLU * up)
 * for any number of rows: a prefill chunk's rows on the pool's threads, a decode step's few rows
 * on the caller's.
 *
 * Why: in bf16, PyTorch runs each of these as several passes over the rows, converting bf16 to
 * float32 and back each time, on OpenMP threads that sleep between regions; the element-wise work
 * was ~40 % of a 2k-token prefill of the bench model (AMX Xeon, 2 cores). Here each row is read
 * once and written once.
 *
 * Numerics: float32 arithmetic on bf16 inputs, rounded to bf16 (nearest-even) where PyTorch's
 * bf16 ops round (so results stay close to HF's bf16 model): the residual sum; RMSNorm's output
 * (one rounding with the weight, as F.rms_norm; q/k heads: once without the weight, once after it);
 * RoPE's products and their sum; SiLU's output and its product with up. A row's result depends on
 * that row alone, whatever M or the thread count (each row is computed whole by one thread in one
 * order), as reuse requires. Shares row_rms_scale and rows_grain with the float32 kernels.
 */

static inline float bf_load(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf_round(float f) { /* nearest-even; a NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf(float f) { return bf_load(bf_round(f)); }

#define BF_MAX_N 32768 /* row width the kernels take (native.py checks) */

struct bf_norm_job {
    uint16_t *x;
    const uint16_t *res, *w;
    uint16_t *out;
    int64_t N;
    float eps;
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* float arithmetic in the 16-lane paths goes through builtins with an explicit rounding
 * (V16_RNE, native_simd.h), which -ffast-math may not reassociate (a plain vector s * scale * w
 * became s * (scale * w): other bits than the loops'), as in the attention kernels */
#define BF_MUL(a, b) _mm512_mul_round_ps((a), (b), V16_RNE)

/* bf(f) of 16 floats, exactly as bf_round rounds (nearest-even, a denormal kept, a NaN made
 * quiet; VCVTNEPS2BF16 would flush denormals): the rounded float, its low 16 bits zero */
static inline __m512 bf16_exact(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), top = _mm512_set1_epi32((int)0xffff0000u);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), top);
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(
        r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)), top));
}

/* bf_round of 16 floats into 16 bf16 at o */
static inline void bf_store16_exact(uint16_t *o, __m512 f) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(
                                         _mm512_srli_epi32(_mm512_castps_si512(bf16_exact(f)), 16)));
}

/* row_rms_scale's end as GCC compiles it under -ffast-math (the 8 lanes summed as ((a0 + a4) +
 * (a2 + a6)) + ((a1 + a5) + (a3 + a7)), the mean as one FMA with 1/n, 1/sqrt as RSQRTSS and one
 * Newton step), written out: the 16-lane paths (norm rows, q/k heads) give the bits the loops
 * gave (GCC 12, Sapphire Rapids; compared on 35 M outputs with NaN, infinities and denormals
 * among the inputs), and no longer depend on what the compiler makes of the expression where it
 * is inlined */
static inline float bf_rms_tail(__m256 acc, float inv_n, float eps) {
    const __m512 z = _mm512_castps256_ps512(acc);
    const __m512 t = _mm512_add_round_ps(z, _mm512_shuffle_f32x4(z, z, 0x01), V16_RNE);
    const __m512 u = _mm512_add_round_ps(t, _mm512_permute_ps(t, 0x0e), V16_RNE);
    const __m512 h = _mm512_add_round_ps(u, _mm512_permute_ps(u, 0x01), V16_RNE);
    const __m128 x = _mm_fmadd_round_ss(_mm512_castps512_ps128(h), _mm_set_ss(inv_n),
                                        _mm_set_ss(eps), V16_RNE);
    const __m128 y = _mm_rsqrt_ss(x);
    const __m128 e = _mm_fmadd_round_ss(_mm_mul_round_ss(y, x, V16_RNE), y, _mm_set_ss(-3.0f),
                                        V16_RNE);
    return _mm_cvtss_f32(_mm_mul_round_ss(e, _mm_mul_round_ss(y, _mm_set_ss(-0.5f), V16_RNE),
                                          V16_RNE));
}

/* acc + the squares of v's 16 values, 8 lanes at a time in order (row_rms_scale's chain) */
static inline __m256 bf_sq_acc(__m256 acc, __m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v), hi = _mm512_extractf32x8_ps(v, 1);
    return _mm256_fmadd_ps(hi, hi, _mm256_fmadd_ps(lo, lo, acc));
}

/* 1/n rounded once, as row_rms_scale's compiled form takes it */
static inline float bf_inv(int64_t n) {
    return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(1.0f), _mm_set_ss((float)n), V16_RNE));
}

#define BF_NORM_ROWS 4 /* rows a pass takes together: their sums of squares are four chains */

/* bf_norm_rows for up to BF_NORM_ROWS rows (N % 16 == 0), 16 lanes at a time, the same
 * operations per element as its loops (x then holds the rounded sum, so the output pass reads
 * it there instead of from a scratch row); a row's squares summed 8 lanes at a time in order
 * (as row_rms_scale), the rows' chains side by side instead of one after another (each row's
 * chain of N / 8 dependent FMAs was its critical path: 8k x 512, 2 threads, 1.40 -> 1.04 ms) */
static void bf_norm_rows16(uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out,
                           int rows, int64_t N, float inv_n, float eps) {
    __m256 acc[BF_NORM_ROWS];
    for (int q = 0; q < rows; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t i = 0; i < N; i += 16)
        for (int q = 0; q < rows; q++) {
            uint16_t *xq = x + q * N + i;
            __m512 h = bf_load16(xq);
            if (res) {
                h = bf16_exact(_mm512_add_round_ps(h, bf_load16(res + q * N + i), V16_RNE));
                bf_store16_exact(xq, h);
            }
            acc[q] = bf_sq_acc(acc[q], h);
        }
    for (int q = 0; q < rows; q++) {
        const __m512 sc = _mm512_set1_ps(bf_rms_tail(acc[q], inv_n, eps));
        for (int64_t i = 0; i < N; i += 16)
            bf_store16_exact(out + q * N + i, BF_MUL(BF_MUL(bf_load16(x + q * N + i), sc),
                                                     bf_load16(w + i)));
    }
}
#endif

static void bf_norm_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct bf_norm_job *j = ctx;
    const int64_t N = j->N;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const float inv_n = bf_inv(N);
    for (int64_t m = m0; m < m1; m += BF_NORM_ROWS) {
        const int rows = m1 - m < BF_NORM_ROWS ? (int)(m1 - m) : BF_NORM_ROWS;
        bf_norm_rows16(j->x + m * N, j->res ? j->res + m * N : NULL, j->w, j->out + m * N, rows,
                       N, inv_n, j->eps);
    }
#else
    float s[BF_MAX_N] __attribute__((aligned(32)));
    for (int64_t m = m0; m < m1; m++) {
        uint16_t *x = j->x + m * N, *o = j->out + m * N;
        const uint16_t *r = j->res ? j->res + m * N : NULL;
        if (r) {
#pragma omp simd
            for (int64_t i = 0; i < N; i++) {
                const uint16_t h = bf_round(bf_load(x[i]) + bf_load(r[i]));
                x[i] = h;
                s[i] = bf_load(h);
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < N; i++) s[i] = bf_load(x[i]);
        }
        const float scale = row_rms_scale(s, N, j->eps);
#pragma omp simd
        for (int64_t i = 0; i < N; i++) o[i] = bf_round(s[i] * scale * bf_load(j->w[i]));
    }
#endif
}

/* x [M, N], res [M, N] or NULL, w [N], all bf16: with res, x = bf16(x + res) first (the new
 * residual stream, written back to x); then out = bf16(x * rsqrt(mean(x^2) + eps) * w).
 * N % 16 == 0, N <= BF_MAX_N. */
void dkv_bf16_add_rmsnorm(uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out,
                          int64_t M, int64_t N, float eps, int nthreads) {
    struct bf_norm_job job = {x, res, w, out, N, eps};
    pool_run(bf_norm_rows, &job, M, rows_grain(N), nthreads);
}

struct bf_rope_job {
    const uint16_t *qkv, *wqk, *cos, *sin;
    uint16_t *q, *k;
    int64_t ld, H, KVH, D;
    float eps;
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* one head of bf_rope_rows (D % 32 == 0), 16 lanes at a time: the same operations per element
 * as the loops below, so the same bits (GCC vectorises those at 8 lanes: a layer's q/k norm and
 * RoPE over 8k tokens, bench shapes, AMX Xeon, 2 threads, 3.0 -> 2.35 ms) */
static void bf_rope_head16(const uint16_t *x, const uint16_t *w, const float *c, const float *s,
                           uint16_t *o, int64_t D, float inv_d, float eps, float *t) {
    const int64_t half = D / 2;
    __m256 acc = _mm256_setzero_ps(); /* the squares, for the norm (w) only */
    for (int64_t i = 0; i < D; i += 16) {
        const __m512 v = bf_load16(x + i);
        _mm512_storeu_ps(t + i, v);
        if (w) acc = bf_sq_acc(acc, v);
    }
    if (w) {
        const __m512 r = _mm512_set1_ps(bf_rms_tail(acc, inv_d, eps));
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(t + i, bf16_exact(BF_MUL(bf16_exact(BF_MUL(_mm512_loadu_ps(t + i), r)),
                                                      bf_load16(w + i))));
    }
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = _mm512_loadu_ps(t + i), x2 = _mm512_loadu_ps(t + half + i);
        const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
        const __m512 lo = _mm512_sub_round_ps(bf16_exact(BF_MUL(x1, cv)),
                                              bf16_exact(BF_MUL(x2, sv)), V16_RNE);
        const __m512 hi = _mm512_add_round_ps(bf16_exact(BF_MUL(x2, cv)),
                                              bf16_exact(BF_MUL(x1, sv)), V16_RNE);
        bf_store16_exact(o + i, lo);
        bf_store16_exact(o + half + i, hi);
    }
}
#endif

static void bf_rope_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct bf_rope_job *j = ctx;
    const int64_t H = j->H, KVH = j->KVH, D = j->D, half = D / 2;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const float inv_d = bf_inv(D);
#endif
    float t[MAX_D] __attribute__((aligned(32)));
    float c[MAX_D / 2], s[MAX_D / 2];
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t i = 0; i < half; i++)
            c[i] = bf_load(j->cos[m * half + i]), s[i] = bf_load(j->sin[m * half + i]);
        for (int64_t h = 0; h < H + KVH; h++) {
            const uint16_t *x = j->qkv + m * j->ld + h * D;
            uint16_t *o = h < H ? j->q + (m * H + h) * D : j->k + (m * KVH + h - H) * D;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (D % 32 == 0) {
                bf_rope_head16(x, j->wqk ? j->wqk + h * D : NULL, c, s, o, D, inv_d, j->eps, t);
                continue;
            }
#endif
#pragma omp simd
            for (int64_t i = 0; i < D; i++) t[i] = bf_load(x[i]);
            if (j->wqk) {
                const float r = row_rms_scale(t, D, j->eps);
                const uint16_t *w = j->wqk + h * D;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) t[i] = bf(bf(t[i] * r) * bf_load(w[i]));
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = t[i], x2 = t[half + i];
                o[i] = bf_round(bf(x1 * c[i]) - bf(x2 * s[i]));
                o[half + i] = bf_round(bf(x2 * c[i]) + bf(x1 * s[i]));
            }
        }
    }
}

/* dkv_qk_norm_rope's layout and work (native_kernels.c) in bf16: q/k heads of qkv normalised
 * (wqk [H + KVH, D] or NULL) and rotated by the row's bf16 tables cos/sin [M, D / 2]. */
void dkv_bf16_qk_norm_rope(const uint16_t *qkv, int64_t ld, const uint16_t *wqk,
                           const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *k,
                           int64_t M, int64_t H, int64_t KVH, int64_t D, float eps, int nthreads) {
    struct bf_rope_job job = {qkv, wqk, cos, sin, q, k, ld, H, KVH, D, eps};
    pool_run(bf_rope_rows, &job, M, rows_grain((H + KVH) * D), nthreads);
}

struct bf_silu_job {
    const uint16_t *gu;
    uint16_t *out;
    int64_t I;
};

static void bf_silu_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct bf_silu_job *j = ctx;
    const int64_t I = j->I;
    for (int64_t m = m0; m < m1; m++) {
        const uint16_t *g = j->gu + m * 2 * I, *u = g + I;
        uint16_t *o = j->out + m * I;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        /* native_simd.h (glibc's vector expf was 3x slower here) */
        for (int64_t i = 0; i < I; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i), v16_silu_mul(bf_load16(g + i), bf_load16(u + i)));
#else
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float x = bf_load(g[i]);
            o[i] = bf_round(bf(x / (1.0f + expf(-x))) * bf_load(u[i]));
        }
#endif
    }
}

/* gu [M, 2 * I] bf16 (gate | up) -> out [M, I] = bf16(bf16(silu(gate)) * up) */
void dkv_bf16_silu_mul(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I, int nthreads) {
    struct bf_silu_job job = {gu, out, I};
    pool_run(bf_silu_rows, &job, M, rows_grain(2 * I), nthreads);
}
