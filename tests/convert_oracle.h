/* Conversion oracles of the tests, independent of src/convert.h: E4M3 by nearest value in the
 * sorted table of all finite E4M3 values (exact midpoints in double, ties to the even code),
 * BF16 by comparing the distances to the two neighbouring BF16 values in double. */
#ifndef MSAIDX_TEST_CONVERT_ORACLE_H
#define MSAIDX_TEST_CONVERT_ORACLE_H

#include "backend_cases.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Positive finite E4M3 values by code 0x00..0x7E: increasing with the code. */
typedef struct e4m3_table {
    double value[127];
} e4m3_table;

static inline void e4m3_table_init(e4m3_table *table) {
    for (int code = 0; code < 127; ++code) table->value[code] = bc_e4m3_value((uint8_t)code);
}

/* Largest code whose value is <= magnitude (magnitude in [0, 448)). */
static inline int e4m3_floor_code(const e4m3_table *table, double magnitude) {
    int lo = 0, hi = 126;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table->value[mid] <= magnitude)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Nearest of codes `below` and below + 1 (ties to the even code). */
static inline uint8_t e4m3_round_between(const e4m3_table *table, int below, double magnitude) {
    const double midpoint = 0.5 * (table->value[below] + table->value[below + 1]);
    if (magnitude < midpoint) return (uint8_t)below;
    if (magnitude > midpoint) return (uint8_t)(below + 1);
    return (uint8_t)(below % 2 == 0 ? below : below + 1);
}

/* SPEC.md section 8: RNE, saturating to 448 at and above 448 (464 ties to 448), NaN -> 0x7F. */
static inline uint8_t e4m3_oracle(const e4m3_table *table, float x) {
    if (isnan(x)) return 0x7F;
    const uint8_t sign = signbit(x) ? 0x80 : 0x00;
    const double magnitude = fabs((double)x);
    if (magnitude >= 448.0) return sign | 0x7E;
    return sign | e4m3_round_between(table, e4m3_floor_code(table, magnitude), magnitude);
}

/* BF16 of a non-NaN float, round to nearest, ties to even. */
static inline uint16_t bf16_oracle(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint16_t below = (uint16_t)((bits >> 16) & 0x7FFFu); /* truncation toward zero */
    const double magnitude = fabs((double)x);
    if (isinf(x)) return sign | 0x7F80;
    const double low = bc_bf16_value(below);
    /* Above the largest finite BF16 the next step would be 2^128, which rounds to infinity. */
    const double high =
        below + 1 == 0x7F80 ? ldexp(1.0, 128) : bc_bf16_value((uint16_t)(below + 1));
    const double to_low = magnitude - low, to_high = high - magnitude;
    uint16_t code;
    if (to_low < to_high)
        code = below;
    else if (to_low > to_high)
        code = (uint16_t)(below + 1);
    else
        code = below % 2 == 0 ? below : (uint16_t)(below + 1);
    return sign | code;
}

static inline float float_of_bits(uint32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

#endif
