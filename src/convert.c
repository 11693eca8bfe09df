/* Host conversions between float and the storage formats (SPEC.md section 8). The arrays may
 * sit at any byte address (numpy views need not be aligned), so elements wider than a byte are
 * moved with memcpy: a misaligned float or uint16_t access is undefined behaviour in C. */
#include "convert.h"
#include "internal.h"

#include <string.h>

void msaidx_e4m3_from_float(const float *src, uint8_t *dst, size_t n) {
    const unsigned char *src_bytes = (const unsigned char *)src;
    for (size_t i = 0; i < n; ++i) {
        float value;
        memcpy(&value, src_bytes + i * sizeof value, sizeof value);
        dst[i] = msaidx_e4m3_encode(value);
    }
}

void msaidx_e4m3_to_float(const uint8_t *src, float *dst, size_t n) {
    unsigned char *dst_bytes = (unsigned char *)dst;
    for (size_t i = 0; i < n; ++i) {
        const float value = msaidx_e4m3_decode(src[i]);
        memcpy(dst_bytes + i * sizeof value, &value, sizeof value);
    }
}

void msaidx_bf16_from_float(const float *src, uint16_t *dst, size_t n) {
    const unsigned char *src_bytes = (const unsigned char *)src;
    unsigned char *dst_bytes = (unsigned char *)dst;
    for (size_t i = 0; i < n; ++i) {
        float value;
        memcpy(&value, src_bytes + i * sizeof value, sizeof value);
        const uint16_t bits = msaidx_bf16_encode(value);
        memcpy(dst_bytes + i * sizeof bits, &bits, sizeof bits);
    }
}

void msaidx_bf16_to_float(const uint16_t *src, float *dst, size_t n) {
    const unsigned char *src_bytes = (const unsigned char *)src;
    unsigned char *dst_bytes = (unsigned char *)dst;
    for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        memcpy(&bits, src_bytes + i * sizeof bits, sizeof bits);
        const float value = msaidx_bf16_decode(bits);
        memcpy(dst_bytes + i * sizeof value, &value, sizeof value);
    }
}
