/* bf16 causal attention by AVX-512 BF16 dot products where there is no AMX: one kernel for prefill
 * chunks and decode steps alike, as native_amx_attn.h is on AMX (its header says why and what a
 * row's bits depend on; native_bf16_attn.h holds the steps both kernels share).
 *
 * The same algorithm, with the block's two products by VDPBF16PS: a score s[i][key] is one lane's
 * sum over the head's dim pairs in order, from zero (row i's pair broadcast, the packed key
 * block's pair of 16 keys); a P . V output [i][dim] one lane's sum over the block's key pairs in
 * order, from zero (row i's pair of probabilities broadcast, the packed value block's pair of 16
 * dims). Each lane is one row's and one key's (or dim's) alone, so a row's bits depend only on its
 * own query, keys and values, whatever the split of its prompt, the other rows of the call or the
 * thread count; masked keys add exact zeros and unreached blocks are skipped as on AMX. Rows go 4
 * at a time against up to 4 columns of 16 keys (or dims): 16 accumulators in registers.
 *
 * Decode rows pack their keys too (AMX reads them in place through K . Q^T, which gives its own
 * product's bits; here the only order is the packed one).
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)

/* scores of the tile's rows i0 .. i0 + mr - 1 (tile at t0) for key columns 0 .. nc - 1 of the
 * packed block, into w->s (unscaled, as the AMX kernel leaves them) */
static inline __attribute__((always_inline)) void
vat_scores(struct at_scratch *w, int64_t D, int64_t t0, int i0, const int mr, const int nc) {
    const int64_t dcs = D / 32, half = D / 2;
    const int32_t *q = (const int32_t *)(w->qt + (t0 + i0) * D);
    __m512 acc[4][4];
    for (int m = 0; m < mr; m++)
        for (int c = 0; c < nc; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t dc = 0; dc < dcs; dc++)
        for (int r = 0; r < 16; r++) {
            __m512bh b[4];
            for (int c = 0; c < nc; c++)
                b[c] = (__m512bh)_mm512_load_si512(w->kp + (c * dcs + dc) * 512 + r * 32);
            for (int m = 0; m < mr; m++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32(q[m * half + dc * 16 + r]);
                for (int c = 0; c < nc; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], a, b[c]);
            }
        }
    for (int m = 0; m < mr; m++)
        for (int c = 0; c < nc; c++) _mm512_store_ps(w->s + (i0 + m) * AT_BK + 16 * c, acc[m][c]);
}

/* the block's P . V for the tile's rows i0 .. i0 + mr - 1 and dim columns g0 .. g0 + nd - 1,
 * over its first `nhalves` halves (32 keys each), into w->ob */
static inline __attribute__((always_inline)) void
vat_pv(struct at_scratch *w, int64_t D, int i0, const int mr, int64_t g0, const int nd,
       int nhalves) {
    const int64_t dcols = D / 16;
    const int32_t *p = (const int32_t *)w->p;
    __m512 acc[4][4];
    for (int m = 0; m < mr; m++)
        for (int d = 0; d < nd; d++) acc[m][d] = _mm512_setzero_ps();
    for (int h = 0; h < nhalves; h++)
        for (int r = 0; r < 16; r++) {
            __m512bh b[4];
            for (int d = 0; d < nd; d++)
                b[d] = (__m512bh)_mm512_load_si512(w->vp +
                                                   ((h * dcols + g0 + d) * 16 + r) * 32);
            for (int m = 0; m < mr; m++) {
                const __m512bh a =
                    (__m512bh)_mm512_set1_epi32(p[(i0 + m) * (AT_BK / 2) + 16 * h + r]);
                for (int d = 0; d < nd; d++) acc[m][d] = _mm512_dpbf16_ps(acc[m][d], a, b[d]);
            }
        }
    for (int m = 0; m < mr; m++)
        for (int d = 0; d < nd; d++)
            _mm512_store_ps(w->ob + (i0 + m) * D + 16 * (g0 + d), acc[m][d]);
}

