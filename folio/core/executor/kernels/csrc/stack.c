/* A whole step's decoder layers in one call: for each layer the same kernels, with the same arguments
 * and dtypes, that the model's modules call one by one through cpu_backend.py (the norms, RoPE + KV
 * write, silu/gelu x gate and attention of layers.c, the quantized GEMMs of quant.c), so its result
 * is bit for bit theirs; what it saves is the Python between them. The stack and the step are
 * checked whole before the first kernel runs (every weight's parts, every pool, every position,
 * slot, row and block id); a bad one writes nothing. */

#define _GNU_SOURCE
#include <string.h>
#include <time.h>

#include "common.h"
#include "folio.h"

/* the work area: each buffer 64-byte aligned */
typedef struct {
    int64_t normed, qkv, q, attn, h, gate_up, act, down, scratch, total;
} work_layout;

static int64_t align64(int64_t v) { return (v + 63) & ~(int64_t)63; }

/* the part just run, when a profile is asked for: its time since *t0 */
static inline void lap(const folio_stack *s, int part, struct timespec *t0) {
    if (s->profile_ns == NULL) return;
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    s->profile_ns[part] += (t1.tv_sec - t0->tv_sec) * 1000000000L + (t1.tv_nsec - t0->tv_nsec);
    *t0 = t1;
}

static work_layout layout_of(const folio_stack *s, int64_t n, int64_t max_len) {
    const folio_layer *l0 = &s->layers[0];
    const int64_t act = s->act_bf16 ? 2 : 4, q_size = s->num_heads * s->head_dim;
    const int64_t group = s->num_heads / l0->kv.num_kv_heads;
    work_layout w;
    int64_t at = 0;
    w.normed = at, at += align64(n * s->hidden * act);
    w.qkv = at, at += align64(n * l0->qkv.n * act);
    w.q = at, at += align64(n * q_size * 4);
    w.attn = at, at += align64(n * q_size * 4);
    w.h = at, at += align64(n * s->hidden * 4);
    w.gate_up = at, at += align64(n * 2 * s->intermediate * act);
    w.act = at, at += align64(n * s->intermediate * act);
    w.down = at, at += align64(n * s->hidden * act);
    w.scratch = at, at += align64(s->threads * folio_attention_scratch(group, max_len) * 4);
    w.total = at + 64; /* the caller's area need not be aligned */
    return w;
}

static int64_t check_shape(const folio_weight *w, int64_t n, int64_t k, int64_t layer, const char *name) {
    const int64_t rc = folio_check_weight(w);
    if (rc) return rc;
    if (w->n != n || w->k != k)
        return folio_fail(FOLIO_EINVAL, "layer %lld %s: %lld x %lld, want %lld x %lld", (long long)layer, name,
                          (long long)w->n, (long long)w->k, (long long)n, (long long)k);
    return FOLIO_OK;
}

static int64_t check_stack(const folio_stack *s) {
    if (s == NULL || s->layers == NULL || s->num_layers < 1 || s->hidden <= 0 || s->num_heads <= 0 ||
        s->head_dim <= 0 || s->intermediate <= 0 || s->first_norm == NULL || s->cos_table == NULL ||
        s->sin_table == NULL || s->rope_len <= 0 || (s->passes != 1 && s->passes != 2) || s->threads < 1)
        return folio_fail(FOLIO_EINVAL, "stack: bad dimensions or tables");
    const folio_layer *l0 = &s->layers[0];
    const int64_t q_size = s->num_heads * s->head_dim;
    for (int64_t i = 0; i < s->num_layers; i++) {
        const folio_layer *l = &s->layers[i];
        int64_t rc;
        if ((rc = folio_check_kv(&l->kv))) return rc;
        if (l->kv.head_dim != s->head_dim || l->kv.num_kv_heads != l0->kv.num_kv_heads || s->num_heads % l->kv.num_kv_heads ||
            l->kv.num_blocks != l0->kv.num_blocks || l->kv.block_size != l0->kv.block_size)
            return folio_fail(FOLIO_EINVAL, "layer %lld: its pool's shape differs", (long long)i);
        const int64_t kv_size = l->kv.num_kv_heads * s->head_dim;
        if ((rc = check_shape(&l->qkv, q_size + 2 * kv_size, s->hidden, i, "qkv")) ||
            (rc = check_shape(&l->o, s->hidden, q_size, i, "o")) ||
            (rc = check_shape(&l->gate_up, 2 * s->intermediate, s->hidden, i, "gate_up")) ||
            (rc = check_shape(&l->down, s->hidden, s->intermediate, i, "down")))
            return rc;
        if (l->post_norm == NULL || l->next_norm == NULL) return folio_fail(FOLIO_EINVAL, "layer %lld: no norm", (long long)i);
    }
    return FOLIO_OK;
}

int64_t folio_stack_work_bytes(const folio_stack *s, int64_t n, int64_t max_len) {
    const int64_t rc = check_stack(s);
    return rc ? rc : layout_of(s, n, max_len).total;
}

