/* A whole decode step's decoder layers in one call: for each layer the same kernels, with the same
 * arguments and dtypes, that the model's modules call one by one through cpu_backend.py (the norms,
 * RoPE + KV write, silu/gelu x gate and attention of layers.c, the quantized GEMMs of qgemm.c), so
 * its result is bit for bit theirs; what it saves is the Python between them (about a millisecond
 * a token on SmolLM2's 30 layers, as much as the GEMMs' own time at batch 1).
 *
 * cpu_backend.py's DecodeStack takes it when every token of the step is attended row by row (decode,
 * or any step of a batch-invariant backend) and the model's layers are plain (pre-norm, dense
 * gated MLP, quantized projections with folio's kernels, no bias, q/k norm, LoRA or sharding).
 * The attention of a step is shared among the GEMMs' threads by (row, KV head): each pair whole on
 * one thread, so the bits do not depend on the split.
 */

#include <stdatomic.h>
#include <string.h>

#include "common.h"

void folio_add_rms_norm(int64_t n, int64_t d, const void *x, int64_t xs, int x_bf16, float *residual, int64_t rs,
                        const float *weight, float eps, void *out, int64_t os, int out_bf16);
void folio_rope_write_kv(int64_t n, const void *qkv, int64_t qs, int qkv_bf16, const int64_t *positions,
                         const float *cos_table, const float *sin_table, const int64_t *slots, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, float *q_out, float *k_cache, float *v_cache);
void folio_silu_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int in_bf16, void *out, int64_t os,
                        int out_bf16);
void folio_gelu_tanh_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int in_bf16, void *out,
                             int64_t os, int out_bf16);
void folio_decode_attention_heads(int64_t m, const int64_t *tok, const int64_t *seq, const float *q,
                                  const int32_t *block_tables, int64_t bt_stride, const int64_t *lens,
                                  const float *k_cache, const float *v_cache, int64_t block_size, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float softcap,
                                  float *out, float *scratch, int64_t g0, int64_t g1);
int64_t folio_qgemm(int64_t kind, int64_t m, int64_t n, int64_t k, const void *x, int64_t ldx, int64_t x_bf16,
                    const uint8_t *w, void *y, int64_t ldy, int64_t y_bf16, int64_t threads, int64_t passes);

#define LAYER_PASSES 2 /* the projections' activations in two int8 passes, as QuantLinear asks (cpu_gemm.py) */

/* a layer's entries in the int64 table (cpu_backend.DecodeStack writes it) */
enum {
    L_QKV, L_QKV_KIND, L_O, L_O_KIND, L_GATE_UP, L_GATE_UP_KIND, L_DOWN, L_DOWN_KIND, /* packed weights */
    L_POST_NORM,      /* post_attention_layernorm's weight */
    L_NEXT_NORM,      /* the next layer's input norm, or the final norm */
    L_K_CACHE, L_V_CACHE, L_WINDOW, L_GELU,
    L_FIELDS
};

typedef struct {
    int64_t m, num_tokens, bt_stride, block_size, num_heads, num_kv_heads, head_dim, window, scratch_stride;
    const int64_t *tok, *seq, *lens;
    const int32_t *block_tables;
    const float *q, *k_cache, *v_cache;
    float scale, softcap;
    float *out, *scratch;
    _Atomic int64_t next;
    _Atomic int slots;
    int max_slots;
} attention_task;

static void attention_part(void *p) {
    attention_task *a = (attention_task *)p;
    const int64_t units = a->m * a->num_kv_heads;
    const int slot = atomic_fetch_add(&a->slots, 1); /* this thread's scratch */
    if (slot >= a->max_slots) return;                 /* more threads came than scratch was made for */
    float *scratch = a->scratch + slot * a->scratch_stride;
    for (;;) { /* unit: (row, KV head), whole on one thread */
        const int64_t u = atomic_fetch_add(&a->next, 1);
        if (u >= units) return;
        const int64_t r = u / a->num_kv_heads, g = u % a->num_kv_heads;
        folio_decode_attention_heads(1, a->tok + r, a->seq + r, a->q, a->block_tables, a->bt_stride, a->lens + r,
                                     a->k_cache, a->v_cache, a->block_size, a->num_heads, a->num_kv_heads, a->head_dim,
                                     a->scale, a->window, a->softcap, a->out, scratch, g, g + 1);
    }
}

