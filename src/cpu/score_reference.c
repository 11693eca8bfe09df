/* The scalar reference scorer: obviously right, one (row, page) cell at a time. */
#include "../convert.h"
#include "cpu.h"

#include <math.h>
#include <stdlib.h>

void msaidx_cpu_decode(msaidx_dtype dtype, const void *src, float *dst, int32_t n) {
    if (dtype == MSAIDX_DTYPE_BF16) {
        const uint16_t *bits = src;
        for (int32_t i = 0; i < n; ++i) dst[i] = msaidx_bf16_decode(bits[i]);
    } else {
        const uint8_t *codes = src;
        for (int32_t i = 0; i < n; ++i) dst[i] = msaidx_e4m3_decode(codes[i]);
    }
}

void msaidx_cpu_scores_reference(const msaidx_cpu_batch *batch) {
    const msaidx_config *c = batch->config;
    const msaidx_batch_desc *d = batch->desc;
    const int32_t D = c->head_dim, P = c->page_size, H = c->num_heads;
    const size_t elem = (size_t)msaidx_elem_size(c->dtype);
    float *q_row = malloc(sizeof(float) * (size_t)D);
    float *k_row = malloc(sizeof(float) * (size_t)D);
    if (!q_row || !k_row) { /* reference path only: no memory, no scores */
        free(q_row);
        free(k_row);
        return;
    }
    for (int32_t b = 0; b < d->batch_size; ++b) {
        const int32_t first = batch->cu_seqlens_q[b], q_len = batch->cu_seqlens_q[b + 1] - first;
        const int32_t *pages = batch->block_table + (size_t)b * d->bt_stride;
        for (int32_t i = 0; i < q_len; ++i) {
            const int32_t t = first + i;
            const int32_t pos = batch->seq_lens[b] - q_len + i;
            const int32_t nvp = pos / P + 1;
            for (int32_t h = 0; h < H; ++h) {
                const size_t row = (size_t)t * H + h;
                msaidx_cpu_decode(c->dtype, (const char *)batch->q + row * D * elem, q_row, D);
                for (int32_t p = 0; p < nvp; ++p) {
                    const char *page =
                        (const char *)batch->k_cache + (size_t)pages[p] * d->page_stride;
                    double best = -INFINITY;
                    for (int32_t j = 0; j < P && p * P + j <= pos; ++j) {
                        msaidx_cpu_decode(c->dtype, page + (size_t)j * D * elem, k_row, D);
                        double dot = 0.0;
                        for (int32_t e = 0; e < D; ++e) dot += (double)q_row[e] * (double)k_row[e];
                        if (dot > best) best = dot;
                    }
                    batch->scores[row * d->pitch + p] = (float)best;
                }
            }
        }
    }
    free(q_row);
    free(k_row);
}
