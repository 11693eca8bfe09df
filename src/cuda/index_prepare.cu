/* Index Q/K preparation on the device (SPEC.md section 11): one pass, 8 lanes per 128-wide
 * vector (each of a token's H query heads and its key), each lane two chunks of 8 dims = two
 * 16-byte BF16 loads, two 8-byte E4M3 (16-byte BF16) stores per vector it holds.
 *
 * The kernels are bound by memory latency and by their instruction count, not by their bytes: a
 * block is resident for the whole pass (a grid of one wave) and walks its tokens, each lane
 * issuing the next tokens' loads (input, position) before the math of the current ones, and
 * their cos/sin rows as soon as their positions are known.
 *
 * index_prepare_pair_kernel (blocks of up to kSmallBlock threads: H = 1-5, 7, 9, 11, 15, and
 * from two full waves of its blocks on, launch() says why) holds two tokens per lane, split so
 * that every lane rotates and one division serves both tokens (its comment says how).
 * index_prepare_kernel (the other calls) holds one token per lane: lane l holds dims [f, f + 8)
 * and [f + 32, f + 40), f = 8 l (+ 32 for l >= 4), so that lanes 0-3 hold the NeoX pairs
 * (d, d + 32) of dims [0, 64) themselves (no shuffle) and load only the 8 cos and 8 sin of their
 * own dims, while lanes 4-7 hold the pass-through dims.
 *
 * The FP32 operations are written out with _rn intrinsics so that nothing is contracted into an
 * FMA, and the sum of squares keeps the cpu backend's order (16 consecutive dims in order, then
 * the 8 partials pairwise): the backends agree bitwise. */
#include "cuda_internal.cuh"

#include <atomic>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kLanesPerVector = 8;
constexpr int kChunkDims = 8; /* one 16-byte BF16 load */
constexpr int kLaneDims = 2 * kChunkDims;
constexpr int kRotaryHalf = 32; /* pairs (d, d + 32), d < 32 */
constexpr int kRotaryLanes = 4; /* lanes 0-3 hold dims [0, 64) (pair kernel: of one token) */
constexpr int kPageSize = 128;  /* the CUDA backends admit page_size 128 only */
constexpr int kTargetThreads = 128;
/* A block is whole warps (the shuffles name the full warp): rows of 8 (H + 1) lanes, at most
 * 4 rows per unit of whole warps, at most kTargetThreads unless one unit is larger. Blocks of
 * up to kSmallBlock threads may run the pair kernel, limited to 96 registers a thread so that
 * four blocks of H = 4 (five of H = 1) are resident; every block, up to kLargeBlock, the
 * one-token kernel. */
constexpr int kSmallBlock = 160;
constexpr int kSmallBlocksPerSm = 4;
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

/* A BF16 value is the top half of its FP32 value: one shift or one mask a value (the library
 * conversion moves the high half down and back up, two instructions). */
__device__ __forceinline__ void unpack_bf16x8(uint4 raw, float *out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
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
    int64_t slot; /* the key's lanes only; -1 elsewhere */
};

__device__ __forceinline__ LaneInput load_input(const PrepareParams &p, bool is_key,
                                                const __nv_bfloat16 *src_first_chunk, int64_t t) {
    LaneInput in;
    in.x[0] = in.x[1] = make_uint4(0, 0, 0, 0);
    in.position = 0;
    in.slot = -1;
    if (t < p.num_tokens) {
        in.position = p.positions[t];
        if (is_key) in.slot = p.slot_mapping[t];
        const int64_t stride = is_key ? p.k_in_token_stride : p.q_in_token_stride;
        const uint4 *src = reinterpret_cast<const uint4 *>(src_first_chunk + t * stride);
        /* Inputs are read once: stream them past the caches. */
        in.x[0] = __ldcs(src);
        in.x[1] = __ldcs(src + kRotaryHalf / kChunkDims);
    }
    return in;
}

/* sum_d x[d]^2 of a vector in the cpu backend's order: partial m = the 16 squares of dims
 * [16 m, 16 m + 16) in order, then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). Partial m
 * starts on the even lane 2 j of its pair (2 j, 2 j + 1) and ends on the odd one. This returns,
 * on the odd lanes of each group of 4 lanes holding the chunks of partials (m, m + 1, m + 2,
 * m + 3), m = 0 or 4 (lane 2 j + 1: partial m + j in its first chunk, m + j + 2 in its second),
 * ((pm + pm+1) + (pm+2 + pm+3)); the even lanes' results are not sums of the vector. */
