/* Decode-step kernels for float32 on the CPU, built on the machine that runs them (native.py).
 * Longer than 300 lines: one translation unit keeps the build a single compiler call.
 *
 * dkv_linear: y[M, N] = x[M, K] . w[N, K]^T for few rows M. A GEMM library packs w (the large
 * operand) before multiplying, which for a few rows costs more than the product; here each
 * weight row is read from memory once and kept in L1 while every row of x meets it.
 *
 * dkv_decode_attn (native_f32_attn.h): one query token per sequence over its cached keys and
 * values, every sequence of a step in one call; dkv_f32_attention (native_f32_prefill.h): the
 * causal attention of prefill chunks, on AVX-512.
 *
 * Both run their work on the thread pool of native_pool.h; the element-wise kernels at the end
 * (RMSNorm, RoPE, SiLU for a decode step's few rows) run on the calling thread.
 *
 * dkv_f32_decode_step (native_f32_decode.h): a float32 decode step through every decoder layer
 * in one call of the kernels above; dkv_bf16_decode_step (native_bf16_decode.h) the same for bf16
 * on the packed bf16 kernels.
 *
 * Included: native_amx.h (the bf16 linear on AMX tiles, every row count) and native_bf16.h (bf16
 * element-wise kernels, every row count).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"
#include "native_amx.h"
#include "native_vdp.h"
#include "native_causal.h"
#include "native_bf16_attn.h"
#include "native_amx_attn.h"
#include "native_vdp_attn.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8 *)p; }

static inline float hsum8(v8 a) {
    typedef float v4 __attribute__((vector_size(16)));
    v4 h = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* The float32 kernels' vectors: as wide as the build's CPU allows (16 floats on AVX-512, 8
 * elsewhere). Head and hidden sizes the Python side passes are multiples of 16. */
#if defined(__AVX512F__)
#define VL 16
#define LIN_MR 4 /* rows of x per weight block in dkv_linear: 4 x 4 accumulators of 32 registers */
#else
#define VL 8
/* 3 x 4 of 16 (x's three rows in registers, each weight vector passing through the last free
 * one): 12 chains cover the FMA latency where 2 x 4's 8 did not (with LIN_SPREAD, a decode step's
 * weights at 8-16 rows 0.91-0.93x the time of 2 x 4 tiles, 2-4 rows the same; AMD EPYC Zen 2).
 * Holding x rather than the weights (session 55): one tile's k-step loads 7 vectors, not 16; a
 * block in L1 at 8 rows 1.18 -> 1.65 FMAs a cycle; a decode step's weights from memory (bench
 * shapes, 2 threads, huge pages, builds interleaved) at 8 rows 0.92x the time, 16 rows 0.84x,
 * 4 rows 0.98x, 2 rows the same; same sums (each accumulator's FMAs in the same order) */
#define LIN_MR 3
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf loadv(const float *p) { return *(const vf *)p; }

static inline float hsumv(vf a) {
#if VL == 16
    return _mm512_reduce_add_ps((__m512)a);
#else
    return hsum8(a);
#endif
}

/* Transposing sums, level by level: sum_pairs(a, b) adds neighbouring lanes, a's pairs in the
 * even lanes and b's in the odd; sum_quads(p, q) of two such vectors adds neighbouring pairs, so
 * lane 4l + m holds the sum over 4 lanes of the m-th of a, b (p's) and c, d (q's). */
#if VL == 16
static inline vf sum_pairs(vf a, vf b) {
    return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                   30) +
           __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                   31);
}

