/* The kernels' own worker threads, which spin briefly between jobs instead of sleeping at once.
 *
 * Why not OpenMP: workers run libgomp with OMP_WAIT_POLICY=PASSIVE (two workers on shared cores
 * must not spin for each other's cores; docs/workers.md, the environment of a worker), so torch's team falls asleep
 * after every parallel region, and a decode step runs ~40 short regions (5 kernels per layer)
 * with a few microseconds of Python between them. Waking a sleeping thread costs 15-115 us here
 * (AMD EPYC VM: an empty 2-thread region took 124 us back to back against 10 us for one thread),
 * a sizeable part of a 25 ms step. These helpers spin for SPIN_US after each job (covering the
 * gaps inside a step), then sleep on a futex, so an idle worker still gives its cores away.
 *
 * A job is fn(ctx, i) for i in [0, count), claimed in grains by an atomic counter: the caller
 * works too, and a helper that is slow to wake finds less left to do. One job at a time per
 * process; a caller that finds the pool busy (another thread's job) runs its job alone.
 * A forked child starts without helpers (pthread_atfork).
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 64
#define SPIN_US 200

typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t lock;       /* held by the caller of a job, for the job's whole run */
    int helpers;                /* started */
    _Atomic uint32_t gen;       /* bumped for every job; helpers wait for it to change */
    _Atomic int sleepers;       /* helpers in (or about to enter) futex_wait */
    _Atomic int64_t next;       /* the next index to claim */
    _Atomic int finished;       /* helpers done with the current job */
    pool_fn fn;
    void *ctx;
    int64_t count, grain;
    int wanted;                 /* helpers the current job asked for */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void pool_work(void) {
    const int64_t count = pool.count, grain = pool.grain;
    for (;;) {
        const int64_t b = atomic_fetch_add(&pool.next, grain);
        if (b >= count) return;
        pool.fn(pool.ctx, b, b + grain < count ? b + grain : count);
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_helper(void *arg) {
    /* the job counter when it was started: a job published before the thread ran is its first */
    const int id = (int)((uintptr_t)arg & 0xffff); /* 1 .. helpers */
    uint32_t seen = (uint32_t)((uintptr_t)arg >> 32);
    for (;;) {
        const int64_t until = now_ns() + SPIN_US * 1000;
        uint32_t g;
        for (int i = 0; (g = atomic_load(&pool.gen)) == seen; i++) {
            cpu_relax();
            if ((i & 63) == 63 && now_ns() > until) {
                atomic_fetch_add(&pool.sleepers, 1);
                if (atomic_load(&pool.gen) == seen)
                    syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
            }
        }
        seen = g;
        if (id <= pool.wanted) pool_work();
        atomic_fetch_add(&pool.finished, 1);
    }
    return NULL;
}

static void pool_forget_helpers(void) { /* in a forked child: the helpers did not come along */
    pthread_mutex_init(&pool.lock, NULL);
    pool.helpers = 0;
    atomic_store(&pool.sleepers, 0);
}

static void pool_start(int n) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_forget_helpers);
        registered = 1;
    }
    while (pool.helpers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = ((uintptr_t)atomic_load(&pool.gen) << 32) | (pool.helpers + 1);
        const int ok = pthread_create(&t, &attr, pool_helper, (void *)arg);
        pthread_attr_destroy(&attr);
        if (ok != 0) break;
        pool.helpers++;
    }
}

/* fn over [0, count) in grains on `nthreads` threads (the caller and nthreads - 1 helpers). */
static void pool_run(pool_fn fn, void *ctx, int64_t count, int64_t grain, int nthreads) {
    if (grain < 1) grain = 1;
    if (nthreads > POOL_MAX) nthreads = POOL_MAX;
    if (nthreads <= 1 || count <= grain || pthread_mutex_trylock(&pool.lock) != 0) {
        fn(ctx, 0, count);
        return;
    }
    pool_start(nthreads - 1);
    const int helpers = pool.helpers;
    pool.fn = fn, pool.ctx = ctx, pool.count = count, pool.grain = grain;
    pool.wanted = nthreads - 1;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.finished, 0);
    atomic_fetch_add(&pool.gen, 1); /* publishes the job (sequentially consistent) */
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    pool_work();
    /* every helper saw the job; past SPIN_US, yield the core to a helper that is not running */
    const int64_t until = now_ns() + SPIN_US * 1000;
    for (int i = 0; atomic_load(&pool.finished) < helpers; i++) {
        cpu_relax();
        if ((i & 63) == 63 && now_ns() > until) sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}
