/* attn_chunk in one pass (native_f32_attn.h includes this in place of its three-pass attn_chunk
 * when FA_ONE_PASS: AVX2 builds since session 54, AVX-512 builds since session 63).
 *
 * For each block of VL keys: the G queries' scores (VL keys at a time in L1, one transposing
 * reduction, as the three-pass kernel), each query's running maximum (a new maximum rescales its
 * sum and accumulators: online softmax), the block's probabilities by exp2v in log2 units, then
 * the block's value rows times them into accumulators kept per query in L1, FA_ACC of them in
 * registers at a time (pv_rows, specialised by shape). Before query g scores a block it asks for
 * its share of the key rows FA_AHEAD rows ahead, after it its share of the value rows, so both
 * streams are asked for in order, row by row, at the pace the chunk computes.
 *
 * Why one pass: the three passes streamed the values in the score pass and the next chunk's keys
 * in the P.V pass, each a stream of its own at a time, and left memory idle in the softmax pass;
 * out of cache a chunk took ~1.5x what plain loads of its 128 KB took (C harness, KV out of cache,
 * 2 threads, AMD EPYC Zen 2, bench shapes). In one pass, with more arithmetic per key (the
 * accumulators' loads and stores per block: 52 against 44 TSC ticks a key with the data in L1), one
 * call took 0.80-0.82x of the three-pass kernel's at 1 x 1k, 1 x 4k, 4 x 2k, 1 x 8k and 8 x 8k, and
 * 0.76-0.81x at 8 x 4k (session 54, builds alternated in one process). At 16 lanes (Intel Xeon with
 * AMX, whose float32 runs these AVX-512 kernels; session 63): the 8 layers' calls at 8 x 4k
 * 0.87-0.91x, 1 x 4k 0.77x, 8 x 8k 0.91x of the three passes' (docs/engine.md).
 *
 * FA_AHEAD, AVX2: 10, 12, 14 and 20 rows ahead gave 0.79-0.84x, 8, 16 and 24 rows (whole blocks
 * ahead) 0.87-0.95x, 4 rows 0.85x; value rows asked for during the block's P.V part instead of its
 * scores, or blocks of 16 keys (half the accumulator traffic, 41 ticks a key in L1): slower out
 * of cache (0.94x, 1.02x of this). AVX-512 (the AMX Xeon): 24 rows 0.95-0.97x of 16 and 12 at
 * 8 x 4k and 8 x 8k, 32 and 48 no better, 8 1.05x. */
#if VL == 16
#define FA_AHEAD 24
#define FA_PIN(v) ((void)0) /* 32 registers: nothing to pin */
static inline float hmaxv(vf a) { return _mm512_reduce_max_ps((__m512)a); }
static inline vf exp2v(vf x) { return (vf)v16_exp2((__m512)x); }
#else
#define FA_AHEAD 12
#define FA_PIN(v) V8_PIN(v)
static inline float hmaxv(vf a) { return v8_hmax((__m256)a); }
static inline vf exp2v(vf x) { return (vf)v8_exp2((__m256)x); }
#endif

/* vectors of a value row per P.V block: FA_ACC accumulators over up to 4 queries (AVX-512 4 x 4,
 * AVX2 3 x 4: a fourth vector would leave no register free) */
#define FA_DB (FA_ACC / 4)

/* acc[g0 .. g0 + gb - 1][c0 .. c0 + db - 1 vectors] += p[g][t] * value row t, for the block's nb
 * rows: gb * db accumulators in registers (db, gb: compile-time; FA_SHAPES) */
static inline __attribute__((always_inline)) void
pv_rows(const float p[][VL], const float *vb, int64_t row_stride, int64_t nb, int64_t g0,
        int64_t c0, const int db, const int gb, float *acc, int64_t D) {
    vf a[4][4];
    for (int g = 0; g < gb; g++)
        for (int c = 0; c < db; c++) a[g][c] = loadv(acc + (g0 + g) * D + (c0 + c) * VL);
    for (int64_t t = 0; t < nb; t++) {
        vf vv[4];
        for (int c = 0; c < db; c++) vv[c] = loadv(vb + t * row_stride + (c0 + c) * VL);
        /* the row's vectors in registers: left to itself the compiler read them from L1 once
         * per query (16 loads a row for 12 FMAs, load-bound; at db 2, the last two vectors of a
         * 64-float row, 8 for 8: pinned too since session 55, a call 0.95-0.99x at 8 x 4k and
         * 8 x 8k, 0.97x at 1 x 4k) */
        for (int c = 0; c < db; c++) FA_PIN(vv[c]);
        for (int g = 0; g < gb; g++) {
            const float pt = p[g0 + g][t];
            for (int c = 0; c < db; c++) a[g][c] += vv[c] * pt;
        }
    }
    for (int g = 0; g < gb; g++)
        for (int c = 0; c < db; c++) *(vf *)(acc + (g0 + g) * D + (c0 + c) * VL) = a[g][c];
}

