/* Index Q/K preparation on the device (SPEC.md section 11): one pass, 8 lanes per 128-wide
 * vector (each of a token's H query heads and its key), each lane two chunks of 8 dims = two
 * 16-byte BF16 loads, two 8-byte E4M3 (16-byte BF16) stores.
 *
 * Lane l holds dims [f, f + 8) and [f + 32, f + 40), f = 8 l (+ 32 for l >= 4): lanes 0-3 hold
 * the NeoX pairs (d, d + 32) of dims [0, 64) themselves, so the rotation needs no shuffle and
 * loads only the 8 cos and 8 sin of its own dims; lanes 4-7 hold the pass-through dims.
 *
 * The kernel is bound by memory latency and by its instruction count, not by its bytes: a block
 * is resident for the whole pass (a grid of one wave) and walks its tokens two per lane at a
 * time, each lane issuing the next two tokens' loads (input, position, slot) before the math of
 * the current two, and their cos/sin rows as soon as their positions are known, so that four
 * tokens' bytes are in flight; the two tokens share the loop, address and division costs.
 *
 * The FP32 operations are written out with _rn intrinsics so that nothing is contracted into an
 * FMA, and the sum of squares keeps the cpu backend's order (16 consecutive dims in order, then
 * the 8 partials pairwise): the two backends agree bitwise. */
#include "cuda_internal.cuh"

#include <atomic>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kLanesPerVector = 8;
constexpr int kChunkDims = 8; /* one 16-byte BF16 load */
constexpr int kLaneDims = 2 * kChunkDims;
constexpr int kRotaryHalf = 32; /* pairs (d, d + 32), d < 32 */
constexpr int kRotaryLanes = 4; /* lanes 0-3 hold dims [0, 64) */
constexpr int kPageSize = 128;  /* the CUDA backends admit page_size 128 only */
constexpr int kTargetThreads = 128;
/* A block is whole warps (the shuffles name the full warp): rows of 8 (H + 1) lanes, at most
 * 4 rows per unit of whole warps, at most kTargetThreads unless one unit is larger. Blocks of
 * up to kSmallBlock threads (H < 8 and every even H + 1) run a kernel that may take the
 * registers two tokens per lane want; larger ones (up to kLargeBlock) one limited to fewer. */
constexpr int kSmallBlock = 256;
constexpr int kSmallBlocksPerSm = 2; /* at most 128 registers a thread */
constexpr int kLargeBlock = 4 * kLanesPerVector * (MSAIDX_MAX_HEADS + 1);
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

struct PrepareParams {
    const __nv_bfloat16 *q_in;
    int64_t q_in_token_stride;
    const __nv_bfloat16 *k_in;
    int64_t k_in_token_stride;
    const int64_t *positions;
    const __nv_bfloat16 *q_norm_weight;
    const __nv_bfloat16 *k_norm_weight;
    const void *cos_sin_cache;
    int64_t max_position;
    const int64_t *slot_mapping;
    char *k_cache;
    int64_t page_stride;
    int64_t num_slots;
    char *q_out;
    int64_t num_tokens;
    int32_t num_heads;
    float eps;
    uint32_t *error_word;
};

__device__ __forceinline__ void unpack_bf16x8(uint4 raw, float *out) {
    const __nv_bfloat162 *pairs = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(pairs[i]);
        out[2 * i] = pair.x;
        out[2 * i + 1] = pair.y;
    }
}

/* 8 consecutive entries of a cos/sin row, as loaded (FP32: two float4; BF16: one uint4). */
template <bool kFp32Table>
struct TableChunk {
    float4 quads[2];
};
template <>
struct TableChunk<false> {
    uint4 raw;
};

template <bool kFp32Table>
__device__ __forceinline__ TableChunk<kFp32Table> load_table_chunk(const void *row, int first) {
    TableChunk<kFp32Table> chunk;
    if constexpr (kFp32Table) {
        const float4 *quads =
            reinterpret_cast<const float4 *>(static_cast<const float *>(row) + first);
        chunk.quads[0] = __ldg(quads);
        chunk.quads[1] = __ldg(quads + 1);
    } else {
        chunk.raw =
            __ldg(reinterpret_cast<const uint4 *>(static_cast<const __nv_bfloat16 *>(row) + first));
    }
    return chunk;
}

