/* bf16 linear by AVX-512 BF16 dot products (VDPBF16PS) where there is no AMX: y[M, N] = x[M, K] .
 * w[N, K]^T (+ bias), one kernel for every M, over the weight packed once by dkv_amx_pack.
 *
 * Why: the same as native_amx.h's. Without it a bf16 decode step's products ran oneDNN through
 * torch (a few rows: 1.6-1.9x slower than the float32 engine), and oneDNN's bf16 GEMM does not add
 * a row's terms in one order whatever M, so a decoder's KV for its answer could differ from a
 * prefill's KV of the same tokens. Here out[m, n] accumulates, for k-pairs in order, one
 * VDPBF16PS lane (row m's pair broadcast, column n's pair of the packed block), then adds the bias
 * in float32 and rounds once to bf16 (nearest-even): a row's bits do not depend on M, the row's
 * place in x, the split into tasks or the thread count. (Not the bits of the AMX kernel: a CPU
 * runs one of the two for every product, so its prefills and decode steps agree.)
 *
 * Layout: dkv_amx_pack's, where column block c (16 columns) at k-pair p is one 64-byte vector at
 * wp + (c * K / 2 + p) * 32: a block's whole K is contiguous. K % 32 == 0 (native.py checks).
 *
 * Blocking: VDP_MR rows by 4 blocks of 16 columns, 24 accumulators in registers; a k-pair costs 4
 * loads of the weight and 24 dot products whose row operand is a 32-bit broadcast from memory. A
 * task is a range of VDP_CR column blocks by a run of VDP_TR rows: the range's packed weight stays
 * in L2 while the task's rows meet it, 6 at a time. A decode step's few rows (M <= VDP_TR) make
 * one task per range, so every weight byte is read from memory once (the hardware prefetcher
 * keeps up with its four streams: software prefetch 4-32 k-pairs ahead changed nothing measurable,
 * a decode step's weights at 1 row read at or above a 1 GiB sum's rate, AMD Zen 4).
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define VDP_MR 6   /* rows per register block */
#define VDP_CR 16  /* column blocks (of 16) per task: 256 columns */
#define VDP_TR 48  /* rows per task */

struct vdp_job {
    const uint16_t *x, *wp;
    const float *bias;
    void *y;
    int64_t M, N, K, mtasks;
    int out; /* BF_OUT_*, as dkv_amx_linear's (the fused gate/up: column blocks 2p, gate, and
              * 2p + 1, up) */
};

/* rows [m0, m0 + mr) against column blocks [c0, c0 + nr) (nr = 4 or 2): c[m][16 i + n] */
static inline __attribute__((always_inline)) void
vdp_block(const struct vdp_job *j, int64_t m0, const int mr, int64_t c0, const int nr,
          float c[VDP_MR][64]) {
    const int64_t K = j->K, kp_n = K / 2;
    const uint16_t *w = j->wp + c0 * K * 16;
    const int32_t *a = (const int32_t *)(j->x + m0 * K);
    __m512 acc[VDP_MR][4];
    for (int m = 0; m < mr; m++)
        for (int i = 0; i < nr; i++) acc[m][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp_n; p++) {
        __m512bh b[4];
        for (int i = 0; i < nr; i++) b[i] = (__m512bh)_mm512_loadu_si512(w + i * K * 16 + p * 32);
        for (int m = 0; m < mr; m++) {
            const __m512bh x2 = (__m512bh)_mm512_set1_epi32(a[m * kp_n + p]);
            for (int i = 0; i < nr; i++) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], x2, b[i]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int i = 0; i < nr; i++) _mm512_store_ps(&c[m][16 * i], acc[m][i]);
}

/* the block's results rounded to bf16 into y: column pairs (32 columns) c0 / 2 .. (c0 + nr) / 2 -
 * 1 (with BF_OUT_SILU: blocks 2q, gate, and 2q + 1, up -> output columns 16q .. 16q + 15) */
static void vdp_store(const struct vdp_job *j, int64_t m0, int mr, int64_t c0, int nr,
                      float c[VDP_MR][64]) {
    for (int h = 0; h < nr / 2; h++)
        bf16_pair_store(j->y, m0, mr, j->N, c0 / 2 + h, j->bias, j->out, &c[0][32 * h], 64);
}

/* constant shapes, so the accumulators stay in registers */
static void vdp_rows(const struct vdp_job *j, int64_t m0, int mr, int64_t c0, int nr) {
    float c[VDP_MR][64] __attribute__((aligned(64)));
#define VDP(MR, NR) vdp_block(j, m0, MR, c0, NR, c)
    if (nr == 4) {
        switch (mr) {
        case 6: VDP(6, 4); break;
        case 5: VDP(5, 4); break;
        case 4: VDP(4, 4); break;
        case 3: VDP(3, 4); break;
        case 2: VDP(2, 4); break;
        default: VDP(1, 4); break;
        }
    } else {
        switch (mr) {
        case 6: VDP(6, 2); break;
        case 5: VDP(5, 2); break;
        case 4: VDP(4, 2); break;
        case 3: VDP(3, 2); break;
        case 2: VDP(2, 2); break;
        default: VDP(1, 2); break;
        }
    }
#undef VDP
    vdp_store(j, m0, mr, c0, nr, c);
}

static void vdp_tasks(void *ctx, int64_t t0, int64_t t1) {
    const struct vdp_job *j = ctx;
    const int64_t blocks = (j->N + 31) / 32 * 2;
    for (int64_t t = t0; t < t1; t++) { /* column range outer, rows inner */
        const int64_t range = t / j->mtasks, m0 = t % j->mtasks * VDP_TR;
        const int64_t b0 = range * VDP_CR, b1 = b0 + VDP_CR < blocks ? b0 + VDP_CR : blocks;
        const int64_t m1 = m0 + VDP_TR < j->M ? m0 + VDP_TR : j->M;
        for (int64_t c0 = b0; c0 < b1; c0 += 4) {
            const int nr = b1 - c0 >= 4 ? 4 : 2;
            for (int64_t m = m0; m < m1; m += VDP_MR)
                vdp_rows(j, m, m1 - m < VDP_MR ? (int)(m1 - m) : VDP_MR, c0, nr);
        }
    }
}

int dkv_vdp_linear(const uint16_t *x, const uint16_t *wp, const float *bias, void *y,
                   int64_t M, int64_t N, int64_t K, int out, int nthreads) {
    if (K % 32 || K <= 0 || M <= 0 || N <= 0 || out < BF_OUT_BF16 || out > BF_OUT_F32
        || (out == BF_OUT_SILU && (N % 32 || bias)))
        return -1;
    const int64_t mtasks = (M + VDP_TR - 1) / VDP_TR;
    const int64_t ranges = ((N + 31) / 32 * 2 + VDP_CR - 1) / VDP_CR;
    struct vdp_job job = {x, wp, bias, y, M, N, K, mtasks, out};
    const int64_t count = mtasks * ranges;
    pool_run(vdp_tasks, &job, count, count / (4 * (nthreads > 0 ? nthreads : 1)), nthreads);
    return 0;
}

int dkv_vdp_available(void) { return 1; }
#else
int dkv_vdp_linear(const uint16_t *x, const uint16_t *wp, const float *bias, void *y,
                   int64_t M, int64_t N, int64_t K, int out, int nthreads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)out, (void)nthreads;
    return -1;
}

int dkv_vdp_available(void) { return 0; }
#endif
