/* Quantized GEMV/GEMM for the CPU: y[m, n] = sum_k x[m, k] W[n, k], W held int4 (a scale and a
 * minimum per 32 weights, GGUF's Q4_1 form) or int8 (a scale per 32, Q8_0's), x quantized to int8
 * per row and block of 32 (a scale per block) as llama.cpp's Q8 dot products do, so that the inner
 * loop is integer multiply-adds: AVX-512 VNNI (vpdpbusd) where the CPU has it, AVX2's vpmaddubsw
 * otherwise, plain C elsewhere.
 *
 * The layout (quant/cpu_gemm.py packs it): rows in tiles of 16; a tile's block of 32 inputs is
 *   int4: 256 bytes of nibbles in 4 chunks of 64 (chunk c: byte 4 r + j holds inputs 8 c + j in its
 *         low nibble and 8 c + 4 + j in its high one, of the tile's row r), then 16 fp16 scales d
 *         and 16 fp16 minima m (w = d q + m, q in 0..15);
 *   int8: 512 bytes in 8 chunks of 64 (chunk c: byte 4 r + j holds input 4 c + j of row r), then 16
 *         fp16 scales d (w = d q, q in -127..127).
 * A 4-byte group of x broadcast over the 16 rows of a chunk gives each row's partial dot in its own
 * 32-bit lane: no horizontal sums. Per block the exact integer dots are scaled into a float
 * accumulator per row: acc += float(dot) (d dx) [+ float(dot2) (d dx / 254), the second pass] + m s
 * (see act_block), the same operations in the same
 * order on every path, so AVX-512, AVX2 and plain C give the same bits, and a row's result does not
 * depend on the other rows in the call (batch invariance).
 *
 * Work is shared by tiles among a pool of threads that stays hot through a step: each worker spins
 * for SPIN_NS after its last task, then sleeps on a futex (an idle server costs nothing). The
 * caller's thread takes a share too.
 */

#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define TILE 16
#define QBLOCK 32
#define Q4_BLOCK_BYTES 320 /* 256 nibbles + 32 d + 32 m */
#define Q8_BLOCK_BYTES 544 /* 512 values + 32 d */
#define MC 4               /* x rows per pass over a tile's blocks */
#define MBLOCK 64          /* x rows whose quantized blocks stay in cache while every tile passes */
#define MAX_THREADS 64
#define SPIN_NS 200000L
#define PREFETCH_BLOCKS 32 /* blocks ahead of the one being read */

/* ---------------------------------------------------------------------------- thread pool */


#define OPEN 0x80000000u /* pool.state: the current task takes helpers; the low bits count them */

static struct {
    _Atomic uint32_t generation; /* bumped for each task; workers wait for it to change */
    _Atomic uint32_t state;      /* OPEN | workers inside the current task */
    _Atomic int sleeping;        /* workers waiting in the futex */
    task_fn fn;
    void *arg;
    int started; /* workers running */
    int size;    /* threads the pool was asked for, the caller's included */
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

/* A worker joins a task only while it is open, and the caller closes it once every unit of work is
 * claimed (tasks hand out their units through an atomic counter): a worker the OS has not run yet
 * never holds the caller up, whose own thread then does the work, as on a loaded machine. */
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
    while (pool.started < pool.size - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        pool.first_generation[pool.started + 1] = atomic_load(&pool.generation);
        if (pthread_create(&pool.workers[pool.started], &attr, worker_main, (void *)(intptr_t)(pool.started + 1))) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        pthread_detach(pool.workers[pool.started]);
        pool.started++;
    }
}

/* threads for the quantized GEMMs, the caller's included (workers are started on first use and
 * kept; asking for fewer leaves the rest asleep) */
void folio_qgemm_set_threads(int64_t n) {
    pthread_mutex_lock(&pool_lock);
    pool.size = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
    pthread_mutex_unlock(&pool_lock);
}

int64_t folio_qgemm_threads(void) { return pool.size; }

/* fn(arg) on the caller's thread and on the pool's workers that come while it runs (with_pool);
 * fn claims its units of work itself, so any number of threads may take part */
