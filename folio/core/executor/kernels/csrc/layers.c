/* A decoder layer's small operations on the CPU, one call each for the whole step: residual add +
 * RMSNorm, RoPE + the KV write, SiLU or GELU(tanh) x gate, and decode attention over the paged
 * pool (a sliding window and a logit soft-cap as parameters). The torch ops they replace
 * (layer_ops.TorchLayerOps, attention.TorchAttentionBackend) stay the reference. Each row (token)
 * is computed on its own, in one order: a sequence's tokens do not depend on the batch. Every
 * entry point checks its sizes and indices (positions in the RoPE tables, slots and block ids in
 * the pool) before it writes anything. */

#include <stdatomic.h>

#include "common.h"
#include "folio.h"

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* residual [n, d] (row stride rs) += x (x may be NULL: a norm alone; fp32 or bf16, row stride xs),
 * then out = weight * (residual * (1 / sqrt(mean(residual^2) + eps))), as
 * layer_ops._rms_norm computes it, into fp32 or bf16 rows of stride os */
static void add_rms_norm(int64_t n, int64_t d, const void *x, int64_t xs, int x_bf16, float *residual, int64_t rs,
                         const float *weight, float eps, void *out, int64_t os, int out_bf16) {
    for (int64_t t = 0; t < n; t++) {
        float *r = residual + t * rs;
        if (x != NULL) {
            if (x_bf16) {
                const uint16_t *xr = (const uint16_t *)x + t * xs;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) r[j] = r[j] + bf16_to_float(xr[j]);
            } else {
                const float *xr = (const float *)x + t * xs;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) r[j] = r[j] + xr[j];
            }
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < d; j++) sum += r[j] * r[j];
        const float inv = 1.0f / sqrtf(sum / (float)d + eps);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + t * os;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] = float_to_bf16(weight[j] * (r[j] * inv));
        } else {
            float *o = (float *)out + t * os;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] = weight[j] * (r[j] * inv);
        }
    }
}

int64_t folio_add_rms_norm(int64_t n, int64_t d, const void *x, int64_t xs, int64_t x_bf16, float *residual,
                           int64_t rs, const float *weight, float eps, void *out, int64_t os, int64_t out_bf16) {
    if (n < 0 || d <= 0 || residual == NULL || weight == NULL || out == NULL || rs < d || os < d || (x != NULL && xs < d))
        return folio_fail(FOLIO_EINVAL, "rms_norm: %lld x %lld, strides %lld %lld %lld", (long long)n, (long long)d,
                          (long long)xs, (long long)rs, (long long)os);
    add_rms_norm(n, d, x, xs, (int)x_bf16, residual, rs, weight, eps, out, os, (int)out_bf16);
    return FOLIO_OK;
}

/* x * cos + rotate_half(x) * sin over one head, rotate_half(x) = (-x[half:], x[:half]) */
static inline void rope_head(const void *x, int64_t at, int bf16, const float *c, const float *s, int64_t dim,
                             float *dst) {
    const int64_t half = dim / 2;
    for (int64_t j = 0; j < half; j++) {
        float a = load(x, at + j, bf16), b = load(x, at + j + half, bf16);
        dst[j] = a * c[j] + (-b) * s[j];
        dst[j + half] = b * c[j + half] + a * s[j + half];
    }
}

/* qkv [n, (num_heads + 2 num_kv_heads) head_dim] (row stride qs): q and k rotated at each token's
 * position (cos/sin tables [rope_len, head_dim]), q into q_out [n, num_heads, head_dim], k and v into
 * their slots of the pool (a negative slot is padding: not written) */
static void rope_write_kv(int64_t n, const void *qkv, int64_t qs, int qkv_bf16, const int64_t *positions,
                          const float *cos_table, const float *sin_table, const int64_t *slots, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, float *q_out, float *k_cache, float *v_cache) {
    const int64_t kv_size = num_kv_heads * head_dim, q_size = num_heads * head_dim;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        const int64_t row = t * qs;
        for (int64_t h = 0; h < num_heads; h++)
            rope_head(qkv, row + h * head_dim, qkv_bf16, c, s, head_dim, q_out + t * q_size + h * head_dim);
        if (slots[t] < 0) continue;
        float *k = k_cache + slots[t] * kv_size, *v = v_cache + slots[t] * kv_size;
        for (int64_t h = 0; h < num_kv_heads; h++)
            rope_head(qkv, row + q_size + h * head_dim, qkv_bf16, c, s, head_dim, k + h * head_dim);
        for (int64_t j = 0; j < kv_size; j++) v[j] = load(qkv, row + q_size + kv_size + j, qkv_bf16);
    }
}

