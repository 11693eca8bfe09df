/* Scalar E4M3 / BF16 <-> float, inline so the cpu backend's inner loops can use them. */
#ifndef MSAIDX_CONVERT_H
#define MSAIDX_CONVERT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t msaidx_float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float msaidx_bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Round-to-nearest-even, saturating to +-448; NaN -> 0x7F. */
static inline uint8_t msaidx_e4m3_encode(float x) {
    uint32_t u = msaidx_float_bits(x);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t magnitude = u & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return 0x7F;
    if (magnitude >= 0x43E80000u) return sign | 0x7E; /* >= 464 (and inf): saturate to 448 */
    if (magnitude < 0x3C800000u) {                    /* below 2^-6: subnormal step 2^-9 */
        /* Steps of 2^-9, rounded to nearest even on the bits (nearbyintf would follow the
         * caller's rounding mode): magnitude = m * 2^(e - 150), m with its implicit bit. */
        const int32_t e = (int32_t)(magnitude >> 23);
        if (e < 117) return sign; /* below 2^-10: rounds to 0 (2^-10 itself ties to 0) */
        const uint32_t m = (magnitude & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = (uint32_t)(141 - e); /* steps = m >> shift, shift in [21, 24] */
        uint32_t steps = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (steps & 1u))) ++steps;
        return sign | (uint8_t)steps; /* 8 steps is the smallest normal, 0x08 */
    }
    /* Normal: keep 3 mantissa bits, ties to even, by rounding the float's bit pattern. */
    uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
    uint32_t exponent = (rounded >> 23) - 127u + 7u;
    uint32_t mantissa = (rounded >> 20) & 7u;
    return sign | (uint8_t)((exponent << 3) | mantissa);
}

static inline float msaidx_e4m3_decode(uint8_t code) {
    uint32_t sign = (uint32_t)(code & 0x80u) << 24;
    uint32_t exponent = (code >> 3) & 0xFu;
    uint32_t mantissa = code & 7u;
    if (exponent == 0xFu && mantissa == 7u) return msaidx_bits_float(sign | 0x7FC00000u);
    if (exponent == 0) { /* subnormal: mantissa * 2^-9 */
        float value = (float)mantissa * (1.0f / 512.0f);
        return sign ? -value : value;
    }
    return msaidx_bits_float(sign | ((exponent - 7u + 127u) << 23) | (mantissa << 20));
}

static inline uint16_t msaidx_bf16_encode(float x) {
    uint32_t u = msaidx_float_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float msaidx_bf16_decode(uint16_t bits) {
    return msaidx_bits_float((uint32_t)bits << 16);
}

#endif /* MSAIDX_CONVERT_H */
