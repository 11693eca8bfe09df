/* Private to the fast cpu scorer: the per-ISA kernels that score_fast.c drives. */
#ifndef MSAIDX_CPU_SCORE_FAST_H
#define MSAIDX_CPU_SCORE_FAST_H

#include "cpu.h"

/* Keys per packed panel: a panel is [head_dim][width] floats, width <= this, a multiple of 16,
 * so one 64-byte vector holds 16 consecutive keys of one dimension. */
#define MSAIDX_PANEL_KEYS 64

/* The most query rows keys_max takes: a decode token's heads, or a few tokens' (speculative
 * decoding). More rows repay a panel's packing. */
#define MSAIDX_FEW_ROWS 16

typedef struct msaidx_fast_kernels {
    const char *name;
    /* Decodes `rows` stored query rows into dst [rows][head_dim], in the layout panel_max reads:
     * floats, or for the BF16-pair kernel, pairs of bf16 in each 32-bit slot. Returns false when
     * the rows hold a value this kernel set cannot score exactly (then run `fallback`). */
    bool (*decode_q)(msaidx_dtype dtype, const void *src, int32_t rows, int32_t head_dim,
                     float *dst);
    /* Decodes `width` consecutive key rows (head_dim elements each) into a transposed panel
     * [head_dim][width] (the BF16-pair kernel: [head_dim / 2 rounded up to 16][width] pairs);
     * width is a multiple of 16, at most MSAIDX_PANEL_KEYS; panel 64-byte aligned. Returns false
     * as decode_q does. */
    bool (*pack_panel)(msaidx_dtype dtype, const void *keys, int32_t head_dim, int32_t width,
                       float *panel);
    /* For each of `rows` decoded query rows q [rows][head_dim], raises row_max[r] to the largest
     * dot product with the panel keys k < limit[r]. A NaN dot never wins, as in the reference. */
    void (*panel_max)(const float *q, int32_t rows, int32_t head_dim, const float *panel,
                      int32_t width, const int32_t *limit, float *row_max);
    /* For items of few query rows (decode), which panel_max would give too little work to repay
     * a panel's packing: raises row_max[r] for each of `rows` decoded query rows q (as decode_q
     * left them) to the largest dot product with the stored key rows k < limit[r] of `keys`
     * (width rows, a multiple of 16); rows <= MSAIDX_FEW_ROWS. Returns false, as pack_panel does,
     * on keys this set cannot score exactly; row_max may then hold the maximum of some keys, which
     * any later pass over all of them keeps right. It prefetches next_bytes from `next` (NULL:
     * none) into L2 a little with each group of keys. NULL: the set has none, and panels score
     * every item. */
    bool (*keys_max)(msaidx_dtype dtype, const void *keys, int32_t head_dim, int32_t width,
                     const float *q, int32_t rows, const int32_t *limit, float *row_max,
                     const void *next, size_t next_bytes);
    /* What scores the data this set refuses (NULL: it refuses none); it refuses none itself. */
    const struct msaidx_fast_kernels *fallback;
} msaidx_fast_kernels;

extern const msaidx_fast_kernels msaidx_fast_scalar;
#if defined(__x86_64__) || defined(__i386__)
extern const msaidx_fast_kernels msaidx_fast_avx2;
extern const msaidx_fast_kernels msaidx_fast_avx512;
/* The AVX512-BF16 dot product (two exact products per lane, FP32 accumulation) doubles the
 * arithmetic rate. E4M3 values are all normal bf16; BF16 rows or panels holding a subnormal,
 * which the instruction flushes to zero, go to the avx512 kernels. */
extern const msaidx_fast_kernels msaidx_fast_avx512_bf16;
#endif

#endif /* MSAIDX_CPU_SCORE_FAST_H */
