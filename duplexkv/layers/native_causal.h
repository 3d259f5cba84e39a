/* What the two causal attention kernels (native_amx_attn.h in bf16, native_f32_prefill.h in
 * float32) share: their work split. A task is one KV head of one sequence and up to `rows` of its
 * folded query rows (position-major, then the group's G heads); the list goes to the pool
 * costliest first (a task's cost: its rows times the keys its last row reads), so the long tasks
 * of a causal prompt do not end up last on one thread. */
/* Both kernels' parameters (T: the element type; native_amx_attn.h describes them, and
 * layers/causal_kernel.py passes them), and the statement a build without the kernel uses them
 * in. */
#define CAUSAL_ARGS(T)                                                                         \
    const T *q, T *out, int64_t nseq, const int64_t *kbase, const int64_t *vbase,              \
        const int64_t *khs, const int64_t *krs, const int64_t *vhs, const int64_t *vrs,        \
        const int64_t *qrow, const int64_t *nnew, const int64_t *start, int64_t H, int64_t KVH, \
        int64_t D, float scale, int nthreads
#define CAUSAL_PASS                                                                            \
    q, out, nseq, kbase, vbase, khs, krs, vhs, vrs, qrow, nnew, start, H, KVH, D, scale, nthreads
#define CAUSAL_UNUSED                                                                          \
    ((void)q, (void)out, (void)nseq, (void)kbase, (void)vbase, (void)khs, (void)krs, (void)vhs, \
     (void)vrs, (void)qrow, (void)nnew, (void)start, (void)H, (void)KVH, (void)D, (void)scale,  \
     (void)nthreads)

struct causal_task {
    int64_t seq, kvh, r0, r1, cost;
};

/* a call's arguments and task list, as the pool's workers read them */
struct causal_job {
    const void *q; /* [T, H, D] of the kernel's element type (bf16 bits, or float) */
    void *out;
    const int64_t *kbase, *vbase, *khs, *krs, *vhs, *vrs, *qrow, *nnew, *start;
    const struct causal_task *tasks;
    int64_t H, G, D;
    float sl; /* scale * log2(e) */
    _Atomic int failed;
};

static int causal_cost_desc(const void *a, const void *b) {
    const int64_t x = ((const struct causal_task *)a)->cost;
    const int64_t y = ((const struct causal_task *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The tasks of `nseq` sequences (n_new[s] query rows at positions from start[s]), sorted; their
 * count in *n. NULL if out of memory (free() the list otherwise). */
static inline struct causal_task *causal_tasks(int64_t nseq, const int64_t *nnew,
                                               const int64_t *start, int64_t KVH, int64_t G,
                                               int64_t rows, int64_t *n) {
    int64_t count = 0;
    for (int64_t s = 0; s < nseq; s++) count += KVH * ((nnew[s] * G + rows - 1) / rows);
    struct causal_task *tasks = malloc((size_t)(count > 0 ? count : 1) * sizeof *tasks);
    if (!tasks) return NULL;
    *n = 0;
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t r0 = 0; r0 < nnew[s] * G; r0 += rows) {
                const int64_t r1 = r0 + rows < nnew[s] * G ? r0 + rows : nnew[s] * G;
                tasks[(*n)++] = (struct causal_task){s, h, r0, r1,
                                                     (r1 - r0) * (start[s] + r1 / G + 1)};
            }
    qsort(tasks, (size_t)*n, sizeof *tasks, causal_cost_desc);
    return tasks;
}

/* A call's tasks (`rows` folded query rows each) run by `fn` on the pool: 0, or -1 (no memory, or
 * a worker could not get its scratch). The caller has checked the shape (H % KVH == 0). */
static inline int causal_run(pool_fn fn, int64_t rows, CAUSAL_ARGS(void)) {
    const int64_t G = H / KVH;
    int64_t n = 0;
    struct causal_task *tasks = causal_tasks(nseq, nnew, start, KVH, G, rows, &n);
    if (!tasks) return -1;
    struct causal_job job = {q, out, kbase, vbase, khs, krs, vhs, vrs, qrow, nnew, start, tasks,
                             H, G, D, scale * 1.4426950408889634f, 0};
    pool_run(fn, &job, n, 1, nthreads);
    free(tasks);
    return atomic_load(&job.failed) ? -1 : 0;
}