template <bool kFp32Table>
__device__ __forceinline__ void unpack_table_chunk(const TableChunk<kFp32Table> &chunk,
                                                   float *out) {
    if constexpr (kFp32Table) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            out[4 * i] = chunk.quads[i].x;
            out[4 * i + 1] = chunk.quads[i].y;
            out[4 * i + 2] = chunk.quads[i].z;
            out[4 * i + 3] = chunk.quads[i].w;
        }
    } else {
        unpack_bf16x8(chunk.raw, out);
    }
}

__device__ __forceinline__ void record(uint32_t *error_word, uint32_t bit) {
    if (error_word) atomicOr(error_word, bit);
}

/* One token's inputs of one lane. */
struct LaneInput {
    uint4 x[2]; /* dims [f, f + 8) and [f + 32, f + 40) */
    int64_t position;
};

__device__ __forceinline__ LaneInput load_input(const PrepareParams &p, bool is_key,
                                                const __nv_bfloat16 *src_first_chunk, int64_t t) {
    LaneInput in;
    in.x[0] = in.x[1] = make_uint4(0, 0, 0, 0);
    in.position = 0;
    if (t < p.num_tokens) {
        in.position = p.positions[t];
        const int64_t stride = is_key ? p.k_in_token_stride : p.q_in_token_stride;
        const uint4 *src = reinterpret_cast<const uint4 *>(src_first_chunk + t * stride);
        /* Inputs are read once: stream them past the caches. */
        in.x[0] = __ldcs(src);
        in.x[1] = __ldcs(src + kRotaryHalf / kChunkDims);
    }
    return in;
}

/* sum_d x[d]^2 of the vector in the cpu backend's order: partial m = the 16 squares of dims
 * [16 m, 16 m + 16) in order, then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). Partial m
 * starts on the even lane 2 j of its pair (2 j, 2 j + 1) and ends on the odd one: lanes 1, 3, 5, 7
 * hold (p0, p2), (p1, p3), (p4, p6), (p5, p7) in their two chunks. The result is exact on the
 * odd lanes only (the even lanes add up partials that are not the vector's). */
__device__ __forceinline__ float odd_lane_sum_of_squares(const float *x) {
    float square[kLaneDims];
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) square[i] = __fmul_rn(x[i], x[i]);
    float head[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        head[c] = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunkDims; ++i)
            head[c] = __fadd_rn(head[c], square[c * kChunkDims + i]);
    }
    float partial[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        partial[c] = __shfl_xor_sync(kFullWarp, head[c], 1); /* the even lane's first half */
#pragma unroll
        for (int i = 0; i < kChunkDims; ++i)
            partial[c] = __fadd_rn(partial[c], square[c * kChunkDims + i]);
    }
    float pairs[2];
#pragma unroll
    for (int c = 0; c < 2; ++c)
        pairs[c] = __fadd_rn(partial[c], __shfl_xor_sync(kFullWarp, partial[c], 2));
    const float half = __fadd_rn(pairs[0], pairs[1]);
    return __fadd_rn(half, __shfl_xor_sync(kFullWarp, half, 4));
}

__device__ __forceinline__ float inverse_rms_of(float sum_of_squares, float eps) {
    return __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(sum_of_squares, 1.0f / kHeadDim), eps)));
}

/* 1 / sqrt(mean square + eps) of the lane's tokens' vectors. Two tokens share one division: the
 * odd lanes divide for token 0, the even lanes for token 1 (whose sum they take from their odd
 * neighbour), and each lane then takes both results from its pair. */
