/* The CPU sampler's one pass per row: penalties, temperature, min-p, top-p and the draw.
 *
 * Loaded by services/executor/cpu_kernels.py (compiled there with the machine's C compiler,
 * -O3 -march=native -fopenmp-simd -ffp-contract=off; no OpenMP runtime, one thread). The torch
 * path in sampler.py is the reference; this file draws from the same distribution with fewer
 * passes over each row and none of torch's fixed cost per operation.
 *
 * Per row r (logits row idx[r] of a [*, vocab] fp32 array with row stride ld):
 *   l      = the row, with the repetition penalty (positive logits divided by rep, negative ones
 *            multiplied: bitwise the torch path's) and the additive penalties (+ bias) applied;
 *   greedy = the first index of max(l) (as numpy's and torch's argmax);
 *   else w = exp(l / T - max(l / T)), the best token's weight 1; min-p keeps w >= min_p;
 *   top-p by rejection (FlashInfer's sorting-free scheme): draw x from the candidates in
 *   proportion to w; accept when the weight of the tokens strictly above w[x] is below
 *   top_p * (the weight min-p kept); otherwise the candidates become the tokens strictly above
 *   w[x] and draw again. The nucleus (tokens with less than top_p of the mass strictly above
 *   them) is an upper set of the weights, so every candidate set holds it and the accepted draw is
 *   distributed as w restricted to it; each rejection shrinks the candidates, so it ends.
 * Uniforms come from splitmix64 over (seed, row, draw); the caller gives a fresh seed each call.
 */

#include "common.h"

#define BLOCK 64 /* the inverse-CDF walk: block sums first, then one block's tokens */

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* a uniform in (0, 1] */
static inline double uniform(uint64_t *state) {
    *state += 0x9E3779B97F4A7C15ull;
    return ((splitmix64(*state) >> 11) + 1) * (1.0 / 9007199254740992.0);
}

/* the first token of positive weight whose running sum reaches u times the total, given the
 * weights' sums per BLOCK tokens */
static int64_t inverse_cdf(const float *w, int64_t vocab, const float *block_sums, double u) {
    int64_t num_blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) total += block_sums[b];
    double target = u * total, acc = 0.0;
    int64_t last = -1;
    for (int64_t b = 0; b < num_blocks; b++) {
        if (block_sums[b] <= 0.0f) continue;
        if (acc + block_sums[b] < target) {
            acc += block_sums[b];
            last = b;
            continue;
        }
        int64_t end = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab, pick = -1;
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

/* w[j] = keep(w[j]) for the tokens of each block, and the block's sum: ``exp`` (w = exp(w - mx),
 * dropped below cut) or a mask (w kept only above cut) */
static inline __attribute__((always_inline)) float weigh_blocks(float *w, int64_t vocab, float *block_sums, float mx, float cut, int exp_first) {
    float total = 0.0f;
    for (int64_t b = 0; b * BLOCK < vocab; b++) {
        int64_t end = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab;
        float s = 0.0f;
        if (exp_first) {
#pragma omp simd reduction(+ : s)
            for (int64_t j = b * BLOCK; j < end; j++) {
                float e = exp_nonpositive(w[j] - mx);
                e = e >= cut ? e : 0.0f;
                w[j] = e;
                s += e;
            }
        } else {
#pragma omp simd reduction(+ : s)
            for (int64_t j = b * BLOCK; j < end; j++) {
                float e = w[j] > cut ? w[j] : 0.0f;
                w[j] = e;
                s += e;
            }
        }
        block_sums[b] = s;
        total += s;
    }
    return total;
}

/* w = the row with its penalties, times scale; returns max(w). Called with constant flags, so
 * that each combination compiles to a loop of its own */
static inline __attribute__((always_inline)) float penalise(const float *restrict l, const float *restrict rp,
                                                            const float *restrict bp, float scale,
                                                            float *restrict w, int64_t vocab, int has_rep,
                                                            int has_bias) {
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < vocab; j++) {
        float x = l[j];
        if (has_rep) x = x > 0.0f ? x / rp[j] : x * rp[j];
        if (has_bias) x = x + bp[j];
        x = x * scale;
        w[j] = x;
        mx = x > mx ? x : mx;
    }
    return mx;
}

