/* dkv_decode_attn: float32 decode attention, one query token per sequence (grouped-query heads: G
 * query heads share a KV head) over that sequence's cached keys and values, every sequence of a
 * step in one call (native.py `decode_attention`).
 *
 * The keys are split in chunks of CHUNK (flash-decoding): each unit (sequence, KV head, chunk)
 * computes its softmax partials, then a second job merges a head's chunks by their maxima. A key
 * or value row j of KV head h sits at base + h * head_stride + j * row_stride floats, so a
 * contiguous mirror [KVH, cap, D] and a gathered [L, KVH, D] both fit.
 *
 * AVX-512 and AVX2 builds compute a chunk in one pass (native_f32_attn_onepass.h: online softmax,
 * keys and values streamed together, exp2 in log2 units by v16_exp2 / v8_exp2, native_simd.h).
 * Other builds (8-float vectors without AVX2) take three passes over it here:
 *
 *   scores   VL keys at a time meet each of the G queries while they are in L1 (their dot
 *            products summed across lanes by one transposing reduction)
 *   softmax  the chunk's maximum and exponentials (glibc's vector expf), per query
 *   P . V    each value row read once for up to FA_ACC / vectors-per-row queries, their
 *            accumulators in registers (pv_block, specialised by shape); meanwhile the next
 *            chunk's key and value rows are prefetched
 *
 * Vectors are as wide as the build's CPU allows: 16 floats on AVX-512, 8 elsewhere. A unit's grain
 * of chunks is claimed whole, so a thread walks one head's keys in order (the hardware
 * prefetcher's best case). The head size must be a multiple of 16 (native.py `attention_ok`).
 */
#define MAX_G 16
#define MAX_D 512
#define CHUNK 256
#define PREFETCH 16 /* key rows ahead (the three passes) */
/* chunks a thread claims at least at once: 2k keys walked in order (a batch-1 step at 4k had
 * grains of 2 chunks, the two threads alternating over a head's keys) */
#define GRAIN_MIN 8

#if VL == 16 /* the build's vector width (native_kernels.c) */
#define FA_ACC 16 /* P.V accumulators kept in registers (of 32) */
#define FA_ONE_PASS 1 /* the one-pass kernel: log2 units, v16_exp2 */
#define FA_LOG2E 1.4426950408889634f
#define FA_EXP_SCALAR exp2f
#else
/* of 16: 3 vectors of a value row x 4 queries (8 accumulators were bound by the FMA latency,
 * not by the loads) */
#define FA_ACC 12
#if defined(__AVX2__) && defined(__FMA__) /* the one-pass kernel: log2 units, v8_exp2 */
#define FA_ONE_PASS 1
#define FA_LOG2E 1.4426950408889634f
#define FA_EXP_SCALAR exp2f
#else
#define FA_ONE_PASS 0
#define FA_LOG2E 1.0f
#define FA_EXP_SCALAR expf
#endif
#endif

/* key and value rows prefetched into L2 (locality 2). Measured on the AVX-512 three-pass kernel,
 * before the one-pass one replaced it there: L1 hints for the values were 8 % slower (bench model,
 * 8 x 4k, AMX Xeon); for the keys, 16 rows ahead into L2 instead of 32 into L1 made a call
 * 0.87-0.92x at 8 x 4k and 8 x 8k, 0.94-0.98x at 1 x 4k-8k (AMD Zen 4, 2 threads, KV out of cache,
 * builds alternated; 8 rows ahead into L2 or 16 into L1: no gain) */
#define KHINT 2
#define VHINT 2
#define prefetch_rows(base, row_stride, D, rows, hint)                                         \
    for (int64_t t_ = 0; t_ < (rows); t_++)                                                    \
        for (int64_t d_ = 0; d_ < (D); d_ += 16)                                               \
            __builtin_prefetch((base) + t_ * (row_stride) + d_, 0, hint)