/* One chunk of keys [j0, j1) for the G queries of one KV head: per query, its maximum score (log2
 * units), the sum of exp2(score - max) and the unnormalised sum of exp-weighted value rows, as the
 * three-pass attn_chunk writes them. `ahead`: the rows of the head after j1 (to prefetch). */
static void attn_chunk(const float *q, const float *k, const float *v, int64_t row_stride,
                       int64_t j0, int64_t j1, int64_t G, int64_t D, float scale, float *part,
                       int64_t ahead) {
    float acc[MAX_G * MAX_D] __attribute__((aligned(64)));
    float p[MAX_G][VL] __attribute__((aligned(64)));
    float m[MAX_G];
    vf sums[MAX_G];
    const int64_t n = j1 - j0, nv = D / VL, reach = n + ahead;
    const float *kc = k + j0 * row_stride, *vc = v + j0 * row_stride;
    const float sc = scale * FA_LOG2E;
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t g = 0; g < G; g++) m[g] = -FLT_MAX, sums[g] = (vf){0};
    for (int64_t j = 0; j < n; j += VL) {
        const int64_t nb = n - j < VL ? n - j : VL;
        const float *kb = kc + j * row_stride, *vb = vc + j * row_stride;
        for (int64_t g = 0; g < G; g++) {
            for (int64_t t = g * VL / G; t < (g + 1) * VL / G; t++)
                if (j + FA_AHEAD + t < reach) {
                    prefetch_rows(kb + (FA_AHEAD + t) * row_stride, row_stride, D, 1, KHINT);
                }
            const float *qg = q + g * D;
            vf s;
            if (nb == VL)
                s = block_scores(qg, kb, row_stride, nv, sc);
            else /* the chunk's last keys: past them -FLT_MAX, their weights masked to 0 */
                for (int t = 0; t < VL; t++)
                    s[t] = t < nb ? key_score(qg, kb + t * row_stride, nv, sc) : -FLT_MAX;
            /* the value rows' share after the scores, not beside the keys' (a call 0.98-0.985x
             * at 8 x 4k, 8 x 8k, 1 x 4k and 1 x 8k, session 56) */
            for (int64_t t = g * VL / G; t < (g + 1) * VL / G; t++)
                if (j + FA_AHEAD + t < reach)
                    prefetch_rows(vb + (FA_AHEAD + t) * row_stride, row_stride, D, 1, VHINT);
            const float bm = hmaxv(s);
            if (bm > m[g]) { /* the first block: exp2(-FLT_MAX - bm) = 0, nothing to keep */
                const float corr = exp2f(m[g] - bm);
                sums[g] *= corr;
                for (int64_t c = 0; c < nv; c++) *(vf *)(acc + g * D + c * VL) *= corr;
                m[g] = bm;
            }
            vf e = exp2v(s - m[g]);
            for (int t = (int)nb; t < VL; t++) e[t] = 0.0f; /* the masked lanes: exactly 0 */
            *(vf *)p[g] = e;
            sums[g] += e;
        }
        for (int64_t c0 = 0; c0 < nv;) { /* FA_DB vectors of the row at a time, as pv_block */
            const int db = nv - c0 >= FA_DB ? FA_DB : nv - c0 >= 2 ? 2 : 1;
            for (int64_t g0 = 0; g0 < G;) {
                const int left = (int)(G - g0);
                const int gb = left >= 4 ? 4 : left >= 2 ? 2 : 1; /* gb * db <= FA_ACC */
#define PV(DB, GB) pv_rows(p, vb, row_stride, nb, g0, c0, DB, GB, acc, D)
                FA_SHAPES(db, gb, PV) /* on AVX2 db <= 3: the 4-vector shapes are never taken */
#undef PV
                g0 += gb;
            }
            c0 += db;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = part + g * (D + 2);
        pg[0] = m[g];
        pg[1] = hsumv(sums[g]);
        memcpy(pg + 2, acc + g * D, (size_t)D * sizeof(float));
    }
}
