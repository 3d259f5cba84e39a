/* Plain reads of a decode step's KV layout, for `duplexkv bench read_limits` (read_limits.py).
 *
 * probe_rows reads `units` runs of `rows` rows of D floats, one run of keys and one of values per
 * unit (a sequence's KV head in its mirror), key row j then value row j, in order, and sums them:
 * the access order of the decode attention's one-pass kernel without its arithmetic. With
 * `ahead` > 0 it also asks, before each row, for the key and value rows `ahead` rows on into L2
 * (__builtin_prefetch, as the kernel does); with 0 it leaves the stream to the hardware
 * prefetcher. `fmas` > 0 adds that many vector FMAs per row between the reads: with `fma_loads` 0
 * their operands are in registers (ten independent chains: the two FMA pipes set the pace, the
 * arithmetic alone), with 1 each reads its operand from L1 (twelve chains: arithmetic with a
 * load per FMA, as kernels with few registers do), to see whether the stream keeps its pace while
 * a core computes, and while it also keeps its load ports busy. The units are split into one
 * contiguous share per thread (the calling thread and nthreads - 1 started for the call), `passes`
 * times over. Returns the sum of every float read
 * (so a caller can check that everything was read, and no compiler can drop the reads).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));

struct probe_job {
    const int64_t *k, *v;
    int64_t units, rows, D, ahead, fmas, fma_loads, passes;
    int thread, nthreads;
    double sum;
};

static void *probe_share(void *arg) {
    struct probe_job *j = arg;
    const int64_t u0 = j->units * j->thread / j->nthreads;
    const int64_t u1 = j->units * (j->thread + 1) / j->nthreads;
    v8 a = {0}, b = {0}, w[12];
    const v8 m = {0.999f, 0.999f, 0.999f, 0.999f, 0.999f, 0.999f, 0.999f, 0.999f};
    const int64_t nv = j->D / 8 < 8 ? j->D / 8 : 8;
    for (int c = 0; c < 12; c++) w[c] = (v8){0};
    double total = 0;
    for (int64_t p = 0; p < j->passes; p++) {
        for (int64_t u = u0; u < u1; u++) {
            const float *k = (const float *)(intptr_t)j->k[u];
            const float *v = (const float *)(intptr_t)j->v[u];
            for (int64_t r = 0; r < j->rows; r++) {
                if (j->ahead && r + j->ahead < j->rows)
                    for (int64_t d = 0; d < j->D; d += 16) {
                        __builtin_prefetch(k + (r + j->ahead) * j->D + d, 0, 2);
                        __builtin_prefetch(v + (r + j->ahead) * j->D + d, 0, 2);
                    }
                for (int64_t d = 0; d < j->D; d += 8) {
                    a += *(const v8 *)(k + r * j->D + d);
                    b += *(const v8 *)(v + r * j->D + d);
                }
                if (j->fmas && j->fma_loads) { /* each FMA reads its operand from L1 */
                    const float *src[8];
                    for (int i = 0; i < 8; i++) src[i] = k + r * j->D + 8 * (i % nv);
                    int64_t f = 0;
                    for (; f + 12 <= j->fmas; f += 12) {
#pragma GCC unroll 12
                        for (int i = 0; i < 12; i++)
                            w[i] = w[i] * m + *(const v8 *)src[i % 8];
                    }
#pragma GCC unroll 12
                    for (int i = 0; i < 12; i++)
                        if (i < j->fmas - f) w[i] = w[i] * m + *(const v8 *)src[i % 8];
                } else if (j->fmas) { /* operands in registers: the arithmetic alone */
                    v8 kk[4];
                    for (int i = 0; i < 4; i++) kk[i] = *(const v8 *)(k + r * j->D + 8 * (i % nv));
                    int64_t f = 0;
                    for (; f + 10 <= j->fmas; f += 10) {
#pragma GCC unroll 10
                        for (int i = 0; i < 10; i++) w[i] = w[i] * m + kk[i % 4];
                    }
#pragma GCC unroll 10
                    for (int i = 0; i < 10; i++)
                        if (i < j->fmas - f) w[i] = w[i] * m + kk[i % 4];
                }
            }
            for (int i = 0; i < 8; i++) total += (double)a[i] + (double)b[i];
            a = (v8){0}, b = (v8){0};
        }
    }
    for (int c = 0; c < 12; c++) /* the chains' results, kept out of the sum: a weight of zero */
        for (int i = 0; i < 8; i++) total += 0.0 * (double)w[c][i];
    j->sum = total;
    return NULL;
}

double probe_rows(const int64_t *k, const int64_t *v, int64_t units, int64_t rows, int64_t D,
                  int64_t ahead, int64_t fmas, int64_t fma_loads, int64_t passes,
                  int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    struct probe_job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int t = 0; t < nthreads; t++)
        jobs[t] = (struct probe_job){k, v, units, rows, D, ahead, fmas, fma_loads, passes, t,
                                     nthreads, 0};
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&threads[t], NULL, probe_share, &jobs[t]) == 0;
    for (int t = 1; t < nthreads; t++)
        if (!started[t]) probe_share(&jobs[t]); /* no thread: this one reads that share too */
    probe_share(&jobs[0]);
    double sum = 0;
    for (int t = 0; t < nthreads; t++) {
        if (t && started[t]) pthread_join(threads[t], NULL);
        sum += jobs[t].sum;
    }
    return sum;
}
