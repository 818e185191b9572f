/* Quantized weights on the CPU: GGUF's block types repacked losslessly into tiles of 16 output rows,
 * and y = x W^T with x quantized to int8 per row and block of 32 (a scale per block; one pass, or
 * two: the value, then its rounding error times 254), so that the inner loop is integer
 * multiply-adds: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw), or plain C. Every path does the same
 * integer sums and the same float operations in the same order: the same bits on every machine,
 * and a row's result never depends on the other rows of the call.
 *
 * The tile form. A weight [n, k] is cut into tiles of 16 rows; a tile's bytes are contiguous and
 * hold its units (32 inputs for the simple types, 256 for the K-quants and IQ4_XS) in order. A
 * unit is made of sub-blocks of 32 inputs. Chunk c (0..7) of a sub-block is inputs 4c..4c+3 of
 * each of the 16 rows, byte 4 r + j for input 4 c + j of row r: a 4-byte group of x broadcast over
 * a chunk gives every row's partial dot in its own 32-bit lane. The values are stored as
 *   NP  (4-bit plane, 256 B a sub-block): 4 groups of 64 B; byte 4 r + j of group g holds input
 *       8 g + j in its low nibble and 8 g + 4 + j in its high one (chunks 2 g and 2 g + 1);
 *   HP1 (5th bit, 64 B): bit c of byte 4 r + j is bit 4 of input 4 c + j;
 *   HP2 (bits 4-5, 128 B): bits 2 i, 2 i + 1 of byte 64 h + 4 r + j are bits 4-5 of input
 *       4 (4 h + i) + j;
 *   V8  (int8, 512 B): chunk c at 64 c.
 * and per type (the dot product of a row with q, the stored values, and the activation block x =
 * dx xq, isum = sum xq, sx = dx isum; o: the offset q carries):
 *   Q4_0   unit 32: NP, d[16] fp16               w = d (q - 8)          s = dot - 8 isum;   acc += s (d dx)
 *   Q4_1   unit 32: NP, d[16], m[16]             w = d q + m            acc += dot (d dx) ... + m sx
 *   Q5_0   unit 32: NP, HP1, d[16]               w = d (q - 16)         s = dot - 16 isum
 *   Q5_1   unit 32: NP, HP1, d[16], m[16]        w = d q + m
 *   Q8_0   unit 32: V8, d[16]                    w = d q (q signed)
 *   IQ4_NL unit 32: NP (indices), d[16]          w = d kv[q] (llama.cpp's 16 values)
 *   Q4_K   unit 256: 8 NP, d, dmin[16], sc[8][16], mn[8][16] (u8)  w = d sc q - dmin mn
 *                                                acc += dot ((d sc) dx) ... - (dmin mn) sx
 *   Q5_K   unit 256: 8 NP, 8 HP1, d, dmin, sc, mn
 *   Q6_K   unit 256: 8 NP, 8 HP2, d[16], sc[16][16] (int8, per 16 inputs)  w = d sc (q - 32)
 *                                                acc += (dotA - 32 isumA) ((d scA) dx) + (dotB - ...) ((d scB) dx)
 *   IQ4_XS unit 256: 8 NP (indices), d[16], ls[8][16] (int8, the 6-bit scale - 32)  w = d ls kv[q]
 *                                                acc += dot(kv) ((d ls) dx)
 * Per block the integer sums are exact; the float steps are acc = fma(float(s), scale dx, acc),
 * once per pass, then the minimum's term. Signed values (Q8_0, IQ4) enter vpdpbusd as q + 128
 * (its unsigned operand), AVX2 as |q| with x's sign moved over (vpmaddubsw saturates otherwise);
 * both give the same integer sum.
 */

#include <immintrin.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "folio.h"

#define SB 32          /* inputs per sub-block (and per activation block) */
#define MBLOCK 64      /* x rows whose quantized blocks stay in cache while every tile passes */
#define PREFETCH 10240 /* the simple types: bytes ahead of the unit being read */

static const int8_t KV_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---------------------------------------------------------------------------- the types */

typedef struct {
    int type, unit, unit_bytes, raw_bytes;
    int np, hp, d, m, sc, mn; /* byte offsets in a unit record (-1: none); sc/mn: [sub][row] */
} type_info;

static const type_info TYPES[] = {
    /* type        unit  bytes  raw   np  hp     d     m      sc     mn */
    {FOLIO_Q4_0,   32,   288,   18,   0,  -1,    256,  -1,    -1,    -1},
    {FOLIO_Q4_1,   32,   320,   20,   0,  -1,    256,  288,   -1,    -1},
    {FOLIO_Q5_0,   32,   352,   22,   0,  256,   320,  -1,    -1,    -1},
    {FOLIO_Q5_1,   32,   384,   24,   0,  256,   320,  352,   -1,    -1},
    {FOLIO_Q8_0,   32,   544,   34,   0,  -1,    512,  -1,    -1,    -1},
    {FOLIO_IQ4_NL, 32,   288,   18,   0,  -1,    256,  -1,    -1,    -1},
    {FOLIO_Q4_K,   256,  2368,  144,  0,  -1,    2048, 2080,  2112,  2240},
    {FOLIO_Q5_K,   256,  2880,  176,  0,  2048,  2560, 2592,  2624,  2752},
    {FOLIO_Q6_K,   256,  3360,  210,  0,  2048,  3072, -1,    3104,  -1},
    {FOLIO_IQ4_XS, 256,  2208,  136,  0,  -1,    2048, -1,    2080,  -1},
};

