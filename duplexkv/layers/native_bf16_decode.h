/* dkv_bf16_decode_step: a bf16 decode step (one new token for each of B <= 16 sequences, each
 * with a mirror of its context) from its token ids to the final norm's output, in one call
 * (layers/decode_stack.py): native_f32_decode.h's step for a bf16 model on the packed bf16
 * kernels (AMX, or AVX-512 BF16 where there is no AMX).
 *
 * It calls the kernels the model's Python path calls one by one for a bf16 step (model/qwen3.py
 * CausalLM.forward with every product packed, `Linear.pack`, and SiLU fused into the gate/up
 * product): the embedding rows, RoPE's cos/sin rows rounded to bf16 (as `Rotary.forward`'s
 * `.to(dtype)`), then per layer dkv_bf16_add_rmsnorm, the packed qkv product (float32 bias),
 * dkv_bf16_qk_norm_rope, the K/V rows written to the pool and the mirror, the causal attention
 * over each mirror (n_new 1 at its position), the o product, dkv_bf16_add_rmsnorm, the gate/up
 * product with SiLU x up, the down product; then the final norm. Same kernels, same arguments,
 * same order: the result is the Python path's to the bit (tests/test_decode_stack.py). What it
 * saves is the Python between the kernels, ~10 calls per layer.
 *
 * Layout and bounds as native_f32_decode.h, in bf16 elements (the pool [blocks, layers, 2,
 * block_size, KVH, D], mirrors [layers, 2, KVH, cap, D]); the RoPE tables stay float32; weights
 * are packed (layers/amx.py `pack`, gate/up by `pack_gate_up`). The caller checks every bound.
 */

struct dkv_bf16_layer_weights { /* one decoder layer's weights, as dkv_layer_weights */
    const uint16_t *in_norm, *post_norm; /* [hidden] */
    const uint16_t *qkv;                 /* packed [(H + 2 KVH) D, hidden] */
    const float *qkv_bias;               /* [(H + 2 KVH) D] or NULL */
    const uint16_t *qk_norm;             /* [H + KVH, D] or NULL */
    const uint16_t *o, *gate_up, *down;  /* packed; gate_up by pack_gate_up */
};

struct dkv_bf16_decode_rows { /* as dkv_decode_rows, bf16 but for the RoPE tables */
    int64_t B;
    const int64_t *ids;
    const uint16_t *embed;
    const float *cos, *sin;
    const uint16_t *norm;
    const int64_t *mirror;
    const int64_t *cap, *pos;
    uint16_t *pool;
    const int64_t *slot;
    int64_t pool_layer, pool_kv;
};

typedef int (*bf16_linear_fn)(const uint16_t *, const uint16_t *, const float *, void *,
                              int64_t, int64_t, int64_t, int, int);
typedef int (*bf16_attention_fn)(CAUSAL_ARGS(uint16_t));

static int bf16_decode_step(const struct dkv_bf16_layer_weights *lw,
                            const struct dkv_stack_dims *dm, const struct dkv_bf16_decode_rows *s,
                            uint16_t *out, bf16_linear_fn linear, bf16_attention_fn attention,
                            int nthreads);

/* out [B, hidden] bf16: the final norm's output. kernel 0: AMX, 1: AVX-512 BF16 (the one
 * `amx.kernels()` names first). Returns 0, or -1 (no memory, a kernel refused the shape, or the
 * kernel does not run here). */
int dkv_bf16_decode_step(const struct dkv_bf16_layer_weights *lw, const struct dkv_stack_dims *dm,
                         const struct dkv_bf16_decode_rows *s, uint16_t *out, int kernel,
                         int nthreads) {
    if (kernel == 0 ? !dkv_amx_init() : kernel != 1 || !dkv_vdp_available()) return -1;
    const bf16_linear_fn linear = kernel == 0 ? dkv_amx_linear : dkv_vdp_linear;
    const bf16_attention_fn attention = kernel == 0 ? dkv_amx_attention : dkv_vdp_attention;
    int rc;
    DP_TIMED(DP_CALL, rc = bf16_decode_step(lw, dm, s, out, linear, attention, nthreads));
    if (atomic_load_explicit(&dp_on, memory_order_relaxed)) dp_steps++;
    return rc;
}

