/* The CPU sampler's one pass per row: penalties, temperature, min-p, top-k, top-p and the draw.
 *
 * Loaded by folio/core/executor/kernels/cpu_kernels.py (compiled there with the machine's C compiler,
 * -O3 -march=native -mprefer-vector-width=512 -fopenmp-simd -ffp-contract=off -fno-math-errno
 * -fno-trapping-math; no OpenMP runtime, one thread). The torch path in sampler.py is the
 * reference; this file draws from the same distribution with fewer passes over each row and none
 * of torch's fixed cost per operation.
 *
 * Per row r of a [m, vocab] fp32 array with row stride ld, whose parameters and penalty state
 * are row rows[r] of their tables (the runner's persistent batch; or row r of per-call arrays):
 *   l      = the row, with the repetition penalty (positive logits divided by rep, negative ones
 *            multiplied: bitwise the torch path's; rows that draw multiply by 1 / rep instead)
 *            and the additive penalties (+ bias) applied;
 *   greedy = the first index of max(l) (as numpy's and torch's argmax), found in the first block
 *            of BLOCK tokens whose maximum it is;
 *   else w = exp(l / T - max(l / T)), the best token's weight 1; min-p keeps w >= min_p; top-k
 *            keeps w >= the k-th largest weight (found by a quickselect on a copy: ties at the
 *            cut stay, as in the torch path);
 *   top-p by rejection (FlashInfer's sorting-free scheme): draw x from the candidates in
 *   proportion to w; accept when the weight of the tokens strictly above w[x] is below
 *   top_p * (the weight min-p and top-k kept); otherwise the candidates become the tokens strictly
 *   above w[x] and draw again. The nucleus (tokens with less than top_p of the mass strictly above
 *   them) is an upper set of the weights, so every candidate set holds it and the accepted draw is
 *   distributed as w restricted to it; each rejection shrinks the candidates, so it ends.
 * Uniforms: draw d (0 for the first, d for the d-th redraw) of row r is philox_uniform(seeds[r],
 * positions[r], d): Philox4x32-10 (Salmon et al. 2011, Random123's constants) keyed by the 64-bit
 * seed, counter (d, position low, position high, 0); the first two output words make a 53-bit
 * uniform in (0, 1]. The torch implementation (sampling/philox.py) and cuda/sampler.cu compute the
 * same bits. A row's token thus depends on its logits, parameters, penalties, seed and position
 * alone, never on the other rows of the call.
 * With a penalty state to record into, each drawn token is counted there in the same call.
 */

#include "common.h"
#include "folio.h"

/* the column names of FOLIO_SAMPLER_COLUMNS (folio.h), comma-separated, in index order */
const char *folio_sampler_columns(void) {
#define FOLIO_COLUMN_NAME(name) #name ","
    static const char names[] = FOLIO_SAMPLER_COLUMNS(FOLIO_COLUMN_NAME);
#undef FOLIO_COLUMN_NAME
    return names;
}

#define BLOCK 64 /* tokens per block: the inverse-CDF walk sums whole blocks, then searches one;
                  * greedy rows find their maximum by its block */

/* Philox4x32-10 of counter c under key (k0, k1), in place */
static inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        const uint32_t c1 = c[1], c3 = c[3];
        c[0] = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c[1] = (uint32_t)p1;
        c[2] = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c[3] = (uint32_t)p0;
    }
}

/* the uniform in (0, 1] of draw `draw` at output position `position` under `seed` */
static inline double philox_uniform(uint64_t seed, int64_t position, uint32_t draw) {
    uint32_t c[4] = {draw, (uint32_t)(uint64_t)position, (uint32_t)((uint64_t)position >> 32), 0u};
    philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    const uint64_t bits = ((uint64_t)c[0] << 21) | (c[1] >> 11);
    return (double)(bits + 1) * (1.0 / 9007199254740992.0);
}

