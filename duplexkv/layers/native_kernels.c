/* Decode-step kernels for float32 on the CPU, built on the machine that runs them (native.py).
 * Longer than 300 lines: one translation unit keeps the build a single compiler call.
 *
 * dkv_linear: y[M, N] = x[M, K] . w[N, K]^T for few rows M. A GEMM library packs w (the large
 * operand) before multiplying, which for a few rows costs more than the product; here each
 * weight row is read from memory once and kept in L1 while every row of x meets it.
 *
 * dkv_decode_attn: one query token per sequence (grouped-query heads: G query heads share a
 * KV head) over that sequence's cached keys and values, every sequence of a step in one call.
 * The keys are split in chunks (flash-decoding): each (sequence, KV head, chunk) computes its
 * softmax partials, then a second pass merges a head's chunks by their maxima. A key or value
 * row j of KV head h sits at base + h * head_stride + j * row_stride floats, so a contiguous
 * mirror [KVH, cap, D] and a gathered [L, KVH, D] both fit.
 *
 * Both run their work on the thread pool of native_pool.h; the element-wise kernels at the end
 * (RMSNorm, RoPE, SiLU for a decode step's few rows) run on the calling thread.
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
#include "native_amx_attn.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8 *)p; }

static inline float hsum8(v8 a) {
    typedef float v4 __attribute__((vector_size(16)));
    v4 h = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* (sum a[0], ..., sum a[7]): the eight horizontal sums in one vector (three shuffle-add levels) */
static inline v8 reduce8(const v8 a[8]) {
    v8 p[4], q[2];
    for (int i = 0; i < 4; i++)
        p[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline void store_row(float *y, int64_t rows, v8 a0, v8 a1, v8 a2, v8 a3) {
    y[0] = hsum8(a0);
    if (rows > 1) y[1] = hsum8(a1);
    if (rows > 2) y[2] = hsum8(a2);
    if (rows > 3) y[3] = hsum8(a3);
}

int dkv_abi(void) { return 5; }

struct linear_job {
    const float *x, *w;
    float *y;
    int64_t M, N, K;
};

/* weight rows [4 * b0, 4 * b1) against every row of x */
static void linear_blocks(void *ctx, int64_t b0, int64_t b1) {
    const struct linear_job *j = ctx;
    const float *x = j->x, *w = j->w;
    float *y = j->y;
    const int64_t M = j->M, N = j->N, K = j->K;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n0 = b * 4;
        const int64_t rows = N - n0 < 4 ? N - n0 : 4;
        const float *w0 = w + n0 * K;
        const float *w1 = w0 + (rows > 1 ? K : 0);
        const float *w2 = w0 + (rows > 2 ? 2 * K : 0);
        const float *w3 = w0 + (rows > 3 ? 3 * K : 0);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) { /* two rows of x meet the four weight rows */
            const float *xa = x + m * K, *xb = xa + K;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t k = 0; k < K; k += 8) {
                const v8 xv = load8(xa + k), yv = load8(xb + k);
                const v8 u0 = load8(w0 + k), u1 = load8(w1 + k), u2 = load8(w2 + k),
                         u3 = load8(w3 + k);
                a0 += u0 * xv, a1 += u1 * xv, a2 += u2 * xv, a3 += u3 * xv;
                c0 += u0 * yv, c1 += u1 * yv, c2 += u2 * yv, c3 += u3 * yv;
            }
            store_row(y + m * N + n0, rows, a0, a1, a2, a3);
            store_row(y + (m + 1) * N + n0, rows, c0, c1, c2, c3);
        }
        for (; m < M; m++) {
            const float *xm = x + m * K;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < K; k += 8) {
                const v8 xv = load8(xm + k);
                a0 += load8(w0 + k) * xv;
                a1 += load8(w1 + k) * xv;
                a2 += load8(w2 + k) * xv;
                a3 += load8(w3 + k) * xv;
            }
            store_row(y + m * N + n0, rows, a0, a1, a2, a3);
        }
    }
}

void dkv_linear(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                int nthreads) {
    struct linear_job job = {x, w, y, M, N, K};
    const int64_t nblocks = (N + 3) / 4;
    pool_run(linear_blocks, &job, nblocks, nblocks / (8 * (nthreads > 0 ? nthreads : 1)),
             nthreads);
}

#define MAX_G 16
#define MAX_D 512
#define CHUNK 256

#define PREFETCH 32 /* keys ahead */

static inline void prefetch_rows(const float *base, int64_t row_stride, int64_t D, int64_t rows) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(base + t * row_stride + d);
}

/* One chunk of keys [j0, j1) for the G queries of one KV head: writes, per query, its maximum
 * score, the sum of exp(score - max) and the unnormalised sum of exp-weighted value rows. Eight
 * keys (and value rows) at a time meet every query while they are in L1. */
