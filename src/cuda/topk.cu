/* Top-k block selection (SPEC section 4) and num_valid_pages on the device, shared by every
 * CUDA backend.
 *
 * Scores are mapped to order-preserving uint32 keys (NaN as -inf, -0 as +0 so that equal floats
 * tie). The slots-th best key is found by a bitwise binary search (32 counting rounds: is the
 * number of keys >= candidate at least `slots`?), which is exact and needs no histogram. Then
 * every key above it is taken, plus the lowest-page keys equal to it. Each thread owns a
 * contiguous run of pages, so exclusive scans of per-thread counts rank the ties and place the
 * chosen pages: the output comes out ascending without a sort.
 *
 * Rows of up to kWarpPages candidates (1024 pages = 128K tokens) are done by one warp with the
 * keys in registers; longer rows by a whole CTA with the keys cached in shared memory. Both
 * kernels cover every row; each leaves the other's rows alone.
 */
#include "cuda_internal.cuh"

#include <cub/block/block_scan.cuh>

#include <climits>

namespace {

constexpr int kWarpPages = 1024;
constexpr int kWarpRowsPerCta = 8;
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
/* Never the key of a score (the lowest, -inf, is 0x007fffff): marks an empty register slot. */
constexpr uint32_t kNoKey = 0;

struct TopkArgs {
    const float *scores;
    const int32_t *nvp;
    int32_t *out;
    int64_t rows;
    int32_t pitch, num_heads, topk, init_blocks, local_blocks;
};

/* Rows that need no selection: padding and invalid rows (all -1), and nvp <= topk (0..nvp-1).
 * Returns false for a row that needs a selection. */
__device__ bool trivial_row(const TopkArgs &a, int32_t n, int32_t *out, int lane, int lanes) {
    if (n > a.topk && n <= a.pitch) return false;
    const bool valid = n > 0 && n <= a.pitch;
    for (int k = lane; k < a.topk; k += lanes) out[k] = valid && k < n ? k : -1;
    return true;
}

__device__ __forceinline__ int32_t warp_exclusive_sum(int32_t value, int lane) {
    int32_t sum = value;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
        const int32_t other = __shfl_up_sync(0xffffffffu, sum, offset);
        if (lane >= offset) sum += other;
    }
    return sum - value;
}

/* One warp selects among count <= 32 * kPerLane candidates; lane l owns pages
 * [lo + l*kPerLane, lo + (l+1)*kPerLane). */
template <int kPerLane>
__device__ void warp_select(const float *scores, int32_t lo, int32_t count, int32_t slots,
                            int32_t *chosen_out, int lane) {
    uint32_t keys[kPerLane];
    const int32_t first = lane * kPerLane;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        keys[i] = first + i < count ? sortable_key(scores[lo + first + i]) : kNoKey;
    uint32_t threshold = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint32_t candidate = threshold | (1u << bit);
        int32_t at_least = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) at_least += keys[i] >= candidate;
        if ((int32_t)__reduce_add_sync(0xffffffffu, (uint32_t)at_least) >= slots) threshold = candidate;
    }
    int32_t above = 0, equal = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        above += keys[i] > threshold;
        equal += keys[i] == threshold;
    }
    const int32_t ties_wanted = slots - (int32_t)__reduce_add_sync(0xffffffffu, (uint32_t)above);
    int32_t tie_rank = warp_exclusive_sum(equal, lane);
    bool take[kPerLane];
    int32_t taken = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        take[i] = keys[i] > threshold || (keys[i] == threshold && tie_rank++ < ties_wanted);
        taken += take[i];
    }
    int32_t place = warp_exclusive_sum(taken, lane);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (take[i]) chosen_out[place++] = lo + first + i;
}

__global__ void __launch_bounds__(kWarpRowsPerCta * 32) topk_warp_kernel(const TopkArgs a) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kWarpRowsPerCta + threadIdx.x / 32;
    if (row >= a.rows) return;
    const int32_t n = a.nvp[row / a.num_heads];
    int32_t *out = a.out + row * a.topk;
    if (trivial_row(a, n, out, lane, 32)) return;
    const int32_t lo = a.init_blocks, count = n - a.local_blocks - lo;
    const int32_t slots = a.topk - a.init_blocks - a.local_blocks;
    if (count > kWarpPages) return; /* the CTA kernel's row */
    for (int k = lane; k < a.init_blocks; k += 32) out[k] = k;
    for (int k = lane; k < a.local_blocks; k += 32) out[a.init_blocks + slots + k] = lo + count + k;
    if (slots <= 0) return;
    const float *scores = a.scores + row * a.pitch;
    int32_t *chosen = out + a.init_blocks;
    if (count <= 32 * 2) warp_select<2>(scores, lo, count, slots, chosen, lane);
    else if (count <= 32 * 8) warp_select<8>(scores, lo, count, slots, chosen, lane);
    else warp_select<kWarpPages / 32>(scores, lo, count, slots, chosen, lane);
}