/* the k-th largest of w[0..n) (1 <= k <= n), by a three-way quickselect on the copy tmp */
static float kth_largest(const float *w, int64_t n, int64_t k, float *tmp) {
    memcpy(tmp, w, (size_t)n * sizeof *tmp);
    int64_t lo = 0, hi = n - 1;
    const int64_t target = k - 1; /* its index in descending order */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float a = tmp[lo], b = tmp[mid], c = tmp[hi]; /* the median of three as the pivot */
        const float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t lt = lo, i = lo, gt = hi; /* [lo, lt) > pivot, [lt, i) == pivot, (gt, hi] < pivot */
        while (i <= gt) {
            const float x = tmp[i];
            if (x > pivot) {
                tmp[i++] = tmp[lt];
                tmp[lt++] = x;
            } else if (x < pivot) {
                tmp[i] = tmp[gt];
                tmp[gt--] = x;
            } else {
                i++;
            }
        }
        if (target < lt) hi = lt - 1;
        else if (target > gt) lo = gt + 1;
        else return pivot;
    }
    return tmp[lo];
}

/* w[j] = 0 where w[j] < tau; returns the weights' sum */
static inline float cut_below(float *w, int64_t vocab, float tau) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < vocab; j++) {
        const float e = w[j] >= tau ? w[j] : 0.0f;
        w[j] = e;
        total += e;
    }
    return total;
}

/* the first token of positive weight whose running sum reaches u times total (the weights'
 * sum): blocks of BLOCK tokens are summed as the walk reaches them, then one block's tokens */
static int64_t inverse_cdf(const float *w, int64_t vocab, float total, double u) {
    const double target = u * (double)total;
    double acc = 0.0;
    int64_t last = -1;
    for (int64_t b = 0; b * BLOCK < vocab; b++) {
        const int64_t end = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = b * BLOCK; j < end; j++) s += w[j];
        if (s <= 0.0f) continue;
        if (acc + s < target) {
            acc += s;
            last = b;
            continue;
        }
        int64_t pick = -1;
        for (int64_t j = b * BLOCK; j < end; j++) {
            if (w[j] <= 0.0f) continue;
            acc += w[j];
            pick = j;
            if (acc >= target) return j;
        }
        return pick; /* rounding left the target past the block's last token: that token */
    }
    /* rounding left the target past every block: the last token of positive weight */
    if (last >= 0)
        for (int64_t j = ((last + 1) * BLOCK < vocab ? (last + 1) * BLOCK : vocab) - 1; j >= last * BLOCK; j--)
            if (w[j] > 0.0f) return j;
    return 0;
}

/* w[j] = exp(w[j] - mx), dropped below cut (min-p); returns the weights' sum */
static inline __attribute__((always_inline)) float weigh(float *w, int64_t vocab, float mx, float cut) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < vocab; j++) {
        float e = exp_nonpositive(w[j] - mx);
        e = e >= cut ? e : 0.0f;
        w[j] = e;
        total += e;
    }
    return total;
}

/* the weight of the tokens strictly above px; with keep, the others' weights become 0 */
static inline __attribute__((always_inline)) float above(float *w, int64_t vocab, float px, int keep) {
    float s = 0.0f;
    if (keep) {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < vocab; j++) {
            float e = w[j] > px ? w[j] : 0.0f;
            w[j] = e;
            s += e;
        }
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < vocab; j++) s += w[j] > px ? w[j] : 0.0f;
    }
    return s;
}

/* w = the row with its penalties, times scale; returns max(w) and each block's maximum in
 * block_max. rep_mode: 0 no repetition penalty, 1 rp[j] per token, 2 the row's penalty rep on the
 * tokens whose bias entry has any bit set (seen: the penalty state writes -0.0 or the additive
 * penalty there, +0.0 only for tokens never seen), 3 as 2 with positive logits multiplied by
 * rep_inv = 1 / rep (for rows that draw, which nothing compares bit for bit: a multiply costs
 * less than a division). Called with constant flags, so that each combination compiles to a
 * loop of its own */
