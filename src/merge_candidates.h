/* The context-parallel merge of one row (SPEC.md section 12): the order, the candidates and the
 * layout of a merged row, shared by the cpu backend and the CUDA merge kernel so that both give
 * the same ids on any input. */
#ifndef MSAIDX_MERGE_CANDIDATES_H
#define MSAIDX_MERGE_CANDIDATES_H

#include "internal.h"

#include <math.h>

/* SPEC section 4's order: higher score first, ties to the lower page (NaN already -inf). */
MSAIDX_SHARD_FN bool msaidx_candidate_above(float a, int32_t page_a, float b, int32_t page_b) {
    return a > b || (a == b && page_a < page_b);
}

/* Below every candidate in the order (pages are < INT32_MAX): "none found". */
#define MSAIDX_MERGE_NONE_SCORE (-INFINITY)
#define MSAIDX_MERGE_NONE_PAGE INT32_MAX

/* Candidate i of rank r of a row (scores and pages point at the row in rank 0's block): its page
 * and its score, NaN as -inf. The merge chooses among the pages in [init_blocks, n - local_blocks)
 * only. */
MSAIDX_SHARD_FN void msaidx_merge_candidate(const float *scores, const int32_t *pages,
                                            int64_t rank_stride, int64_t r, int32_t i, float *score,
                                            int32_t *page) {
    const int64_t at = r * rank_stride + i;
    *page = pages[at];
    const float raw = scores[at];
    *score = isnan(raw) ? -INFINITY : raw;
}

/* Entry k of a merged row that is not one of the num chosen pages: the forced init pages
 * [0, init_blocks) first, after the chosen ones the forced local pages [hi, hi + local_blocks),
 * then -1. */
MSAIDX_SHARD_FN int32_t msaidx_merge_forced(int32_t k, int32_t init_blocks, int32_t local_blocks,
                                            int32_t num, int32_t hi) {
    if (k < init_blocks) return k;
    const int32_t after = k - init_blocks - num;
    return after < local_blocks ? hi + after : -1;
}

/* One row (t, h) of the merge: from the candidates of world_size ranks (rank r's topk of the row
 * at r * rank_stride elements of scores and pages, which point at rank 0's), the selection of a
 * row with n = nvp[t] global visible pages into out[0, topk): the forced init and local pages, and
 * the free slots filled with the best pages outside them, each page at its best copy (a page sent
 * more than once counts once, with its highest score), in ascending order. Every page of the
 * global best is among its rank's best topk (a rank's best topk hold at least topk - its forced
 * pages >= the free slots of the non-forced ones).
 *
 * One pass over the candidates keeps the best `slots` distinct pages seen so far, best first, each
 * at its best copy so far: a page already kept moves up when a better copy arrives; a page not
 * kept enters when it beats the last one (an earlier copy of it, if any, was below the last one
 * then, and the last one only rises). So the result does not depend on where a candidate sits. The
 * CUDA kernel gives the same pages with a warp per row (ranked or walked down the order). */
MSAIDX_SHARD_FN void msaidx_merge_row(int32_t world_size, int32_t topk, int32_t init_blocks,
                                      int32_t local_blocks, int32_t n, const float *scores,
                                      const int32_t *pages, int64_t rank_stride, int32_t *out) {
    if (n <= topk) {
        for (int32_t k = 0; k < topk; ++k) out[k] = k < n ? k : -1;
        return;
    }
    const int32_t slots = topk - init_blocks - local_blocks;
    const int32_t lo = init_blocks, hi = n - local_blocks;
    float best_score[MSAIDX_MAX_TOPK];
    int32_t chosen[MSAIDX_MAX_TOPK];
    int32_t num = 0;
    for (int32_t r = 0; r < world_size && slots > 0; ++r)
        for (int32_t i = 0; i < topk; ++i) {
            float v;
            int32_t p;
            msaidx_merge_candidate(scores, pages, rank_stride, r, i, &v, &p);
            if (p < lo || p >= hi) continue;
            if (num == slots &&
                !msaidx_candidate_above(v, p, best_score[slots - 1], chosen[slots - 1]))
                continue;
            int32_t j = 0; /* where p is kept, else num (a new page) */
            while (j < num && chosen[j] != p) ++j;
            if (j < num && !(v > best_score[j])) continue;     /* not a better copy */
            if (j == num) j = num < slots ? num++ : slots - 1; /* a new page: over the last one */
            for (; j > 0 && msaidx_candidate_above(v, p, best_score[j - 1], chosen[j - 1]); --j) {
                best_score[j] = best_score[j - 1];
                chosen[j] = chosen[j - 1];
            }
            best_score[j] = v;
            chosen[j] = p;
        }
    for (int32_t i = 1; i < num; ++i) { /* ascending: insertion sort of <= 64 */
        const int32_t page = chosen[i];
        int32_t j = i;
        for (; j > 0 && chosen[j - 1] > page; --j) chosen[j] = chosen[j - 1];
        chosen[j] = page;
    }
    for (int32_t k = 0; k < topk; ++k) {
        const int32_t at = k - init_blocks;
        out[k] = at >= 0 && at < num ? chosen[at]
                                     : msaidx_merge_forced(k, init_blocks, local_blocks, num, hi);
    }
}

#endif
