/* bf16 linear on AMX tiles: y[M, N] = x[M, K] . w[N, K]^T (+ bias), one kernel for every M.
 *
 * Why: a bf16 decode step's products went to oneDNN through torch, on OpenMP threads that sleep
 * between parallel regions (OMP_WAIT_POLICY=PASSIVE, native_pool.h), and a decode-only kernel of
 * our own would round differently from the prefill's GEMM, so the KV a decoder computes for its
 * answer would differ from the KV a prefill of the same tokens gives (reuse would change answers,
 * docs/engine.md). This kernel runs on the native pool for every row count, prefill chunks and
 * decode steps alike, and adds each output's terms in one order whatever M, the row's place in
 * x, the split into tasks or the thread count: out[m, n] accumulates, for k-blocks of 32 in
 * order, one TDPBF16PS of row m against column n's packed block (the instruction treats each row
 * of its A tile alone), then adds the bias in float32 and rounds once to bf16 (nearest-even).
 *
 * The weight is packed once (dkv_amx_pack) into the tiles' VNNI layout, 16 output columns by 32
 * k per 1 KiB block, columns padded with zeros to a multiple of 32: [N32 / 16][K / 32][16 k-pairs]
 * [16 columns][2]. K must be a multiple of 32 (native.py checks). Rows of x are read in place; a
 * task's last rows load into tiles configured with as many rows (amx_config), so no padded copy
 * is made.
 *
 * A task is 32 rows (or 16, the last) by up to 256 columns; tasks run column range outer and rows
 * inner, so a range's packed weight (K x 256 x 2 bytes) stays in L2 while the rows stream through,
 * and a task's rows (32 x K) stay in L1 across its column pairs.
 */
/* the packed layout, also read by native_vdp.h (plain C: built on every CPU) */
void dkv_amx_pack(const uint16_t *w, uint16_t *out, int64_t N, int64_t K) {
    const int64_t nblocks = (N + 31) / 32 * 2, kblocks = K / 32;
    for (int64_t nb = 0; nb < nblocks; nb++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint16_t *o = out + (nb * kblocks + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 16; n++) {
                    const int64_t col = nb * 16 + n;
                    for (int j = 0; j < 2; j++)
                        o[r * 32 + n * 2 + j] = col < N ? w[col * K + kb * 32 + 2 * r + j] : 0;
                }
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define AMX_NR 8 /* column pairs (32 columns each) per task */
/* bytes ahead a product of up to 16 rows prefetches its weights into L2, in both of a pair's
 * streams (a task's pairs lie one after the other, so it runs on into the next pair's; past the
 * buffer's end a prefetch reads nothing and cannot fault). 4 KiB: engine_ab, bench, AMX Xeon, a
 * decode step at 4k / 8k x 1 0.94-0.97x without it, 8 KiB 0.97x; x 8 within the noise. */
#define AMX_PF 4096

int dkv_amx_init(void) { /* Linux only lends the tile state to a process that asks */
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
}

struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

struct amx_job {
    const uint16_t *x, *wp;
    const float *bias;
    void *y;
    int64_t M, N, K, mtasks; /* row blocks of 32: tasks are (column range, row block) */
    int out; /* BF_OUT_*: bf16, the fused gate/up (y[M, N / 2] = bf16(bf16(silu(gate)) * up),
              * pairs (gate16, up16)), or float32 of the bf16 result (native_simd.h) */
};

/* The tiles' shapes: 4 and 5 hold x's rows (16 at most each, 32 bf16 k), 6 and 7 a weight block
 * (16 k-pairs x 16 columns), 0 and 1 the float32 sums of tile 4's rows against 6 and 7, 2 and 3
 * those of tile 5's. `ra` and `rb`: the rows tiles 4 and 5 (and their sums) hold; fewer than 16
 * where a task's last rows end before them, so a tile reads no row past x's end (a row's products
 * do not depend on the other rows of its tile, so its bits are those of a full tile's). */
static void amx_config(int ra, int rb) {
    struct amx_cfg cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)ra;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rb > 0 ? rb : 16);
    _tile_loadconfig(&cfg);
}

/* rows [m0, m0 + 16 * mt) of x (mt = 1 or 2; fewer past M) against column pairs [p0, p1), with
 * the tiles configured for those rows (amx_config) */