template <int kTokens>
__device__ __forceinline__ void inverse_rms_of_tokens(const float *odd_lane_sum, int lane,
                                                      float eps, float *inverse_rms) {
    static_assert(kTokens == 1 || kTokens == 2, "one division serves at most two tokens");
    if constexpr (kTokens == 1) {
        inverse_rms[0] = inverse_rms_of(
            __shfl_sync(kFullWarp, odd_lane_sum[0], lane | 1, kLanesPerVector), eps);
    } else {
        const float sum1 = __shfl_xor_sync(kFullWarp, odd_lane_sum[1], 1);
        const float inverse = inverse_rms_of((lane & 1) ? odd_lane_sum[0] : sum1, eps);
        inverse_rms[0] = __shfl_sync(kFullWarp, inverse, lane | 1, kLanesPerVector);
        inverse_rms[1] = __shfl_sync(kFullWarp, inverse, lane & ~1, kLanesPerVector);
    }
}

/* Casts the lane's 16 values and stores them at dst (its first dim's byte). */
template <bool kE4M3>
__device__ __forceinline__ void store_lane(const float *y, char *dst) {
    if constexpr (kE4M3) {
        uint32_t words[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * w], y[4 * w + 1]),
                                                          __NV_SATFINITE, __NV_E4M3);
            const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * w + 2], y[4 * w + 3]),
                                                           __NV_SATFINITE, __NV_E4M3);
            words[w] = low | high << 16;
        }
        *reinterpret_cast<uint2 *>(dst) = make_uint2(words[0], words[1]);
        *reinterpret_cast<uint2 *>(dst + kRotaryHalf) = make_uint2(words[2], words[3]);
    } else {
        uint4 packed[2];
        __nv_bfloat162 *pairs = reinterpret_cast<__nv_bfloat162 *>(packed);
#pragma unroll
        for (int i = 0; i < kLaneDims / 2; ++i)
            pairs[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
        *reinterpret_cast<uint4 *>(dst) = packed[0];
        *reinterpret_cast<uint4 *>(dst + kRotaryHalf * 2) = packed[1];
    }
}

/* Block (8 (H + 1), R): threadIdx.x / 8 is the head (H: the key), threadIdx.y one of R token
 * rows. Each lane holds kTokens tokens at a time, R apart, so that a block step covers a tile
 * of kTokens R consecutive tokens and the per-token costs that do not depend on the data (the
 * loop, the addresses, the division with its fix-up branches) are paid once per kTokens tokens:
 * block b's row r handles tokens kTokens R (b + k gridDim.x) + r + j R, j < kTokens, k = 0, 1...
 * Two tokens need more registers than the largest blocks leave a thread: those hold one. */