__device__ __forceinline__ float odd_lane_half_sum_of_squares(const float *x) {
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
    return __fadd_rn(pairs[0], pairs[1]);
}

/* The whole sum on the odd lanes, v3's layout (lanes 0-3 hold p0-p3, lanes 4-7 p4-p7). */
__device__ __forceinline__ float odd_lane_sum_of_squares(const float *x) {
    const float half = odd_lane_half_sum_of_squares(x);
    return __fadd_rn(half, __shfl_xor_sync(kFullWarp, half, 4));
}

__device__ __forceinline__ float inverse_rms_of(float sum_of_squares, float eps) {
    return __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(sum_of_squares, 1.0f / kHeadDim), eps)));
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

/* One token per lane. Block (8 (H + 1), R): threadIdx.x / 8 is the head (H: the key),
 * threadIdx.y one of R token rows; block b's row r handles tokens b R + r + k gridDim.x R,
 * k = 0, 1, ... */
template <bool kE4M3, bool kFp32Table>
__global__ void __launch_bounds__(kLargeBlock) index_prepare_kernel(const PrepareParams p) {
    const int lane = threadIdx.x % kLanesPerVector;
    const int head = threadIdx.x / kLanesPerVector;
    const bool is_key = head == p.num_heads;
    const bool rotary = lane < kRotaryLanes;
    const int first_dim = kChunkDims * lane + (rotary ? 0 : kRotaryHalf);
    msaidx_wait_for_prior_grids();

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
    const __nv_bfloat16 *src_first_chunk = (is_key ? p.k_in : p.q_in + head * kHeadDim) + first_dim;
    const int elem = kE4M3 ? 1 : 2;

    const int64_t rows = blockDim.y, step = (int64_t)gridDim.x * rows;
    LaneInput next = load_input(p, is_key, src_first_chunk, blockIdx.x * rows + threadIdx.y);
    /* The loop bound is the block's, so every lane of a warp runs every shuffle. */
    for (int64_t block_first = blockIdx.x * rows; block_first < p.num_tokens; block_first += step) {
        const int64_t t = block_first + threadIdx.y;
        const LaneInput in = next;
        const bool token = t < p.num_tokens;
        const bool position_ok = token && in.position >= 0 && in.position < p.max_position;
        const bool slot_ok = in.slot >= 0 && in.slot < p.num_slots;

        TableChunk<kFp32Table> cos_chunk, sin_chunk;
        if (rotary) {
            const void *row =
                static_cast<const char *>(p.cos_sin_cache) +
                (position_ok ? in.position : 0) * 2 * kRotaryHalf * (kFp32Table ? 4 : 2);
            cos_chunk = load_table_chunk<kFp32Table>(row, first_dim);
            sin_chunk = load_table_chunk<kFp32Table>(row, kRotaryHalf + first_dim);
        }
        next = load_input(p, is_key, src_first_chunk, t + step);

        float x[kLaneDims];
        unpack_bf16x8(in.x[0], x);
        unpack_bf16x8(in.x[1], x + kChunkDims);
        const float inverse_rms = inverse_rms_of(
            __shfl_sync(kFullWarp, odd_lane_sum_of_squares(x), lane | 1, kLanesPerVector), p.eps);
        float y[kLaneDims];
#pragma unroll
        for (int i = 0; i < kLaneDims; ++i)
            y[i] = __fmul_rn(__fmul_rn(x[i], inverse_rms), one_plus_weight[i]);
        if (rotary) {
            float cos[kChunkDims], sin[kChunkDims];
            unpack_table_chunk<kFp32Table>(cos_chunk, cos);
            unpack_table_chunk<kFp32Table>(sin_chunk, sin);
#pragma unroll
            for (int i = 0; i < kChunkDims; ++i) {
                const float first = y[i], second = y[kChunkDims + i];
                y[i] = __fsub_rn(__fmul_rn(first, cos[i]), __fmul_rn(second, sin[i]));
                y[kChunkDims + i] = __fadd_rn(__fmul_rn(second, cos[i]), __fmul_rn(first, sin[i]));
            }
        }

        if (token && !position_ok && lane == 0 && head == 0)
            record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
        if (token && is_key && !slot_ok && in.slot != -1 && lane == 0)
            record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
        if (!position_ok || (is_key && !slot_ok)) continue;

        char *dst = is_key ? p.k_cache + (uint64_t)in.slot / kPageSize * p.page_stride +
                                 (uint64_t)in.slot % kPageSize * kHeadDim * elem
                           : p.q_out + (t * p.num_heads + head) * kHeadDim * elem;
        store_lane<kE4M3>(y, dst + first_dim * elem);
    }
}