/* CALL(DB, GB) for the runtime (db, gb) with compile-time shapes, so the P.V accumulators stay in
 * registers (db: vectors of a value row, 1-4; gb: queries, 1, 2 or 4) */
#define FA_SHAPES(db, gb, CALL)                                                                \
    switch ((db) * 8 + (gb)) {                                                                 \
    case 4 * 8 + 4: CALL(4, 4); break;                                                         \
    case 4 * 8 + 2: CALL(4, 2); break;                                                         \
    case 4 * 8 + 1: CALL(4, 1); break;                                                         \
    case 3 * 8 + 4: CALL(3, 4); break;                                                         \
    case 3 * 8 + 2: CALL(3, 2); break;                                                         \
    case 3 * 8 + 1: CALL(3, 1); break;                                                         \
    case 2 * 8 + 4: CALL(2, 4); break;                                                         \
    case 2 * 8 + 2: CALL(2, 2); break;                                                         \
    case 2 * 8 + 1: CALL(2, 1); break;                                                         \
    case 1 * 8 + 4: CALL(1, 4); break;                                                         \
    case 1 * 8 + 2: CALL(1, 2); break;                                                         \
    default: CALL(1, 1); break;                                                                \
    }

/* query qg's scores (times sc) against the VL key rows from kb: VL keys at a time in L1, their
 * dot products summed across lanes by one transposing reduction */
static inline vf block_scores(const float *qg, const float *kb, int64_t row_stride, int64_t nv,
                              float sc) {
    vf acc[VL] = {{0}};
    for (int64_t c = 0; c < nv; c++) {
        const vf qv = loadv(qg + c * VL);
        for (int t = 0; t < VL; t++) acc[t] += qv * loadv(kb + t * row_stride + c * VL);
    }
    return reducev(acc) * sc;
}

/* query qg's score (times sc) against one key row kr */
static inline float key_score(const float *qg, const float *kr, int64_t nv, float sc) {
    vf acc = {0};
    for (int64_t c = 0; c < nv; c++) acc += loadv(qg + c * VL) * loadv(kr + c * VL);
    return hsumv(acc) * sc;
}

#if FA_ONE_PASS
#include "native_f32_attn_onepass.h"
#else
/* The chunk's scores times its value rows for queries g0 .. g0 + gb - 1 and vectors c0 .. c0 +
 * db - 1 of the row: gb * db accumulators that stay in registers (db, gb: compile-time). The
 * first block also prefetches the next chunk's first `ahead` key and value rows into L2, one of
 * each per value row read, so memory keeps streaming while this pass computes: the next chunk's
 * score pass then reads its keys from L2 (bench model, 8 x 8k, float32, AMD EPYC Zen 4, 2
 * threads: a call 3.9 -> 2.9 ms; a decode step 46.8 -> 39 ms). */
static inline __attribute__((always_inline)) void
pv_block(float s[][CHUNK], const float *vc, int64_t row_stride, int64_t n, int64_t g0,
         int64_t c0, const int db, const int gb, float *part, int64_t D, const float *next_k,
         const float *next_v, int64_t ahead) {
    vf acc[4][4] = {{{0}}};
    if (c0 || g0) ahead = 0;
    for (int64_t j = 0; j < n; j++) {
        const float *vj = vc + j * row_stride + c0 * VL;
        if (j < ahead) {
            prefetch_rows(next_k + j * row_stride, row_stride, D, 1, VHINT);
            prefetch_rows(next_v + j * row_stride, row_stride, D, 1, VHINT);
        }
        vf vv[4];
        for (int c = 0; c < db; c++) vv[c] = loadv(vj + c * VL);
        for (int g = 0; g < gb; g++) {
            const float p = s[g0 + g][j];
            for (int c = 0; c < db; c++) acc[g][c] += vv[c] * p;
        }
    }
    for (int g = 0; g < gb; g++)
        for (int c = 0; c < db; c++)
            memcpy(part + (g0 + g) * (D + 2) + 2 + (c0 + c) * VL, &acc[g][c], sizeof(vf));
}