static const type_info *info(int64_t type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

/* the layout of type T, folded to constants where T is one (the kernels' instances) */
static inline __attribute__((always_inline)) type_info layout(const int T) {
    switch (T) {
        case FOLIO_Q4_0: return TYPES[0];
        case FOLIO_Q4_1: return TYPES[1];
        case FOLIO_Q5_0: return TYPES[2];
        case FOLIO_Q5_1: return TYPES[3];
        case FOLIO_Q8_0: return TYPES[4];
        case FOLIO_IQ4_NL: return TYPES[5];
        case FOLIO_Q4_K: return TYPES[6];
        case FOLIO_Q5_K: return TYPES[7];
        case FOLIO_Q6_K: return TYPES[8];
        default: return TYPES[9];
    }
}

int64_t folio_unit(int64_t type) { return info(type) ? info(type)->unit : 0; }
int64_t folio_unit_bytes(int64_t type) { return info(type) ? info(type)->unit_bytes : 0; }
int64_t folio_raw_unit_bytes(int64_t type) { return info(type) ? info(type)->raw_bytes : 0; }

int64_t folio_tiles_bytes(int64_t type, int64_t n, int64_t k) {
    const type_info *t = info(type);
    if (t == NULL || n < 0 || k < 0 || k % t->unit) return -1;
    return (n + FOLIO_TILE - 1) / FOLIO_TILE * (k / t->unit) * t->unit_bytes;
}

static inline int np_index(int r, int e) { return 64 * (e / 8) + 4 * r + (e % 4); } /* its nibble: (e / 4) % 2 */
static inline int v8_index(int r, int e) { return 64 * (e / 4) + 4 * r + (e % 4); }
static inline int hp2_index(int r, int e) { return 64 * (e / 16) + 4 * r + (e % 4); } /* bits 2 ((e / 4) % 4) */

static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* ---------------------------------------------------------------------------- GGUF blocks */

/* One GGUF block of a row: its values q[unit] (unsigned, or signed for Q8_0 and IQ4's indices'
 * values; IQ4 keeps the 4-bit index), and its scales as stored (fp16 bits, or small integers). */
typedef struct {
    int32_t q[256];
    uint16_t d, m;    /* fp16 bits: d, and m (Q4_1, Q5_1) or dmin (K) */
    int32_t sc[16];   /* K: per sub-block of 32 (Q6_K: per 16) */
    int32_t mn[8];
} raw_block;

static void get_scale_min_k4(const uint8_t *s, int j, int32_t *sc, int32_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void read_raw(int type, const uint8_t *b, raw_block *o) {
    switch (type) {
        case FOLIO_Q4_0:
        case FOLIO_IQ4_NL:
            memcpy(&o->d, b, 2);
            for (int j = 0; j < 16; j++) o->q[j] = b[2 + j] & 15, o->q[j + 16] = b[2 + j] >> 4;
            break;
        case FOLIO_Q4_1:
            memcpy(&o->d, b, 2), memcpy(&o->m, b + 2, 2);
            for (int j = 0; j < 16; j++) o->q[j] = b[4 + j] & 15, o->q[j + 16] = b[4 + j] >> 4;
            break;
        case FOLIO_Q5_0:
        case FOLIO_Q5_1: {
            const int off = type == FOLIO_Q5_1 ? 4 : 2;
            memcpy(&o->d, b, 2);
            if (type == FOLIO_Q5_1) memcpy(&o->m, b + 2, 2);
            uint32_t qh;
            memcpy(&qh, b + off, 4);
            for (int j = 0; j < 16; j++) {
                o->q[j] = (b[off + 4 + j] & 15) | (((qh >> j) & 1) << 4);
                o->q[j + 16] = (b[off + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            }
            break;
        }
        case FOLIO_Q8_0:
            memcpy(&o->d, b, 2);
            for (int j = 0; j < 32; j++) o->q[j] = (int8_t)b[2 + j];
            break;
        case FOLIO_Q4_K:
        case FOLIO_Q5_K: {
            memcpy(&o->d, b, 2), memcpy(&o->m, b + 2, 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == FOLIO_Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) get_scale_min_k4(scales, j, &o->sc[j], &o->mn[j]);
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    o->q[64 * g + l] = qs[32 * g + l] & 15;
                    o->q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
                }
            if (type == FOLIO_Q5_K)
                for (int s = 0; s < 8; s++)
                    for (int l = 0; l < 32; l++) o->q[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
            break;
        }
        case FOLIO_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            memcpy(&o->d, b + 208, 2);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++)
                    for (int l = 0; l < 32; l++) {
                        const int lo = (ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15;
                        const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                        o->q[128 * h + 32 * g + l] = lo | (hi << 4);
                    }
            for (int j = 0; j < 16; j++) o->sc[j] = scales[j];
            break;
        }
        case FOLIO_IQ4_XS: {
            memcpy(&o->d, b, 2);
            uint16_t sh;
            memcpy(&sh, b + 2, 2);
            const uint8_t *sl = b + 4, *qs = b + 8;
            for (int s = 0; s < 8; s++) {
                o->sc[s] = (((sl[s / 2] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)) - 32;
                for (int l = 0; l < 16; l++) o->q[32 * s + l] = qs[16 * s + l] & 15, o->q[32 * s + 16 + l] = qs[16 * s + l] >> 4;
            }
            break;
        }
        default: break;
    }
}

/* row r's block, as read_raw gives it, written into a zeroed tile unit */
static void put_unit(const type_info *t, const raw_block *o, int r, uint8_t *u) {
    const int subs = t->unit / SB;
    for (int s = 0; s < subs; s++) {
        const int32_t *q = o->q + SB * s;
        if (t->type == FOLIO_Q8_0) {
            for (int e = 0; e < SB; e++) u[v8_index(r, e)] = (uint8_t)(int8_t)q[e];
            continue;
        }
        uint8_t *np = u + t->np + 256 * s;
        for (int e = 0; e < SB; e++) np[np_index(r, e)] |= (uint8_t)((q[e] & 15) << (4 * ((e / 4) % 2)));
        if (t->type == FOLIO_Q5_0 || t->type == FOLIO_Q5_1 || t->type == FOLIO_Q5_K) {
            uint8_t *hp = u + t->hp + 64 * s;
            for (int e = 0; e < SB; e++) hp[4 * r + e % 4] |= (uint8_t)(((q[e] >> 4) & 1) << (e / 4));
        } else if (t->type == FOLIO_Q6_K) {
            uint8_t *hp = u + t->hp + 128 * s;
            for (int e = 0; e < SB; e++) hp[hp2_index(r, e)] |= (uint8_t)(((q[e] >> 4) & 3) << (2 * ((e / 4) % 4)));
        }
    }
    memcpy(u + t->d + 2 * r, &o->d, 2);
    if (t->type == FOLIO_Q4_1 || t->type == FOLIO_Q5_1 || t->type == FOLIO_Q4_K || t->type == FOLIO_Q5_K)
        memcpy(u + t->m + 2 * r, &o->m, 2);
    if (t->type == FOLIO_Q4_K || t->type == FOLIO_Q5_K)
        for (int s = 0; s < 8; s++) u[t->sc + 16 * s + r] = (uint8_t)o->sc[s], u[t->mn + 16 * s + r] = (uint8_t)o->mn[s];
    else if (t->type == FOLIO_Q6_K)
        for (int s = 0; s < 16; s++) u[t->sc + 16 * s + r] = (uint8_t)(int8_t)o->sc[s];
    else if (t->type == FOLIO_IQ4_XS)
        for (int s = 0; s < 8; s++) u[t->sc + 16 * s + r] = (uint8_t)(int8_t)o->sc[s];
}

/* value e of sub-block s of row r, as read_raw gives it */
static int32_t get_q(const type_info *t, const uint8_t *u, int r, int s, int e) {
    if (t->type == FOLIO_Q8_0) return (int8_t)u[v8_index(r, e)];
    int32_t q = (u[t->np + 256 * s + np_index(r, e)] >> (4 * ((e / 4) % 2))) & 15;
    if (t->type == FOLIO_Q5_0 || t->type == FOLIO_Q5_1 || t->type == FOLIO_Q5_K)
        q |= ((u[t->hp + 64 * s + 4 * r + e % 4] >> (e / 4)) & 1) << 4;
    else if (t->type == FOLIO_Q6_K)
        q |= ((u[t->hp + 128 * s + hp2_index(r, e)] >> (2 * ((e / 4) % 4))) & 3) << 4;
    return q;
}

typedef struct {
    const type_info *t;
    int64_t n, k, raw_row_bytes, tiles;
    const uint8_t *raw;
    const int64_t *order;
    uint8_t *out;
    _Atomic int64_t next;
} repack_args;

static void repack_task(void *p) {
    repack_args *a = p;
    const type_info *t = a->t;
    const int64_t units = a->k / t->unit;
    raw_block blk;
    for (;;) {
        const int64_t tile = atomic_fetch_add(&a->next, 1);
        if (tile >= a->tiles) return;
        uint8_t *dst = a->out + tile * units * t->unit_bytes;
        memset(dst, 0, (size_t)(units * t->unit_bytes));
        for (int r = 0; r < FOLIO_TILE; r++) {
            const int64_t row = tile * FOLIO_TILE + r;
            if (row >= a->n) break; /* zero rows: every scale 0 */
            const uint8_t *src = a->raw + (a->order ? a->order[row] : row) * a->raw_row_bytes;
            for (int64_t u = 0; u < units; u++) {
                memset(&blk, 0, sizeof blk);
                read_raw(t->type, src + u * t->raw_bytes, &blk);
                put_unit(t, &blk, r, dst + u * t->unit_bytes);
            }
        }
    }
}

int64_t folio_repack(int64_t type, int64_t n, int64_t k, const uint8_t *raw, int64_t raw_row_bytes,
                     const int64_t *order, uint8_t *tiles, int64_t tiles_bytes) {
    const type_info *t = info(type);
    if (t == NULL) return folio_fail(FOLIO_EINVAL, "unknown weight type %lld", (long long)type);
    if (raw == NULL || tiles == NULL || n <= 0 || k <= 0 || k % t->unit)
        return folio_fail(FOLIO_EINVAL, "repack: %lld x %lld is not whole units of %d", (long long)n, (long long)k, t->unit);
    if (raw_row_bytes != k / t->unit * t->raw_bytes)
        return folio_fail(FOLIO_EINVAL, "repack: rows of %lld bytes for %lld inputs", (long long)raw_row_bytes, (long long)k);
    if (tiles_bytes != folio_tiles_bytes(type, n, k))
        return folio_fail(FOLIO_EINVAL, "repack: %lld bytes of tiles, need %lld", (long long)tiles_bytes,
                          (long long)folio_tiles_bytes(type, n, k));
    if (order != NULL)
        for (int64_t i = 0; i < n; i++)
            if (order[i] < 0 || order[i] >= n) return folio_fail(FOLIO_ERANGE, "repack: row order %lld", (long long)order[i]);
    repack_args a = {t, n, k, raw_row_bytes, (n + FOLIO_TILE - 1) / FOLIO_TILE, raw, order, tiles, 0};
    folio_run_parallel(repack_task, &a, a.tiles > 4);
    return FOLIO_OK;
}

int64_t folio_dequant_rows(int64_t type, int64_t n, int64_t k, const uint8_t *tiles, int64_t tiles_bytes,
                           const int64_t *rows, int64_t count, float *out) {
    const type_info *t = info(type);
    if (t == NULL) return folio_fail(FOLIO_EINVAL, "unknown weight type %lld", (long long)type);
    if (tiles == NULL || out == NULL || (count > 0 && rows == NULL) || tiles_bytes != folio_tiles_bytes(type, n, k))
        return folio_fail(FOLIO_EINVAL, "dequant: tiles of %lld bytes for %lld x %lld", (long long)tiles_bytes,
                          (long long)n, (long long)k);
    for (int64_t i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= n) return folio_fail(FOLIO_ERANGE, "dequant: row %lld of %lld", (long long)rows[i], (long long)n);
    const int64_t units = k / t->unit;
    for (int64_t i = 0; i < count; i++) {
        const int64_t tile = rows[i] / FOLIO_TILE;
        const int r = (int)(rows[i] % FOLIO_TILE);
        float *o = out + i * k;
        for (int64_t ui = 0; ui < units; ui++) {
            const uint8_t *u = tiles + (tile * units + ui) * t->unit_bytes;
            const float d = fp16_at(u + t->d + 2 * r), m = t->m >= 0 ? fp16_at(u + t->m + 2 * r) : 0.0f;
            for (int s = 0; s < t->unit / SB; s++) {
                float *os = o + ui * t->unit + SB * s;
                for (int e = 0; e < SB; e++) {
                    const int32_t q = get_q(t, u, r, s, e);
                    switch (t->type) { /* GGUF's own dequantization, operation for operation */
                        case FOLIO_Q4_0: os[e] = d * (float)(q - 8); break;
                        case FOLIO_Q5_0: os[e] = d * (float)(q - 16); break;
                        case FOLIO_Q4_1:
                        case FOLIO_Q5_1: os[e] = d * (float)q + m; break;
                        case FOLIO_Q8_0: os[e] = (float)q * d; break;
                        case FOLIO_IQ4_NL: os[e] = d * (float)KV_IQ4[q]; break;
                        case FOLIO_Q4_K:
                        case FOLIO_Q5_K: {
                            const float a = d * (float)u[t->sc + 16 * s + r], b = m * (float)u[t->mn + 16 * s + r];
                            os[e] = a * (float)q - b;
                            break;
                        }
                        case FOLIO_Q6_K: os[e] = (d * (float)(int8_t)u[t->sc + 16 * (2 * s + e / 16) + r]) * (float)(q - 32); break;
                        case FOLIO_IQ4_XS: os[e] = (d * (float)(int8_t)u[t->sc + 16 * s + r]) * (float)KV_IQ4[q]; break;
                        default: break;
                    }
                }
            }
        }
    }
    return FOLIO_OK;
}

/* ---------------------------------------------------------------------------- activations */

/* A row's block of 32 inputs: x ~ dx (xq + xq2 / 254), xq = round(x / dx), dx = max|x| / 127,
 * xq2 = round((x / dx - xq) 254) (the second pass: the rounding error itself, about 15 bits in
 * all); rounding half away from zero, as llama.cpp's Q8 blocks. The kernels sum both passes in
 * integers, x ~ (dx / 254) (254 xq + xq2), so a block carries the sum's scale and integers: with
 * one pass ds = dx and isum = sum xq, with two ds = dx / 254 and isum = 254 sum xq + sum xq2
 * (|254 dot(w, xq) + dot(w, xq2)| < 2^29 for 8-bit w). sx = ds isum is what a minimum multiplies;
 * isumA: the sum over the first 16 (Q6_K's scales are per 16). */
typedef struct {
    float ds, sx;
    int32_t isum, isumA;
} act_block;

/* round half away from zero (roundf) of |t| < 2^23, LANES at a time: truncate, then step away
 * where the exact remainder is half or more */
#if defined(__AVX512F__)
#define QLANES 16
static inline void round_lanes(const float *t, int32_t *q) {
    const __m512 v = _mm512_loadu_ps(t), r = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, r)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000));
    const __m512 away = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)), sign));
    _mm512_storeu_si512(q, _mm512_cvttps_epi32(_mm512_mask_add_ps(r, up, r, away)));
}
static inline float absmax_block(const float *v) {
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)), _mm512_abs_ps(_mm512_loadu_ps(v + 16)));
    return _mm512_reduce_max_ps(m);
}
#elif defined(__AVX2__)
#define QLANES 8
static inline void round_lanes(const float *t, int32_t *q) {
    const __m256 v = _mm256_loadu_ps(t), r = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, r)),
                                    _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 step = _mm256_and_ps(up, _mm256_or_ps(_mm256_set1_ps(1.0f), sign));
    _mm256_storeu_si256((__m256i *)q, _mm256_cvttps_epi32(_mm256_add_ps(r, step)));
}
static inline float absmax_block(const float *v) {
    const __m256 mask = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(mask, _mm256_loadu_ps(v));
    for (int j = 8; j < SB; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(mask, _mm256_loadu_ps(v + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#else
#define QLANES 1
static inline void round_lanes(const float *t, int32_t *q) { *q = (int32_t)roundf(*t); }
static inline float absmax_block(const float *v) {
    float amax = 0.0f;
    for (int j = 0; j < SB; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    return amax;
}
#endif

static void quantize_row(const void *x, int bf16, int64_t k, int passes, int8_t *xq, int8_t *xq2, act_block *blk) {
    for (int64_t b = 0; b < k / SB; b++) {
        float v[SB], t[SB], r[SB];
        int32_t q[SB], q2[SB], c[SB];
        if (bf16)
            for (int j = 0; j < SB; j++) v[j] = bf16_to_float(((const uint16_t *)x)[b * SB + j]);
        else
            memcpy(v, (const float *)x + b * SB, sizeof(v));
        const float amax = absmax_block(v); /* inputs are finite */
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < SB; j++) t[j] = v[j] * inv;
        for (int j = 0; j < SB; j += QLANES) round_lanes(t + j, q + j);
        for (int j = 0; j < SB; j++) xq[b * SB + j] = (int8_t)q[j];
        if (passes > 1) {
            for (int j = 0; j < SB; j++) r[j] = (t[j] - (float)q[j]) * 254.0f; /* t - q is exact: |t| < 128 */
            for (int j = 0; j < SB; j += QLANES) round_lanes(r + j, q2 + j);
            for (int j = 0; j < SB; j++) xq2[b * SB + j] = (int8_t)q2[j];
            for (int j = 0; j < SB; j++) c[j] = 254 * q[j] + q2[j];
        } else {
            memcpy(c, q, sizeof(c));
        }
        int32_t sumA = 0, sumB = 0;
        for (int j = 0; j < 16; j++) sumA += c[j];
        for (int j = 16; j < SB; j++) sumB += c[j];
        act_block *o = blk + b;
        o->ds = passes > 1 ? d / 254.0f : d;
        o->sx = o->ds * (float)(sumA + sumB);
        o->isum = sumA + sumB, o->isumA = sumA;
    }
}

/* ---------------------------------------------------------------------------- the GEMM */

typedef struct {
    const folio_weight *w;
    int64_t tile0[FOLIO_MAX_PARTS + 1]; /* the first tile of each part, in the call's numbering */
    int64_t row0[FOLIO_MAX_PARTS], tile_bytes[FOLIO_MAX_PARTS]; /* each part's first row of y; a tile's bytes */
    int64_t m, k, kb, passes;
    const int8_t *xq, *xq2;
    const act_block *blk;
    void *y;
    int64_t ldy, y_bf16;
    int64_t tiles, units, chunk;
    _Atomic int64_t next;
    /* the activations' quantization, shared among the threads first */
    const void *x;
    int64_t ldx, x_bf16;
    _Atomic int64_t next_row;
} gemm_args;

static inline void store_row(const gemm_args *a, int64_t row, int64_t col, int64_t count, const float *v) {
    if (a->y_bf16) {
        uint16_t *y = (uint16_t *)a->y + row * a->ldy + col;
        for (int64_t i = 0; i < count; i++) y[i] = float_to_bf16(v[i]);
    } else {
        float *y = (float *)a->y + row * a->ldy + col;
        for (int64_t i = 0; i < count; i++) y[i] = v[i];
    }
}

#define IS_K(T) ((T) == FOLIO_Q4_K || (T) == FOLIO_Q5_K)
#define HAS_MIN(T) ((T) == FOLIO_Q4_1 || (T) == FOLIO_Q5_1)
#define HAS_HP1(T) ((T) == FOLIO_Q5_0 || (T) == FOLIO_Q5_1 || (T) == FOLIO_Q5_K)
#define IS_IQ4(T) ((T) == FOLIO_IQ4_NL || (T) == FOLIO_IQ4_XS)
#define SIGNED(T) ((T) == FOLIO_Q8_0 || IS_IQ4(T))
/* the offset o of s = dot - o isum for the unsigned forms (Q6_K's is per half, in the epilogue) */
#define OFFSET(T) ((T) == FOLIO_Q4_0 ? 8 : (T) == FOLIO_Q5_0 ? 16 : 0)

/* The vector helpers both SIMD paths share: a vector is a chunk of 16 rows (AVX-512) or of 8
 * (AVX2, half h of the tile: bytes 32 h .. 32 h + 31 of each 64-byte chunk). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
typedef __m512i vec;
#define VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define VAND _mm512_and_si512
#define VOR _mm512_or_si512
#define VXOR _mm512_xor_si512
#define VSLL16 _mm512_slli_epi16
#define VSRL16 _mm512_srli_epi16
#define VSET8 _mm512_set1_epi8
#define VSHUF _mm512_shuffle_epi8
#define VLUT(t) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(t)))
#define VSET32 _mm512_set1_epi32
typedef __m512 vfl; /* 16 rows' floats */
#define VF_MUL _mm512_mul_ps
#define VF_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef __m256i vec;
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VAND _mm256_and_si256
#define VOR _mm256_or_si256
#define VXOR _mm256_xor_si256
#define VSLL16 _mm256_slli_epi16
#define VSRL16 _mm256_srli_epi16
#define VSET8 _mm256_set1_epi8
#define VSHUF _mm256_shuffle_epi8
#define VLUT(t) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t)))
#define VSET32 _mm256_set1_epi32
typedef __m256 vfl; /* 8 rows' floats */
#define VF_MUL _mm256_mul_ps
#define VF_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define SIMD 1
#endif

#ifdef SIMD
#define LANES ((int)(sizeof(vfl) / 4))

/* a unit's lines, non-temporal (the tiles stream through once): for the simple types (units of
 * about 300 bytes) the unit PREFETCH bytes ahead; for the 256-input units (2.2-3.4 KB) the unit
 * about to be read, every line of it at once. Measured on a Zen 4 EPYC, one row, runs interleaved:
 * a 215 MB Q6_K LM head read at 30.5 GB/s this way against 17.8 at 10240 bytes ahead (every
 * distance from 512 to 32768 bytes was slower, and no prefetch slower still: 15.1), Q4_K and Q6_K
 * FFN weights at 30.2 against 23.6; Q4_0 read faster ahead (23.8 against 20.9), Q4_1 the same. */
static inline __attribute__((always_inline)) void prefetch_unit(const uint8_t *w, const type_info *t) {
    const int ahead = t->unit == SB ? PREFETCH : 0;
    for (int off = 0; off < t->unit_bytes; off += 64) _mm_prefetch((const char *)(w + ahead + off), _MM_HINT_NTA);
}

/* a 4-byte group of x over every lane */
static inline vec bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return VSET32(v);
}

/* the sub-block's per-row scales (half h of the tile on AVX2): K-quants d sc and dmin mn,
 * Q6_K's two halves' d sc, IQ4_XS's d ls; the others keep the unit's d (and m) */
static inline __attribute__((always_inline)) void sub_scales(const int T, const type_info *t, const uint8_t *w, int s,
                                                             int h, vfl d, vfl dm, vfl *scale, vfl *bmin,
                                                             vfl *scale_b) {
    const int at = LANES * h;
    *scale = d, *bmin = dm, *scale_b = d;
    if (IS_K(T)) {
        *scale = VF_MUL(d, VF_U8(w + t->sc + 16 * s + at));
        *bmin = VF_MUL(dm, VF_U8(w + t->mn + 16 * s + at));
    } else if (T == FOLIO_Q6_K) { /* per 16 inputs */
        *scale = VF_MUL(d, VF_I8(w + t->sc + 16 * (2 * s) + at));
        *scale_b = VF_MUL(d, VF_I8(w + t->sc + 16 * (2 * s + 1) + at));
    } else if (T == FOLIO_IQ4_XS) {
        *scale = VF_MUL(d, VF_I8(w + t->sc + 16 * s + at));
    }
}

/* llama.cpp's 16 IQ4 values + 128: vpdpbusd's unsigned operand (AVX2 reads them signed) */
static const uint8_t KV_IQ4_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* sub-block s of unit u as eight chunks of its stored values: unsigned bytes, the signed types
 * (Q8_0, IQ4) as q + 128 for vpdpbusd (AVX-512) or as they are (AVX2, which moves signs over) */
static inline __attribute__((always_inline)) void decode(const int T, const uint8_t *u, int s, int h, vec q[8]) {
    const type_info L = layout(T), *t = &L;
    const int at = (int)sizeof(vec) == 32 ? 32 * h : 0;
    if (T == FOLIO_Q8_0) {
        for (int c = 0; c < 8; c++) q[c] = VLOAD(u + 64 * c + at);
        if (sizeof(vec) == 64)
            for (int c = 0; c < 8; c++) q[c] = VXOR(q[c], VSET8((char)0x80));
        return;
    }
    const vec low = VSET8(0x0f);
    const uint8_t *np = u + t->np + 256 * s + at;
    for (int g = 0; g < 4; g++) {
        const vec raw = VLOAD(np + 64 * g);
        q[2 * g] = VAND(raw, low);
        q[2 * g + 1] = VAND(VSRL16(raw, 4), low);
    }
    if (HAS_HP1(T)) { /* bit c of each byte is bit 4 of chunk c */
        const vec v = VLOAD(u + t->hp + 64 * s + at), bit = VSET8(0x10);
        q[0] = VOR(q[0], VAND(VSLL16(v, 4), bit));
        q[1] = VOR(q[1], VAND(VSLL16(v, 3), bit));
        q[2] = VOR(q[2], VAND(VSLL16(v, 2), bit));
        q[3] = VOR(q[3], VAND(VSLL16(v, 1), bit));
        q[4] = VOR(q[4], VAND(v, bit));
        q[5] = VOR(q[5], VAND(VSRL16(v, 1), bit));
        q[6] = VOR(q[6], VAND(VSRL16(v, 2), bit));
        q[7] = VOR(q[7], VAND(VSRL16(v, 3), bit));
    } else if (T == FOLIO_Q6_K) { /* bits 2 i, 2 i + 1 of each byte of half hh are chunk 4 hh + i's bits 4-5 */
        const vec bits = VSET8(0x30);
        for (int hh = 0; hh < 2; hh++) {
            const vec v = VLOAD(u + t->hp + 128 * s + 64 * hh + at);
            q[4 * hh] = VOR(q[4 * hh], VAND(VSLL16(v, 4), bits));
            q[4 * hh + 1] = VOR(q[4 * hh + 1], VAND(VSLL16(v, 2), bits));
            q[4 * hh + 2] = VOR(q[4 * hh + 2], VAND(v, bits));
            q[4 * hh + 3] = VOR(q[4 * hh + 3], VAND(VSRL16(v, 2), bits));
        }
    } else if (IS_IQ4(T)) {
        const vec lut = sizeof(vec) == 64 ? VLUT(KV_IQ4_U8) : VLUT(KV_IQ4);
        for (int c = 0; c < 8; c++) q[c] = VSHUF(lut, q[c]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMM_PATH "avx512-vnni"
#define MC 8

/* rows r0 .. r0 + mc of x against one tile: every unit of it */
static inline __attribute__((always_inline)) void tile_rows(const gemm_args *a, const int T, const uint8_t *w,
                                                            int64_t col, int64_t count, int64_t r0, const int mc,
                                                            const int P) {
    const type_info L = layout(T), *t = &L;
    const int subs = L.unit / SB;
    __m512 acc[MC];
    for (int i = 0; i < mc; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t un = 0; un < a->kb / subs; un++, w += L.unit_bytes) {
        prefetch_unit(w, &L);
        const __m512 d = VF_HALVES(w + t->d);
        const __m512 dm = IS_K(T) || HAS_MIN(T) ? VF_HALVES(w + t->m) : _mm512_setzero_ps();
        for (int s = 0; s < subs; s++) {
            __m512i q[8];
            decode(T, w, s, 0, q);
            __m512 scale, bmin, scaleB; /* per row: the sub-block's scales and minimum */
            sub_scales(T, t, w, s, 0, d, dm, &scale, &bmin, &scaleB);
            const int64_t b = un * subs + s;
#pragma GCC unroll 16
            for (int i = 0; i < mc; i++) {
                const act_block *ab = a->blk + (r0 + i) * a->kb + b;
                /* both passes' dots in one integer sum (act_block): Q6_K's halves apart (dotA: inputs
                 * 0-15, dotB: 16-31), the others' two chains added at the end */
                __m512i dotA = _mm512_setzero_si512(), dotB = dotA;
                _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                    const int8_t *xb = (p ? a->xq2 : a->xq) + (r0 + i) * a->k + b * SB;
                    if (p && T == FOLIO_Q6_K) {
                        dotA = _mm512_mullo_epi32(dotA, _mm512_set1_epi32(254));
                        dotB = _mm512_mullo_epi32(dotB, _mm512_set1_epi32(254));
                    } else if (p) {
                        dotA = _mm512_mullo_epi32(_mm512_add_epi32(dotA, dotB), _mm512_set1_epi32(254));
                        dotB = _mm512_setzero_si512();
                    }
                    if (T == FOLIO_Q6_K) {
                        for (int c = 0; c < 4; c++) dotA = _mm512_dpbusd_epi32(dotA, q[c], bcast4(xb + 4 * c));
                        for (int c = 4; c < 8; c++) dotB = _mm512_dpbusd_epi32(dotB, q[c], bcast4(xb + 4 * c));
                    } else {
                        for (int c = 0; c < 8; c += 2) {
                            dotA = _mm512_dpbusd_epi32(dotA, q[c], bcast4(xb + 4 * c));
                            dotB = _mm512_dpbusd_epi32(dotB, q[c + 1], bcast4(xb + 4 * c + 4));
                        }
                    }
                }
                const __m512 dx = _mm512_set1_ps(ab->ds);
                if (T == FOLIO_Q6_K) { /* two halves of 16, each with its own scale */
                    const __m512i a32 = _mm512_sub_epi32(dotA, _mm512_set1_epi32(32 * ab->isumA));
                    const __m512i b32 = _mm512_sub_epi32(dotB, _mm512_set1_epi32(32 * (ab->isum - ab->isumA)));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a32), _mm512_mul_ps(scale, dx), acc[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b32), _mm512_mul_ps(scaleB, dx), acc[i]);
                } else {
                    __m512i sum = _mm512_add_epi32(dotA, dotB);
                    if (SIGNED(T)) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * ab->isum));
                    if (OFFSET(T)) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(OFFSET(T) * ab->isum));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, dx), acc[i]);
                }
                if (HAS_MIN(T)) acc[i] = _mm512_fmadd_ps(bmin, _mm512_set1_ps(ab->sx), acc[i]);
                if (IS_K(T)) acc[i] = _mm512_fnmadd_ps(bmin, _mm512_set1_ps(ab->sx), acc[i]);
            }
        }
    }
    for (int i = 0; i < mc; i++) {
        float v[FOLIO_TILE];
        _mm512_storeu_ps(v, acc[i]);
        store_row(a, r0 + i, col, count, v);
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMM_PATH "avx2"
#define MC 4

/* 8 lanes of int32: s + the dots of w's 4-byte groups with x's (w unsigned, x signed) */
static inline __m256i dot8(__m256i s, __m256i w, __m256i x) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* the same for signed w: |w| with x's sign moved over (both within 127: no saturation) */
static inline __m256i dot8s(__m256i s, __m256i w, __m256i x) {
    return dot8(s, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

static inline __attribute__((always_inline)) void tile_rows(const gemm_args *a, const int T, const uint8_t *w,
                                                            int64_t col, int64_t count, int64_t r0, const int mc,
                                                            const int P) {
    const type_info L = layout(T), *t = &L;
    __m256 acc[MC][2]; /* rows 0..7, 8..15 of the tile */
    for (int i = 0; i < mc; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t un = 0, subs = L.unit / SB; un < a->kb / subs; un++, w += L.unit_bytes) {
        prefetch_unit(w, &L);
        for (int s = 0; s < subs; s++) {
            const int64_t b = un * subs + s;
            for (int h = 0; h < 2; h++) {
                __m256i q[8];
                decode(T, w, s, h, q);
                const __m256 d = VF_HALVES(w + t->d + 16 * h);
                const __m256 dm = IS_K(T) || HAS_MIN(T) ? VF_HALVES(w + t->m + 16 * h) : _mm256_setzero_ps();
                __m256 scale, bmin, scaleB;
                sub_scales(T, t, w, s, h, d, dm, &scale, &bmin, &scaleB);
#pragma GCC unroll 16
                for (int i = 0; i < mc; i++) {
                    const act_block *ab = a->blk + (r0 + i) * a->kb + b;
                    __m256i dotA = _mm256_setzero_si256(), dotB = dotA; /* both passes summed (act_block) */
                    _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                        const int8_t *xb = (p ? a->xq2 : a->xq) + (r0 + i) * a->k + b * SB;
                        if (p) {
                            dotA = _mm256_mullo_epi32(dotA, _mm256_set1_epi32(254));
                            dotB = _mm256_mullo_epi32(dotB, _mm256_set1_epi32(254));
                        }
                        for (int c = 0; c < 4; c++) {
                            if (SIGNED(T)) {
                                dotA = dot8s(dotA, q[c], bcast4(xb + 4 * c));
                                dotB = dot8s(dotB, q[c + 4], bcast4(xb + 16 + 4 * c));
                            } else {
                                dotA = dot8(dotA, q[c], bcast4(xb + 4 * c));
                                dotB = dot8(dotB, q[c + 4], bcast4(xb + 16 + 4 * c));
                            }
                        }
                    }
                    const __m256 dx = _mm256_set1_ps(ab->ds);
                    if (T == FOLIO_Q6_K) {
                        const __m256i a32 = _mm256_sub_epi32(dotA, _mm256_set1_epi32(32 * ab->isumA));
                        const __m256i b32 = _mm256_sub_epi32(dotB, _mm256_set1_epi32(32 * (ab->isum - ab->isumA)));
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a32), _mm256_mul_ps(scale, dx), acc[i][h]);
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b32), _mm256_mul_ps(scaleB, dx), acc[i][h]);
                    } else {
                        __m256i sum = _mm256_add_epi32(dotA, dotB);
                        if (OFFSET(T)) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(OFFSET(T) * ab->isum));
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, dx), acc[i][h]);
                    }
                    if (HAS_MIN(T)) acc[i][h] = _mm256_fmadd_ps(bmin, _mm256_set1_ps(ab->sx), acc[i][h]);
                    if (IS_K(T)) acc[i][h] = _mm256_fnmadd_ps(bmin, _mm256_set1_ps(ab->sx), acc[i][h]);
                }
            }
        }
    }
    for (int i = 0; i < mc; i++) {
        float v[FOLIO_TILE];
        _mm256_storeu_ps(v, acc[i][0]);
        _mm256_storeu_ps(v + 8, acc[i][1]);
        store_row(a, r0 + i, col, count, v);
    }
}

