/* Context parallel on the CUDA backends (SPEC.md section 12): the candidates' local columns mapped
 * to global pages, and the merge of every rank's gathered candidates. One thread per row (t, h);
 * grids from the arguments alone (graph safe), on the caller's stream, no allocation. */
#include "cuda_internal.cuh"
#include "merge_candidates.h"

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t rows) { return (unsigned)((rows + kThreads - 1) / kThreads); }

/* Rewrites the local columns (>= 0) of rows with visible pages to the global pages they are. */
__global__ void __launch_bounds__(kThreads)
    global_pages_kernel(int32_t *pages, const int32_t *nvp, const int32_t *request_pages,
                        msaidx_page_shard shard, int32_t num_tokens, int32_t num_heads,
                        int32_t topk, int64_t stride_t, int64_t stride_h) {
    msaidx_wait_for_prior_grids();
    const int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (row >= (int64_t)num_tokens * num_heads) return;
    const int64_t t = row / num_heads;
    if (nvp[t] <= 0) return; /* padding and skipped rows hold -1 only */
    const int32_t request = request_pages[t];
    int32_t *entry = pages + t * stride_t + row % num_heads * stride_h;
    for (int32_t k = 0; k < topk; ++k)
        if (entry[k] >= 0) entry[k] = msaidx_shard_global(shard, request, entry[k]);
}

/* One thread per row, msaidx_merge_row as the cpu backend runs it. */
__global__ void __launch_bounds__(kThreads)
    merge_kernel(int32_t world_size, int32_t num_tokens, int32_t num_heads, int32_t topk,
                 int32_t init_blocks, int32_t local_blocks, const int32_t *nvp,
                 const float *candidate_scores, const int32_t *candidate_pages, int64_t rank_stride,
                 int32_t *out, int64_t stride_t, int64_t stride_h) {
    msaidx_wait_for_prior_grids();
    const int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (row >= (int64_t)num_tokens * num_heads) return;
    msaidx_merge_row(world_size, topk, init_blocks, local_blocks, nvp[row / num_heads],
                     candidate_scores + row * topk, candidate_pages + row * topk, rank_stride,
                     out + row / num_heads * stride_t + row % num_heads * stride_h);
}

} // namespace

msaidx_status msaidx_cuda_global_pages(const msaidx_plan *plan, int32_t *pages, int32_t topk,
                                       int64_t stride_t, int64_t stride_h, void *stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t H = plan->context->config.num_heads;
    const int64_t rows = (int64_t)d->num_tokens * H;
    if (rows == 0) return MSAIDX_SUCCESS;
    MSAIDX_CUDA_TRY(
        msaidx_launch_dependent(global_pages_kernel, dim3(blocks_for(rows)), dim3(kThreads), 0,
                                msaidx_cuda_stream(stream), pages, msaidx_cuda_nvp(plan->workspace),
                                msaidx_cuda_request_pages(plan->workspace, d), msaidx_shard_of(d),
                                d->num_tokens, H, topk, stride_t, stride_h),
        "global_pages_kernel launch");
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_merge_candidates(const msaidx_context *context, int32_t world_size,
                                           int32_t num_tokens, const int32_t *nvp,
                                           const float *candidate_scores,
                                           const int32_t *candidate_pages, int64_t rank_stride,
                                           int32_t *out, int64_t stride_t, int64_t stride_h,
                                           void *stream) {
    const msaidx_config *c = &context->config;
    const int64_t rows = (int64_t)num_tokens * c->num_heads;
    if (rows == 0) return MSAIDX_SUCCESS;
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(merge_kernel, dim3(blocks_for(rows)), dim3(kThreads), 0,
                                            msaidx_cuda_stream(stream), world_size, num_tokens,
                                            c->num_heads, c->topk, c->init_blocks, c->local_blocks,
                                            nvp, candidate_scores, candidate_pages, rank_stride,
                                            out, stride_t, stride_h),
                    "merge_kernel launch");
    return MSAIDX_SUCCESS;
}