static int bf16_decode_step(const struct dkv_bf16_layer_weights *lw,
                            const struct dkv_stack_dims *dm, const struct dkv_bf16_decode_rows *s,
                            uint16_t *out, bf16_linear_fn linear, bf16_attention_fn attention,
                            int nthreads) {
    const int64_t B = s->B, Hd = dm->hidden, H = dm->heads, KVH = dm->kv_heads, D = dm->head_dim;
    const int64_t I = dm->inter, NQKV = (H + 2 * KVH) * D, L = dm->layers, half = D / 2;
    if (B < 1 || B > 16 || KVH < 1 || H % KVH) return -1;
    /* the residual stream, the RoPE rows and one layer's intermediate values */
    const int64_t per_row = 4 * Hd + 2 * half + NQKV + 2 * H * D + KVH * D + I;
    uint16_t *buf = malloc((size_t)(B * per_row) * sizeof(uint16_t));
    int64_t *meta = malloc((size_t)(7 * B) * sizeof(int64_t));
    if (!buf || !meta) {
        free(buf);
        free(meta);
        return -1;
    }
    uint16_t *x = buf, *y = x + B * Hd, *cs = y + B * Hd, *sn = cs + B * half, *h = sn + B * half;
    uint16_t *qkv = h + B * Hd, *q = qkv + B * NQKV, *k = q + B * H * D;
    uint16_t *o = k + B * KVH * D, *a = o + B * H * D, *sm = a + B * Hd;
    /* the attention's per-sequence arguments (native_causal.h): key/value bases of this layer's
     * mirror planes, their head and row strides, the query row, one new row, its position */
    int64_t *kb = meta, *vb = meta + B, *hs = meta + 2 * B, *rs = meta + 3 * B;
    int64_t *qrow = meta + 4 * B, *nnew = meta + 5 * B, *start = meta + 6 * B;
    for (int64_t b = 0; b < B; b++) {
        memcpy(x + b * Hd, s->embed + s->ids[b] * Hd, (size_t)Hd * sizeof(uint16_t));
        for (int64_t i = 0; i < half; i++) {
            cs[b * half + i] = bf_round(s->cos[s->pos[b] * half + i]);
            sn[b * half + i] = bf_round(s->sin[s->pos[b] * half + i]);
        }
        hs[b] = s->cap[b] * D, rs[b] = D, qrow[b] = b, nnew[b] = 1, start[b] = s->pos[b];
    }
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const struct dkv_bf16_layer_weights *w = lw + l;
        DP_TIMED(DP_NORMS, dkv_bf16_add_rmsnorm(x, l ? y : NULL, w->in_norm, h, B, Hd, dm->eps,
                                                nthreads));
        DP_TIMED(DP_QKV,
                 rc = linear(h, w->qkv, w->qkv_bias, qkv, B, NQKV, Hd, BF_OUT_BF16, nthreads));
        if (rc) break;
        DP_TIMED(DP_ROPE, dkv_bf16_qk_norm_rope(qkv, NQKV, w->qk_norm, cs, sn, q, k, B, H, KVH,
                                                D, dm->qk_eps, nthreads));
        DP_TIMED(DP_KV_WRITES, {
            for (int64_t b = 0; b < B; b++) {
                const struct step_kv row = {s->pool + s->slot[b] + l * s->pool_layer,
                                            s->pool_kv, s->mirror[b], s->cap[b], s->pos[b]};
                step_kv_write(&row, l, k + b * KVH * D, qkv + b * NQKV + (H + KVH) * D, KVH, D,
                              sizeof(uint16_t), &kb[b], &vb[b]);
            }
        });
        DP_TIMED(DP_ATTENTION, rc = attention(q, o, B, kb, vb, hs, rs, hs, rs, qrow, nnew, start, H,
                                              KVH, D, dm->scale, nthreads));
        if (rc) break;
        DP_TIMED(DP_O, rc = linear(o, w->o, NULL, a, B, Hd, H * D, BF_OUT_BF16, nthreads));
        if (rc) break;
        DP_TIMED(DP_NORMS, dkv_bf16_add_rmsnorm(x, a, w->post_norm, h, B, Hd, dm->eps, nthreads));
        DP_TIMED(DP_GATE_UP,
                 rc = linear(h, w->gate_up, NULL, sm, B, 2 * I, Hd, BF_OUT_SILU, nthreads));
        if (rc) break;
        DP_TIMED(DP_DOWN, rc = linear(sm, w->down, NULL, y, B, Hd, I, BF_OUT_BF16, nthreads));
    }
    if (rc == 0)
        DP_TIMED(DP_NORMS, dkv_bf16_add_rmsnorm(x, y, s->norm, out, B, Hd, dm->eps, nthreads));
    free(meta);
    free(buf);
    return rc ? -1 : 0;
}