#else
#define GEMM_PATH "c"
#define MC 1

/* the signed value of element e of sub-block s, row r (the stored value less its offset) */
static inline int32_t value_of(const type_info *t, int T, const uint8_t *u, int r, int s, int e) {
    const int32_t q = get_q(t, u, r, s, e);
    if (IS_IQ4(T)) return KV_IQ4[q];
    if (T == FOLIO_Q6_K) return q - 32;
    return q - OFFSET(T);
}

static inline void tile_rows(const gemm_args *a, const int T, const uint8_t *w0, int64_t col, int64_t count,
                             int64_t r0, const int mc, const int P) {
    const type_info L = layout(T), *t = &L;
    const int subs = t->unit / SB;
    const int64_t units = a->kb / subs;
    for (int i = 0; i < mc; i++) {
        float acc[FOLIO_TILE] = {0};
        const uint8_t *w = w0;
        for (int64_t un = 0; un < units; un++, w += t->unit_bytes) {
            for (int s = 0; s < subs; s++) {
                const int64_t b = un * subs + s;
                const act_block *ab = a->blk + (r0 + i) * a->kb + b;
                for (int r = 0; r < FOLIO_TILE; r++) {
                    const float d = fp16_at(w + t->d + 2 * r), dm = t->m >= 0 ? fp16_at(w + t->m + 2 * r) : 0.0f;
                    float scale = d, bmin = dm, scaleB = d;
                    if (IS_K(T)) {
                        scale = d * (float)w[t->sc + 16 * s + r];
                        bmin = dm * (float)w[t->mn + 16 * s + r];
                    } else if (T == FOLIO_Q6_K) {
                        scale = d * (float)(int8_t)w[t->sc + 16 * (2 * s) + r];
                        scaleB = d * (float)(int8_t)w[t->sc + 16 * (2 * s + 1) + r];
                    } else if (T == FOLIO_IQ4_XS) {
                        scale = d * (float)(int8_t)w[t->sc + 16 * s + r];
                    }
                    int32_t dotA = 0, dotB = 0; /* both passes summed (act_block) */
                    _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                        const int8_t *xb = (p ? a->xq2 : a->xq) + (r0 + i) * a->k + b * SB;
                        dotA *= p ? 254 : 1, dotB *= p ? 254 : 1;
                        for (int e = 0; e < 16; e++) dotA += value_of(t, T, w, r, s, e) * xb[e];
                        for (int e = 16; e < SB; e++) dotB += value_of(t, T, w, r, s, e) * xb[e];
                    }
                    if (T == FOLIO_Q6_K) {
                        acc[r] = fmaf((float)dotA, scale * ab->ds, acc[r]);
                        acc[r] = fmaf((float)dotB, scaleB * ab->ds, acc[r]);
                    } else {
                        acc[r] = fmaf((float)(dotA + dotB), scale * ab->ds, acc[r]);
                    }
                    if (HAS_MIN(T)) acc[r] = fmaf(bmin, ab->sx, acc[r]);
                    if (IS_K(T)) acc[r] = fmaf(-bmin, ab->sx, acc[r]);
                }
            }
        }
        store_row(a, r0 + i, col, count, acc);
    }
}
#endif