/* Two tokens per lane, split at the rotary boundary so that every lane rotates: lane l of a
 * vector's 8 holds, with q = l % 4, the rotary dims [8 q, 8 q + 8) and [8 q + 32, 8 q + 40) of
 * one token ("slot 0": token 0 on lanes 0-3, token 1 on lanes 4-7) and the pass-through dims
 * [64 + 8 q, 64 + 8 q + 8) and [96 + 8 q, 96 + 8 q + 8) of the other ("slot 1"). Each load
 * and store still covers whole 32-byte sectors (lanes 0-3 and 4-7 each take 64 contiguous
 * bytes of one token), the rotation costs every lane 8 pairs of one token instead of half the
 * lanes 8 pairs of two, each lane loads one token's cos/sin, and the two tokens' sums of squares
 * meet in one shuffle: lane 2 j + 1 < 4 holds token 0's ((p0 + p1) + (p2 + p3)) in slot 0 and
 * token 1's ((p4 + p5) + (p6 + p7)) in slot 1, lane 2 j + 5 the other two, so that one xor-4
 * shuffle completes token 0's sum on lanes 1 and 3 and token 1's on lanes 5 and 7, and one
 * division serves both. Block (8 (H + 1), R) as the one-token kernel's; a block step covers a
 * tile of 2 R consecutive tokens: row r holds tokens 2 R (b + k gridDim.x) + r and that + R. */
