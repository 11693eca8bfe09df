/* Context parallel on the CUDA backends (SPEC.md section 12): the candidates' local columns mapped
 * to global pages, and the merge of every rank's gathered candidates. One thread per row (t, h);
 * grids from the arguments alone (graph safe), on the caller's stream, no allocation. */
#include "cuda_internal.cuh"

#include <cmath>

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t rows) { return (unsigned)((rows + kThreads - 1) / kThreads); }

/* Rewrites the local columns (>= 0) of rows with visible pages to the global pages they are. */
__global__ void __launch_bounds__(kThreads)
    global_pages_kernel(int32_t *pages, const int32_t *nvp, const int32_t *request_pages,
                        msaidx_page_shard shard, int32_t num_tokens, int32_t num_heads,
                        int32_t topk, int64_t stride_t, int64_t stride_h) {
    const int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (row >= (int64_t)num_tokens * num_heads) return;
    const int64_t t = row / num_heads;
    if (nvp[t] <= 0) return; /* padding and skipped rows hold -1 only */
    const int32_t request = request_pages[t];
    int32_t *entry = pages + t * stride_t + row % num_heads * stride_h;
    for (int32_t k = 0; k < topk; ++k)
        if (entry[k] >= 0) entry[k] = msaidx_shard_global(shard, request, entry[k]);
}

/* SPEC section 4's order: higher score first, ties to the lower page (NaN already -inf). */
__device__ __forceinline__ bool candidate_above(float a, int32_t page_a, float b, int32_t page_b) {
    return a > b || (a == b && page_a < page_b);
}

/* The cpu backend's merge (cpu_backend.c), row for row, so the two agree bitwise on any input. */
__global__ void __launch_bounds__(kThreads)
    merge_kernel(int32_t world_size, int32_t num_tokens, int32_t num_heads, int32_t topk,
                 int32_t init_blocks, int32_t local_blocks, const int32_t *nvp,
                 const float *candidate_scores, const int32_t *candidate_pages, int64_t rank_stride,
                 int32_t *out, int64_t stride_t, int64_t stride_h) {
    const int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (row >= (int64_t)num_tokens * num_heads) return;
    const int32_t n = nvp[row / num_heads];
    int32_t *o = out + row / num_heads * stride_t + row % num_heads * stride_h;
    int32_t k = 0;
    if (n > topk) {
        /* The free slots take the best candidates outside the forced pages, each page once. */
        const int32_t slots = topk - init_blocks - local_blocks;
        const int32_t lo = init_blocks, hi = n - local_blocks;
        float best_score[MSAIDX_MAX_TOPK];
        int32_t best_page[MSAIDX_MAX_TOPK];
        int32_t num_best = 0;
        for (int32_t r = 0; r < world_size && slots > 0; ++r) {
            const int64_t at = r * rank_stride + row * topk;
            for (int32_t i = 0; i < topk; ++i) {
                const int32_t p = candidate_pages[at + i];
                const float raw = candidate_scores[at + i];
                const float v = isnan(raw) ? -INFINITY : raw;
                if (p < lo || p >= hi) continue;
                if (num_best == slots &&
                    !candidate_above(v, p, best_score[slots - 1], best_page[slots - 1]))
                    continue;
                bool seen = false;
                for (int32_t j = 0; j < num_best; ++j) seen |= best_page[j] == p;
                if (seen) continue;
                int32_t j = num_best < slots ? num_best++ : slots - 1;
                for (; j > 0 && candidate_above(v, p, best_score[j - 1], best_page[j - 1]); --j) {
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
        for (int32_t p = 0; p < init_blocks; ++p) o[k++] = p;
        for (int32_t i = 0; i < num_best; ++i) o[k++] = best_page[i];
        for (int32_t p = hi; p < n; ++p) o[k++] = p;
    } else {
        for (; k < n; ++k) o[k] = k;
    }
    for (; k < topk; ++k) o[k] = -1;
}

} // namespace

msaidx_status msaidx_cuda_global_pages(const msaidx_plan *plan, int32_t *pages, int32_t topk,
                                       int64_t stride_t, int64_t stride_h, void *stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t H = plan->context->config.num_heads;
    const int64_t rows = (int64_t)d->num_tokens * H;
    if (rows == 0) return MSAIDX_SUCCESS;
    global_pages_kernel<<<blocks_for(rows), kThreads, 0, msaidx_cuda_stream(stream)>>>(
        pages, msaidx_cuda_nvp(plan->workspace), msaidx_cuda_request_pages(plan->workspace, d),
        msaidx_shard_of(d), d->num_tokens, H, topk, stride_t, stride_h);
    MSAIDX_CUDA_CHECK_LAUNCH("global_pages_kernel launch");
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
    merge_kernel<<<blocks_for(rows), kThreads, 0, msaidx_cuda_stream(stream)>>>(
        world_size, num_tokens, c->num_heads, c->topk, c->init_blocks, c->local_blocks, nvp,
        candidate_scores, candidate_pages, rank_stride, out, stride_t, stride_h);
    MSAIDX_CUDA_CHECK_LAUNCH("merge_kernel launch");
    return MSAIDX_SUCCESS;
}