/* (rows, columns) shapes as constants, so the accumulators stay in registers */
#define VAT_SHAPES(CALL, MR, N)                                                                  \
    switch ((MR) * 8 + (N)) {                                                                    \
    case 4 * 8 + 4: CALL(4, 4); break;                                                           \
    case 4 * 8 + 3: CALL(4, 3); break;                                                           \
    case 4 * 8 + 2: CALL(4, 2); break;                                                           \
    case 4 * 8 + 1: CALL(4, 1); break;                                                           \
    case 3 * 8 + 4: CALL(3, 4); break;                                                           \
    case 3 * 8 + 3: CALL(3, 3); break;                                                           \
    case 3 * 8 + 2: CALL(3, 2); break;                                                           \
    case 3 * 8 + 1: CALL(3, 1); break;                                                           \
    case 2 * 8 + 4: CALL(2, 4); break;                                                           \
    case 2 * 8 + 3: CALL(2, 3); break;                                                           \
    case 2 * 8 + 2: CALL(2, 2); break;                                                           \
    case 2 * 8 + 1: CALL(2, 1); break;                                                           \
    case 1 * 8 + 4: CALL(1, 4); break;                                                           \
    case 1 * 8 + 3: CALL(1, 3); break;                                                           \
    case 1 * 8 + 2: CALL(1, 2); break;                                                           \
    default: CALL(1, 1); break;                                                                  \
    }

/* one tile (rows t0 .. t0 + real - 1 of the task) over the packed block at k0 (an at_tile_fn;
 * its keys always packed: kt is NULL) */
static void vat_tile_block(const struct causal_job *j, struct at_scratch *w, int64_t t0,
                           int64_t k0, int real, const uint16_t *kt, int64_t krs, int64_t ctx) {
    (void)kt, (void)krs, (void)ctx;
    const int64_t D = j->D, dcols = D / 16;
    int64_t maxlim = 0;
    for (int i = 0; i < real; i++) {
        const int64_t lim = w->pos[t0 + i] - k0 + 1;
        if (lim > maxlim) maxlim = lim;
    }
    if (maxlim <= 0) return; /* no row reaches this block: every row would stay as it is */
    if (maxlim > AT_BK) maxlim = AT_BK;
    const int ncols = (int)((maxlim + 15) / 16), nhalves = (int)((maxlim + 31) / 32);
    for (int i0 = 0; i0 < real; i0 += 4) {
        const int mr = real - i0 < 4 ? real - i0 : 4;
#define VAT_S(MR, NC) vat_scores(w, D, t0, i0, MR, NC)
        VAT_SHAPES(VAT_S, mr, ncols)
#undef VAT_S
    }
    at_softmax(j, w, t0, k0, real);
    for (int64_t g0 = 0; g0 < dcols; g0 += 4) {
        const int nd = dcols - g0 < 4 ? (int)(dcols - g0) : 4;
        for (int i0 = 0; i0 < real; i0 += 4) {
            const int mr = real - i0 < 4 ? real - i0 : 4;
#define VAT_PV(MR, ND) vat_pv(w, D, i0, MR, g0, ND, nhalves)
            VAT_SHAPES(VAT_PV, mr, nd)
#undef VAT_PV
        }
    }
    at_acc_update(w, t0, real, D);
}

static void vat_tasks(void *ctx, int64_t t0, int64_t t1) {
    struct causal_job *j = ctx;
    struct at_scratch *w = at_scratch_get();
    if (!w) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = t0; t < t1; t++) at_task_walk(j, w, &j->tasks[t], vat_tile_block, 0);
}

/* as dkv_amx_attention (native_amx_attn.h) */
int dkv_vdp_attention(CAUSAL_ARGS(uint16_t)) {
    if (D % 32 || D <= 0 || D > AT_MAX_D || KVH <= 0 || H % KVH || nseq <= 0) return -1;
    return causal_run(vat_tasks, AT_QB, CAUSAL_PASS);
}
#else
int dkv_vdp_attention(CAUSAL_ARGS(uint16_t)) {
    CAUSAL_UNUSED;
    return -1;
}
#endif
