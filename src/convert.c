/* Host conversions between float and the storage formats (SPEC.md section 8). */
#include "internal.h"
#include "convert.h"

void msaidx_e4m3_from_float(const float *src, uint8_t *dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = msaidx_e4m3_encode(src[i]);
}

void msaidx_e4m3_to_float(const uint8_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = msaidx_e4m3_decode(src[i]);
}

void msaidx_bf16_from_float(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = msaidx_bf16_encode(src[i]);
}

void msaidx_bf16_to_float(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = msaidx_bf16_decode(src[i]);
}
