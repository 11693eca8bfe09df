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

/* How many of the pages [0, n) of the request rank r owns. */
static inline int32_t owned_below(int32_t layout, int32_t W, int32_t r, int32_t P, int32_t n) {
    int32_t count = 0;
    for (int32_t j = 0; j < n && j < P; ++j) count += owns(layout, W, r, P, j);
    return count;
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