/* rows r0 .. r1 of x against one tile of type T, in passes of MC rows and then fewer; P: the
 * activations' passes, a constant in each copy so that the rows' sums stay in registers */
static inline __attribute__((always_inline)) void rows_of(const gemm_args *a, const int T, const int P,
                                                          const uint8_t *w, int64_t col, int64_t count, int64_t r0,
                                                          int64_t r1) {
    int64_t r = r0;
    for (; r + MC <= r1; r += MC) tile_rows(a, T, w, col, count, r, MC, P);
#if MC >= 8
    if (r + 4 <= r1) tile_rows(a, T, w, col, count, r, 4, P), r += 4;
#endif
#if MC >= 4
    if (r + 2 <= r1) tile_rows(a, T, w, col, count, r, 2, P), r += 2;
#endif
#if MC >= 2
    if (r + 1 <= r1) tile_rows(a, T, w, col, count, r, 1, P), r += 1;
#endif
}

#define ROWS_OF(T) (a->passes == 2 ? rows_of(a, T, 2, w, col, count, r0, r1) : rows_of(a, T, 1, w, col, count, r0, r1))

static void rows_of_type(const gemm_args *a, int type, const uint8_t *w, int64_t col, int64_t count, int64_t r0,
                         int64_t r1) {
    switch (type) {
        case FOLIO_Q4_0: ROWS_OF(FOLIO_Q4_0); break;
        case FOLIO_Q4_1: ROWS_OF(FOLIO_Q4_1); break;
        case FOLIO_Q5_0: ROWS_OF(FOLIO_Q5_0); break;
        case FOLIO_Q5_1: ROWS_OF(FOLIO_Q5_1); break;
        case FOLIO_Q8_0: ROWS_OF(FOLIO_Q8_0); break;
        case FOLIO_IQ4_NL: ROWS_OF(FOLIO_IQ4_NL); break;
        case FOLIO_Q4_K: ROWS_OF(FOLIO_Q4_K); break;
        case FOLIO_Q5_K: ROWS_OF(FOLIO_Q5_K); break;
        case FOLIO_Q6_K: ROWS_OF(FOLIO_Q6_K); break;
        case FOLIO_IQ4_XS: ROWS_OF(FOLIO_IQ4_XS); break;
        default: break;
    }
}

