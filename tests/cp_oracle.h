/* The context-parallel tests' own reading of msaidx_cp_layout (SPEC.md section 12), written from
 * the SPEC and not from the library, shared by the host and the device test. */
#ifndef MSAIDX_TEST_CP_ORACLE_H
#define MSAIDX_TEST_CP_ORACLE_H

#include <msaidx.h>
#include <stdbool.h>
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

#endif