static void amx_task(const struct amx_job *j, int64_t m0, int mt, int64_t p0, int64_t p1) {
    const int64_t K = j->K, kblocks = K / 32, rows = j->M - m0 < 16 * mt ? j->M - m0 : 16 * mt;
    const uint16_t *a = j->x + m0 * K;
    const int prefetch = j->M <= 16; /* few rows: the product reads its weights at memory's pace */
    float c[32][32] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *b0 = j->wp + (2 * p) * kblocks * 512, *b1 = b0 + kblocks * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kblocks; kb++) {
            if (prefetch) /* the weights AMX_PF bytes ahead in both streams, into L2 */
                for (int l = 0; l < 1024; l += 64) {
                    _mm_prefetch((const char *)(b0 + kb * 512) + AMX_PF + l, _MM_HINT_T1);
                    _mm_prefetch((const char *)(b1 + kb * 512) + AMX_PF + l, _MM_HINT_T1);
                }
            _tile_loadd(4, a + kb * 32, K * 2);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (mt == 2) {
                _tile_loadd(5, a + 16 * K + kb * 32, K * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &c[0][0], 128);
        _tile_stored(1, &c[0][16], 128);
        if (mt == 2) {
            _tile_stored(2, &c[16][0], 128);
            _tile_stored(3, &c[16][16], 128);
        }
        /* with BF_OUT_SILU, columns 0..15 of the pair are gate, 16..31 up, of output 16p.. */
        bf16_pair_store(j->y, m0, rows, j->N, p, j->bias, j->out, &c[0][0], 32);
    }
}

static void amx_tasks(void *ctx, int64_t t0, int64_t t1) {
    const struct amx_job *j = ctx;
    int ra = 0, rb = 0; /* the configured rows (none yet) */
    const int64_t pairs = (j->N + 31) / 32;
    for (int64_t t = t0; t < t1; t++) { /* column range outer, rows inner */
        const int64_t range = t / j->mtasks, mb = t % j->mtasks, m0 = mb * 32;
        const int64_t p0 = range * AMX_NR, p1 = p0 + AMX_NR < pairs ? p0 + AMX_NR : pairs;
        const int64_t rows = j->M - m0 < 32 ? j->M - m0 : 32;
        const int want_a = rows < 16 ? (int)rows : 16, want_b = rows > 16 ? (int)rows - 16 : 0;
        if (want_a != ra || want_b != rb) amx_config(ra = want_a, rb = want_b);
        amx_task(j, m0, rows > 16 ? 2 : 1, p0, p1);
    }
    _tile_release();
}

/* 0, or -1 (AMX not lent to this process, or a shape it does not take). y is bf16 [M, N], or
 * with `out` BF_OUT_F32 float32 [M, N] (each value the bf16 result widened). With BF_OUT_SILU, w
 * was packed with gate and up rows interleaved by 16 (amx.py pack_gate_up), no bias, N % 32 == 0,
 * and y is [M, N / 2]: the gate and up values round to bf16 as the plain product's would, then
 * meet the bf16 SiLU kernel's formula (v16_silu_mul), so the fused result is the unfused one, bit
 * for bit, without writing and re-reading the [M, N] product. */
int dkv_amx_linear(const uint16_t *x, const uint16_t *wp, const float *bias, void *y,
                   int64_t M, int64_t N, int64_t K, int out, int nthreads) {
    if (!dkv_amx_init() || K % 32 || K <= 0 || M <= 0 || N <= 0) return -1;
    if (out < BF_OUT_BF16 || out > BF_OUT_F32 || (out == BF_OUT_SILU && (N % 32 || bias)))
        return -1;
    const int64_t mtasks = (M + 31) / 32, ctasks = ((N + 31) / 32 + AMX_NR - 1) / AMX_NR;
    struct amx_job job = {x, wp, bias, y, M, N, K, mtasks, out};
    const int64_t count = mtasks * ctasks;
    pool_run(amx_tasks, &job, count, count / (4 * (nthreads > 0 ? nthreads : 1)), nthreads);
    return 0;
}
#else
int dkv_amx_init(void) { return 0; }
int dkv_amx_linear(const uint16_t *x, const uint16_t *wp, const float *bias, void *y,
                   int64_t M, int64_t N, int64_t K, int out, int nthreads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)out, (void)nthreads;
    return -1;
}
#endif