/* dims: hidden, q_size, kv_size, intermediate, num_heads, num_kv_heads, head_dim, block_size, bt_stride,
 * threads (for the attention), scratch_stride (floats per thread), activations bf16 (1) or fp32 (0);
 * bufs: normed ([n, hidden]), qkv, q (fp32 [n, q_size]), attn (fp32 [n, q_size]), h (fp32 [n, hidden]),
 * gate_up ([n, 2 inter]), act ([n, inter]), down ([n, hidden]), in the activations' dtype but q, attn, h;
 * scratch (fp32, threads * scratch_stride);
 * residual [n, hidden] fp32 holds the embeddings and is updated in place; the last layer's
 * normed output (the final norm, fp32) goes to out [n, hidden]. The first layer's input norm is
 * first_norm. taps (NULL, or one pointer per layer, NULL where not wanted): the residual after that
 * layer is copied there ([n, hidden] fp32), for a draft head that reads the target's hidden states. */
void folio_decode_stack(int64_t num_layers, const int64_t *layers, const int64_t *dims, float eps, float scale,
                        float softcap, int64_t n, float *residual, const float *first_norm, const int64_t *positions,
                        const float *cos_table, const float *sin_table, const int64_t *slots, int64_t m,
                        const int64_t *tok, const int64_t *seq, const int64_t *lens, const int32_t *block_tables,
                        void *const *bufs, float *out, float *const *taps) {
    const int64_t hidden = dims[0], q_size = dims[1], kv_size = dims[2], inter = dims[3];
    const int64_t num_heads = dims[4], num_kv_heads = dims[5], head_dim = dims[6], block_size = dims[7];
    const int64_t bt_stride = dims[8], threads = dims[9], scratch_stride = dims[10];
    const int ab = (int)dims[11]; /* the activations between the operations: bf16 (1) or fp32 (0) */
    const int64_t qkv_size = q_size + 2 * kv_size;
    void *normed = bufs[0], *qkv = bufs[1], *gate_up = bufs[5], *act = bufs[6], *down = bufs[7];
    float *q = bufs[2], *attn = bufs[3], *h = bufs[4], *scratch = bufs[8];
    folio_add_rms_norm(n, hidden, NULL, 0, 0, residual, hidden, first_norm, eps, normed, hidden, ab);
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *L = layers + i * L_FIELDS;
        folio_qgemm(L[L_QKV_KIND], n, qkv_size, hidden, normed, hidden, ab, (const uint8_t *)L[L_QKV], qkv, qkv_size,
                    ab, 0, LAYER_PASSES);
        float *k_cache = (float *)L[L_K_CACHE], *v_cache = (float *)L[L_V_CACHE];
        folio_rope_write_kv(n, qkv, qkv_size, ab, positions, cos_table, sin_table, slots, num_heads, num_kv_heads,
                            head_dim, q, k_cache, v_cache);
        attention_task at = {m, n, bt_stride, block_size, num_heads, num_kv_heads, head_dim, L[L_WINDOW],
                             scratch_stride, tok, seq, lens, block_tables, q, k_cache, v_cache, scale, softcap,
                             attn, scratch, 0, 0, (int)threads};
        int64_t total = 0;
        for (int64_t r = 0; r < m; r++) total += lens[r];
        /* below ~a thousand keys per head a second thread costs more than the attention */
        folio_run_parallel(attention_part, &at, threads > 1 && total * num_kv_heads >= 4096);
        folio_qgemm(L[L_O_KIND], n, hidden, q_size, attn, q_size, 0, (const uint8_t *)L[L_O], h, hidden, 0, 0,
                    LAYER_PASSES);
        folio_add_rms_norm(n, hidden, h, hidden, 0, residual, hidden, (const float *)L[L_POST_NORM], eps, normed,
                           hidden, ab);
        folio_qgemm(L[L_GATE_UP_KIND], n, 2 * inter, hidden, normed, hidden, ab, (const uint8_t *)L[L_GATE_UP],
                    gate_up, 2 * inter, ab, 0, LAYER_PASSES);
        if (L[L_GELU])
            folio_gelu_tanh_and_mul(n, inter, gate_up, 2 * inter, ab, act, inter, ab);
        else
            folio_silu_and_mul(n, inter, gate_up, 2 * inter, ab, act, inter, ab);
        folio_qgemm(L[L_DOWN_KIND], n, hidden, inter, act, inter, ab, (const uint8_t *)L[L_DOWN], down, hidden, ab, 0,
                    LAYER_PASSES);
        const int last = i == num_layers - 1;
        folio_add_rms_norm(n, hidden, down, hidden, ab, residual, hidden, (const float *)L[L_NEXT_NORM], eps,
                           last ? (void *)out : normed, hidden, last ? 0 : ab);
        if (taps && taps[i]) memcpy(taps[i], residual, (size_t)(n * hidden) * sizeof(float));
    }
}
