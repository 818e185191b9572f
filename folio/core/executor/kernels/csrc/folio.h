/* The CPU kernels' one interface: every exported entry point, the structs they take and the error
 * codes they return. Every .c file of the library includes it; cpu_kernels.py declares the same
 * prototypes for ctypes once (a test reads this file and compares), and fills the structs by name.
 *
 * Checked entry points return FOLIO_OK (0) or a negative FOLIO_E* code; folio_error_message(code)
 * says what it means and folio_last_error() what was wrong (thread-local). Nothing is written when
 * a check fails. */

#ifndef FOLIO_H
#define FOLIO_H

#include <stdint.h>

/* ------------------------------------------------------------------------------ errors */
enum {
    FOLIO_OK = 0,
    FOLIO_EINVAL = -1,  /* a bad argument: a null pointer, a size that does not add up, an unknown type */
    FOLIO_ENOMEM = -2,  /* an allocation failed */
    FOLIO_ERANGE = -3,  /* an index (a slot, a position, a block id, a row) outside its table */
};
const char *folio_error_message(int64_t code);
const char *folio_last_error(void);

/* ------------------------------------------------------------------------------ weights */
/* Weight types: GGML's type ids (the tile layouts are in quant.c). */
enum {
    FOLIO_Q4_0 = 2, FOLIO_Q4_1 = 3, FOLIO_Q5_0 = 6, FOLIO_Q5_1 = 7, FOLIO_Q8_0 = 8,
    FOLIO_Q4_K = 12, FOLIO_Q5_K = 13, FOLIO_Q6_K = 14, FOLIO_IQ4_NL = 20, FOLIO_IQ4_XS = 23,
};
enum { FOLIO_F32 = 0, FOLIO_BF16 = 1 }; /* activation dtypes */
#define FOLIO_TILE 16                  /* output rows per tile */
#define FOLIO_MAX_PARTS 4

/* rows [row0, row0 + n) of a projection, in one type's tiles */
typedef struct {
    int64_t type, n, nbytes;
    const uint8_t *data;
} folio_part;

/* a projection y = x W^T: W [n, k] as up to FOLIO_MAX_PARTS parts stacked along n (q, k and v of
 * a fused projection may have types of their own) */
typedef struct {
    int64_t n, k, num_parts;
    folio_part parts[FOLIO_MAX_PARTS];
} folio_weight;

/* rows of activations: rows x cols in dtype, row stride stride (elements) */
typedef struct {
    void *data;
    int64_t rows, cols, stride, dtype;
} folio_matrix;

int64_t folio_unit(int64_t type);                  /* inputs per unit (32 or 256); 0 for an unknown type */
int64_t folio_unit_bytes(int64_t type);            /* bytes of one tile's unit */
int64_t folio_raw_unit_bytes(int64_t type);        /* bytes of one GGUF block of that many inputs */
int64_t folio_tiles_bytes(int64_t type, int64_t n, int64_t k);
int64_t folio_check_weight(const folio_weight *w); /* FOLIO_OK when its parts add up */
/* GGUF rows (raw [rows of raw_row_bytes]) -> tiles: tile row i is raw row order[i] (order NULL:
 * row i); rows past n are zero */
int64_t folio_repack(int64_t type, int64_t n, int64_t k, const uint8_t *raw, int64_t raw_row_bytes,
                     const int64_t *order, uint8_t *tiles, int64_t tiles_bytes);
/* rows rows[i] of tiles -> out [count, k] fp32, the values GGUF's dequantization gives */
int64_t folio_dequant_rows(int64_t type, int64_t n, int64_t k, const uint8_t *tiles, int64_t tiles_bytes,
                           const int64_t *rows, int64_t count, float *out);

/* y = x W^T for the rows of x (fp32 or bf16) into y (fp32 or bf16); activations quantized to int8
 * per row and block of 32 in `passes` passes (1, or 2: the value, then its rounding error);
 * threads 0: the pool's */
