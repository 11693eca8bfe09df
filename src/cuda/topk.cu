/* Top-k block selection (SPEC section 4) and num_valid_pages on the device, shared by every
 * CUDA backend.
 *
 * Top-k: one CTA per score row. Scores are mapped to order-preserving uint32 keys (NaN as -inf,
 * -0 as +0 so that equal floats tie), cached in shared memory, and a 4-pass 8-bit radix select
 * finds the key of the slots-th best candidate. The selection pass keeps every candidate above
 * that key and the lowest-page ones equal to it; threads own contiguous page segments, so block
 * scans give each chosen page its place and the output comes out ascending without a sort.
 */
#include "cuda_internal.cuh"

#include <cub/block/block_scan.cuh>

#include <climits>

namespace {

constexpr int kTopkThreads = 256;
constexpr int kCachedKeys = 8192; /* rows up to 1M tokens stay in shared memory */
constexpr int kNvpThreads = 256;

using TopkScan = cub::BlockScan<int32_t, kTopkThreads>;

__device__ __forceinline__ uint32_t sortable_key(float score) {
    uint32_t bits = __float_as_uint(score);
    if (score != score) bits = 0xff800000u; /* NaN ranks as -inf */
    if (bits == 0x80000000u) bits = 0;      /* -0 == +0 */
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

struct TopkArgs {
    const float *scores;
    const int32_t *nvp;
    int32_t *out;
    int32_t pitch, num_heads, topk, init_blocks, local_blocks;
};

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const TopkArgs a) {
    __shared__ uint32_t cache[kCachedKeys];
    __shared__ int32_t histogram[256];
    __shared__ typename TopkScan::TempStorage scan_storage;
    __shared__ uint32_t chosen_prefix;
    __shared__ int32_t chosen_remaining;

    const int64_t row = blockIdx.x;
    const int32_t n = a.nvp[row / a.num_heads];
    int32_t *out = a.out + row * a.topk;
    const int tid = threadIdx.x;
    if (n <= a.topk || n > a.pitch) { /* includes padding (n <= 0) and invalid rows */
        for (int k = tid; k < a.topk; k += kTopkThreads) out[k] = (n > 0 && n <= a.pitch && k < n) ? k : -1;
        return;
    }
    const float *scores = a.scores + row * a.pitch;
    const int32_t lo = a.init_blocks, hi = n - a.local_blocks, count = hi - lo;
    const int32_t slots = a.topk - a.init_blocks - a.local_blocks;
    for (int k = tid; k < a.init_blocks; k += kTopkThreads) out[k] = k;
    for (int k = tid; k < a.local_blocks; k += kTopkThreads) out[a.init_blocks + slots + k] = hi + k;
    if (slots <= 0) return;

    const bool cached = count <= kCachedKeys;
    if (cached)
        for (int32_t i = tid; i < count; i += kTopkThreads) cache[i] = sortable_key(scores[lo + i]);
    auto key_at = [&](int32_t i) { return cached ? cache[i] : sortable_key(scores[lo + i]); };

    uint32_t prefix = 0, prefix_mask = 0;
    int32_t remaining = slots; /* still to choose among keys matching the prefix */
    for (int shift = 24; shift >= 0; shift -= 8) {
        histogram[tid] = 0; /* kTopkThreads == 256 bins */
        __syncthreads();
        for (int32_t i = tid; i < count; i += kTopkThreads) {
            const uint32_t key = key_at(i);
            if ((key & prefix_mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255], 1);
        }
        __syncthreads();
        /* Suffix sums from the top digit: the digit where `remaining` is reached. */
        const int32_t bin = 255 - tid;
        int32_t above;
        TopkScan(scan_storage).ExclusiveSum(histogram[bin], above);
        if (above < remaining && above + histogram[bin] >= remaining) {
            chosen_prefix = prefix | ((uint32_t)bin << shift);
            chosen_remaining = remaining - above;
        }
        __syncthreads();
        prefix = chosen_prefix;
        remaining = chosen_remaining;
        prefix_mask |= 255u << shift;
    }
    /* `prefix` is now the slots-th best key; take all above it and the first `remaining` equal. */
    const int32_t segment = (count + kTopkThreads - 1) / kTopkThreads;
    const int32_t seg_begin = min(tid * segment, count), seg_end = min(seg_begin + segment, count);
    int32_t equal = 0;
    for (int32_t i = seg_begin; i < seg_end; ++i) equal += key_at(i) == prefix;
    int32_t equal_before;
    TopkScan(scan_storage).ExclusiveSum(equal, equal_before);
    __syncthreads();
    int32_t taken = 0;
    for (int32_t i = seg_begin, e = equal_before; i < seg_end; ++i) {
        const uint32_t key = key_at(i);
        if (key == prefix) taken += e++ < remaining;
        else taken += key > prefix;
    }
    int32_t place;
    TopkScan(scan_storage).ExclusiveSum(taken, place);
    for (int32_t i = seg_begin, e = equal_before; i < seg_end && taken > 0; ++i) {
        const uint32_t key = key_at(i);
        const bool take = key == prefix ? e++ < remaining : key > prefix;
        if (take) {
            if (place < slots) out[a.init_blocks + place] = lo + i;
            ++place;
            --taken;
        }
    }
}

/* nvp of token t: the request whose cu range holds t, found by binary search (clamped: garbage
 * metadata gives garbage counts, never an out-of-bounds access). */
__global__ void __launch_bounds__(kNvpThreads)
    num_valid_pages_kernel(const int32_t *cu, const int32_t *seq_lens, int32_t batch_size,
                           int32_t num_tokens, int32_t page_size, int32_t *nvp) {
    const int64_t t = (int64_t)blockIdx.x * kNvpThreads + threadIdx.x;
    if (t >= num_tokens) return;
    if (batch_size <= 0) {
        nvp[t] = 0;
        return;
    }
    int32_t lo = 0, hi = batch_size - 1; /* last request with cu[b] <= t */
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        if (cu[mid] <= t) lo = mid;
        else hi = mid - 1;
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

msaidx_status msaidx_cuda_topk(const msaidx_context *context, const float *scores, int32_t pitch,
                               const int32_t *nvp, int32_t num_tokens, int32_t *out, void *stream) {
    const msaidx_config *c = &context->config;
    const int64_t rows = (int64_t)num_tokens * c->num_heads;
    if (rows == 0) return MSAIDX_SUCCESS;
    if (rows > INT_MAX)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED, "num_tokens = %d: too many rows for one launch",
                           num_tokens);
    const TopkArgs a{scores, nvp, out, pitch, c->num_heads, c->topk, c->init_blocks, c->local_blocks};
    topk_kernel<<<(unsigned)rows, kTopkThreads, 0, msaidx_cuda_stream(stream)>>>(a);
    MSAIDX_CUDA_CHECK_LAUNCH("topk_kernel launch");
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_num_valid_pages(const msaidx_context *context, const int32_t *cu_seqlens_q,
                                          const int32_t *seq_lens, int32_t batch_size,
                                          int32_t num_tokens, int32_t *nvp, void *stream) {
    if (num_tokens == 0) return MSAIDX_SUCCESS;
    const unsigned blocks = (unsigned)(((int64_t)num_tokens + kNvpThreads - 1) / kNvpThreads);
    num_valid_pages_kernel<<<blocks, kNvpThreads, 0, msaidx_cuda_stream(stream)>>>(
        cu_seqlens_q, seq_lens, batch_size, num_tokens, context->config.page_size, nvp);
    MSAIDX_CUDA_CHECK_LAUNCH("num_valid_pages_kernel launch");
    return MSAIDX_SUCCESS;
}
