/* dkv_f32_decode_step: a float32 decode step (one new token for each of B <= 16 sequences, each
 * with a mirror of its context) from its token ids to the final norm's output, in one call
 * (layers/decode_stack.py).
 *
 * It calls the kernels the model's Python path calls one by one (model/qwen3.py CausalLM.forward:
 * the embedding lookup, RoPE's cos/sin rows from the tables, then per layer RMSNorm, the qkv
 * product, per-head norm and RoPE, the K/V writes to the pool and the mirror, decode attention,
 * the output product, RMSNorm, gate/up, SiLU x up, down; then the final RMSNorm), in the same
 * order, with the same arguments, so its result is the same to the bit; what it saves is the
 * Python between them: ~10 calls per layer, each with its checks, tensor views and allocations
 * (bench model, float32, AMD EPYC Zen 4, 2 threads, in-process: a step at 4k x 1 8.5 -> 6.5 ms,
 * at 4k x 8 25.2 -> 23.3 ms; docs/engine.md), and the embedding, RoPE rows and final norm's
 * ~0.15 ms (AMD EPYC Zen 2, 4k x 1).
 *
 * Layout: the pool is [blocks, layers, 2, block_size, KVH, D]; row b's slot in layer l, K (kv 0)
 * or V (kv 1), starts at pool + slot[b] + l * pool_layer + kv * pool_kv. Sequence b's mirror is
 * [layers, 2, KVH, cap[b], D] at address mirror[b]; its new token goes to position pos[b] and
 * attention reads positions 0 .. pos[b]. The caller (decode_stack.py) checks every bound: the
 * ids against the embedding's rows, the positions against the RoPE tables' rows.
 */

struct dkv_layer_weights { /* one decoder layer's float32 weights, all contiguous */
    const float *in_norm, *post_norm; /* [hidden] */
    const float *qkv, *qkv_bias;      /* [(H + 2 KVH) D, hidden]; [(H + 2 KVH) D] or NULL */
    const float *qk_norm;             /* per-head weights [H + KVH, D] or NULL (no qk norm) */
    const float *o, *gate_up, *down;  /* [hidden, H D], [2 I, hidden], [hidden, I] */
};

struct dkv_stack_dims {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, qk_eps, scale;
};

struct dkv_decode_rows {
    int64_t B;
    const int64_t *ids;        /* [B] token ids, rows of embed */
    const float *embed;        /* [vocab, hidden] */
    const float *cos, *sin;    /* RoPE tables [P, D / 2], rows pos[b] */
    const float *norm;         /* the final norm's weight [hidden] */
    const int64_t *mirror;     /* [B] addresses of the mirrors */
    const int64_t *cap, *pos;  /* [B] */
    float *pool;
    const int64_t *slot;       /* [B] element offsets into the pool (layer 0, K) */
    int64_t pool_layer, pool_kv;
};

/* Profiling (bench decode_profile): while it is on, each step adds every part's wall time on the
 * calling thread to that part's total; off (the default) a part costs one load of the flag. One
 * decode stack at a time per process (an engine's thread), as it runs. */
enum { DP_NORMS, DP_QKV, DP_ROPE, DP_KV_WRITES, DP_ATTENTION, DP_O, DP_GATE_UP, DP_SILU, DP_DOWN,
       DP_CALL, DP_PARTS };
static _Atomic int dp_on;
static int64_t dp_ns[DP_PARTS], dp_steps;

/* The totals since the last call (ns per part, DP_CALL the whole calls) and the steps they cover
 * into out[DP_PARTS + 1], then zeroed; profiling on from now if `on`. Returns DP_PARTS. */
int dkv_decode_profile(int on, int64_t *out) {
    for (int i = 0; i < DP_PARTS; i++) out[i] = dp_ns[i], dp_ns[i] = 0;
    out[DP_PARTS] = dp_steps, dp_steps = 0;
    atomic_store(&dp_on, on != 0);
    return DP_PARTS;
}

#define DP_TIMED(part, ...)                                                                    \
    do {                                                                                       \
        const int64_t t_ = atomic_load_explicit(&dp_on, memory_order_relaxed) ? now_ns() : 0;   \
        __VA_ARGS__;                                                                           \
        if (t_) dp_ns[part] += now_ns() - t_;                                                  \
    } while (0)

/* Where one sequence's new K/V row goes in a step: its pool slot (layer 0's K; V `pool_kv`
 * elements after it) and its mirror [layers, 2, KVH, cap, D] at address `mirror`, position pos. */
struct step_kv {
    void *slot;
    int64_t pool_kv, mirror, cap, pos;
};

/* Layer l's K row kr and V row vr [KVH, D] (elements of `elem` bytes) into the pool slot and the
 * mirror (both dtypes' steps); the addresses of the mirror's K and V planes for layer l into
 * *kbase and *vbase (what the attention reads). */
static void step_kv_write(const struct step_kv *r, int64_t l, const void *kr, const void *vr,
                          int64_t KVH, int64_t D, int64_t elem, int64_t *kbase, int64_t *vbase) {
    const size_t row_bytes = (size_t)(KVH * D * elem), head_bytes = (size_t)(D * elem);
    uint8_t *slot = r->slot;
    memcpy(slot, kr, row_bytes);
    memcpy(slot + r->pool_kv * elem, vr, row_bytes);
    const int64_t plane = KVH * r->cap * D * elem; /* one layer's K or V, in bytes */
    uint8_t *mk = (uint8_t *)(intptr_t)r->mirror + 2 * l * plane, *mv = mk + plane;
    for (int64_t h = 0; h < KVH; h++) {
        const int64_t at = (h * r->cap + r->pos) * D * elem;
        memcpy(mk + at, (const uint8_t *)kr + h * D * elem, head_bytes);
        memcpy(mv + at, (const uint8_t *)vr + h * D * elem, head_bytes);
    }
    *kbase = (int64_t)(intptr_t)mk, *vbase = (int64_t)(intptr_t)mv;
}

