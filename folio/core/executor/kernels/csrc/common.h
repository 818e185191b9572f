/* What the CPU kernels share (folio/core/executor/kernels/csrc): a vectorisable exp, bf16 and fp16 conversions.
 * Compiled with -ffp-contract=off, so that plain arithmetic rounds as torch's does; fmaf is asked
 * for by name where a fused multiply-add is wanted. */

#ifndef FOLIO_CSRC_COMMON_H
#define FOLIO_CSRC_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 within 2 ulp, exactly 0 below -87.3 (a -inf logit is never drawn); written
 * so that the loops around it vectorise (no calls, no branches) */
static inline float exp_nonpositive(float x) {
    const float lo = -87.3f;
    float xc = x < lo ? lo : x;
    float n = nearbyintf(xc * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, xc); /* ln 2 in two parts (Cody-Waite) */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lo ? 0.0f : p * scale;
}

/* bf16 <-> fp32, as torch converts (round to nearest even; NaN stays NaN) */
static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* IEEE half -> float (exact), for the plain C paths */
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

#endif