static inline __attribute__((always_inline)) float penalise(const float *restrict l, const float *restrict rp,
                                                            const float *restrict bp, float rep, float rep_inv,
                                                            float scale,
                                                            float *restrict w, int64_t vocab, float *block_max,
                                                            int rep_mode, int add_bias) {
    float mx = -INFINITY;
    for (int64_t b = 0; b * BLOCK < vocab; b++) {
        int64_t end = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab;
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (int64_t j = b * BLOCK; j < end; j++) {
            float x = l[j];
            if (rep_mode == 1) x = x > 0.0f ? x / rp[j] : x * rp[j];
            if (rep_mode == 2) {
                uint32_t bits;
                memcpy(&bits, &bp[j], sizeof bits);
                const float r = bits != 0u ? rep : 1.0f;
                x = x > 0.0f ? x / r : x * r;
            }
            if (rep_mode == 3) { /* as 2, multiplying by the reciprocal (within an ulp of it) */
                uint32_t bits;
                memcpy(&bits, &bp[j], sizeof bits);
                const float f = x > 0.0f ? rep_inv : rep;
                x = x * (bits == 0u ? 1.0f : f); /* (times 1 is exact: a select the loop vectorizes) */
            }
            if (add_bias) x = x + bp[j];
            x = x * scale;
            w[j] = x;
            bm = x > bm ? x : bm;
        }
        block_max[b] = bm;
        mx = bm > mx ? bm : mx;
    }
    return mx;
}

/* One row's token: l is its logits; its penalties as penalise() reads them (rep_mode, rp, rep;
 * bp added when add_bias). w and block_max are the scratch row and its per-block maxima, tmp a
 * second scratch row (top-k). Its uniforms: philox_uniform(seed, position, 0, 1, ...). */
static inline __attribute__((always_inline)) int64_t draw_row(const float *l, const float *rp, const float *bp,
                                                              float rep, int rep_mode, int add_bias, int greedy,
                                                              float temperature, float top_p, float min_p,
                                                              int64_t top_k, uint64_t seed, int64_t position,
                                                              int64_t vocab, float *w, float *block_max,
                                                              float *tmp) {
    /* penalties (the torch path's arithmetic, bit for bit), then the temperature (a multiply:
     * these rows draw, nothing compares them with the torch path's bits) */
    const float scale = greedy ? 1.0f : 1.0f / temperature;
    const float rep_inv = 1.0f / rep;
    float mx;
    if (rep_mode == 1)
        mx = add_bias ? penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 1, 1)
                      : penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 1, 0);
    else if (rep_mode == 2 && greedy)
        mx = add_bias ? penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 2, 1)
                      : penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 2, 0);
    else if (rep_mode == 2)
        mx = add_bias ? penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 3, 1)
                      : penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 3, 0);
    else
        mx = add_bias ? penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 0, 1)
                      : penalise(l, rp, bp, rep, rep_inv, scale, w, vocab, block_max, 0, 0);
    if (greedy) { /* the first index of the maximum: in the first block that holds it */
        for (int64_t b = 0; b * BLOCK < vocab; b++) {
            if (!(block_max[b] == mx)) continue;
            int64_t j = b * BLOCK;
            while (!(w[j] == mx)) j++;
            return j;
        }
        return vocab - 1; /* no maximum (a row of NaN) */
    }
    /* weights (the best token's is 1), what min-p keeps, then what top-k keeps of that */
    float kept = weigh(w, vocab, mx, min_p);
    if (top_k > 0 && top_k < vocab) kept = cut_below(w, vocab, kth_largest(w, vocab, top_k, tmp));
    const float limit = top_p * kept;
    uint32_t draw = 0;
    int64_t x = inverse_cdf(w, vocab, kept, philox_uniform(seed, position, draw++));
    while (top_p < 1.0f) {
        const float px = w[x];
        const float heavier = above(w, vocab, px, 0);
        if (heavier < limit || heavier == 0.0f) break; /* (nothing above: x is the best token) */
        /* x is outside the nucleus: the candidates become the tokens above it */
        x = inverse_cdf(w, vocab, above(w, vocab, px, 1), philox_uniform(seed, position, draw++));
    }
    return x;
}

