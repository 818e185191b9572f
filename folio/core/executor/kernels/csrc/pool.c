/* The kernels' thread pool and their error reporting.
 *
 * Work is shared among threads that stay hot through a step: each worker spins for SPIN_NS after
 * its last task, then sleeps on a futex (an idle server costs nothing). The caller's thread takes a
 * share too. A worker joins a task only while it is open, and the caller closes it once every unit
 * of work is claimed (tasks hand out their units through an atomic counter): a worker the OS has not
 * run yet never holds the caller up. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "folio.h"

#define MAX_THREADS 64
#define SPIN_NS 200000L
#define OPEN 0x80000000u /* pool.state: the current task takes helpers; the low bits count them */

/* ---------------------------------------------------------------------------- errors */

static __thread char last_error[256];

int folio_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

const char *folio_last_error(void) { return last_error; }

const char *folio_error_message(int64_t code) {
    switch (code) {
        case FOLIO_OK: return "ok";
        case FOLIO_EINVAL: return "invalid argument";
        case FOLIO_ENOMEM: return "out of memory";
        case FOLIO_ERANGE: return "index out of range";
        default: return "unknown error";
    }
}

/* ---------------------------------------------------------------------------- the pool */

static struct {
    _Atomic uint32_t generation; /* bumped for each task; workers wait for it to change */
    _Atomic uint32_t state;      /* OPEN | workers inside the current task */
    _Atomic int sleeping;        /* workers waiting in the futex */
    folio_task_fn fn;
    void *arg;
    int started; /* workers running */
    _Atomic int size; /* threads the pool was asked for, the caller's included */
    pthread_t workers[MAX_THREADS];
    uint32_t first_generation[MAX_THREADS]; /* the generation a worker was started in: it waits for the next */
} pool = {.size = 1};

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void *worker_main(void *p) {
    const int ith = (int)(intptr_t)p;
    /* not the generation now: the caller may have posted a task before this thread ran */
    uint32_t seen = pool.first_generation[ith];
    for (;;) {
        uint32_t gen;
        long spin_start = now_ns();
        int checks = 0;
        while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++checks == 256) {
                checks = 0;
                if (now_ns() - spin_start > SPIN_NS) {
                    atomic_fetch_add(&pool.sleeping, 1);
                    if (atomic_load(&pool.generation) == seen)
                        syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                    atomic_fetch_sub(&pool.sleeping, 1);
                    spin_start = now_ns();
                }
            }
        }
        seen = gen;
        uint32_t state = atomic_load(&pool.state);
        while (state & OPEN) {
            if (atomic_compare_exchange_weak(&pool.state, &state, state + 1)) {
                pool.fn(pool.arg); /* stable while we are inside: the caller waits for us */
                atomic_fetch_sub(&pool.state, 1);
                break;
            }
        }
    }
    return NULL;
}

static void pool_forget(void) { pool.started = 0; } /* a forked child has no workers */

static void pool_start(void) {
    static int atfork_set = 0;
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, pool_forget);
        atfork_set = 1;
    }
    while (pool.started < atomic_load(&pool.size) - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        pool.first_generation[pool.started + 1] = atomic_load(&pool.generation);
        int failed = pthread_create(&pool.workers[pool.started], &attr, worker_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer workers: the caller does their share */
        pthread_detach(pool.workers[pool.started]);
        pool.started++;
    }
}

/* threads for the kernels, the caller's included (workers are started on first use and kept;
 * asking for fewer leaves the rest asleep) */
void folio_set_threads(int64_t n) { atomic_store(&pool.size, n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n); }

int64_t folio_threads(void) { return atomic_load(&pool.size); }

void folio_run_parallel(folio_task_fn fn, void *arg, int with_pool) {
    if (!with_pool || atomic_load(&pool.size) <= 1) {
        fn(arg);
        return;
    }
    pthread_mutex_lock(&pool_lock);
    pool_start();
    if (pool.started == 0) {
        pthread_mutex_unlock(&pool_lock);
        fn(arg);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    atomic_store(&pool.state, OPEN);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleeping) > 0) syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    fn(arg);
    atomic_fetch_and(&pool.state, ~OPEN); /* every unit is claimed: no one else may join */
    for (int spins = 0; atomic_load(&pool.state) != 0; spins++) {
        cpu_relax();
        if (spins > 4096) sched_yield(); /* a worker was descheduled mid-unit: let it run */
    }
    pthread_mutex_unlock(&pool_lock);
}
