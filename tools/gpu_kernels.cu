/* The tool's own kernels: bench's read-once baselines (of the top-k input, and of the key pages a
 * scorer must read) and e2e's random fill of device buffers (gigabytes of key cache are generated
 * where they live, not copied from the host). */
extern "C" {
#include "tool.h"
}

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kCellsPerLane = 8;
/* One warp reads one segment of a row; a long row is spread over several warps so that a batch of
 * few long rows (q128 at 1M context) still keeps enough loads in flight to stream from HBM. */
constexpr int kSegmentCells = 32 * kCellsPerLane;

int64_t segments_per_row(int32_t pitch) {
    return ((int64_t)pitch + kSegmentCells - 1) / kSegmentCells;
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    read_once_kernel(const float *__restrict__ scores, int32_t pitch,
                     const int32_t *__restrict__ nvp, int heads, int64_t segments,
                     int64_t num_warps, float *__restrict__ segment_max) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    if (warp >= num_warps) return;
    const int64_t row = warp / segments;
    const int64_t begin = (warp % segments) * kSegmentCells;
    const int64_t valid = nvp[row / heads];
    if (begin >= valid) return;
    const float *cells = scores + row * pitch;
    float best = -INFINITY;
#pragma unroll
    for (int i = 0; i < kCellsPerLane; ++i) {
        const int64_t p = begin + i * 32 + lane;
        if (p < valid) best = fmaxf(best, __ldg(cells + p));
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        best = fmaxf(best, __shfl_xor_sync(0xFFFFFFFFu, best, offset));
    if (lane == 0) segment_max[warp] = best;
}

constexpr int kKeyReadThreads = 512;
/* 4 pages per block measured best of 1..62 for 134 MB of 16 KB pages on the H200; a batch of few
 * pages reads one per block, so that all of them are in flight at once. */
constexpr int kKeyPagesPerBlock = 4;
constexpr int64_t kKeyPagesForFullBlocks = 4096;

/* Each block reads kKeyPagesPerBlock listed pages, 16 bytes per load, and folds them into one
 * word that is written only if it equals an impossible value: nothing but the reads is timed. */
__global__ void __launch_bounds__(kKeyReadThreads)
    key_read_kernel(const uint8_t *__restrict__ k_cache, int64_t page_stride, int32_t page_chunks,
                    const int32_t *__restrict__ pages, int64_t num_pages,
                    uint32_t *__restrict__ sink) {
    uint32_t folded = 0;
    const int pages_per_block = num_pages >= kKeyPagesForFullBlocks ? kKeyPagesPerBlock : 1;
    const int64_t first = (int64_t)blockIdx.x * pages_per_block;
    for (int64_t p = first; p < num_pages && p < first + pages_per_block; ++p) {
        const uint4 *page = (const uint4 *)(k_cache + (int64_t)pages[p] * page_stride);
#pragma unroll 4
        for (int32_t c = threadIdx.x; c < page_chunks; c += kKeyReadThreads) {
            const uint4 v = __ldg(page + c);
            folded ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (folded == 0x9E3779B9u && threadIdx.x == 0) sink[0] = folded;
}

__device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Clearing bit 6 of every byte keeps E4M3 codes below 2 in magnitude: never NaN, never all zero. */
__global__ void fill_kernel(uint32_t *words, int64_t num_words, uint8_t *tail, int tail_bytes,
                            uint64_t seed) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < num_words; i += stride)
        words[i] = hash32(seed + (uint64_t)i) & 0xBFBFBFBFu;
    if (blockIdx.x == 0 && (int)threadIdx.x < tail_bytes)
        tail[threadIdx.x] = (uint8_t)(hash32(seed + (uint64_t)num_words + threadIdx.x) & 0xBFu);
}

} // namespace

extern "C" size_t tool_gpu_read_once_floats(int32_t num_tokens, int heads, int32_t pitch) {
    const int64_t warps = (int64_t)num_tokens * heads * segments_per_row(pitch);
    return (size_t)(warps > 0 ? warps : 1);
}

extern "C" bool tool_gpu_read_once(const float *scores, int32_t pitch, const int32_t *nvp,
                                   int32_t num_tokens, int heads, float *segment_max,
                                   void *stream) {
    const int64_t segments = segments_per_row(pitch);
    const int64_t num_warps = (int64_t)num_tokens * heads * segments;
    if (num_warps <= 0) return true;
    const int64_t blocks = (num_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
    read_once_kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, (cudaStream_t)stream>>>(
        scores, pitch, nvp, heads, segments, num_warps, segment_max);
    return tool_cuda_ok(cudaGetLastError(), "read-once kernel launch");
}

extern "C" bool tool_gpu_key_read(const void *k_cache, int64_t page_stride, int32_t page_bytes,
                                  const int32_t *pages, int64_t num_pages, uint32_t *sink,
                                  void *stream) {
    if (num_pages <= 0) return true;
    const int pages_per_block = num_pages >= kKeyPagesForFullBlocks ? kKeyPagesPerBlock : 1;
    const int64_t blocks = (num_pages + pages_per_block - 1) / pages_per_block;
    key_read_kernel<<<(unsigned)blocks, kKeyReadThreads, 0, (cudaStream_t)stream>>>(
        (const uint8_t *)k_cache, page_stride, page_bytes / 16, pages, num_pages, sink);
    return tool_cuda_ok(cudaGetLastError(), "key read-once kernel launch");
}

extern "C" bool tool_gpu_fill_random(void *dst, size_t bytes, uint64_t seed, void *stream) {
    const int64_t num_words = (int64_t)(bytes / 4);
    const int tail_bytes = (int)(bytes % 4);
    if (num_words == 0 && tail_bytes == 0) return true;
    const int64_t wanted = (num_words + 255) / 256;
    const unsigned blocks = (unsigned)(wanted < 1 ? 1 : wanted > 4096 ? 4096 : wanted);
    fill_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(
        (uint32_t *)dst, num_words, (uint8_t *)dst + num_words * 4, tail_bytes, seed);
    return tool_cuda_ok(cudaGetLastError(), "random fill kernel launch");
}