void folio_run_parallel(task_fn fn, void *arg, int with_pool) {
    if (!with_pool || pool.size <= 1) {
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

/* ---------------------------------------------------------------------------- activations */

/* What a row's block of 32 inputs becomes: x ~ d (q + q2 / 254) with q = round(x / d) and d =
 * max|x| / 127 (q in -127..127), and q2 = round((x / d - q) 254), the rounding error itself in
 * int8 (two passes: about 15 bits, where one pass of int8 cost 3x the KLD of bf16 activations on
 * SmolLM2); rounding half away from zero, as llama.cpp's Q8 blocks. s = d (sum q + sum q2 / 254) is
 * the int4 minimum's factor, i and i2 the sums the int8 weights' offset needs. */
typedef struct {
    float d, d2, s;
    int32_t i, i2;
} act_block;

static void quantize_row(const void *x, int bf16, int64_t k, int passes, int8_t *xq, int8_t *xq2, act_block *blk) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        float v[QBLOCK], amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) {
            const int64_t i = b * QBLOCK + j;
            v[j] = bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0, sum2 = 0;
        for (int j = 0; j < QBLOCK; j++) {
            const float t = v[j] * inv;
            const float q = roundf(t);
            xq[b * QBLOCK + j] = (int8_t)q;
            sum += (int32_t)q;
            if (passes > 1) {
                const int32_t q2 = (int32_t)roundf((t - q) * 254.0f); /* t - q is exact: |t| < 128 */
                xq2[b * QBLOCK + j] = (int8_t)q2;
                sum2 += q2;
            }
        }
        blk[b].d = d;
        blk[b].d2 = d / 254.0f;
        blk[b].s = d * (float)sum + blk[b].d2 * (float)sum2;
        blk[b].i = sum;
        blk[b].i2 = sum2;
    }
}

/* ---------------------------------------------------------------------------- tiles */

typedef struct {
    int kind; /* 4 or 8 */
    int64_t m, n, k, ldy;
    const uint8_t *w;
    int passes;
    const int8_t *xq, *xq2;
    const act_block *blk;
    void *y;
    int y_bf16;
    int64_t tiles, units, chunk; /* units: (block of MBLOCK rows, tile) pairs, claimed chunk at a time */
    _Atomic int64_t next;
} gemm_args;

static inline void store_row(const gemm_args *a, int64_t row, int64_t n0, const float *v) {
    const int64_t count = a->n - n0 < TILE ? a->n - n0 : TILE;
    if (a->y_bf16) {
        uint16_t *y = (uint16_t *)a->y + row * a->ldy + n0;
        for (int64_t i = 0; i < count; i++) y[i] = float_to_bf16(v[i]);
    } else {
        float *y = (float *)a->y + row * a->ldy + n0;
        for (int64_t i = 0; i < count; i++) y[i] = v[i];
    }
}

