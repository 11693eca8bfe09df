/* num_valid_pages on the device: nvp of every token from cu_seqlens_q and seq_lens, clamped so
 * that garbage metadata gives garbage counts but never an out-of-bounds access. */
#include "cuda_internal.cuh"

#include <climits>

namespace {

constexpr int kNvpThreads = 256;

/* nvp of token t: the request whose cu range holds t, found by binary search (clamped: garbage
 * metadata gives garbage counts, never an out-of-bounds access). */
__global__ void __launch_bounds__(kNvpThreads)
    num_valid_pages_kernel(const int32_t *cu, const int32_t *seq_lens, int32_t batch_size,
                           int32_t num_tokens, int32_t page_size, int32_t *nvp) {
    msaidx_wait_for_prior_grids();
    const int64_t t = (int64_t)blockIdx.x * kNvpThreads + threadIdx.x;
    if (t >= num_tokens) return;
    if (batch_size <= 0) {
        nvp[t] = 0;
        return;
    }
    int32_t lo = 0, hi = batch_size - 1; /* last request with cu[b] <= t */
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    int32_t pages = 0;
    const int64_t begin = cu[lo], end = cu[lo + 1];
    if (begin <= t && t < end) {
        const int64_t pos = (int64_t)seq_lens[lo] - (end - begin) + (t - begin);
        if (pos >= 0) pages = (int32_t)min(pos / page_size + 1, (int64_t)INT_MAX);
    }
    nvp[t] = pages;
}

} // namespace

msaidx_status msaidx_cuda_num_valid_pages(const msaidx_context *context,
                                          const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                          int32_t batch_size, int32_t num_tokens, int32_t *nvp,
                                          void *stream) {
    if (num_tokens == 0) return MSAIDX_SUCCESS;
    const unsigned blocks = (unsigned)(((int64_t)num_tokens + kNvpThreads - 1) / kNvpThreads);
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(num_valid_pages_kernel, dim3(blocks), dim3(kNvpThreads),
                                            0, msaidx_cuda_stream(stream), cu_seqlens_q, seq_lens,
                                            batch_size, num_tokens, context->config.page_size, nvp),
                    "num_valid_pages_kernel launch");
    return MSAIDX_SUCCESS;
}