int64_t folio_check_kv(const folio_kv *kv) {
    if (kv == NULL || kv->k == NULL || kv->v == NULL || kv->num_blocks <= 0 || kv->block_size <= 0 ||
        kv->num_kv_heads <= 0 || kv->head_dim <= 0)
        return folio_fail(FOLIO_EINVAL, "kv pool: %lld blocks of %lld", kv ? (long long)kv->num_blocks : 0LL,
                          kv ? (long long)kv->block_size : 0LL);
    return FOLIO_OK;
}

/* positions inside the RoPE tables, slots inside the pool (or padding) */
int64_t folio_check_tokens(int64_t n, const int64_t *positions, int64_t rope_len, const int64_t *slots,
                           const folio_kv *kv) {
    if (n < 0 || (n > 0 && (positions == NULL || slots == NULL)))
        return folio_fail(FOLIO_EINVAL, "tokens: %lld without positions or slots", (long long)n);
    const int64_t num_slots = kv->num_blocks * kv->block_size;
    for (int64_t t = 0; t < n; t++) {
        if (positions[t] < 0 || positions[t] >= rope_len)
            return folio_fail(FOLIO_ERANGE, "token %lld: position %lld outside the RoPE tables (%lld)", (long long)t,
                              (long long)positions[t], (long long)rope_len);
        if (slots[t] >= num_slots)
            return folio_fail(FOLIO_ERANGE, "token %lld: slot %lld outside the pool (%lld)", (long long)t,
                              (long long)slots[t], (long long)num_slots);
    }
    return FOLIO_OK;
}

int64_t folio_rope_write_kv(int64_t n, const void *qkv, int64_t qs, int64_t qkv_bf16, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t rope_len, const int64_t *slots,
                            int64_t num_heads, const folio_kv *kv, float *q_out) {
    int64_t rc;
    if ((rc = folio_check_kv(kv))) return rc;
    if (qkv == NULL || cos_table == NULL || sin_table == NULL || q_out == NULL || num_heads <= 0 ||
        qs < (num_heads + 2 * kv->num_kv_heads) * kv->head_dim || kv->head_dim % 2)
        return folio_fail(FOLIO_EINVAL, "rope: qkv stride %lld for %lld + 2 x %lld heads of %lld", (long long)qs,
                          (long long)num_heads, (long long)kv->num_kv_heads, (long long)kv->head_dim);
    if ((rc = folio_check_tokens(n, positions, rope_len, slots, kv))) return rc;
    rope_write_kv(n, qkv, qs, (int)qkv_bf16, positions, cos_table, sin_table, slots, num_heads, kv->num_kv_heads,
                  kv->head_dim, q_out, kv->k, kv->v);
    return FOLIO_OK;
}

static inline float silu_times(float g, float u) {
    /* sigmoid from an exp of a non-positive number either side of 0 */
    float e = exp_nonpositive(g >= 0.0f ? -g : g);
    float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return (g * sig) * u;
}

/* gelu_tanh(g) * u: 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3),
 * the sigmoid as in silu_times */
static inline float gelu_tanh_times(float g, float u) {
    const float y2 = 2.0f * (0.7978845608028654f * (g + 0.044715f * (g * g * g)));
    float e = exp_nonpositive(y2 >= 0.0f ? -y2 : y2);
    float sig = y2 >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return (g * sig) * u;
}

static inline float gated(float g, float u, const int gelu) { return gelu ? gelu_tanh_times(g, u) : silu_times(g, u); }

