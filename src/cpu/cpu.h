/* The cpu backend's pieces, shared with the tests (which force the scalar reference). */
#ifndef MSAIDX_CPU_H
#define MSAIDX_CPU_H

#include "../internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Worker threads for one call: config.num_threads, or one per core the process may run on.
 * Not OpenMP's default team size: OMP_NUM_THREADS can ask for far more threads than
 * config.num_threads admits, and the runtime crashes on stack space past a few thousand. */
static inline int msaidx_cpu_threads(const msaidx_config *config) {
#ifdef _OPENMP
    return config->num_threads > 0 ? config->num_threads : omp_get_num_procs();
#else
    (void)config;
    return 1;
#endif
}

/* A validated batch in host memory, as the scorers see it. */
typedef struct msaidx_cpu_batch {
    const msaidx_config *config;
    const msaidx_batch_desc *desc;
    const int32_t *cu_seqlens_q;
    const int32_t *seq_lens;
    const int32_t *block_table;
    const void *q;
    const void *k_cache;
    float *scores;
} msaidx_cpu_batch;

/* Checks host metadata (naming the first bad entry) and fills nvp [num_tokens]. The visible
 * entries of each block-table row are copied to table_copy (row stride table_stride, >= the
 * pages of desc->max_seq_len) and checked there. block_table may be NULL (then page ids are not
 * read), as may desc (then no bounds, and block_table must be NULL). */
msaidx_status msaidx_cpu_valid_pages(int32_t page_size, const msaidx_batch_desc *desc,
                                     const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                     const int32_t *block_table, int32_t *table_copy,
                                     int32_t table_stride, int32_t batch_size, int32_t num_tokens,
                                     int32_t *nvp);

/* Scalar reference: FP64 accumulation of the exact products, one cell at a time. */
void msaidx_cpu_scores_reference(const msaidx_cpu_batch *batch);
/* Fast path: threads over (request, page) work items, SIMD chosen at run time. */
void msaidx_cpu_scores_fast(const msaidx_cpu_batch *batch);
/* Name of the SIMD path msaidx_cpu_scores_fast uses on this machine ("avx512_bf16" (the
 * AVX512-BF16 dot product, on CPUs with AVX512-VBMI too; BF16 data holding subnormals runs
 * "avx512"), "avx512", "avx2", "scalar"). */
const char *msaidx_cpu_simd_name(void);

/* Top-k (SPEC.md section 4) of rows [num_tokens * H]; nvp already checked against pitch. */
void msaidx_cpu_topk_reference(const msaidx_config *config, const float *scores, int32_t pitch,
                               const int32_t *nvp, int32_t num_tokens, int32_t *out);
void msaidx_cpu_topk_fast(const msaidx_config *config, const float *scores, int32_t pitch,
                          const int32_t *nvp, int32_t num_tokens, int32_t *out);
/* The same, row (t, h) written at out + t * out_stride_t + h * out_stride_h. */
void msaidx_cpu_topk_fast_strided(const msaidx_config *config, const float *scores, int32_t pitch,
                                  const int32_t *nvp, int32_t num_tokens, int32_t *out,
                                  int64_t out_stride_t, int64_t out_stride_h);

/* Decode n stored elements of `dtype` to float. */
void msaidx_cpu_decode(msaidx_dtype dtype, const void *src, float *dst, int32_t n);

#ifdef __cplusplus
}
#endif

#endif /* MSAIDX_CPU_H */