__device__ int32_t block_sum(int32_t value, int32_t *scratch) {
    value = (int32_t)__reduce_add_sync(0xffffffffu, (uint32_t)value);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
    __syncthreads();
    int32_t total = 0;
#pragma unroll
    for (int w = 0; w < kTopkThreads / 32; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

/* One CTA per row of more than kWarpPages candidates (other rows exit at once). */
__global__ void __launch_bounds__(kTopkThreads) topk_block_kernel(const TopkArgs a) {
    __shared__ uint32_t cache[kCachedKeys];
    __shared__ int32_t scratch[kTopkThreads / 32];
    __shared__ typename TopkScan::TempStorage scan_storage;

    const int64_t row = blockIdx.x;
    const int32_t n = a.nvp[row / a.num_heads];
    if (n <= a.topk || n > a.pitch) return;
    const int32_t lo = a.init_blocks, count = n - a.local_blocks - lo;
    const int32_t slots = a.topk - a.init_blocks - a.local_blocks;
    if (count <= kWarpPages) return;
    int32_t *out = a.out + row * a.topk;
    const float *scores = a.scores + row * a.pitch;
    const int tid = threadIdx.x;
    for (int k = tid; k < a.init_blocks; k += kTopkThreads) out[k] = k;
    for (int k = tid; k < a.local_blocks; k += kTopkThreads) out[a.init_blocks + slots + k] = lo + count + k;
    if (slots <= 0) return;

    const bool cached = count <= kCachedKeys;
    if (cached) {
        /* Batches of independent loads: one row is the CTA's whole traffic, so it must be in
         * flight at once rather than one load latency per element. */
        constexpr int kBatch = 16;
        for (int32_t base = 0; base < count; base += kBatch * kTopkThreads) {
            float batch[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const int32_t i = base + j * kTopkThreads + tid;
                batch[j] = i < count ? scores[lo + i] : 0.f;
            }
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const int32_t i = base + j * kTopkThreads + tid;
                if (i < count) cache[i] = sortable_key(batch[j]);
            }
        }
    }
    __syncthreads();
    auto key_at = [&](int32_t i) { return cached ? cache[i] : sortable_key(scores[lo + i]); };

    uint32_t threshold = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint32_t candidate = threshold | (1u << bit);
        int32_t at_least = 0;
        for (int32_t i = tid; i < count; i += kTopkThreads) at_least += key_at(i) >= candidate;
        if (block_sum(at_least, scratch) >= slots) threshold = candidate;
    }
    const int32_t segment = (count + kTopkThreads - 1) / kTopkThreads;
    const int32_t seg_begin = min(tid * segment, count), seg_end = min(seg_begin + segment, count);
    int32_t above = 0, equal = 0;
    for (int32_t i = seg_begin; i < seg_end; ++i) {
        const uint32_t key = key_at(i);
        above += key > threshold;
        equal += key == threshold;
    }
    const int32_t ties_wanted = slots - block_sum(above, scratch);
    int32_t tie_rank;
    TopkScan(scan_storage).ExclusiveSum(equal, tie_rank);
    __syncthreads();
    int32_t taken = 0;
    for (int32_t i = seg_begin, rank = tie_rank; i < seg_end; ++i) {
        const uint32_t key = key_at(i);
        taken += key > threshold || (key == threshold && rank++ < ties_wanted);
    }
    int32_t place;
    TopkScan(scan_storage).ExclusiveSum(taken, place);
    for (int32_t i = seg_begin, rank = tie_rank; i < seg_end && taken > 0; ++i) {
        const uint32_t key = key_at(i);
        if (key > threshold || (key == threshold && rank++ < ties_wanted)) {
            out[a.init_blocks + place++] = lo + i;
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
    const cudaStream_t s = msaidx_cuda_stream(stream);
    const TopkArgs a{scores, nvp, out, rows, pitch, c->num_heads, c->topk, c->init_blocks,
                     c->local_blocks};
    topk_warp_kernel<<<(unsigned)((rows + kWarpRowsPerCta - 1) / kWarpRowsPerCta),
                       kWarpRowsPerCta * 32, 0, s>>>(a);
    MSAIDX_CUDA_CHECK_LAUNCH("topk_warp_kernel launch");
    /* Rows longer than a warp's registers exist only when the pitch allows them. */
    if (pitch - c->init_blocks - c->local_blocks > kWarpPages) {
        topk_block_kernel<<<(unsigned)rows, kTopkThreads, 0, s>>>(a);
        MSAIDX_CUDA_CHECK_LAUNCH("topk_block_kernel launch");
    }
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