/* gate_up [n, 2 d] (row stride gs): out [n, d] = act(gate) * up, in fp32, rounded once */
static inline __attribute__((always_inline)) void gated_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs,
                                                                int in_bf16, void *out, int64_t os, int out_bf16,
                                                                const int gelu) {
    for (int64_t t = 0; t < n; t++) {
        if (in_bf16 && out_bf16) { /* bf16 activations (torch's packed kernels), a loop that vectorises */
            const uint16_t *g = (const uint16_t *)gate_up + t * gs, *u = g + d;
            uint16_t *o = (uint16_t *)out + t * os;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                o[j] = float_to_bf16(gated(bf16_to_float(g[j]), bf16_to_float(u[j]), gelu));
        } else if (!in_bf16 && !out_bf16) { /* fp32 (folio's quantized kernels), the same */
            const float *g = (const float *)gate_up + t * gs, *u = g + d;
            float *o = (float *)out + t * os;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] = gated(g[j], u[j], gelu);
        } else {
            for (int64_t j = 0; j < d; j++) {
                const float g = load(gate_up, t * gs + j, in_bf16), u = load(gate_up, t * gs + d + j, in_bf16);
                store(out, t * os + j, gated(g, u, gelu), out_bf16);
            }
        }
    }
}

/* silu(gate) * up (SwiGLU) */
static int64_t check_gated(int64_t n, int64_t d, const void *gate_up, int64_t gs, const void *out, int64_t os) {
    if (n < 0 || d <= 0 || gate_up == NULL || out == NULL || gs < 2 * d || os < d)
        return folio_fail(FOLIO_EINVAL, "gated: %lld x %lld, strides %lld %lld", (long long)n, (long long)d,
                          (long long)gs, (long long)os);
    return FOLIO_OK;
}

int64_t folio_silu_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int64_t in_bf16, void *out,
                           int64_t os, int64_t out_bf16) {
    const int64_t rc = check_gated(n, d, gate_up, gs, out, os);
    if (rc == FOLIO_OK) gated_and_mul(n, d, gate_up, gs, (int)in_bf16, out, os, (int)out_bf16, 0);
    return rc;
}

/* gelu_tanh(gate) * up (GeGLU, Gemma's) */
int64_t folio_gelu_tanh_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int64_t in_bf16, void *out,
                                int64_t os, int64_t out_bf16) {
    const int64_t rc = check_gated(n, d, gate_up, gs, out, os);
    if (rc == FOLIO_OK) gated_and_mul(n, d, gate_up, gs, (int)in_bf16, out, os, (int)out_bf16, 1);
    return rc;
}

/* float vectors for the attention, where the CPU has them */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VF_N 16
#define VF_LOAD _mm512_loadu_ps
#define VF_STORE _mm512_storeu_ps
#define VF_FMA _mm512_fmadd_ps
#define VF_MUL _mm512_mul_ps
#define VF_SET1 _mm512_set1_ps
#define VF_ZERO _mm512_setzero_ps
#define VF_SUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VF_N 8
#define VF_LOAD _mm256_loadu_ps
#define VF_STORE _mm256_storeu_ps
#define VF_FMA _mm256_fmadd_ps
#define VF_MUL _mm256_mul_ps
#define VF_SET1 _mm256_set1_ps
#define VF_ZERO _mm256_setzero_ps
static inline float VF_SUM(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
#endif

/* a key's or value's row, AHEAD rows before it is read: the rows of a sequence's keys are scattered
 * over its blocks and strided by the KV heads, so the hardware prefetcher does not find them */
#define AHEAD 8
static inline void prefetch_row(const float *row, int64_t head_dim) {
    for (int64_t j = 0; j < head_dim; j += 16) __builtin_prefetch(row + j, 0, 0);
}

/* q . k of one head over head_dim floats */
static inline __attribute__((always_inline)) float dot_head(const float *restrict q, const float *restrict k,
                                                            const int64_t head_dim) {
#ifdef VF_N
    if (head_dim % VF_N == 0) {
        vf acc = VF_MUL(VF_LOAD(q), VF_LOAD(k));
        for (int64_t j = VF_N; j < head_dim; j += VF_N) acc = VF_FMA(VF_LOAD(q + j), VF_LOAD(k + j), acc);
        return VF_SUM(acc);
    }
#endif
    float dot = 0.0f;
    for (int64_t j = 0; j < head_dim; j++) dot = fmaf(q[j], k[j], dot);
    return dot;
}

/* out[h] = sum_i p[h n + i] v_i for each of the group's heads, over the rows at cache + offsets[i]:
 * one pass over the rows, the sums in registers until the end where they fit */
static inline __attribute__((always_inline)) void weighted_rows(const float *restrict p, const int64_t *offsets,
                                                                int64_t n, const float *cache, int64_t group,
                                                                const int64_t head_dim, float *restrict out) {
#ifdef VF_N
    enum { MAXACC = 16 };
    const int nv = (int)(head_dim / VF_N);
    if (head_dim % VF_N == 0 && group * nv <= MAXACC) {
        vf acc[MAXACC];
        for (int a = 0; a < group * nv; a++) acc[a] = VF_ZERO();
        for (int64_t i = 0; i < n; i++) {
            const float *v = cache + offsets[i];
            if (i + AHEAD < n) prefetch_row(cache + offsets[i + AHEAD], head_dim);
            for (int j = 0; j < nv; j++) {
                const vf row = VF_LOAD(v + j * VF_N);
                for (int64_t h = 0; h < group; h++) acc[h * nv + j] = VF_FMA(VF_SET1(p[h * n + i]), row, acc[h * nv + j]);
            }
        }
        for (int64_t h = 0; h < group; h++)
            for (int j = 0; j < nv; j++) VF_STORE(out + h * head_dim + j * VF_N, acc[h * nv + j]);
        return;
    }
#endif
    for (int64_t h = 0; h < group; h++)
        for (int64_t j = 0; j < head_dim; j++) out[h * head_dim + j] = 0.0f;
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < group; h++)
            for (int64_t j = 0; j < head_dim; j++)
                out[h * head_dim + j] = fmaf(p[h * n + i], cache[offsets[i] + j], out[h * head_dim + j]);
}