/* logits: [*, vocab] (row stride ld); idx [m]: the rows to sample (NULL: rows 0..m-1); bias/rep:
 * NULL or arrays of the logits' shape and stride; greedy [m] (0/1); params: [m, params_ld] with
 * the temperature, top-p and min-p in columns col_t, col_p, col_min_p; out [m]; scratch: vocab +
 * vocab / BLOCK + 1 floats */
void folio_sample(int64_t m, int64_t vocab, const float *logits, int64_t ld, const int64_t *idx,
                  const float *bias, const float *rep, const uint8_t *greedy, const float *params,
                  int64_t params_ld, int64_t col_t, int64_t col_p, int64_t col_min_p, uint64_t seed,
                  int64_t *out, float *scratch) {
    float *w = scratch, *block_sums = scratch + vocab;
    for (int64_t r = 0; r < m; r++) {
        const int64_t row = idx != NULL ? idx[r] : r;
        const float *param = params + r * params_ld, top_p = param[col_p];
        const float *l = logits + row * ld;
        const float *rp = rep != NULL ? rep + row * ld : NULL, *bp = bias != NULL ? bias + row * ld : NULL;
        /* one pass: penalties (the torch path's arithmetic, bit for bit), then the temperature
         * (a multiply: these rows draw, nothing compares them with the torch path's bits) */
        const float scale = greedy[r] ? 1.0f : 1.0f / param[col_t];
        float mx;
        if (rp != NULL && bp != NULL)
            mx = penalise(l, rp, bp, scale, w, vocab, 1, 1);
        else if (rp != NULL)
            mx = penalise(l, rp, bp, scale, w, vocab, 1, 0);
        else if (bp != NULL)
            mx = penalise(l, rp, bp, scale, w, vocab, 0, 1);
        else
            mx = penalise(l, rp, bp, scale, w, vocab, 0, 0);
        if (greedy[r]) { /* the first index of the maximum */
            int64_t j = 0;
            while (j < vocab - 1 && !(w[j] == mx)) j++;
            out[r] = j;
            continue;
        }
        /* weights (the best token's is 1), what min-p keeps, per block */
        const float kept = weigh_blocks(w, vocab, block_sums, mx, param[col_min_p], 1);
        uint64_t state = splitmix64(seed ^ splitmix64((uint64_t)r));
        const float limit = top_p * kept;
        int64_t x = inverse_cdf(w, vocab, block_sums, uniform(&state));
        while (top_p < 1.0f) {
            const float px = w[x];
            float above = 0.0f;
#pragma omp simd reduction(+ : above)
            for (int64_t j = 0; j < vocab; j++) above += w[j] > px ? w[j] : 0.0f;
            if (above < limit || above == 0.0f) break; /* (nothing above: x is the best token) */
            /* x is outside the nucleus: the candidates become the tokens above it */
            weigh_blocks(w, vocab, block_sums, 0.0f, px, 0);
            x = inverse_cdf(w, vocab, block_sums, uniform(&state));
        }
        out[r] = x;
    }
}

/* tokens just generated: counts[row, token] += 1, bias = -(frequency * count + presence),
 * rep = repetition (rows may repeat: a verification appends several tokens to one row) */
void folio_record_penalties(int64_t n, int64_t vocab, const int64_t *rows, const int64_t *tokens,
                            const float *frequency, const float *presence, const float *repetition,
                            int32_t *counts, float *bias, float *rep) {
    for (int64_t i = 0; i < n; i++) {
        int64_t at = rows[i] * vocab + tokens[i];
        int32_t c = ++counts[at];
        bias[at] = -(frequency[i] * (float)c + presence[i]);
        rep[at] = repetition[i];
    }
}

/* exp_nonpositive over n values, for the tests */
void folio_exp_nonpositive(int64_t n, const float *x, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(x[i]);
}
