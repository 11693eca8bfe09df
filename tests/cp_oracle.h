/* The context-parallel tests' own reading of msaidx_cp_layout (SPEC.md section 12), written from
 * the SPEC and not from the library, shared by the host and the device test. */
#ifndef MSAIDX_TEST_CP_ORACLE_H
#define MSAIDX_TEST_CP_ORACLE_H

#include "harness.h"

#include <math.h>
#include <msaidx.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

static inline int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

/* Whether rank r of W owns page j of a request of P pages. */
static inline bool owns(int32_t layout, int32_t W, int32_t r, int32_t P, int32_t j) {
    if (layout == MSAIDX_CP_INTERLEAVED) return j % W == r;
    const int32_t chunk = ceil_div(P, W);
    return j >= r * chunk && j < (r + 1) * chunk;
}

/* Global page of local index i (the i-th page rank r owns), or -1 past its pages. */
static inline int32_t global_page(int32_t layout, int32_t W, int32_t r, int32_t P, int32_t i) {
    for (int32_t j = 0, seen = 0; j < P; ++j)
        if (owns(layout, W, r, P, j) && seen++ == i) return j;
    return -1;
}

/* Every global page rank r owns, by local index, into `map` (P entries at most), in one walk
 * over the request's pages (global_page walks once per page: quadratic on 1M-token rows).
 * Returns how many. */
static inline int32_t owned_pages(int32_t layout, int32_t W, int32_t r, int32_t P, int32_t *map) {
    int32_t count = 0;
    for (int32_t j = 0; j < P; ++j)
        if (owns(layout, W, r, P, j)) map[count++] = j;
    return count;
}

/* How many of the pages [0, n) of the request rank r owns. */
static inline int32_t owned_below(int32_t layout, int32_t W, int32_t r, int32_t P, int32_t n) {
    int32_t count = 0;
    for (int32_t j = 0; j < n && j < P; ++j) count += owns(layout, W, r, P, j);
    return count;
}

/* SPEC section 4's order on (score, page) with NaN as -inf, for qsort: best first. */
static inline int oracle_candidate_order(const void *a, const void *b) {
    const float *x = (const float *)a, *y = (const float *)b; /* {score, page} */
    const float sx = isnan(x[0]) ? -INFINITY : x[0], sy = isnan(y[0]) ? -INFINITY : y[0];
    if (sx != sy) return sx > sy ? -1 : 1;
    return (x[1] > y[1]) - (x[1] < y[1]);
}

static inline int oracle_ascending(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The merge of one row as msaidx_merge_candidates documents it, by sorting: the candidates with
 * pages in [init, n - local), each page once at its highest score, in SPEC order; the best
 * topk - init - local of them ascending between the forced pages; -1 after. Pages are carried as
 * floats, exact for the |page| < 2^24 the tests use. `pool` holds 2 x W x topk floats. */
static inline void oracle_merge_row(int32_t W, int32_t topk, int32_t init, int32_t local, int32_t n,
                                    const float *scores, const int32_t *pages, int64_t rank_stride,
                                    float *pool, int32_t *out) {
    int32_t k = 0;
    if (n > topk) {
        const int32_t lo = init, hi = n - local;
        int32_t count = 0;
        for (int32_t r = 0; r < W; ++r)
            for (int32_t i = 0; i < topk; ++i) {
                const int32_t p = pages[r * rank_stride + i];
                if (p < lo || p >= hi) continue;
                pool[2 * count] = scores[r * rank_stride + i];
                pool[2 * count + 1] = (float)p;
                ++count;
            }
        qsort(pool, (size_t)count, 2 * sizeof(float), oracle_candidate_order);
        int32_t chosen[64], num = 0;
        for (int32_t c = 0; c < count && num < topk - init - local; ++c) {
            bool again = false; /* a lower copy of a page already taken */
            for (int32_t j = 0; j < num; ++j) again |= (float)chosen[j] == pool[2 * c + 1];
            if (!again) chosen[num++] = (int32_t)pool[2 * c + 1];
        }
        qsort(chosen, (size_t)num, sizeof(int32_t), oracle_ascending);
        for (int32_t p = 0; p < init; ++p) out[k++] = p;
        for (int32_t j = 0; j < num; ++j) out[k++] = chosen[j];
        for (int32_t p = hi; p < n; ++p) out[k++] = p;
    } else {
        for (; k < n; ++k) out[k] = k;
    }
    for (; k < topk; ++k) out[k] = -1;
}

/* Candidates no rank would send, for the merge's hostile cases: pages anywhere (negative, repeated,
 * far past nvp, the int32 extremes), NaN and infinite scores, with `ties` every score 0 or 1; and
 * any nvp, negative and huge included. */
static inline void hostile_candidates(harness_rng *rng, float *scores, int32_t *pages, size_t count,
                                      int32_t *nvp, int32_t num_tokens, bool ties) {
    static const int32_t hostile_pages[] = {-1, -2, 0, 1, 2, 3, 17, 100, INT32_MAX, INT32_MIN};
    static const float hostile_scores[] = {0.0f, 1.0f, -1.0f, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < count; ++i) {
        scores[i] = hostile_scores[harness_int(rng, 0, 5)];
        pages[i] = harness_int(rng, 0, 1) ? hostile_pages[harness_int(rng, 0, 9)]
                                          : (int32_t)harness_int(rng, -3, 120);
        if (ties) scores[i] = hostile_scores[harness_int(rng, 0, 1)];
    }
    for (int32_t t = 0; t < num_tokens; ++t)
        nvp[t] = harness_int(rng, 0, 3) ? (int32_t)harness_int(rng, -2, 130)
                                        : hostile_pages[harness_int(rng, 0, 9)];
}

#endif
