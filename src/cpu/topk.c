/* Top-k block selection on the host (SPEC.md section 4). */
#include "cpu.h"

#include <math.h>

/* NaN ranks as -inf; equal scores go to the lower page. */
static inline float rank_value(float score) { return isnan(score) ? -INFINITY : score; }
static inline int ranks_above(float a, int32_t page_a, float b, int32_t page_b) {
    return a > b || (a == b && page_a < page_b);
}

/* Writes the forced blocks, sorts `chosen` pages ascending into out, pads with -1. */
static void emit_row(const msaidx_config *c, int32_t nvp, int32_t *chosen, int32_t num_chosen,
                     int32_t *out) {
    if (nvp <= 0) {
        for (int32_t k = 0; k < c->topk; ++k) out[k] = -1;
        return;
    }
    if (nvp <= c->topk) {
        for (int32_t k = 0; k < c->topk; ++k) out[k] = k < nvp ? k : -1;
        return;
    }
    int32_t n = 0;
    for (int32_t p = 0; p < c->init_blocks; ++p) out[n++] = p;
    for (int32_t i = 1; i < num_chosen; ++i) { /* insertion sort: at most 64 entries */
        int32_t page = chosen[i], j = i;
        for (; j > 0 && chosen[j - 1] > page; --j) chosen[j] = chosen[j - 1];
        chosen[j] = page;
    }
    for (int32_t i = 0; i < num_chosen; ++i) out[n++] = chosen[i];
    for (int32_t p = nvp - c->local_blocks; p < nvp; ++p) out[n++] = p;
}

void msaidx_cpu_topk_reference(const msaidx_config *c, const float *scores, int32_t pitch,
                               const int32_t *nvp, int32_t num_tokens, int32_t *out) {
    const int32_t H = c->num_heads;
    for (int64_t row = 0; row < (int64_t)num_tokens * H; ++row) {
        const int32_t n = nvp[row / H];
        const float *s = scores + row * pitch;
        int32_t chosen[MSAIDX_MAX_TOPK];
        int32_t num_chosen = 0;
        if (n > c->topk) {
            /* Repeatedly take the best page not yet taken. */
            const int32_t slots = c->topk - c->init_blocks - c->local_blocks;
            for (; num_chosen < slots; ++num_chosen) {
                int32_t best = -1;
                for (int32_t p = c->init_blocks; p < n - c->local_blocks; ++p) {
                    int taken = 0;
                    for (int32_t i = 0; i < num_chosen; ++i) taken |= chosen[i] == p;
                    if (taken) continue;
                    if (best < 0 || ranks_above(rank_value(s[p]), p, rank_value(s[best]), best))
                        best = p;
                }
                chosen[num_chosen] = best;
            }
        }
        emit_row(c, n, chosen, num_chosen, out + row * c->topk);
    }
}

void msaidx_cpu_topk_fast(const msaidx_config *c, const float *scores, int32_t pitch,
                          const int32_t *nvp, int32_t num_tokens, int32_t *out) {
    msaidx_cpu_topk_fast_strided(c, scores, pitch, nvp, num_tokens, out,
                                 (int64_t)c->num_heads * c->topk, c->topk);
}

void msaidx_cpu_topk_fast_strided(const msaidx_config *c, const float *scores, int32_t pitch,
                                  const int32_t *nvp, int32_t num_tokens, int32_t *out,
                                  int64_t out_stride_t, int64_t out_stride_h) {
    const int32_t H = c->num_heads;
    const int64_t rows = (int64_t)num_tokens * H;
#pragma omp parallel for schedule(dynamic, 16) num_threads(msaidx_cpu_threads(c))
    for (int64_t row = 0; row < rows; ++row) {
        const int32_t n = nvp[row / H];
        const float *s = scores + row * pitch;
        /* The best `slots` pages so far, kept sorted best-first; a page enters only if it
         * ranks above the current worst, so most pages cost one comparison. */
        float best_score[MSAIDX_MAX_TOPK];
        int32_t best_page[MSAIDX_MAX_TOPK];
        int32_t num_best = 0;
        if (n > c->topk) {
            const int32_t slots = c->topk - c->init_blocks - c->local_blocks;
            for (int32_t p = c->init_blocks; p < n - c->local_blocks && slots > 0; ++p) {
                const float v = rank_value(s[p]);
                if (num_best == slots &&
                    !ranks_above(v, p, best_score[slots - 1], best_page[slots - 1]))
                    continue;
                int32_t j = num_best < slots ? num_best++ : slots - 1;
                for (; j > 0 && ranks_above(v, p, best_score[j - 1], best_page[j - 1]); --j) {
                    best_score[j] = best_score[j - 1];
                    best_page[j] = best_page[j - 1];
                }
                best_score[j] = v;
                best_page[j] = p;
            }
        }
        emit_row(c, n, best_page, num_best,
                 out + (row / H) * out_stride_t + (row % H) * out_stride_h);
    }
}