static inline vf sum_quads(vf p, vf q) {
    return __builtin_shufflevector(p, q, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                   29) +
           __builtin_shufflevector(p, q, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
}
#else
static inline vf sum_pairs(vf a, vf b) {
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

static inline vf sum_quads(vf p, vf q) {
    return __builtin_shufflevector(p, q, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(p, q, 2, 3, 10, 11, 6, 7, 14, 15);
}
#endif

/* (sum of a[0]'s lanes, ..., sum of a[VL - 1]'s) in one vector: log2(VL) levels of shuffle-add,
 * each halving the vectors and doubling the lanes a partial sum covers */
static inline vf reducev(const vf a[VL]) {
    vf p[VL / 2], q[VL / 4];
    for (int i = 0; i < VL / 2; i++) p[i] = sum_pairs(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < VL / 4; i++) q[i] = sum_quads(p[2 * i], p[2 * i + 1]);
#if VL == 16
    vf r[2];
    for (int i = 0; i < 2; i++)
        r[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(q[2 * i], q[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                       14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(r[0], r[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                   22, 23) +
           __builtin_shufflevector(r[0], r[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                   29, 30, 31);
#else
    return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

/* lanes 0-3: the sums of a[0]'s, ..., a[3]'s lanes (the other lanes hold partial sums): the
 * quads' groups of four lanes folded onto the first */
static inline vf reduce4(const vf a[4]) {
    vf r = sum_quads(sum_pairs(a[0], a[1]), sum_pairs(a[2], a[3]));
#if VL == 16
    r += __builtin_shufflevector(r, r, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    return r + __builtin_shufflevector(r, r, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
#else
    return r + __builtin_shufflevector(r, r, 4, 5, 6, 7, 0, 1, 2, 3);
#endif
}

int dkv_abi(void) { return 9; }

struct linear_job {
    const float *x, *w;
    float *y;
    int64_t M, N, K;
};

/* mr (compile-time) rows of x against the weight rows w[0 .. rows): mr * 4 accumulators kept in
 * registers, each weight vector loaded once for the mr rows; the pf_len floats at pf (a later
 * block's share) prefetched into L2, spread over the loop */
static inline __attribute__((always_inline)) void
linear_tile(const float *x, const float *const w[4], float *y, int64_t rows, int64_t N,
            int64_t K, const int mr, const float *pf, int64_t pf_len) {
    vf acc[LIN_MR][4] = {{{0}}};
    int64_t asked = 0; /* floats of pf asked for: as many as this far into the loop's share */
    for (int64_t k = 0; k < K; k += VL) {
        if (pf) /* a test outside the loop: the tiles without a share keep a clean loop */
            for (; asked * K < (k + VL) * pf_len; asked += 16) __builtin_prefetch(pf + asked, 0, 2);
#ifdef V8_PIN /* AVX2 builds */
        /* the tile's rows of x held in registers and each weight vector loaded once into the last
         * free one (unpinned, GCC folded the loads into the FMAs: it re-read x from L1 for every
         * weight row, 16 loads for 12 FMAs, the load ports the limit) */
        vf xv[LIN_MR];
        for (int r = 0; r < mr; r++) {
            xv[r] = loadv(x + r * K + k);
            V8_PIN(xv[r]);
        }
        for (int i = 0; i < 4; i++) {
            vf u = loadv(w[i] + k);
            V8_PIN(u);
            for (int r = 0; r < mr; r++) acc[r][i] += u * xv[r];
        }
#else
        const vf u0 = loadv(w[0] + k), u1 = loadv(w[1] + k), u2 = loadv(w[2] + k),
                 u3 = loadv(w[3] + k);
        for (int r = 0; r < mr; r++) {
            const vf xv = loadv(x + r * K + k);
            acc[r][0] += u0 * xv, acc[r][1] += u1 * xv, acc[r][2] += u2 * xv, acc[r][3] += u3 * xv;
        }
#endif
    }
    if (mr * 4 == VL) { /* one transposing reduction for the whole tile */
        const vf sums = reducev((const vf *)acc);
        for (int r = 0; r < mr; r++)
            for (int i = 0; i < rows; i++) y[r * N + i] = sums[r * 4 + i];
        return;
    }
    for (int r = 0; r < mr; r++) { /* a row's four sums: one shuffle-add tree, not four */
        const vf s4 = reduce4(acc[r]);
        for (int i = 0; i < rows; i++) y[r * N + i] = s4[i];
    }
}

/* How far ahead the few-row products prefetch weight rows into L2, in rows. Near: the hardware
 * prefetcher carries a long stream by itself, and a prefetch 16 rows (32 KB) ahead competed with
 * it; what the software prefetch adds is the start of each weight's stream. AMD Zen 4, 2
 * threads, float32, a decode step's weights (bench shapes, 8 layers + LM head, 161 MB on huge
 * pages), alternated in random order, as a share of a 1 GiB sum in the same round (fast memory
 * spells / slow): 1 row of x 16 rows ahead with two grains per thread 0.74 / 1.02, 2 ahead with
 * one grain 0.92 / 1.07; 8 rows of x (pairs) 16 ahead 0.58 / 0.95, 4 ahead 0.61 / 1.00 */
#if VL == 16 || !defined(__AVX2__)
#define ROW_AHEAD 2  /* linear_row: two rows (4 KB at K 512) */
#else
/* AVX2 builds: none. AMD EPYC Zen 2, 2 threads, float32, a decode step's weights at 1 row (bench
 * shapes, huge pages, caches flushed, builds interleaved): without the prefetch 0.89-0.92x the
 * time (24.8 -> 27.9 GB/s; the 8 layers 0.95x, the LM head 0.89x); prefetching only the first
 * rows of a thread's run 0.90x; 4 and 8 rows ahead 1.00 / 0.99x. The few-row tiles below still
 * need theirs (without: 1.13x at 2 rows, 1.31x at 4, 1.57x at 8). */
#define ROW_AHEAD 0
#endif
#define PAIR_AHEAD 4 /* linear_pairs: the pair after next */
#define TILE_AHEAD 4 /* linear_blocks: the next block of four */
/* LIN_SPREAD (AVX2): every tile of a block asks for its share of the next block, not the first
 * tile for all of it; the first tile's burst left memory idle while the others computed. A decode
 * step's weights (bench shapes, 2 threads, huge pages, AMD EPYC Zen 2, 2 rows a tile): 8 rows
 * 11.0 -> 9.1 ms, 4 rows 7.7 -> 6.4, 12 rows 14.0 -> 12.5, 2 rows the same. AVX-512 builds keep
 * the first tile's prefetch (tuned on Zen 4; spreading not measured there). */
#if VL == 16
#define LIN_SPREAD 0
#else
#define LIN_SPREAD 1
#endif

/* one row of x against the weight rows [n0, n1), one weight row after another: a thread reads
 * its rows as one sequential stream (four interleaved row streams, as the blocks below read them,
 * stalled the hardware prefetcher on long runs: a 1 GiB weight read at 36 GB/s against 46 for
 * the sequential stream, AMD Zen 4), the row ROW_AHEAD ahead prefetched into L2 (if any); four
 * accumulators. Not inlined into linear_blocks: inlined beside the AVX2 3-row tiles, a step's
 * weights at 1 row read 3-6 % slower (code placement; AMD EPYC Zen 2) */
static __attribute__((noinline)) void linear_row(const float *x, const float *w, float *y,
                                                int64_t n0, int64_t n1, int64_t K) {
    for (int64_t n = n0; n < n1; n++) {
        const float *r = w + n * K;
        const float *pf = ROW_AHEAD && n + ROW_AHEAD < n1 ? r + ROW_AHEAD * K : NULL;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t k = 0;
        for (; k + 4 * VL <= K; k += 4 * VL) {
            if (pf)
                for (int i = 0; i < 4 * VL; i += 16) __builtin_prefetch(pf + k + i, 0, 2);
            a0 += loadv(r + k) * loadv(x + k), a1 += loadv(r + k + VL) * loadv(x + k + VL);
            a2 += loadv(r + k + 2 * VL) * loadv(x + k + 2 * VL);
            a3 += loadv(r + k + 3 * VL) * loadv(x + k + 3 * VL);
        }
        for (; k < K; k += VL) a0 += loadv(r + k) * loadv(x + k);
        y[n] = hsumv((a0 + a1) + (a2 + a3));
    }
}

#if VL == 16
#define PAIR_MR 8 /* rows of x per pair of weight rows: 8 x 2 accumulators of 32 registers */
/* two weight rows (w1 == w0 when the range has one left: its sums are not stored) against mr
 * (compile-time) rows of x, two rows from PAIR_AHEAD ahead of w0 prefetched into L2 */
static inline __attribute__((always_inline)) void
linear_pair(const float *x, const float *w0, const float *w1, float *y, int rows, int64_t N,
            int64_t K, const int mr, const float *pf) {
    vf acc[PAIR_MR][2] = {{{0}}};
    for (int64_t k = 0; k < K; k += VL) {
        if (pf) __builtin_prefetch(pf + 2 * k, 0, 2), __builtin_prefetch(pf + 2 * k + 16, 0, 2);
        const vf u0 = loadv(w0 + k), u1 = loadv(w1 + k);
        for (int r = 0; r < mr; r++) {
            const vf xv = loadv(x + r * K + k);
            acc[r][0] += u0 * xv, acc[r][1] += u1 * xv;
        }
    }
    if (mr == PAIR_MR) { /* one transposing reduction: lane 2 r + i holds row r's sum of w_i */
        const vf sums = reducev((const vf *)acc);
        for (int r = 0; r < mr; r++)
            for (int i = 0; i < rows; i++) y[r * N + i] = sums[2 * r + i];
        return;
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < rows; i++) y[r * N + i] = hsumv(acc[r][i]);
}

/* M rows of x (PAIR_MR <= M < 2 PAIR_MR) against the weight rows [n0, n1), two weight rows at a
 * time: each pair is read once and meets eight rows of x per pass (the blocks of four below met
 * four per pass, twice at M 8, and their FMAs waited on memory the single pass overlaps better).
 * AMD Zen 4, 2 threads, weights cold: the LM head's 32000 x 512 at M 8 2.6 -> 2.1-2.3 ms; a decode
 * step's weights (bench shapes) at M 8 0.89x, M 12 0.99x, M 16 1.03x (so 16 keeps the blocks) */
static void linear_pairs(const float *x, const float *w, float *y, int64_t n0, int64_t n1,
                         int64_t M, int64_t N, int64_t K) {
    for (int64_t n = n0; n < n1; n += 2) {
        const int rows = n + 1 < n1 ? 2 : 1;
        const float *w0 = w + n * K, *w1 = rows > 1 ? w0 + K : w0;
        const float *pf = K >= 256 && n + PAIR_AHEAD + 2 <= n1 ? w0 + PAIR_AHEAD * K : NULL;
        int64_t m = 0;
        for (; m + PAIR_MR <= M; m += PAIR_MR, pf = NULL)
            linear_pair(x + m * K, w0, w1, y + m * N + n, rows, N, K, PAIR_MR, pf);
        for (; m + 4 <= M; m += 4, pf = NULL)
            linear_pair(x + m * K, w0, w1, y + m * N + n, rows, N, K, 4, pf);
        for (; m + 2 <= M; m += 2, pf = NULL)
            linear_pair(x + m * K, w0, w1, y + m * N + n, rows, N, K, 2, pf);
        for (; m < M; m++, pf = NULL) linear_pair(x + m * K, w0, w1, y + m * N + n, rows, N, K, 1, pf);
    }
}
#endif

/* weight rows [4 * b0, 4 * b1) against every row of x: each block of four weight rows is read
 * from memory once and stays in L1 while the rows of x meet it, LIN_MR at a time */
static void linear_blocks(void *ctx, int64_t b0, int64_t b1) {
    const struct linear_job *j = ctx;
    const float *x = j->x;
    const int64_t M = j->M, N = j->N, K = j->K;
    if (M == 1) { /* one row of x: no block of four weight rows (below) */
        const int64_t n1 = 4 * b1 < N ? 4 * b1 : N;
        linear_row(x, j->w, j->y, 4 * b0, n1, K);
        return;
    }
#if VL == 16
    if (M >= PAIR_MR && M < 2 * PAIR_MR) { /* 16 rows: the blocks' passes of four, 3 % faster */
        linear_pairs(x, j->w, j->y, 4 * b0, 4 * b1 < N ? 4 * b1 : N, M, N, K);
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n0 = b * 4;
        const int64_t rows = N - n0 < 4 ? N - n0 : 4;
        const float *w0 = j->w + n0 * K;
        const float *const w[4] = {w0, w0 + (rows > 1 ? K : 0), w0 + (rows > 2 ? 2 * K : 0),
                                   w0 + (rows > 3 ? 3 * K : 0)};
        float *y = j->y + n0;
        /* the next block, prefetched into L2 while x meets this one */
        const float *pf = K >= 256 && n0 + TILE_AHEAD + 4 <= N ? w0 + TILE_AHEAD * K
                                                              : NULL; /* short rows: cached */
        const int64_t tiles = LIN_SPREAD ? M / LIN_MR + (M % LIN_MR) / 2 + (M % LIN_MR) % 2 : 1;
        const int64_t share = (4 * K / tiles + 15) / 16 * 16; /* floats, whole lines */
        int64_t m = 0, asked = 0; /* of the next block's 4 K floats */
#define TILE(MR)                                                                               \
    do {                                                                                       \
        const int64_t len = pf && asked < 4 * K ? (4 * K - asked < share ? 4 * K - asked : share) \
                                                : 0;                                           \
        linear_tile(x + m * K, w, y + m * N, rows, N, K, MR, len ? pf + asked : NULL, len);  \
        asked += len;                                                                          \
    } while (0)
        for (; m + LIN_MR <= M; m += LIN_MR) TILE(LIN_MR);
        for (; m + 2 <= M; m += 2) TILE(2);
        for (; m < M; m++) TILE(1);
#undef TILE
    }
}

void dkv_linear(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                int nthreads) {
    struct linear_job job = {x, w, y, M, N, K};
    const int64_t nblocks = (N + 3) / 4;
    /* one grain per thread: each thread streams one run of rows, the threads' runs a half of the
     * weight apart. Two grains per thread (neighbouring runs at a time) read a decode step's
     * weights at 0.85 of one grain's rate in fast memory spells, eight 5-10 % slower still (AMD
     * Zen 4, 2 threads, bench shapes, M 1 and 8, interleaved); a helper late to wake costs the
     * step its wake-up, but inside a step the helpers spin (native_pool.h) */
    const int64_t threads = nthreads > 0 ? nthreads : 1;
    pool_run(linear_blocks, &job, nblocks, (nblocks + threads - 1) / threads, nthreads);
}

#include "native_f32_attn.h"
#include "native_f32_prefill.h"

/* A step's new K and V rows appended to each sequence's own copy of its context (a mirror [KVH,
 * cap, D], layers/staging.py) in one call instead of two tensor copies per sequence and layer. k
 * and v are the step's rows [T, KVH, D] (element strides per row and per head; v is a view into
 * the fused projection's output); sequence s's rows q_row[s] .. q_row[s] + n_new[s] - 1 go to
 * positions start[s] .. of its stores dk[s] / dv[s] (addresses; head stride dhs[s], row stride
 * drs[s], elements of `elem` bytes). Bounds are the caller's (native.py checks them). */
void dkv_kv_append(const uint8_t *k, int64_t k_rs, int64_t k_hs, const uint8_t *v, int64_t v_rs,
                   int64_t v_hs, int64_t nseq, const int64_t *dk, const int64_t *dv,
                   const int64_t *dhs, const int64_t *drs, const int64_t *qrow,
                   const int64_t *nnew, const int64_t *start, int64_t KVH, int64_t D,
                   int64_t elem) {
    const size_t row = (size_t)(D * elem);
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t i = 0; i < nnew[s]; i++) {
                const int64_t dst = (h * dhs[s] + (start[s] + i) * drs[s]) * elem;
                memcpy((uint8_t *)dk[s] + dst, k + ((qrow[s] + i) * k_rs + h * k_hs) * elem, row);
                memcpy((uint8_t *)dv[s] + dst, v + ((qrow[s] + i) * v_rs + h * v_hs) * elem, row);
            }
}

/* The element-wise work of a layer in float32: a decode step's few rows on the calling thread (a few
 * thousand floats, where a parallel region would cost more than the work), a prefill chunk's rows
 * in grains on the pool. A row is computed whole by one thread, the same way whatever M. */

static inline float row_rms_scale(const float *x, int64_t n, float eps) {
    v8 acc = {0};
    for (int64_t i = 0; i < n; i += 8) {
        const v8 a = load8(x + i);
        acc += a * a;
    }
    return 1.0f / sqrtf(hsum8(acc) / (float)n + eps);
}

static inline int64_t rows_grain(int64_t width) { /* rows per grain: ~16k elements */
    return width >= 16384 ? 1 : 16384 / width;
}

struct f32_norm_job {
    float *x;
    const float *res, *w;
    float *out;
    int64_t N;
    float eps;
};

static void f32_norm_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct f32_norm_job *j = ctx;
    const int64_t N = j->N;
    for (int64_t m = m0; m < m1; m++) {
        float *xm = j->x + m * N;
        if (j->res)
            for (int64_t i = 0; i < N; i += 8)
                *(v8 *)(xm + i) = load8(xm + i) + load8(j->res + m * N + i);
        const v8 r = (v8){0} + row_rms_scale(xm, N, j->eps);
        for (int64_t i = 0; i < N; i += 8)
            *(v8 *)(j->out + m * N + i) = load8(xm + i) * r * load8(j->w + i);
    }
}

/* x [M, N], res [M, N] or NULL, w [N]: with res, x += res first (the new
 * residual stream, written back to x); then out = x * rsqrt(mean(x^2) + eps) * w. */
void dkv_add_rmsnorm(float *x, const float *res, const float *w, float *out, int64_t M,
                     int64_t N, float eps, int nthreads) {
    struct f32_norm_job job = {x, res, w, out, N, eps};
    pool_run(f32_norm_rows, &job, M, rows_grain(N), nthreads);
}

struct f32_rope_job {
    const float *qkv, *wqk, *cos, *sin;
    float *q, *k;
    int64_t ld, H, KVH, D;
    float eps;
};

static void f32_rope_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct f32_rope_job *j = ctx;
    const int64_t H = j->H, KVH = j->KVH, D = j->D, half = D / 2;
    float t[MAX_D] __attribute__((aligned(32)));
    for (int64_t m = m0; m < m1; m++) {
        const float *c = j->cos + m * half, *s = j->sin + m * half;
        for (int64_t h = 0; h < H + KVH; h++) {
            const float *x = j->qkv + m * j->ld + h * D;
            float *o = h < H ? j->q + (m * H + h) * D : j->k + (m * KVH + h - H) * D;
            if (j->wqk) {
                const v8 r = (v8){0} + row_rms_scale(x, D, j->eps);
                for (int64_t i = 0; i < D; i += 8)
                    *(v8 *)(t + i) = load8(x + i) * r * load8(j->wqk + h * D + i);
                x = t;
            }
            for (int64_t i = 0; i < half; i += 8) {
                const v8 x1 = load8(x + i), x2 = load8(x + half + i);
                const v8 cv = load8(c + i), sv = load8(s + i);
                *(v8 *)(o + i) = x1 * cv - x2 * sv;
                *(v8 *)(o + half + i) = x2 * cv + x1 * sv;
            }
        }
    }
}

/* Rows of qkv [M, (H + 2 * KVH) * D] (rows ld floats apart): the H query heads and the first KVH
 * key heads are RMS-normalised over D (eps) with per-head weights wqk [H + KVH, D] (NULL: no
 * norm), then rotated by RoPE with the row's half-width tables cos/sin [M, D / 2]
 * (x1 * c - x2 * s | x2 * c + x1 * s), into q [M, H, D] and k [M, KVH, D]. D % 16 == 0,
 * D <= MAX_D. */
void dkv_qk_norm_rope(const float *qkv, int64_t ld, const float *wqk, const float *cos,
                      const float *sin, float *q, float *k, int64_t M, int64_t H, int64_t KVH,
                      int64_t D, float eps, int nthreads) {
    struct f32_rope_job job = {qkv, wqk, cos, sin, q, k, ld, H, KVH, D, eps};
    pool_run(f32_rope_rows, &job, M, rows_grain((H + KVH) * D), nthreads);
}

struct f32_silu_job {
    const float *gu;
    float *out;
    int64_t I;
};

static void f32_silu_rows(void *ctx, int64_t m0, int64_t m1) {
    const struct f32_silu_job *j = ctx;
    const int64_t I = j->I;
    for (int64_t m = m0; m < m1; m++) {
        const float *g = j->gu + m * 2 * I, *u = g + I;
        float *o = j->out + m * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* gu [M, 2 * I] (gate | up) -> out [M, I] = silu(gate) * up */
void dkv_silu_mul(const float *gu, float *out, int64_t M, int64_t I, int nthreads) {
    struct f32_silu_job job = {gu, out, I};
    pool_run(f32_silu_rows, &job, M, rows_grain(2 * I), nthreads);
}

#include "native_f32_decode.h"
#include "native_bf16.h"
#include "native_bf16_decode.h"