template <bool kE4M3, bool kFp32Table, int kMaxBlock>
__global__ void __launch_bounds__(kMaxBlock, kMaxBlock == kSmallBlock ? kSmallBlocksPerSm : 1)
    index_prepare_kernel(const PrepareParams p) {
    constexpr int kTokens = kMaxBlock == kSmallBlock ? 2 : 1;
    const int lane = threadIdx.x % kLanesPerVector;
    const int head = threadIdx.x / kLanesPerVector;
    const bool is_key = head == p.num_heads;
    const bool rotary = lane < kRotaryLanes;
    const int first_dim = kChunkDims * lane + (rotary ? 0 : kRotaryHalf);
    const __nv_bfloat16 *src_first_chunk = (is_key ? p.k_in : p.q_in + head * kHeadDim) + first_dim;
    const int rows = blockDim.y, tile = kTokens * rows, step = gridDim.x * tile; /* < 2^31 */

    /* The first inputs before the weights: nothing waits for the weights until the math. */
    LaneInput next[kTokens];
#pragma unroll
    for (int k = 0; k < kTokens; ++k)
        next[k] = load_input(p, is_key, src_first_chunk, blockIdx.x * tile + k * rows + threadIdx.y);

    float one_plus_weight[kLaneDims];
    {
        const __nv_bfloat16 *weight = (is_key ? p.k_norm_weight : p.q_norm_weight) + first_dim;
        unpack_bf16x8(__ldg(reinterpret_cast<const uint4 *>(weight)), one_plus_weight);
        unpack_bf16x8(__ldg(reinterpret_cast<const uint4 *>(weight + kRotaryHalf)),
                      one_plus_weight + kChunkDims);
#pragma unroll
        for (int i = 0; i < kLaneDims; ++i)
            one_plus_weight[i] = __fadd_rn(1.0f, one_plus_weight[i]);
    }
    const int elem = kE4M3 ? 1 : 2;

    /* The loop bound is the block's, so every lane of a warp runs every shuffle. */
    for (int64_t tile_first = blockIdx.x * tile; tile_first < p.num_tokens; tile_first += step) {
        LaneInput in[kTokens];
        int64_t t[kTokens];
        bool position_ok[kTokens];
        int64_t slot[kTokens]; /* the key's lanes only; -1 elsewhere */
        TableChunk<kFp32Table> cos_chunk[kTokens], sin_chunk[kTokens];
#pragma unroll
        for (int k = 0; k < kTokens; ++k) {
            t[k] = tile_first + k * rows + threadIdx.y;
            in[k] = next[k];
            const bool token = t[k] < p.num_tokens;
            position_ok[k] = token && in[k].position >= 0 && in[k].position < p.max_position;
            slot[k] = is_key && token ? p.slot_mapping[t[k]] : -1;
            if (rotary) {
                const void *row =
                    static_cast<const char *>(p.cos_sin_cache) +
                    (position_ok[k] ? in[k].position : 0) * 2 * kRotaryHalf * (kFp32Table ? 4 : 2);
                cos_chunk[k] = load_table_chunk<kFp32Table>(row, first_dim);
                sin_chunk[k] = load_table_chunk<kFp32Table>(row, kRotaryHalf + first_dim);
            }
        }
#pragma unroll
        for (int k = 0; k < kTokens; ++k)
            next[k] = load_input(p, is_key, src_first_chunk, t[k] + step);

        float x[kTokens][kLaneDims], odd_lane_sum[kTokens];
#pragma unroll
        for (int k = 0; k < kTokens; ++k) {
            unpack_bf16x8(in[k].x[0], x[k]);
            unpack_bf16x8(in[k].x[1], x[k] + kChunkDims);
            odd_lane_sum[k] = odd_lane_sum_of_squares(x[k]);
        }
        float inverse_rms[kTokens];
        inverse_rms_of_tokens<kTokens>(odd_lane_sum, lane, p.eps, inverse_rms);

#pragma unroll
        for (int k = 0; k < kTokens; ++k) {
            float y[kLaneDims];
#pragma unroll
            for (int i = 0; i < kLaneDims; ++i)
                y[i] = __fmul_rn(__fmul_rn(x[k][i], inverse_rms[k]), one_plus_weight[i]);
            if (rotary) {
                float cos[kChunkDims], sin[kChunkDims];
                unpack_table_chunk<kFp32Table>(cos_chunk[k], cos);
                unpack_table_chunk<kFp32Table>(sin_chunk[k], sin);
#pragma unroll
                for (int i = 0; i < kChunkDims; ++i) {
                    const float first = y[i], second = y[kChunkDims + i];
                    y[i] = __fsub_rn(__fmul_rn(first, cos[i]), __fmul_rn(second, sin[i]));
                    y[kChunkDims + i] =
                        __fadd_rn(__fmul_rn(second, cos[i]), __fmul_rn(first, sin[i]));
                }
            }

            const bool token = t[k] < p.num_tokens;
            const bool slot_ok = slot[k] >= 0 && slot[k] < p.num_slots;
            if (token && !position_ok[k] && lane == 0 && head == 0)
                record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
            if (token && is_key && !slot_ok && slot[k] != -1 && lane == 0)
                record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
            if (!position_ok[k] || (is_key && !slot_ok)) continue;

            char *dst = is_key ? p.k_cache + (uint64_t)slot[k] / kPageSize * p.page_stride +
                                     (uint64_t)slot[k] % kPageSize * kHeadDim * elem
                               : p.q_out + (t[k] * p.num_heads + head) * kHeadDim * elem;
            store_lane<kE4M3>(y, dst + first_dim * elem);
        }
    }
}

/* Resident blocks per SM of one kernel at one block size (registers bound it), asked once per
 * (kernel, H): the occupancy query is host work the launch path need not repeat. */