/* One chunk of keys [j0, j1) for the G queries of one KV head: writes, per query, its maximum
 * score, the sum of exp(score - max) and the unnormalised sum of exp-weighted value rows (scores
 * in log2 units where exp is exp2: FA_LOG2E). `ahead`: the rows of the head after j1 (to
 * prefetch, up to a chunk). */
static void attn_chunk(const float *q, const float *k, const float *v, int64_t row_stride,
                       int64_t j0, int64_t j1, int64_t G, int64_t D, float scale, float *part,
                       int64_t ahead) {
    float s[MAX_G][CHUNK] __attribute__((aligned(64)));
    const int64_t n = j1 - j0, full = n / VL * VL, nv = D / VL;
    const float *kc = k + j0 * row_stride, *vc = v + j0 * row_stride;
    const float sc = scale * FA_LOG2E;
    for (int64_t j = 0; j < full; j += VL) {
        if (j + PREFETCH + VL <= n)
            prefetch_rows(kc + (j + PREFETCH) * row_stride, row_stride, D, VL, KHINT);
        for (int64_t g = 0; g < G; g++)
            *(vf *)(s[g] + j) = block_scores(q + g * D, kc + j * row_stride, row_stride, nv, sc);
    }
    if (full < n) prefetch_rows(vc + full * row_stride, row_stride, D, n - full, VHINT);
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        for (int64_t j = full; j < n; j++) s[g][j] = key_score(qg, kc + j * row_stride, nv, sc);
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
    for (int64_t c0 = 0; c0 < nv;) {
        /* three vectors of the row at a time (the fourth would leave no register free) */
        const int db = nv - c0 >= 3 ? 3 : nv - c0 >= 2 ? 2 : 1;
        for (int64_t g0 = 0; g0 < G;) {
            const int left = (int)(G - g0);
            const int gb = left >= 4 && 4 * db <= FA_ACC   ? 4
                           : left >= 2 && 2 * db <= FA_ACC ? 2
                                                           : 1;
            const float *kn = kc + n * row_stride, *vn = vc + n * row_stride;
#define PV(DB, GB) pv_block(s, vc, row_stride, n, g0, c0, DB, GB, part, D, kn, vn, ahead)
            FA_SHAPES(db, gb, PV)
#undef PV
            g0 += gb;
        }
        c0 += db;
    }
}
#endif

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
        const int64_t rest = j->length[b] - j1;
        attn_chunk(j->q + (b * KVH + h) * G * D, kh, vh, j->row_stride[b], j0, j1, G, D,
                   j->scale, j->parts + u * part_len, rest < CHUNK ? rest : CHUNK);
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
                const float w = FA_EXP_SCALAR(pg[0] - mx);
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
 * or the shape is beyond the kernel's limits (G > MAX_G, D % 16 != 0, D > MAX_D). */
int dkv_decode_attn(const float *q, float *out, const int64_t *k_base, const int64_t *v_base,
                    const int64_t *head_stride, const int64_t *row_stride, const int64_t *length,
                    int64_t B, int64_t KVH, int64_t G, int64_t D, float scale, int nthreads) {
    if (G > MAX_G || G < 1 || D % 16 != 0 || D > MAX_D || B <= 0) return -1;
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
    const int threads = nthreads > 0 ? nthreads : 1;
    /* eight grains per thread, but never fewer than GRAIN_MIN chunks in a row */
    const int64_t grain = units / (8 * threads) > GRAIN_MIN ? units / (8 * threads) : GRAIN_MIN;
    pool_run(attn_units, &job, units, grain, nthreads);
    pool_run(attn_merge, &job, B * KVH, 1, nthreads);
    free(parts);
    free(first);
    return 0;
}