/* a token drawn for table row `row`: its count, bias and repetition entries */
static inline void record_one(int64_t row, int64_t token, int64_t pen_ld, float frequency, float presence,
                              float repetition, int32_t *counts, float *bias, float *rep) {
    const int64_t at = row * pen_ld + token;
    const int32_t c = ++counts[at];
    bias[at] = -(frequency * (float)c + presence);
    rep[at] = repetition;
}

/* logits: [m, vocab] fp32 rows (row stride ld), one per token to draw. rows [m]: each logits
 * row's row in the tables below (NULL: row r is table row r). Tables, indexed by that row:
 * greedy [*] (0/1); params [*, params_ld] (params_ld >= FOLIO_NUM_COLUMNS) with the columns at
 * the COL_ indices of folio.h; bias and rep [*, pen_ld] (NULL:
 * no such penalty), read only for the rows whose own penalties are not neutral (a neutral row's
 * are zero and one); with rep_from_bias the rep table is not read at all: a row's repetition
 * penalty applies to the tokens whose bias entry has a bit set (penalise()). counts [*, pen_ld]
 * int32: NULL, or the penalty state to record each drawn token into (as folio_record_penalties,
 * for the penalised rows). seeds [m] and positions [m]: each logits row's seed and output
 * position (its uniforms' key). out [m]; scratch: 2 * vocab + vocab / BLOCK + 1 floats */
void folio_sample(int64_t m, int64_t vocab, const float *logits, int64_t ld, const int64_t *rows,
                  const uint8_t *greedy, const float *params, int64_t params_ld, float *bias,
                  float *rep, int64_t rep_from_bias, int32_t *counts, int64_t pen_ld, const uint64_t *seeds,
                  const int64_t *positions, int64_t *out, float *scratch) {
    float *w = scratch, *block_max = scratch + vocab, *tmp = scratch + vocab + vocab / BLOCK + 1;
    for (int64_t r = 0; r < m; r++) {
        const int64_t row = rows != NULL ? rows[r] : r;
        const float *param = params + row * params_ld;
        const float presence = param[COL_presence_penalty], frequency = param[COL_frequency_penalty];
        const float repetition = param[COL_repetition_penalty];
        const int has_rep = repetition != 1.0f && (rep_from_bias ? bias != NULL : rep != NULL);
        const int add_bias = bias != NULL && (presence != 0.0f || frequency != 0.0f);
        const int rep_mode = !has_rep ? 0 : rep_from_bias ? 2 : 1;
        const int64_t token = draw_row(logits + r * ld, rep != NULL ? rep + row * pen_ld : NULL,
                                       bias != NULL ? bias + row * pen_ld : NULL, repetition, rep_mode, add_bias,
                                       greedy[row], param[COL_temperature], param[COL_top_p], param[COL_min_p],
                                       (int64_t)param[COL_top_k], seeds[r], positions[r], vocab, w, block_max, tmp);
        out[r] = token;
        if (counts != NULL && bias != NULL && rep != NULL && (has_rep || add_bias))
            record_one(row, token, pen_ld, frequency, presence, repetition, counts, bias, rep);
    }
}

/* tokens just generated: counts[row, token] += 1, bias = -(frequency * count + presence),
 * rep = repetition (rows may repeat: a verification appends several tokens to one row) */
void folio_record_penalties(int64_t n, int64_t vocab, const int64_t *rows, const int64_t *tokens,
                            const float *frequency, const float *presence, const float *repetition,
                            int32_t *counts, float *bias, float *rep) {
    for (int64_t i = 0; i < n; i++)
        record_one(rows[i], tokens[i], vocab, frequency[i], presence[i], repetition[i], counts, bias, rep);
}

/* out[i, d] = draw first + d of (seeds[i], positions[i]), for i < n and d < count: for the tests */
void folio_philox_uniforms(int64_t n, const uint64_t *seeds, const int64_t *positions, int64_t first, int64_t count,
                           double *out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < count; d++) out[i * count + d] = philox_uniform(seeds[i], positions[i], (uint32_t)(first + d));
}

/* exp_nonpositive over n values, for the tests */
void folio_exp_nonpositive(int64_t n, const float *x, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(x[i]);
}