static void attn_chunk(const float *q, const float *k, const float *v, int64_t row_stride,
                       int64_t j0, int64_t j1, int64_t G, int64_t D, float scale, float *part) {
    float s[MAX_G][CHUNK] __attribute__((aligned(32)));
    const int64_t n = j1 - j0, full = n / 8 * 8;
    const float *kc = k + j0 * row_stride, *vc = v + j0 * row_stride;
    for (int64_t j = 0; j < full; j += 8) {
        if (j + PREFETCH + 8 <= n)
            prefetch_rows(kc + (j + PREFETCH) * row_stride, row_stride, D, 8);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            v8 acc[8] = {{0}};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 qv = load8(qg + d);
                for (int t = 0; t < 8; t++) acc[t] += qv * load8(kc + (j + t) * row_stride + d);
            }
            *(v8 *)(s[g] + j) = reduce8(acc) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        for (int64_t j = full; j < n; j++) {
            v8 acc = {0};
            for (int64_t d = 0; d < D; d += 8)
                acc += load8(qg + d) * load8(kc + j * row_stride + d);
            s[g][j] = hsum8(acc) * scale;
        }
        float mx = -FLT_MAX, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            s[g][j] = expf(s[g][j] - mx);
            sum += s[g][j];
        }
        float *pg = part + g * (D + 2);
        pg[0] = mx;
        pg[1] = sum;
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = part + g * (D + 2);
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* up to eight vectors of the output at once */
            const int64_t w = D - d0 < 64 ? (D - d0) / 8 : 8;
            v8 acc[8] = {{0}};
            for (int64_t j = 0; j < n; j++) {
                const float p = s[g][j];
                const float *vj = vc + j * row_stride + d0;
                for (int64_t c = 0; c < w; c++) acc[c] += load8(vj + 8 * c) * p;
            }
            for (int64_t c = 0; c < w; c++) memcpy(pg + 2 + d0 + 8 * c, &acc[c], sizeof(v8));
        }
    }
}

struct attn_job {
    const float *q;
    float *out;
    const int64_t *k_base, *v_base, *head_stride, *row_stride, *length, *first;
    float *parts;
    int64_t KVH, G, D;
    float scale;
};

/* units [u0, u1): (sequence, KV head, chunk of keys) -> softmax partials */
static void attn_units(void *ctx, int64_t u0, int64_t u1) {
    const struct attn_job *j = ctx;
    const int64_t KVH = j->KVH, G = j->G, D = j->D, part_len = G * (D + 2);
    int64_t b = 0;
    for (int64_t u = u0; u < u1; u++) {
        while (j->first[b + 1] <= u) b++;
        const int64_t chunks = (j->length[b] + CHUNK - 1) / CHUNK;
        const int64_t h = (u - j->first[b]) / chunks, c = (u - j->first[b]) % chunks;
        const int64_t j0 = c * CHUNK, j1 = j0 + CHUNK < j->length[b] ? j0 + CHUNK : j->length[b];
        const float *kh = (const float *)(intptr_t)j->k_base[b] + h * j->head_stride[b];
        const float *vh = (const float *)(intptr_t)j->v_base[b] + h * j->head_stride[b];
        attn_chunk(j->q + (b * KVH + h) * G * D, kh, vh, j->row_stride[b], j0, j1, G, D,
                   j->scale, j->parts + u * part_len);
    }
}

/* (sequence, KV head) pairs [p0, p1): their chunks' partials merged by their maxima */
static void attn_merge(void *ctx, int64_t p0, int64_t p1) {
    const struct attn_job *j = ctx;
    const int64_t KVH = j->KVH, G = j->G, D = j->D, part_len = G * (D + 2);
    for (int64_t bh = p0; bh < p1; bh++) {
        const int64_t b = bh / KVH, h = bh % KVH;
        const int64_t chunks = (j->length[b] + CHUNK - 1) / CHUNK;
        const float *p = j->parts + (j->first[b] + h * chunks) * part_len;
        for (int64_t g = 0; g < G; g++) {
            float mx = -FLT_MAX, sum = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float m = p[c * part_len + g * (D + 2)];
                mx = m > mx ? m : mx;
            }
            float *o = j->out + (bh * G + g) * D;
            memset(o, 0, (size_t)D * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *pg = p + c * part_len + g * (D + 2);
                const float w = expf(pg[0] - mx);
                sum += w * pg[1];
                for (int64_t d = 0; d < D; d++) o[d] += w * pg[2 + d];
            }
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

/* q, out: [B, KVH * G, D] contiguous. Per sequence b: k_base[b], v_base[b] (addresses),
 * head_stride[b], row_stride[b] (floats), length[b] >= 1. Returns 0, or -1 if out of memory
 * or the shape is beyond the kernel's limits (G > MAX_G, D % 8 != 0). */
int dkv_decode_attn(const float *q, float *out, const int64_t *k_base, const int64_t *v_base,
                    const int64_t *head_stride, const int64_t *row_stride, const int64_t *length,
                    int64_t B, int64_t KVH, int64_t G, int64_t D, float scale, int nthreads) {
    if (G > MAX_G || D % 8 != 0 || B <= 0) return -1;
    int64_t *first = malloc((size_t)(B + 1) * sizeof(int64_t)); /* first unit of sequence b */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first[b + 1] = first[b] + KVH * ((length[b] + CHUNK - 1) / CHUNK);
    const int64_t units = first[B];
    const int64_t part_len = G * (D + 2);
    float *parts = malloc((size_t)units * part_len * sizeof(float));
    if (!parts) {
        free(first);
        return -1;
    }
    struct attn_job job = {q, out, k_base, v_base, head_stride, row_stride, length, first,
                           parts, KVH, G, D, scale};
    pool_run(attn_units, &job, units, 1, nthreads);
    pool_run(attn_merge, &job, B * KVH, 1, nthreads);
    free(parts);
    free(first);
    return 0;
}

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

#include "native_bf16.h"