static void quantize_task(void *p) {
    gemm_args *a = p;
    const int elem = a->x_bf16 ? 2 : 4;
    for (;;) {
        const int64_t r = atomic_fetch_add(&a->next_row, 8);
        if (r >= a->m) return;
        for (int64_t i = r; i < r + 8 && i < a->m; i++)
            quantize_row((const char *)a->x + i * a->ldx * elem, (int)a->x_bf16, a->k, (int)a->passes,
                         (int8_t *)a->xq + i * a->k, (int8_t *)a->xq2 + i * a->k, (act_block *)a->blk + i * a->kb);
    }
}

static void gemm_task(void *p) {
    gemm_args *a = p;
    for (;;) {
        const int64_t u0 = atomic_fetch_add(&a->next, a->chunk);
        if (u0 >= a->units) return;
        const int64_t u1 = u0 + a->chunk < a->units ? u0 + a->chunk : a->units;
        for (int64_t u = u0; u < u1; u++) { /* unit: (block of MBLOCK rows, tile) */
            const int64_t m0 = (u / a->tiles) * MBLOCK, tile = u % a->tiles;
            const int64_t m1 = a->m - m0 < MBLOCK ? a->m : m0 + MBLOCK;
            int part = 0;
            while (tile >= a->tile0[part + 1]) part++;
            const folio_part *pt = &a->w->parts[part];
            const int64_t local = tile - a->tile0[part];
            const int64_t count = pt->n - local * FOLIO_TILE < FOLIO_TILE ? pt->n - local * FOLIO_TILE : FOLIO_TILE;
            rows_of_type(a, (int)pt->type, pt->data + local * a->tile_bytes[part], a->row0[part] + local * FOLIO_TILE,
                         count, m0, m1);
        }
    }
}

