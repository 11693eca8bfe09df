/* Portable kernels of the fast scorer: plain C over the same packed layout as the SIMD ones. */
#include "score_fast.h"

#include <math.h>
#include <string.h>

static bool scalar_decode_q(msaidx_dtype dtype, const void *src, int32_t rows, int32_t head_dim,
                            float *dst) {
    msaidx_cpu_decode(dtype, src, dst, rows * head_dim);
    return true;
}

static bool scalar_pack_panel(msaidx_dtype dtype, const void *keys, int32_t head_dim, int32_t width,
                              float *panel) {
    const size_t elem = (size_t)msaidx_elem_size(dtype);
    float row[256]; /* head_dim <= 256 */
    for (int32_t k = 0; k < width; ++k) {
        msaidx_cpu_decode(dtype, (const char *)keys + (size_t)k * head_dim * elem, row, head_dim);
        for (int32_t d = 0; d < head_dim; ++d) panel[(size_t)d * width + k] = row[d];
    }
    return true;
}

/* Four floats of portable GNU C vector: SSE2 or NEON where present, plain floats elsewhere.
 * Written out because the auto-vectorizer picks the dimension loop, an in-order reduction. */
typedef float float4 __attribute__((vector_size(16)));

/* Two rows x sixteen keys at a time: each key load feeds two rows, and the accumulators fit
 * the 16 vector registers of baseline x86-64. */
static void scalar_panel_max(const float *q, int32_t rows, int32_t head_dim, const float *panel,
                             int32_t width, const int32_t *limit, float *row_max) {
    for (int32_t r = 0; r < rows; r += 2) {
        const int32_t pair = rows - r < 2 ? 1 : 2;
        const float *q0 = q + (size_t)r * head_dim;
        const float *q1 = pair == 2 ? q0 + head_dim : q0;
        for (int32_t k0 = 0; k0 < width; k0 += 16) {
            float4 acc[2][4] = {{{0}}};
            for (int32_t d = 0; d < head_dim; ++d) {
                float4 keys[4];
                memcpy(keys, panel + (size_t)d * width + k0, sizeof keys);
                for (int v = 0; v < 4; ++v) {
                    acc[0][v] += q0[d] * keys[v];
                    acc[1][v] += q1[d] * keys[v];
                }
            }
            for (int32_t i = 0; i < pair; ++i) {
                float dots[16];
                memcpy(dots, acc[i], sizeof dots);
                for (int32_t l = 0; l < 16 && k0 + l < limit[r + i]; ++l)
                    if (dots[l] > row_max[r + i]) row_max[r + i] = dots[l];
            }
        }
    }
}

const msaidx_fast_kernels msaidx_fast_scalar = {
    .name = "scalar",
    .decode_q = scalar_decode_q,
    .pack_panel = scalar_pack_panel,
    .panel_max = scalar_panel_max,
};
