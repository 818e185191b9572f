/* A decoder layer's small operations on the CPU, one call each for the whole step: residual add +
 * RMSNorm, RoPE + the KV write, SiLU or GELU(tanh) x gate, and decode attention over the paged
 * pool (with a sliding window and a logit soft-cap as parameters).
 *
 * Loaded by folio/core/executor/kernels/cpu_kernels.py with csrc/sampler.c; used by cpu_backend.py, where
 * the torch ops they replace (layer_ops.TorchLayerOps, attention.TorchAttentionBackend) stay the
 * reference. Each row (token) is computed on its own, in one order, whatever else is in the call:
 * a sequence's tokens do not depend on the batch it shares a step with. Activations are fp32 or
 * bf16 (flags per argument; bf16 is what the quantized linears read and write), the KV pool is
 * fp32 ([num_blocks, block_size, num_kv_heads, head_dim]), the arithmetic fp32.
 */

#include <pthread.h>

#include "common.h"

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
void folio_add_rms_norm(int64_t n, int64_t d, const void *x, int64_t xs, int x_bf16, float *residual, int64_t rs,
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
 * position (cos/sin tables [*, head_dim]), q into q_out [n, num_heads, head_dim], k and v into
 * their slots of the pool (a negative slot is padding: not written) */
void folio_rope_write_kv(int64_t n, const void *qkv, int64_t qs, int qkv_bf16, const int64_t *positions,
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
        if (in_bf16 && out_bf16) { /* the quantized layers' case, in a loop of its own that vectorises */
            const uint16_t *g = (const uint16_t *)gate_up + t * gs, *u = g + d;
            uint16_t *o = (uint16_t *)out + t * os;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                o[j] = float_to_bf16(gated(bf16_to_float(g[j]), bf16_to_float(u[j]), gelu));
        } else {
            for (int64_t j = 0; j < d; j++) {
                const float g = load(gate_up, t * gs + j, in_bf16), u = load(gate_up, t * gs + d + j, in_bf16);
                store(out, t * os + j, gated(g, u, gelu), out_bf16);
            }
        }
    }
}

/* silu(gate) * up (SwiGLU) */
void folio_silu_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int in_bf16, void *out, int64_t os,
                        int out_bf16) {
    gated_and_mul(n, d, gate_up, gs, in_bf16, out, os, out_bf16, 0);
}

/* gelu_tanh(gate) * up (GeGLU, Gemma's) */
void folio_gelu_tanh_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int in_bf16, void *out, int64_t os,
                             int out_bf16) {
    gated_and_mul(n, d, gate_up, gs, in_bf16, out, os, out_bf16, 1);
}

/* attention of one KV head's query heads (group of them, at qg) over keys first..len-1 through a
 * block table (blocks wholly before first are not read), into orow; each score scaled, then
 * capped to softcap * tanh(score / softcap) when softcap > 0; head_dim is a constant where the
 * caller can make it one */
static inline __attribute__((always_inline)) void attend_group(
    const float *restrict qg, const int32_t *table, int64_t first, int64_t len, const float *k_cache,
    const float *v_cache, int64_t block_size, int64_t kv_size, int64_t head_offset, int64_t group,
    const int64_t head_dim, float scale, float softcap, float *restrict orow, float *restrict scratch) {
    const int64_t n = len - first;
    /* scores: scratch[h * n + position - first] */
    for (int64_t b = first / block_size, start = b * block_size; start < len; start += block_size, b++) {
        const int64_t lo = start < first ? first - start : 0;
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *keys = k_cache + (int64_t)table[b] * block_size * kv_size + head_offset;
        for (int64_t o = lo; o < count; o++) {
            const float *key = keys + o * kv_size;
            for (int64_t h = 0; h < group; h++) {
                const float *qh = qg + h * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < head_dim; j++) dot += qh[j] * key[j];
                float s = dot * scale;
                if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                scratch[h * n + start + o - first] = s;
            }
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
        float *oh = orow + h * head_dim;
        for (int64_t j = 0; j < head_dim; j++) oh[j] = 0.0f;
    }
    for (int64_t b = first / block_size, start = b * block_size; start < len; start += block_size, b++) {
        const int64_t lo = start < first ? first - start : 0;
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *vals = v_cache + (int64_t)table[b] * block_size * kv_size + head_offset;
        for (int64_t o = lo; o < count; o++) {
            const float *val = vals + o * kv_size;
            for (int64_t h = 0; h < group; h++) {
                const float p = scratch[h * n + start + o - first];
                float *oh = orow + h * head_dim;
#pragma omp simd
                for (int64_t j = 0; j < head_dim; j++) oh[j] += p * val[j];
            }
        }
    }
}

/* One query row per entry: row r is token tok[r] of q [*, num_heads, head_dim] and sees keys
 * 0..lens[r]-1 of its sequence seq[r] (block table block_tables + seq[r] * bt_stride), or with a
 * window > 0 only its last window of them (lens[r] - window .. lens[r] - 1: the table's entries
 * for blocks wholly before are not read). out [*, num_heads, head_dim] gets softmax(cap(q . k *
 * scale)) . v for each head (GQA: num_heads / num_kv_heads query heads read each KV head; cap(s)
 * = softcap * tanh(s / softcap) when softcap > 0, else s). scratch: (num_heads / num_kv_heads) *
 * max(lens) floats. */