/* per-thread scratch for the quantized activations */
static __thread uint8_t *scratch;
static __thread size_t scratch_size;

static int check_matrix(const folio_matrix *x, const char *what) {
    if (x == NULL || x->data == NULL) return folio_fail(FOLIO_EINVAL, "%s: no data", what);
    if (x->dtype != FOLIO_F32 && x->dtype != FOLIO_BF16) return folio_fail(FOLIO_EINVAL, "%s: dtype %lld", what, (long long)x->dtype);
    if (x->rows < 0 || x->cols < 0 || x->stride < x->cols) return folio_fail(FOLIO_EINVAL, "%s: %lld x %lld, stride %lld", what,
                                                                           (long long)x->rows, (long long)x->cols, (long long)x->stride);
    return FOLIO_OK;
}

int64_t folio_check_weight(const folio_weight *w) {
    if (w == NULL || w->num_parts < 1 || w->num_parts > FOLIO_MAX_PARTS || w->k <= 0)
        return folio_fail(FOLIO_EINVAL, "weight: %lld parts", w ? (long long)w->num_parts : 0LL);
    int64_t n = 0;
    for (int64_t i = 0; i < w->num_parts; i++) {
        const folio_part *p = &w->parts[i];
        const type_info *t = info(p->type);
        if (t == NULL) return folio_fail(FOLIO_EINVAL, "weight part %lld: unknown type %lld", (long long)i, (long long)p->type);
        if (w->k % t->unit) return folio_fail(FOLIO_EINVAL, "weight: k %lld is not whole units of %d", (long long)w->k, t->unit);
        if (p->data == NULL || p->n <= 0 || p->nbytes != folio_tiles_bytes(p->type, p->n, w->k))
            return folio_fail(FOLIO_EINVAL, "weight part %lld: %lld bytes for %lld x %lld", (long long)i, (long long)p->nbytes,
                              (long long)p->n, (long long)w->k);
        n += p->n;
    }
    if (n != w->n) return folio_fail(FOLIO_EINVAL, "weight: parts of %lld rows, not %lld", (long long)n, (long long)w->n);
    return FOLIO_OK;
}