int64_t folio_gemm(const folio_weight *w, const folio_matrix *x, folio_matrix *y, int64_t passes, int64_t threads);
void folio_set_threads(int64_t n);
int64_t folio_threads(void);
const char *folio_gemm_path(void); /* "avx512-vnni", "avx2" or "c" */

/* ------------------------------------------------------------------------------ layer operations */
/* The KV pool of one layer, fp32 [num_blocks, block_size, num_kv_heads, head_dim]. */
typedef struct {
    float *k, *v;
    int64_t num_blocks, block_size, num_kv_heads, head_dim;
} folio_kv;

/* decode rows: row r is token tok[r] of the step and reads keys 0 .. lens[r] - 1 of sequence
 * seq[r], whose blocks are row seq[r] of block_tables [num_seqs, max_blocks]; where extra is not
 * NULL, also the key at position lens[r] + j for each bit j set in extra[r] (a tree draft's
 * ancestors: the root and the nodes on its path, laid out after the context; no window then);
 * where window_ends is not NULL, a sliding window ends at window_ends[r] <= lens[r] instead of
 * lens[r] (a row inside an image that its keys see whole: its own window, and its image's later
 * keys up to lens[r]) */
typedef struct {
    int64_t m;
    const int64_t *tok, *seq, *lens;
    const int32_t *block_tables;
    int64_t num_seqs, max_blocks;
    const uint64_t *extra;
    const int64_t *window_ends;
} folio_rows;

int64_t folio_add_rms_norm(int64_t n, int64_t d, const void *x, int64_t xs, int64_t x_bf16, float *residual,
                           int64_t rs, const float *weight, float eps, void *out, int64_t os, int64_t out_bf16);
int64_t folio_rope_write_kv(int64_t n, const void *qkv, int64_t qs, int64_t qkv_bf16, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t rope_len, const int64_t *slots,
                            int64_t num_heads, const folio_kv *kv, float *q_out);
int64_t folio_silu_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int64_t in_bf16, void *out,
                           int64_t os, int64_t out_bf16);
int64_t folio_gelu_tanh_and_mul(int64_t n, int64_t d, const void *gate_up, int64_t gs, int64_t in_bf16, void *out,
                                int64_t os, int64_t out_bf16);
/* floats of scratch one thread's attention needs: group query heads a KV head, max_len keys */
int64_t folio_attention_scratch(int64_t group, int64_t max_len);
/* out[tok[r]] = attention of q[tok[r]] (fp32 [*, num_heads, head_dim]) over its keys; num_tokens:
 * q's and out's rows; scratch: threads areas of scratch_stride floats */
int64_t folio_decode_attention(const folio_rows *rows, const float *q, int64_t num_tokens, int64_t num_heads,
                               const folio_kv *kv, float scale, int64_t window, float softcap, float *out,
                               float *scratch, int64_t scratch_stride, int64_t threads);

/* checks shared by the entry points above and the stack (FOLIO_OK or an error code) */
int64_t folio_check_kv(const folio_kv *kv);
int64_t folio_check_tokens(int64_t n, const int64_t *positions, int64_t rope_len, const int64_t *slots,
                           const folio_kv *kv);
int64_t folio_check_rows(const folio_rows *rows, int64_t num_tokens, const folio_kv *kv, int64_t window,
                         int64_t *max_len);
/* the attention of checked rows */
void folio_attend(const folio_rows *rows, const float *q, int64_t num_heads, const folio_kv *kv, float scale,
                  int64_t window, float softcap, float *out, float *scratch, int64_t scratch_stride, int64_t threads);

/* ------------------------------------------------------------------------------ the layer stack */
typedef struct {
    folio_weight qkv, o, gate_up, down;
    const float *post_norm; /* post_attention_layernorm's weight */
    const float *next_norm; /* the next layer's input norm, or the final norm */
    folio_kv kv;
    int64_t window, gelu;
} folio_layer;