/* KV heads g0 .. g1 of each row (the stack in stack.c shares (row, head) pairs among threads) */
void folio_decode_attention_heads(int64_t m, const int64_t *tok, const int64_t *seq, const float *q,
                                  const int32_t *block_tables, int64_t bt_stride, const int64_t *lens,
                                  const float *k_cache, const float *v_cache, int64_t block_size, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float softcap,
                                  float *out, float *scratch, int64_t g0, int64_t g1) {
    const int64_t group = num_heads / num_kv_heads, kv_size = num_kv_heads * head_dim;
    for (int64_t r = 0; r < m; r++) {
        const int32_t *table = block_tables + seq[r] * bt_stride;
        const float *qr = q + tok[r] * num_heads * head_dim;
        float *orow = out + tok[r] * num_heads * head_dim;
        const int64_t len = lens[r], first = window > 0 && len > window ? len - window : 0;
        for (int64_t g = g0; g < g1; g++) {
            const float *qg = qr + g * group * head_dim;
            float *og = orow + g * group * head_dim;
            if (head_dim == 64)
                attend_group(qg, table, first, len, k_cache, v_cache, block_size, kv_size, g * 64, group, 64, scale,
                             softcap, og, scratch);
            else if (head_dim == 128)
                attend_group(qg, table, first, len, k_cache, v_cache, block_size, kv_size, g * 128, group, 128, scale,
                             softcap, og, scratch);
            else
                attend_group(qg, table, first, len, k_cache, v_cache, block_size, kv_size, g * head_dim, group,
                             head_dim, scale, softcap, og, scratch);
        }
    }
}

void folio_decode_attention(int64_t m, const int64_t *tok, const int64_t *seq, const float *q,
                            const int32_t *block_tables, int64_t bt_stride, const int64_t *lens, const float *k_cache,
                            const float *v_cache, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, float scale, int64_t window, float softcap, float *out, float *scratch) {
    folio_decode_attention_heads(m, tok, seq, q, block_tables, bt_stride, lens, k_cache, v_cache, block_size,
                                 num_heads, num_kv_heads, head_dim, scale, window, softcap, out, scratch, 0,
                                 num_kv_heads);
}

/* folio_decode_attention's rows shared by num_threads threads (the caller's among them), split where
 * the keys read (the rows' lens) are halved, thirded...: each row is still computed whole by one
 * thread, in the same order, so the result is bit for bit the single-threaded one. scratch holds
 * num_threads areas of scratch_stride floats (what one thread needs). */
typedef struct {
    int64_t m;
    const int64_t *tok, *seq, *lens;
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t bt_stride, block_size, num_heads, num_kv_heads, head_dim, window;
    float scale, softcap;
    float *out, *scratch;
} attention_rows;

static void *attend_rows(void *arg) {
    const attention_rows *a = arg;
    folio_decode_attention(a->m, a->tok, a->seq, a->q, a->block_tables, a->bt_stride, a->lens, a->k_cache, a->v_cache,
                           a->block_size, a->num_heads, a->num_kv_heads, a->head_dim, a->scale, a->window, a->softcap,
                           a->out, a->scratch);
    return NULL;
}

void folio_decode_attention_threads(int64_t num_threads, int64_t scratch_stride, int64_t m, const int64_t *tok,
                                    const int64_t *seq, const float *q, const int32_t *block_tables, int64_t bt_stride,
                                    const int64_t *lens, const float *k_cache, const float *v_cache,
                                    int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    float scale, int64_t window, float softcap, float *out, float *scratch) {
    enum { MAX_THREADS = 16 };
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > m) num_threads = m;
    int64_t total = 0;
    for (int64_t r = 0; r < m; r++) total += lens[r];
    attention_rows parts[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t r = 0, seen = 0;
    for (int64_t t = 0; t < num_threads; t++) {
        const int64_t r0 = r, goal = total * (t + 1) / num_threads;
        while (r < m && (t == num_threads - 1 || seen + lens[r] <= goal || r == r0)) seen += lens[r++];
        parts[t] = (attention_rows){r - r0, tok + r0, seq + r0, lens + r0, q, k_cache, v_cache, block_tables,
                                    bt_stride, block_size, num_heads, num_kv_heads, head_dim, window, scale, softcap,
                                    out, scratch + t * scratch_stride};
    }
    for (int64_t t = 1; t < num_threads; t++)
        started[t] = parts[t].m > 0 && pthread_create(&threads[t], NULL, attend_rows, &parts[t]) == 0;
    attend_rows(&parts[0]);
    for (int64_t t = 1; t < num_threads; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else if (parts[t].m > 0)
            attend_rows(&parts[t]); /* no thread to be had: the caller takes the part */
    }
}