static int decode_step(const struct dkv_layer_weights *lw, const struct dkv_stack_dims *dm,
                       const struct dkv_decode_rows *s, float *out, int nthreads);

/* out [B, hidden]: the final norm's output. Returns 0, or -1 if a buffer could not be allocated
 * or attention refused the shape. */
int dkv_f32_decode_step(const struct dkv_layer_weights *lw, const struct dkv_stack_dims *dm,
                        const struct dkv_decode_rows *s, float *out, int nthreads) {
    int rc;
    DP_TIMED(DP_CALL, rc = decode_step(lw, dm, s, out, nthreads));
    if (atomic_load_explicit(&dp_on, memory_order_relaxed)) dp_steps++;
    return rc;
}

static int decode_step(const struct dkv_layer_weights *lw, const struct dkv_stack_dims *dm,
                       const struct dkv_decode_rows *s, float *out, int nthreads) {
    const int64_t B = s->B, Hd = dm->hidden, H = dm->heads, KVH = dm->kv_heads, D = dm->head_dim;
    const int64_t I = dm->inter, NQKV = (H + 2 * KVH) * D, L = dm->layers, half = D / 2;
    if (B < 1 || B > 16 || KVH < 1 || H % KVH) return -1;
    /* the residual stream, the RoPE rows and one layer's intermediate values, as the Python
     * path's tensors */
    const int64_t per_row = 4 * Hd + 2 * half + NQKV + 2 * H * D + KVH * D + 3 * I;
    float *buf = malloc((size_t)(B * per_row) * sizeof(float));
    int64_t *meta = malloc((size_t)(5 * B) * sizeof(int64_t));
    if (!buf || !meta) {
        free(buf);
        free(meta);
        return -1;
    }
    float *x = buf, *y = x + B * Hd, *cs = y + B * Hd, *sn = cs + B * half, *h = sn + B * half;
    float *qkv = h + B * Hd, *q = qkv + B * NQKV, *k = q + B * H * D;
    float *o = k + B * KVH * D, *a = o + B * H * D, *gu = a + B * Hd, *sm = gu + B * 2 * I;
    int64_t *kb = meta, *vb = meta + B, *hs = meta + 2 * B, *rs = meta + 3 * B,
            *len = meta + 4 * B;
    for (int64_t b = 0; b < B; b++) {
        memcpy(x + b * Hd, s->embed + s->ids[b] * Hd, (size_t)Hd * sizeof(float));
        memcpy(cs + b * half, s->cos + s->pos[b] * half, (size_t)half * sizeof(float));
        memcpy(sn + b * half, s->sin + s->pos[b] * half, (size_t)half * sizeof(float));
    }
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const struct dkv_layer_weights *w = lw + l;
        DP_TIMED(DP_NORMS,
                 dkv_add_rmsnorm(x, l ? y : NULL, w->in_norm, h, B, Hd, dm->eps, nthreads));
        DP_TIMED(DP_QKV, {
            dkv_linear(h, w->qkv, qkv, B, NQKV, Hd, nthreads);
            if (w->qkv_bias)
                for (int64_t b = 0; b < B; b++)
                    for (int64_t n = 0; n < NQKV; n++) qkv[b * NQKV + n] += w->qkv_bias[n];
        });
        DP_TIMED(DP_ROPE, dkv_qk_norm_rope(qkv, NQKV, w->qk_norm, cs, sn, q, k, B, H, KVH, D,
                                           dm->qk_eps, nthreads));
        DP_TIMED(DP_KV_WRITES, {
            for (int64_t b = 0; b < B; b++) {
                const struct step_kv row = {s->pool + s->slot[b] + l * s->pool_layer,
                                            s->pool_kv, s->mirror[b], s->cap[b], s->pos[b]};
                step_kv_write(&row, l, k + b * KVH * D, qkv + b * NQKV + (H + KVH) * D, KVH, D,
                              sizeof(float), &kb[b], &vb[b]);
                hs[b] = s->cap[b] * D, rs[b] = D, len[b] = s->pos[b] + 1;
            }
        });
        DP_TIMED(DP_ATTENTION, rc = dkv_decode_attn(q, o, kb, vb, hs, rs, len, B, KVH, H / KVH, D,
                                                   dm->scale, nthreads));
        if (rc) break;
        DP_TIMED(DP_O, dkv_linear(o, w->o, a, B, Hd, H * D, nthreads));
        DP_TIMED(DP_NORMS, dkv_add_rmsnorm(x, a, w->post_norm, h, B, Hd, dm->eps, nthreads));
        DP_TIMED(DP_GATE_UP, dkv_linear(h, w->gate_up, gu, B, 2 * I, Hd, nthreads));
        DP_TIMED(DP_SILU, dkv_silu_mul(gu, sm, B, I, nthreads));
        DP_TIMED(DP_DOWN, dkv_linear(sm, w->down, y, B, Hd, I, nthreads));
    }
    if (rc == 0)
        DP_TIMED(DP_NORMS, dkv_add_rmsnorm(x, y, s->norm, out, B, Hd, dm->eps, nthreads));
    free(meta);
    free(buf);
    return rc ? -1 : 0;
}