template <bool kE4M3, bool kFp32Table>
__global__ void __launch_bounds__(kSmallBlock, kSmallBlocksPerSm)
    index_prepare_pair_kernel(const PrepareParams p) {
    const int lane = threadIdx.x % kLanesPerVector;
    const int head = threadIdx.x / kLanesPerVector;
    const bool is_key = head == p.num_heads;
    const bool second_half = lane >= kRotaryLanes;
    const int quarter = lane % kRotaryLanes;
    const int first_dim[2] = {kChunkDims * quarter, 2 * kRotaryHalf + kChunkDims * quarter};
    const bool slot_token[2] = {second_half, !second_half}; /* slot s holds token 1? */
    const int elem = kE4M3 ? 1 : 2;
    /* Token numbers are below 2^31 (int32 in the API); unsigned, a step past the last stays
     * below 2^32. */
    const unsigned num_tokens = (unsigned)p.num_tokens;
    const unsigned rows = blockDim.y, tile = 2 * rows, step = gridDim.x * tile;
    const int64_t stride = is_key ? p.k_in_token_stride : p.q_in_token_stride;
    const __nv_bfloat16 *src = is_key ? p.k_in : p.q_in + head * kHeadDim;
    const __nv_bfloat16 *slot_src[2] = {src + first_dim[0] + (slot_token[0] ? rows * stride : 0),
                                        src + first_dim[1] + (slot_token[1] ? rows * stride : 0)};

    /* A tile's inputs (zeros past the end) and both tokens' cos/sin rows, t0 = its token 0:
     * row_ok[k] says whether token k exists and its position is inside the table, row[k] is
     * then the position (which fits 32 bits: a table of 2^32 rows would take 512 GiB). */
    auto load_tile = [&](unsigned t0, uint4(*x)[2], uint32_t *row, bool *row_ok) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int64_t position = t0 + k * rows < num_tokens ? p.positions[t0 + k * rows] : -1;
            row_ok[k] = (uint64_t)position < (uint64_t)p.max_position;
            row[k] = row_ok[k] ? (uint32_t)position : 0;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            x[s][0] = x[s][1] = make_uint4(0, 0, 0, 0);
            if (t0 + (slot_token[s] ? rows : 0) < num_tokens) {
                const uint4 *chunk = reinterpret_cast<const uint4 *>(slot_src[s] + t0 * stride);
                /* Inputs are read once: stream them past the caches. */
                x[s][0] = __ldcs(chunk);
                x[s][1] = __ldcs(chunk + kRotaryHalf / kChunkDims);
            }
        }
    };
    uint4 next_x[2][2];
    uint32_t next_row[2];
    bool next_row_ok[2];
    msaidx_wait_for_prior_grids();
    load_tile(blockIdx.x * tile + threadIdx.y, next_x, next_row, next_row_ok);

    /* (1 + w) of the queries and of the key in shared memory, not in 32 registers a thread;
     * the barrier comes after the first tile's loads are in flight. */
    __shared__ float4 one_plus_weight[2][kHeadDim / 4];
    for (unsigned i = threadIdx.y * blockDim.x + threadIdx.x; i < 2 * kHeadDim;
         i += blockDim.x * blockDim.y) {
        const __nv_bfloat16 *weight = i < kHeadDim ? p.q_norm_weight : p.k_norm_weight;
        reinterpret_cast<float *>(one_plus_weight)[i] =
            __fadd_rn(1.0f, __bfloat162float(weight[i % kHeadDim]));
    }
    __syncthreads();
    const float4 *lane_weight = one_plus_weight[is_key];

    /* The loop bound is the block's, so every lane of a warp runs every shuffle. */
    for (unsigned tile_first = blockIdx.x * tile; tile_first < num_tokens; tile_first += step) {
        const unsigned t0 = tile_first + threadIdx.y;
        const unsigned t[2] = {t0, t0 + rows};
        uint4 in_x[2][2];
        int64_t slot[2];
        uint32_t row[2];
        bool position_ok[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            row[k] = next_row[k];
            position_ok[k] = next_row_ok[k];
            slot[k] = is_key && t[k] < num_tokens ? p.slot_mapping[t[k]] : -1;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int c = 0; c < 2; ++c) in_x[s][c] = next_x[s][c];
        /* The cos/sin of slot 0's token. */
        const void *table_row =
            static_cast<const char *>(p.cos_sin_cache) +
            (uint64_t)(second_half ? row[1] : row[0]) * 2 * kRotaryHalf * (kFp32Table ? 4 : 2);
        const TableChunk<kFp32Table> cos_chunk =
            load_table_chunk<kFp32Table>(table_row, first_dim[0]);
        const TableChunk<kFp32Table> sin_chunk =
            load_table_chunk<kFp32Table>(table_row, kRotaryHalf + first_dim[0]);
        load_tile(t0 + step, next_x, next_row, next_row_ok);

        float y[2][kLaneDims], half_sum[2];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            unpack_bf16x8(in_x[s][0], y[s]);
            unpack_bf16x8(in_x[s][1], y[s] + kChunkDims);
            half_sum[s] = odd_lane_half_sum_of_squares(y[s]);
        }
        const float inverse = inverse_rms_of(
            __fadd_rn(half_sum[0], __shfl_xor_sync(kFullWarp, half_sum[1], 4)), p.eps);
        const float inverse_rms[2] = {
            __shfl_sync(kFullWarp, inverse, lane | 1, kLanesPerVector),
            __shfl_sync(kFullWarp, inverse, (lane | 1) ^ kRotaryLanes, kLanesPerVector)};
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int q = 0; q < kChunkDims / 4; ++q) {
                    const float4 w = lane_weight[(first_dim[s] + c * kRotaryHalf) / 4 + q];
                    const float weight[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float &v = y[s][c * kChunkDims + 4 * q + i];
                        v = __fmul_rn(__fmul_rn(v, inverse_rms[s]), weight[i]);
                    }
                }
        {
            float cos[kChunkDims], sin[kChunkDims];
            unpack_table_chunk<kFp32Table>(cos_chunk, cos);
            unpack_table_chunk<kFp32Table>(sin_chunk, sin);
#pragma unroll
            for (int i = 0; i < kChunkDims; ++i) {
                const float first = y[0][i], second = y[0][kChunkDims + i];
                y[0][i] = __fsub_rn(__fmul_rn(first, cos[i]), __fmul_rn(second, sin[i]));
                y[0][kChunkDims + i] =
                    __fadd_rn(__fmul_rn(second, cos[i]), __fmul_rn(first, sin[i]));
            }
        }

        bool write[2];