typedef struct {
    int64_t num_layers;
    const folio_layer *layers;
    int64_t hidden, num_heads, head_dim, intermediate;
    float eps, scale, softcap;
    const float *first_norm;          /* the first layer's input norm */
    const float *cos_table, *sin_table; /* [rope_len, head_dim] */
    int64_t rope_len;
    int64_t act_bf16;                 /* the activations between the operations: bf16 (1) or fp32 (0) */
    int64_t passes, threads;
    int64_t *profile_ns;              /* NULL, or FOLIO_STACK_PARTS counters: each part's nanoseconds are added */
} folio_stack;

/* the parts of a layer, as profile_ns counts them */
enum { FOLIO_P_NORMS, FOLIO_P_QKV, FOLIO_P_ROPE, FOLIO_P_ATTENTION, FOLIO_P_O, FOLIO_P_GATE_UP, FOLIO_P_ACT,
       FOLIO_P_DOWN, FOLIO_STACK_PARTS };

/* one step: n tokens (positions, slots into the pool: -1 is padding), its decode rows; residual
 * [n, hidden] fp32 holds the embeddings and is updated in place; out [n, hidden] fp32 gets the
 * final norm's output; work: folio_stack_work_bytes() bytes; taps: NULL, or one [n, hidden] fp32
 * pointer per layer (NULL where not wanted) that gets the residual after that layer */
typedef struct {
    int64_t n;
    float *residual;
    const int64_t *positions, *slots;
    folio_rows rows;
    float *out;
    void *work;
    int64_t work_bytes;
    float *const *taps;
} folio_step;

int64_t folio_stack_work_bytes(const folio_stack *s, int64_t n, int64_t max_len);
int64_t folio_decode_stack(const folio_stack *s, const folio_step *step);

/* ------------------------------------------------------------------------------ sampling (sampler.c) */
/* The columns of a row of sampling parameters, in order: sampler_columns.COLUMNS on the Python side,
 * which builds the rows (column_values) and refuses a library whose folio_sampler_columns() differs.
 * A sampling parameter the kernel reads is one more entry here. */
#define FOLIO_SAMPLER_COLUMNS(X) \
    X(temperature)               \
    X(top_p)                     \
    X(min_p)                     \
    X(presence_penalty)          \
    X(frequency_penalty)         \
    X(repetition_penalty)        \
    X(top_k)

enum { /* COL_temperature, COL_top_p, ...: a column's index in a row */
#define FOLIO_COLUMN_INDEX(name) COL_##name,
    FOLIO_SAMPLER_COLUMNS(FOLIO_COLUMN_INDEX)
#undef FOLIO_COLUMN_INDEX
    FOLIO_NUM_COLUMNS
};

/* the column names, comma-separated, in index order */
const char *folio_sampler_columns(void);
int64_t folio_sample(int64_t m, int64_t vocab, const float *logits, int64_t ld, const int64_t *rows,
                     int64_t num_rows, const uint8_t *greedy, const float *params, int64_t params_ld, float *bias,
                     float *rep, int64_t rep_from_bias, int32_t *counts, int64_t pen_ld, const uint64_t *seeds,
                     const int64_t *positions, int64_t *out, float *scratch);
int64_t folio_record_penalties(int64_t n, int64_t vocab, int64_t num_rows, const int64_t *rows, const int64_t *tokens,
                               const float *frequency, const float *presence, const float *repetition,
                               int32_t *counts, float *bias, float *rep);
int64_t folio_philox_uniforms(int64_t n, const uint64_t *seeds, const int64_t *positions, int64_t first,
                              int64_t count, double *out);
int64_t folio_exp_nonpositive(int64_t n, const float *x, float *out);

/* ------------------------------------------------------------------------------ internal */
/* the pool (pool.c): fn(arg) on the caller's thread and, with_pool, on the workers that join while
 * it runs (fn claims its own units of work); returns when every thread is out of fn */
typedef void (*folio_task_fn)(void *arg);
void folio_run_parallel(folio_task_fn fn, void *arg, int with_pool);
int folio_fail(int code, const char *fmt, ...); /* records the message, returns code */

#endif