template <bool kE4M3, bool kFp32Table, int kMaxBlock>
int resident_blocks(int num_heads, int threads) {
    static std::atomic<int> cached[MSAIDX_MAX_HEADS + 1];
    int blocks = cached[num_heads].load(std::memory_order_relaxed);
    if (blocks > 0) return blocks;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, index_prepare_kernel<kE4M3, kFp32Table, kMaxBlock>, threads, 0) !=
        cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    blocks = blocks > 0 ? blocks : 1;
    cached[num_heads].store(blocks, std::memory_order_relaxed);
    return blocks;
}

template <bool kE4M3, bool kFp32Table, int kMaxBlock>
msaidx_status launch_block(const PrepareParams &p, dim3 block, int num_sms, cudaStream_t stream) {
    const int64_t tile = (kMaxBlock == kSmallBlock ? 2 : 1) * block.y;
    const int64_t needed = (p.num_tokens + tile - 1) / tile;
    const int64_t resident =
        (int64_t)max(num_sms, 1) *
        resident_blocks<kE4M3, kFp32Table, kMaxBlock>(p.num_heads, block.x * block.y);
    const dim3 grid((unsigned)min(needed, resident));
    index_prepare_kernel<kE4M3, kFp32Table, kMaxBlock><<<grid, block, 0, stream>>>(p);
    MSAIDX_CUDA_CHECK_LAUNCH("index_prepare_kernel launch");
    return MSAIDX_SUCCESS;
}

template <bool kE4M3, bool kFp32Table>
msaidx_status launch(const PrepareParams &p, int num_sms, cudaStream_t stream) {
    const unsigned row_threads = kLanesPerVector * (unsigned)(p.num_heads + 1); /* <= 136 */
    unsigned rows_per_unit = 1;
    while (row_threads * rows_per_unit % 32) rows_per_unit *= 2; /* whole warps: 1, 2 or 4 */
    const unsigned units = max(1u, kTargetThreads / (row_threads * rows_per_unit));
    const dim3 block(row_threads, rows_per_unit * units);
    if (block.x * block.y <= kSmallBlock)
        return launch_block<kE4M3, kFp32Table, kSmallBlock>(p, block, num_sms, stream);
    return launch_block<kE4M3, kFp32Table, kLargeBlock>(p, block, num_sms, stream);
}

} // namespace

msaidx_status msaidx_cuda_index_prepare(const msaidx_context *context,
                                        const msaidx_index_prepare_args *a, void *stream) {
    const msaidx_config *config = &context->config;
    PrepareParams p;
    p.q_in = static_cast<const __nv_bfloat16 *>(a->q_in);
    p.q_in_token_stride = a->q_in_token_stride;
    p.k_in = static_cast<const __nv_bfloat16 *>(a->k_in);
    p.k_in_token_stride = a->k_in_token_stride;
    p.positions = a->positions;
    p.q_norm_weight = static_cast<const __nv_bfloat16 *>(a->q_norm_weight);
    p.k_norm_weight = static_cast<const __nv_bfloat16 *>(a->k_norm_weight);
    p.cos_sin_cache = a->cos_sin_cache;
    p.max_position = a->max_position;
    p.slot_mapping = a->slot_mapping;
    p.k_cache = static_cast<char *>(a->k_cache);
    p.page_stride = a->page_stride;
    p.num_slots = (int64_t)a->num_pages * config->page_size;
    p.q_out = static_cast<char *>(a->q_out);
    p.num_tokens = a->num_tokens;
    p.num_heads = config->num_heads;
    p.eps = a->eps;
    p.error_word = a->error_word;

    const cudaStream_t s = msaidx_cuda_stream(stream);
    const int sms = context->num_sms;
    const bool e4m3 = config->dtype == MSAIDX_DTYPE_E4M3;
    const bool fp32_table = a->cos_sin_format == MSAIDX_COS_SIN_FP32;
    if (e4m3 && fp32_table) return launch<true, true>(p, sms, s);
    if (e4m3) return launch<true, false>(p, sms, s);
    if (fp32_table) return launch<false, true>(p, sms, s);
    return launch<false, false>(p, sms, s);
}