#pragma unroll
        for (int k = 0; k < 2; ++k)
            write[k] = position_ok[k] && (!is_key || (uint64_t)slot[k] < (uint64_t)p.num_slots);
        if (!(write[0] && write[1])) { /* rare: a bad token, or the tile's end */
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                if (t[k] >= num_tokens || lane != 0) continue;
                if (!position_ok[k] && head == 0) record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
                if (is_key && (uint64_t)slot[k] >= (uint64_t)p.num_slots && slot[k] != -1)
                    record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
            }
        }
        /* Each slot's row: the key's cache row or the queries' q_out row. */
        char *const q_row = p.q_out + ((int64_t)t0 * p.num_heads + head) * kHeadDim * elem;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if (!(slot_token[s] ? write[1] : write[0])) continue;
            const uint64_t token_slot = slot_token[s] ? slot[1] : slot[0];
            char *dst =
                is_key
                    ? p.k_cache + token_slot / kPageSize * p.page_stride +
                          token_slot % kPageSize * kHeadDim * elem
                    : q_row + (slot_token[s] ? (int64_t)rows * p.num_heads * kHeadDim * elem : 0);
            store_lane<kE4M3>(y[s], dst + first_dim[s] * elem);
        }
    }
}

/* Resident blocks per SM of one kernel at one block size (registers bound it), asked once per
 * (kernel, H): the occupancy query is host work the launch path need not repeat. */
template <auto kKernel>
int resident_blocks(int num_heads, int threads) {
    static std::atomic<int> cached[MSAIDX_MAX_HEADS + 1];
    int blocks = cached[num_heads].load(std::memory_order_relaxed);
    if (blocks > 0) return blocks;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, 0) !=
        cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    blocks = blocks > 0 ? blocks : 1;
    cached[num_heads].store(blocks, std::memory_order_relaxed);
    return blocks;
}

/* Blocks a kernel whose block step covers kTokens tokens a row needs for the call, and how many
 * of them are resident at once on the device. */
struct Grid {
    int64_t needed, resident;
};
template <auto kKernel, int kTokens>
Grid grid_of(const PrepareParams &p, dim3 block, int num_sms) {
    const int64_t tile = kTokens * block.y;
    return {(p.num_tokens + tile - 1) / tile,
            (int64_t)max(num_sms, 1) * resident_blocks<kKernel>(p.num_heads, block.x * block.y)};
}

/* One resident wave at most: the blocks walk the tokens. */
template <auto kKernel>
msaidx_status launch_kernel(const PrepareParams &p, dim3 block, Grid grid, cudaStream_t stream) {
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(kKernel,
                                            dim3((unsigned)min(grid.needed, grid.resident)), block,
                                            0, stream, p),
                    "index_prepare_kernel launch");
    return MSAIDX_SUCCESS;
}

template <bool kE4M3, bool kFp32Table>
msaidx_status launch(const PrepareParams &p, int num_sms, cudaStream_t stream) {
    const unsigned row_threads = kLanesPerVector * (unsigned)(p.num_heads + 1); /* <= 136 */
    unsigned rows_per_unit = 1;
    while (row_threads * rows_per_unit % 32) rows_per_unit *= 2; /* whole warps: 1, 2 or 4 */
    const unsigned units = max(1u, kTargetThreads / (row_threads * rows_per_unit));
    const dim3 block(row_threads, rows_per_unit * units);
    constexpr auto kPair = index_prepare_pair_kernel<kE4M3, kFp32Table>;
    constexpr auto kOne = index_prepare_kernel<kE4M3, kFp32Table>;
    /* The pair kernel runs half the threads of the one-token kernel: below two full waves of its
     * blocks (T < 8448 at H = 4, 21120 at H = 1 on an H200) the one-token kernel's twice as many
     * warps hide the latency better, and measured 0.1-0.9 us faster at T = 4096 and 16384, H = 1
     * (bench/results/2026-12-01_h200_index_prepare.md). */
    if (block.x * block.y <= kSmallBlock) {
        const Grid pair = grid_of<kPair, 2>(p, block, num_sms);
        if (pair.needed >= 2 * pair.resident) return launch_kernel<kPair>(p, block, pair, stream);
    }
    return launch_kernel<kOne>(p, block, grid_of<kOne, 1>(p, block, num_sms), stream);
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