static int64_t gemm(const folio_weight *w, int64_t n, void *x, int64_t x_dtype, void *y, int64_t y_dtype,
                    const folio_stack *s) {
    folio_matrix in = {x, n, w->k, w->k, x_dtype}, out = {y, n, w->n, w->n, y_dtype};
    return folio_gemm(w, &in, &out, s->passes, 0);
}

int64_t folio_decode_stack(const folio_stack *s, const folio_step *step) {
    int64_t rc, max_len;
    if ((rc = check_stack(s))) return rc;
    if (step == NULL || step->n < 0 || step->residual == NULL || step->out == NULL || step->work == NULL)
        return folio_fail(FOLIO_EINVAL, "step: missing buffers");
    const folio_kv *kv0 = &s->layers[0].kv;
    if ((rc = folio_check_tokens(step->n, step->positions, s->rope_len, step->slots, kv0))) return rc;
    if ((rc = folio_check_rows(&step->rows, step->n, kv0, 0, &max_len))) return rc;
    for (int64_t i = 0; step->rows.extra && i < s->num_layers; i++)
        for (int64_t r = 0; s->layers[i].window > 0 && r < step->rows.m; r++)
            if (step->rows.extra[r])
                return folio_fail(FOLIO_EINVAL, "step: tree rows and layer %lld's sliding window", (long long)i);
    if (step->rows.m != step->n) return folio_fail(FOLIO_EINVAL, "step: %lld rows for %lld tokens", (long long)step->rows.m,
                                                   (long long)step->n);
    const work_layout w = layout_of(s, step->n, max_len);
    if (step->work_bytes < w.total)
        return folio_fail(FOLIO_EINVAL, "step: %lld bytes of work area, need %lld", (long long)step->work_bytes, (long long)w.total);
    const int64_t n = step->n, hidden = s->hidden, inter = s->intermediate;
    const int64_t ab = s->act_bf16 ? FOLIO_BF16 : FOLIO_F32;
    const int64_t stride = folio_attention_scratch(s->num_heads / kv0->num_kv_heads, max_len);
    char *base = (char *)(((uintptr_t)step->work + 63) & ~(uintptr_t)63);
    void *normed = base + w.normed, *qkv = base + w.qkv, *gate_up = base + w.gate_up, *act = base + w.act,
         *down = base + w.down;
    float *q = (float *)(base + w.q), *attn = (float *)(base + w.attn), *h = (float *)(base + w.h),
          *scratch = (float *)(base + w.scratch);
    float *residual = step->residual;
    /* every size was checked above: the calls below cannot fail but for memory */
    struct timespec t0;
    if (s->profile_ns) clock_gettime(CLOCK_MONOTONIC, &t0);
    folio_add_rms_norm(n, hidden, NULL, 0, 0, residual, hidden, s->first_norm, s->eps, normed, hidden, ab);
    lap(s, FOLIO_P_NORMS, &t0);
    for (int64_t i = 0; i < s->num_layers; i++) {
        const folio_layer *l = &s->layers[i];
        if ((rc = gemm(&l->qkv, n, normed, ab, qkv, ab, s))) return rc;
        lap(s, FOLIO_P_QKV, &t0);
        folio_rope_write_kv(n, qkv, l->qkv.n, ab, step->positions, s->cos_table, s->sin_table, s->rope_len,
                            step->slots, s->num_heads, &l->kv, q);
        lap(s, FOLIO_P_ROPE, &t0);
        folio_attend(&step->rows, q, s->num_heads, &l->kv, s->scale, l->window, s->softcap, attn, scratch, stride,
                     s->threads);
        lap(s, FOLIO_P_ATTENTION, &t0);
        if ((rc = gemm(&l->o, n, attn, FOLIO_F32, h, FOLIO_F32, s))) return rc;
        lap(s, FOLIO_P_O, &t0);
        folio_add_rms_norm(n, hidden, h, hidden, FOLIO_F32, residual, hidden, l->post_norm, s->eps, normed, hidden, ab);
        lap(s, FOLIO_P_NORMS, &t0);
        if ((rc = gemm(&l->gate_up, n, normed, ab, gate_up, ab, s))) return rc;
        lap(s, FOLIO_P_GATE_UP, &t0);
        if (l->gelu)
            folio_gelu_tanh_and_mul(n, inter, gate_up, 2 * inter, ab, act, inter, ab);
        else
            folio_silu_and_mul(n, inter, gate_up, 2 * inter, ab, act, inter, ab);
        lap(s, FOLIO_P_ACT, &t0);
        if ((rc = gemm(&l->down, n, act, ab, down, ab, s))) return rc;
        lap(s, FOLIO_P_DOWN, &t0);
        const int last = i == s->num_layers - 1;
        folio_add_rms_norm(n, hidden, down, hidden, ab, residual, hidden, l->next_norm, s->eps,
                           last ? (void *)step->out : normed, hidden, last ? FOLIO_F32 : ab);
        if (step->taps && step->taps[i]) memcpy(step->taps[i], residual, (size_t)(n * hidden) * sizeof(float));
        lap(s, FOLIO_P_NORMS, &t0);
    }
    return FOLIO_OK;
}