/* attention of one KV head's query heads (group of them, at qg) over keys first..len-1 through a
 * block table (blocks wholly before first are not read), into orow; each score scaled, then
 * capped to softcap * tanh(score / softcap) when softcap > 0. scratch: group * n scores, then n
 * offsets (int64, 8-byte aligned) of the keys' rows in the pool (the same for K and V); head_dim is a constant
 * where the caller can make it one. One fixed order per row: a row's result does not depend on
 * the rows beside it. */
static inline __attribute__((always_inline)) void attend_group(
    const float *restrict qg, const int32_t *table, int64_t first, int64_t len, uint64_t extra, const float *k_cache,
    const float *v_cache, int64_t block_size, int64_t kv_size, int64_t head_offset, int64_t group,
    const int64_t head_dim, float scale, float softcap, float *restrict orow, float *restrict scratch) {
    const int64_t n = len - first + __builtin_popcountll(extra);
    /* the offsets start on the next 8-byte boundary after the scores (one float of slack) */
    int64_t *offsets = (int64_t *)(((uintptr_t)(scratch + group * n) + 7) & ~(uintptr_t)7);
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    int64_t i = 0;
    if ((block_size & (block_size - 1)) == 0) /* a power of two, as block sizes are: no division */
        for (int64_t pos = first; pos < len; pos++, i++)
            offsets[i] = ((int64_t)table[pos >> shift] * block_size + (pos & (block_size - 1))) * kv_size + head_offset;
    else
        for (int64_t pos = first; pos < len; pos++, i++)
            offsets[i] = ((int64_t)table[pos / block_size] * block_size + pos % block_size) * kv_size + head_offset;
    for (uint64_t bits = extra; bits; bits &= bits - 1, i++) { /* a tree row's ancestors, in position order */
        const int64_t pos = len + __builtin_ctzll(bits);
        offsets[i] = ((int64_t)table[pos / block_size] * block_size + pos % block_size) * kv_size + head_offset;
    }
    for (int64_t i = 0; i < n; i++) {
        const float *key = k_cache + offsets[i];
        if (i + AHEAD < n) prefetch_row(k_cache + offsets[i + AHEAD], head_dim);
        for (int64_t h = 0; h < group; h++) {
            float s = dot_head(qg + h * head_dim, key, head_dim) * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            scratch[h * n + i] = s;
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *sc = scratch + h * n, mx = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t k = 0; k < n; k++) mx = sc[k] > mx ? sc[k] : mx;
#pragma omp simd reduction(+ : total)
        for (int64_t k = 0; k < n; k++) {
            float e = exp_nonpositive(sc[k] - mx);
            sc[k] = e;
            total += e;
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t k = 0; k < n; k++) sc[k] *= inv;
    }
    weighted_rows(scratch, offsets, n, v_cache, group, head_dim, orow);
}

/* the first key row r reads in a layer of this window (0: none): its window's, which ends at its
 * keys' end or at its window_ends entry (folio_rows) */
