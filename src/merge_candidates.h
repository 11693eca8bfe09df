/* The context-parallel merge of one row (SPEC.md section 12), shared by the cpu backend and the
 * CUDA merge kernel so that both give the same ids on any input. */
#ifndef MSAIDX_MERGE_CANDIDATES_H
#define MSAIDX_MERGE_CANDIDATES_H

#include "internal.h"

#include <math.h>

/* SPEC section 4's order: higher score first, ties to the lower page (NaN already -inf). */
MSAIDX_SHARD_FN bool msaidx_candidate_above(float a, int32_t page_a, float b, int32_t page_b) {
    return a > b || (a == b && page_a < page_b);
}

/* One row (t, h) of the merge: from the candidates of world_size ranks (rank r's topk of the row
 * at r * rank_stride elements of scores and pages, which point at rank 0's), the selection of a
 * row with n = nvp[t] global visible pages into out[0, topk): the forced init and local pages, and
 * the free slots filled with the best candidates outside them, each page once. Every page of the
 * global best is among its rank's best topk (a rank's best topk hold at least topk - its forced
 * pages >= the free slots of the non-forced ones). */
MSAIDX_SHARD_FN void msaidx_merge_row(int32_t world_size, int32_t topk, int32_t init_blocks,
                                      int32_t local_blocks, int32_t n, const float *scores,
                                      const int32_t *pages, int64_t rank_stride, int32_t *out) {
    int32_t k = 0;
    if (n > topk) {
        const int32_t slots = topk - init_blocks - local_blocks;
        const int32_t lo = init_blocks, hi = n - local_blocks;
        float best_score[MSAIDX_MAX_TOPK];
        int32_t best_page[MSAIDX_MAX_TOPK];
        int32_t num_best = 0;
        for (int32_t r = 0; r < world_size && slots > 0;
             ++r, scores += rank_stride, pages += rank_stride) {
            for (int32_t i = 0; i < topk; ++i) {
                const int32_t p = pages[i];
                const float raw = scores[i];
                const float v = isnan(raw) ? -INFINITY : raw;
                if (p < lo || p >= hi) continue;
                if (num_best == slots &&
                    !msaidx_candidate_above(v, p, best_score[slots - 1], best_page[slots - 1]))
                    continue;
                bool seen = false;
                for (int32_t j = 0; j < num_best; ++j) seen |= best_page[j] == p;
                if (seen) continue;
                int32_t j = num_best < slots ? num_best++ : slots - 1;
                for (; j > 0 && msaidx_candidate_above(v, p, best_score[j - 1], best_page[j - 1]);
                     --j) {
                    best_score[j] = best_score[j - 1];
                    best_page[j] = best_page[j - 1];
                }
                best_score[j] = v;
                best_page[j] = p;
            }
        }
        for (int32_t i = 1; i < num_best; ++i) { /* ascending: insertion sort of <= 64 */
            const int32_t page = best_page[i];
            int32_t j = i;
            for (; j > 0 && best_page[j - 1] > page; --j) best_page[j] = best_page[j - 1];
            best_page[j] = page;
        }
        for (int32_t p = 0; p < init_blocks; ++p) out[k++] = p;
        for (int32_t i = 0; i < num_best; ++i) out[k++] = best_page[i];
        for (int32_t p = hi; p < n; ++p) out[k++] = p;
    } else {
        for (; k < n; ++k) out[k] = k;
    }
    for (; k < topk; ++k) out[k] = -1;
}

#endif