/* IEEE half -> float (exact), for the plain C path */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QGEMM_PATH "avx512-vnni"

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* rows r0 .. r0 + mc of x against one tile (16 rows of W), every block */
static inline __attribute__((always_inline)) void tile_rows(const gemm_args *a, int64_t tile, int64_t r0, int mc) {
    const int64_t kb = a->k / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MC];
    for (int i = 0; i < mc; i++) acc[i] = _mm512_setzero_ps();
    const int block_bytes = a->kind == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    const uint8_t *w = a->w + tile * kb * block_bytes;
    for (int64_t b = 0; b < kb; b++, w += block_bytes) {
        _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes), _MM_HINT_NTA);
        _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + 64), _MM_HINT_NTA);
        __m512i q[8];
        __m512 d, mn = _mm512_setzero_ps();
        if (a->kind == 4) {
            _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + 128), _MM_HINT_NTA);
            _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + 192), _MM_HINT_NTA);
            _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + 256), _MM_HINT_NTA);
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * c));
                q[2 * c] = _mm512_and_si512(raw, low);
                q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 256)));
            mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 288)));
        } else {
            for (int c = 1; c < 8; c++) _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + 64 * c), _MM_HINT_NTA);
            for (int c = 0; c < 8; c++)
                q[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64 * c)), flip); /* q + 128 */
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 512)));
        }
        for (int i = 0; i < mc; i++) {
            const int64_t row = r0 + i;
            const act_block *ab = a->blk + row * kb + b;
            for (int pass = 0; pass < a->passes; pass++) {
                /* q[c] holds inputs 4c..4c+3 of each row (int4: chunk c/2's low or high nibbles);
                 * four independent chains, then their sum: integer, so exact in any order */
                const int8_t *xb = (pass ? a->xq2 : a->xq) + row * a->k + b * QBLOCK;
                __m512i p[4];
                for (int c = 0; c < 4; c++) p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], bcast4(xb + 4 * c));
                for (int c = 4; c < 8; c++) p[c - 4] = _mm512_dpbusd_epi32(p[c - 4], q[c], bcast4(xb + 4 * c));
                __m512i s = _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
                if (a->kind == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * (pass ? ab->i2 : ab->i)));
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(pass ? ab->d2 : ab->d));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
            }
            if (a->kind == 4) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ab->s), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) {
        float v[TILE];
        _mm512_storeu_ps(v, acc[i]);
        store_row(a, r0 + i, tile * TILE, v);
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_PATH "avx2"

/* 8 lanes of int32 dots: rows 0..7 (half 0) or 8..15 (half 1) of a chunk of 4-byte groups */
static inline __m256i dot8(__m256i s, __m256i w_u8, __m256i x_s8) {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, x_s8), ones));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void tile_rows(const gemm_args *a, int64_t tile, int64_t r0, int mc) {
    const int64_t kb = a->k / QBLOCK;
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[MC][2];
    for (int i = 0; i < mc; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const int block_bytes = a->kind == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    const uint8_t *w = a->w + tile * kb * block_bytes;
    for (int64_t b = 0; b < kb; b++, w += block_bytes) {
        for (int c = 0; c < block_bytes; c += 64) _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * block_bytes + c), _MM_HINT_NTA);
        __m256i q[8][2];
        __m256 d[2], mn[2];
        const int scales_at = a->kind == 4 ? 256 : 512;
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + scales_at + 16 * h)));
            mn[h] = a->kind == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 288 + 16 * h)))
                                 : _mm256_setzero_ps();
            if (a->kind == 4) {
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h));
                    q[2 * c][h] = _mm256_and_si256(raw, low);
                    q[2 * c + 1][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
            } else {
                for (int c = 0; c < 8; c++) q[c][h] = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h));
            }
        }
        for (int i = 0; i < mc; i++) {
            const int64_t row = r0 + i;
            const act_block *ab = a->blk + row * kb + b;
            for (int h = 0; h < 2; h++) {
                for (int pass = 0; pass < a->passes; pass++) {
                    const int8_t *xb = (pass ? a->xq2 : a->xq) + row * a->k + b * QBLOCK;
                    __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* two chains */
                    if (a->kind == 4) {
                        for (int c = 0; c < 8; c++) p[c & 1] = dot8(p[c & 1], q[c][h], bcast4(xb + 4 * c));
                    } else { /* |q| times x with q's sign: both within 127, no saturation */
                        for (int c = 0; c < 8; c++)
                            p[c & 1] = dot8(p[c & 1], _mm256_abs_epi8(q[c][h]), _mm256_sign_epi8(bcast4(xb + 4 * c), q[c][h]));
                    }
                    const __m256i s = _mm256_add_epi32(p[0], p[1]);
                    const __m256 scale = _mm256_mul_ps(d[h], _mm256_set1_ps(pass ? ab->d2 : ab->d));
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[i][h]);
                }
                if (a->kind == 4) acc[i][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(ab->s), acc[i][h]);
            }
        }
    }
    for (int i = 0; i < mc; i++) {
        float v[TILE];
        _mm256_storeu_ps(v, acc[i][0]);
        _mm256_storeu_ps(v + 8, acc[i][1]);
        store_row(a, r0 + i, tile * TILE, v);
    }
}

#else
#define QGEMM_PATH "c"

static void tile_rows(const gemm_args *a, int64_t tile, int64_t r0, int mc) {
    const int64_t kb = a->k / QBLOCK;
    const int block_bytes = a->kind == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    for (int i = 0; i < mc; i++) {
        const int64_t row = r0 + i;
        float acc[TILE] = {0};
        const uint8_t *w = a->w + tile * kb * block_bytes;
        for (int64_t b = 0; b < kb; b++, w += block_bytes) {
            const act_block *ab = a->blk + row * kb + b;
            const uint16_t *dh = (const uint16_t *)(w + (a->kind == 4 ? 256 : 512));
            for (int r = 0; r < TILE; r++) {
                for (int pass = 0; pass < a->passes; pass++) {
                    const int8_t *xb = (pass ? a->xq2 : a->xq) + row * a->k + b * QBLOCK;
                    int32_t s = 0;
                    for (int j = 0; j < QBLOCK; j++) {
                        int32_t q;
                        if (a->kind == 4) {
                            const uint8_t byte = w[64 * (j / 8) + 4 * r + (j % 4)];
                            q = (j % 8) < 4 ? (byte & 15) : (byte >> 4);
                        } else {
                            q = (int8_t)w[64 * (j / 4) + 4 * r + (j % 4)];
                        }
                        s += q * xb[j];
                    }
                    acc[r] = fmaf((float)s, half_to_float(dh[r]) * (pass ? ab->d2 : ab->d), acc[r]);
                }
                if (a->kind == 4) acc[r] = fmaf(half_to_float(dh[TILE + r]), ab->s, acc[r]);
            }
        }
        store_row(a, row, tile * TILE, acc);
    }
}
#endif