static inline int64_t window_first(const folio_rows *rows, int64_t r, int64_t window) {
    const int64_t end = rows->window_ends ? rows->window_ends[r] : rows->lens[r];
    return window > 0 && end > window ? end - window : 0;
}

/* One query row per entry: row r is token tok[r] of q [*, num_heads, head_dim] and sees keys
 * 0..lens[r]-1 of its sequence seq[r], or with a window > 0 only its last window of them (the
 * table's entries for blocks wholly before are not read), then its extra keys (folio_rows). out [*, num_heads, head_dim] gets
 * softmax(cap(q . k * scale)) . v for each head (GQA: num_heads / num_kv_heads query heads read
 * each KV head; cap(s) = softcap * tanh(s / softcap) when softcap > 0, else s). scratch:
 * folio_attention_scratch(num_heads / num_kv_heads, max(lens)) floats. KV heads g0 .. g1 of row r. */
static void attend_row(const folio_rows *rows, int64_t r, const float *q, int64_t num_heads, const folio_kv *kv,
                       float scale, int64_t window, float softcap, float *out, float *scratch, int64_t g0, int64_t g1) {
    const int64_t head_dim = kv->head_dim, group = num_heads / kv->num_kv_heads, kv_size = kv->num_kv_heads * head_dim;
    const int32_t *table = rows->block_tables + rows->seq[r] * rows->max_blocks;
    const float *qr = q + rows->tok[r] * num_heads * head_dim;
    float *orow = out + rows->tok[r] * num_heads * head_dim;
    const int64_t len = rows->lens[r], first = window_first(rows, r, window);
    const uint64_t extra = rows->extra ? rows->extra[r] : 0;
    for (int64_t g = g0; g < g1; g++) {
        const float *qg = qr + g * group * head_dim;
        float *og = orow + g * group * head_dim;
        if (head_dim == 64)
            attend_group(qg, table, first, len, extra, kv->k, kv->v, kv->block_size, kv_size, g * 64, group, 64, scale,
                         softcap, og, scratch);
        else if (head_dim == 128)
            attend_group(qg, table, first, len, extra, kv->k, kv->v, kv->block_size, kv_size, g * 128, group, 128,
                         scale, softcap, og, scratch);
        else
            attend_group(qg, table, first, len, extra, kv->k, kv->v, kv->block_size, kv_size, g * head_dim, group,
                         head_dim, scale, softcap, og, scratch);
    }
}

/* every row's token inside the step, its sequence inside the tables, its keys inside its table
 * and each block it reads inside the pool; *max_len: the longest row */
int64_t folio_check_rows(const folio_rows *rows, int64_t num_tokens, const folio_kv *kv, int64_t window,
                         int64_t *max_len) {
    *max_len = 0;
    if (rows == NULL || rows->m < 0 || (rows->m > 0 && (rows->tok == NULL || rows->seq == NULL || rows->lens == NULL ||
                                                        rows->block_tables == NULL)))
        return folio_fail(FOLIO_EINVAL, "attention rows: missing arrays");
    for (int64_t r = 0; r < rows->m; r++) {
        const int64_t tok = rows->tok[r], seq = rows->seq[r], len = rows->lens[r];
        if (tok < 0 || tok >= num_tokens)
            return folio_fail(FOLIO_ERANGE, "row %lld: token %lld of %lld", (long long)r, (long long)tok, (long long)num_tokens);
        if (seq < 0 || seq >= rows->num_seqs)
            return folio_fail(FOLIO_ERANGE, "row %lld: sequence %lld of %lld", (long long)r, (long long)seq,
                              (long long)rows->num_seqs);
        const uint64_t extra = rows->extra ? rows->extra[r] : 0;
        /* the last key a row reads: its context's, or its highest ancestor's */
        const int64_t end = len < 0 || len > rows->max_blocks * kv->block_size ? -1
                            : extra ? len + 64 - __builtin_clzll(extra) : len;
        if (end < 1 || end > rows->max_blocks * kv->block_size)
            return folio_fail(FOLIO_ERANGE, "row %lld: keys up to %lld for a table of %lld blocks", (long long)r,
                              (long long)end, (long long)rows->max_blocks);
        if (extra && window > 0)
            return folio_fail(FOLIO_EINVAL, "row %lld: a tree row in a sliding-window layer", (long long)r);
        if (rows->window_ends && (rows->window_ends[r] < 1 || rows->window_ends[r] > len))
            return folio_fail(FOLIO_ERANGE, "row %lld: a window ending at %lld for %lld keys", (long long)r,
                              (long long)rows->window_ends[r], (long long)len);
        const int64_t first = window_first(rows, r, window);
        const int32_t *table = rows->block_tables + seq * rows->max_blocks;
        for (int64_t b = first / kv->block_size; b <= (end - 1) / kv->block_size; b++)
            if (table[b] < 0 || table[b] >= kv->num_blocks)
                return folio_fail(FOLIO_ERANGE, "row %lld: block %lld of the pool's %lld", (long long)r, (long long)table[b],
                                  (long long)kv->num_blocks);
        const int64_t keys = len + __builtin_popcountll(extra);
        if (keys > *max_len) *max_len = keys;
    }
    return FOLIO_OK;
}