int64_t folio_gemm(const folio_weight *w, const folio_matrix *x, folio_matrix *y, int64_t passes, int64_t threads) {
    int rc;
    if ((rc = (int)folio_check_weight(w)) || (rc = check_matrix(x, "x")) || (rc = check_matrix(y, "y"))) return rc;
    if (x->cols != w->k) return folio_fail(FOLIO_EINVAL, "x has %lld columns, the weight %lld inputs", (long long)x->cols, (long long)w->k);
    if (y->rows != x->rows || y->cols != w->n)
        return folio_fail(FOLIO_EINVAL, "y is %lld x %lld, want %lld x %lld", (long long)y->rows, (long long)y->cols,
                          (long long)x->rows, (long long)w->n);
    if (passes != 1 && passes != 2) return folio_fail(FOLIO_EINVAL, "passes %lld", (long long)passes);
    const int64_t m = x->rows, k = w->k, kb = k / SB;
    if (m == 0) return FOLIO_OK;
    const size_t rows_bytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    const size_t need = 2 * rows_bytes + (size_t)(m * kb) * sizeof(act_block) + 64;
    if (need > scratch_size) {
        free(scratch);
        scratch = NULL;
        scratch_size = 0;
        if (posix_memalign((void **)&scratch, 64, need * 2)) return folio_fail(FOLIO_ENOMEM, "gemm: %zu bytes", need * 2);
        scratch_size = need * 2;
    }
    gemm_args a = {0};
    a.w = w, a.m = m, a.k = k, a.kb = kb, a.passes = passes;
    a.xq = (const int8_t *)scratch, a.xq2 = (const int8_t *)(scratch + rows_bytes);
    a.blk = (const act_block *)(scratch + 2 * rows_bytes);
    a.y = y->data, a.ldy = y->stride, a.y_bf16 = y->dtype == FOLIO_BF16;
    a.x = x->data, a.ldx = x->stride, a.x_bf16 = x->dtype == FOLIO_BF16;
    int64_t bytes = 0;
    for (int64_t i = 0; i < w->num_parts; i++) {
        a.tile0[i + 1] = a.tile0[i] + (w->parts[i].n + FOLIO_TILE - 1) / FOLIO_TILE;
        a.row0[i] = i ? a.row0[i - 1] + w->parts[i - 1].n : 0;
        a.tile_bytes[i] = k / info(w->parts[i].type)->unit * info(w->parts[i].type)->unit_bytes;
        bytes += w->parts[i].nbytes;
    }
    for (int64_t i = w->num_parts + 1; i <= FOLIO_MAX_PARTS; i++) a.tile0[i] = a.tile0[w->num_parts] + 1;
    a.tiles = a.tile0[w->num_parts];
    a.units = a.tiles * ((m + MBLOCK - 1) / MBLOCK);
    int64_t nth = threads < 1 ? folio_threads() : threads;
    /* below ~32 KB of weights a second thread costs more than it saves */
    if (bytes * (m < 4 ? 1 : 4) < (1 << 15)) nth = 1;
    /* a few long runs of tiles per thread: each a sequential stream the hardware prefetcher follows */
    a.chunk = nth > 1 ? (a.units / (2 * nth) > 1 ? a.units / (2 * nth) : 1) : a.units;
    folio_run_parallel(quantize_task, &a, nth > 1 && m * k >= (1 << 16));
    folio_run_parallel(gemm_task, &a, nth > 1);
    return FOLIO_OK;
}

const char *folio_gemm_path(void) { return GEMM_PATH; }