static void gemm_task(void *p) {
    gemm_args *a = (gemm_args *)p;
    for (;;) {
        const int64_t u0 = atomic_fetch_add(&a->next, a->chunk);
        if (u0 >= a->units) return;
        const int64_t u1 = u0 + a->chunk < a->units ? u0 + a->chunk : a->units;
        for (int64_t u = u0; u < u1; u++) { /* unit: (block of MBLOCK rows, tile) */
            const int64_t m0 = (u / a->tiles) * MBLOCK, t = u % a->tiles;
            const int64_t m1 = a->m - m0 < MBLOCK ? a->m : m0 + MBLOCK;
            int64_t r = m0;
            for (; r + MC <= m1; r += MC) tile_rows(a, t, r, MC);
            switch (m1 - r) {
                case 3: tile_rows(a, t, r, 3); break;
                case 2: tile_rows(a, t, r, 2); break;
                case 1: tile_rows(a, t, r, 1); break;
                default: break;
            }
        }
    }
}

/* per-thread scratch for the quantized activations */
static __thread int8_t *scratch;
static __thread size_t scratch_size;

/* y [m, n] (row stride ldy, fp32 or bf16) = x [m, k] (row stride ldx, fp32 or bf16) W^T, W packed
 * (kind 4 or 8) with n rows; k a multiple of 32; x in one int8 pass or two (see act_block).
 * Returns 0, or -1 when out of memory. */
int64_t folio_qgemm(int64_t kind, int64_t m, int64_t n, int64_t k, const void *x, int64_t ldx, int64_t x_bf16,
                    const uint8_t *w, void *y, int64_t ldy, int64_t y_bf16, int64_t threads, int64_t passes) {
    const int64_t kb = k / QBLOCK, rows_bytes = (m * k + 63) & ~63L;
    const size_t need = (size_t)(2 * rows_bytes) + (size_t)m * (size_t)kb * sizeof(act_block) + 64;
    if (need > scratch_size) {
        free(scratch);
        scratch = NULL;
        scratch_size = 0;
        if (posix_memalign((void **)&scratch, 64, need * 2)) return -1;
        scratch_size = need * 2;
    }
    passes = passes > 1 ? 2 : 1;
    int8_t *xq = scratch, *xq2 = scratch + rows_bytes;
    act_block *blk = (act_block *)(scratch + 2 * rows_bytes);
    const int elem = x_bf16 ? 2 : 4;
    for (int64_t r = 0; r < m; r++)
        quantize_row((const char *)x + r * ldx * elem, (int)x_bf16, k, (int)passes, xq + r * k, xq2 + r * k,
                     blk + r * kb);
    const int64_t tiles = (n + TILE - 1) / TILE, units = tiles * ((m + MBLOCK - 1) / MBLOCK);
    int64_t nth = threads < 1 ? pool.size : threads;
    /* below ~32 KB of weights a second thread costs more than it saves */
    if (tiles * kb * (kind == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES) * (m < 4 ? 1 : 4) < (1 << 15)) nth = 1;
    /* a few long runs of tiles per thread: each a sequential stream the hardware prefetcher follows */
    const int64_t chunk = nth > 1 ? (units / (2 * nth) > 1 ? units / (2 * nth) : 1) : units;
    gemm_args a = {(int)kind, m, n, k, ldy, w, (int)passes, xq, xq2, blk, y, (int)y_bf16, tiles, units, chunk, 0};
    folio_run_parallel(gemm_task, &a, nth > 1);
    return 0;
}

/* "avx512-vnni", "avx2" or "c": the inner loop this build runs */
const char *folio_qgemm_path(void) { return QGEMM_PATH; }