typedef struct {
    const folio_rows *rows;
    const float *q;
    int64_t num_heads;
    const folio_kv *kv;
    float scale, softcap;
    int64_t window;
    float *out, *scratch;
    int64_t scratch_stride, max_slots;
    _Atomic int64_t next;
    _Atomic int64_t slots;
} attention_task;

/* (row, KV head) pairs, each whole on one thread, so the bits do not depend on the split */
static void attention_part(void *p) {
    attention_task *a = p;
    const int64_t units = a->rows->m * a->kv->num_kv_heads;
    const int64_t slot = atomic_fetch_add(&a->slots, 1); /* this thread's scratch */
    if (slot >= a->max_slots) return;                     /* more threads came than scratch was made for */
    float *scratch = a->scratch + slot * a->scratch_stride;
    for (;;) {
        const int64_t u = atomic_fetch_add(&a->next, 1);
        if (u >= units) return;
        const int64_t r = u / a->kv->num_kv_heads, g = u % a->kv->num_kv_heads;
        attend_row(a->rows, r, a->q, a->num_heads, a->kv, a->scale, a->window, a->softcap, a->out, scratch, g, g + 1);
    }
}

/* the attention of checked rows, shared among `threads` threads (the caller's among them) when it
 * reads enough keys to pay for them */
void folio_attend(const folio_rows *rows, const float *q, int64_t num_heads, const folio_kv *kv, float scale,
                  int64_t window, float softcap, float *out, float *scratch, int64_t scratch_stride, int64_t threads) {
    attention_task a = {rows, q, num_heads, kv, scale, softcap, window, out, scratch, scratch_stride, threads, 0, 0};
    int64_t total = 0;
    for (int64_t r = 0; r < rows->m; r++) total += rows->lens[r] + (rows->extra ? __builtin_popcountll(rows->extra[r]) : 0);
    /* below a few hundred keys in all a second thread costs more than it saves */
    folio_run_parallel(attention_part, &a, threads > 1 && total * kv->num_kv_heads >= 256);
}

int64_t folio_attention_scratch(int64_t group, int64_t max_len) { return (group + 2) * max_len + 2; }

int64_t folio_decode_attention(const folio_rows *rows, const float *q, int64_t num_tokens, int64_t num_heads,
                               const folio_kv *kv, float scale, int64_t window, float softcap, float *out,
                               float *scratch, int64_t scratch_stride, int64_t threads) {
    int64_t rc, max_len;
    if ((rc = folio_check_kv(kv))) return rc;
    if (q == NULL || out == NULL || scratch == NULL || num_heads <= 0 || num_heads % kv->num_kv_heads || threads < 1)
        return folio_fail(FOLIO_EINVAL, "attention: %lld heads over %lld KV heads", (long long)num_heads,
                          (long long)kv->num_kv_heads);
    if ((rc = folio_check_rows(rows, num_tokens, kv, window, &max_len))) return rc;
    if (scratch_stride < folio_attention_scratch(num_heads / kv->num_kv_heads, max_len))
        return folio_fail(FOLIO_EINVAL, "attention: scratch of %lld floats a thread, need %lld", (long long)scratch_stride,
                          (long long)folio_attention_scratch(num_heads / kv->num_kv_heads, max_len));
    folio_attend(rows, q, num_heads, kv, scale, window, softcap, out, scratch, scratch_stride, threads);
    return FOLIO_OK;
}
