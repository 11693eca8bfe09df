/* Index Q/K preparation on the device (SPEC.md section 11): one pass, 8 lanes per 128-wide
 * vector (each of a token's H query heads and its key), each lane two chunks of 8 dims = two
 * 16-byte BF16 loads, two 8-byte E4M3 (16-byte BF16) stores.
 *
 * Lane l holds dims [f, f + 8) and [f + 32, f + 40), f = 8 l (+ 32 for l >= 4): lanes 0-3 hold
 * the NeoX pairs (d, d + 32) of dims [0, 64) themselves, so the rotation needs no shuffle and
 * loads only the 8 cos and 8 sin of its own dims; lanes 4-7 hold the pass-through dims.
 *
 * Latency, not bytes, bounds a kernel that waits for a token's inputs, then for its position,
 * then for its cos/sin row. Here the grid is one resident wave and each lane walks its tokens
 * through a pipeline: while it works on token t, the inputs of the next kStages - 1 tokens are
 * on their way into its shared-memory ring (cp.async, no registers held), the next token's
 * slot and cos/sin chunks into registers, and the position of the token after it.
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
 * 4 rows per unit of whole warps, at most kTargetThreads unless one unit is larger. */
constexpr int kMaxThreads = 4 * kLanesPerVector * (MSAIDX_MAX_HEADS + 1);
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
/* Tokens in a lane's ring of inputs: kStages - 1 on their way, one in use. */
constexpr int kStages = 4;
constexpr int kStageBytesPerLane = 2 * 16;

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
    uint32_t num_tokens;
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
template <bool kFp32Table> struct TableChunk {
    float4 quads[2];
};
template <> struct TableChunk<false> {
    uint4 raw;
};

template <bool kFp32Table>
__device__ __forceinline__ TableChunk<kFp32Table> load_table_chunk(const void *row, int first) {
    TableChunk<kFp32Table> chunk;
    if constexpr (kFp32Table) {
        const float4 *quads = reinterpret_cast<const float4 *>(static_cast<const float *>(row) + first);
        chunk.quads[0] = __ldg(quads);
        chunk.quads[1] = __ldg(quads + 1);
    } else {
        chunk.raw = __ldg(reinterpret_cast<const uint4 *>(static_cast<const __nv_bfloat16 *>(row) + first));
    }
    return chunk;
}

template <bool kFp32Table>
__device__ __forceinline__ void unpack_table_chunk(const TableChunk<kFp32Table> &chunk, float *out) {
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

/* The cos and sin chunks of a rotary lane's dims for one position (row 0 for a bad one: it is
 * loaded, never stored). */
template <bool kFp32Table> struct TableChunks {
    TableChunk<kFp32Table> cos, sin;
};

template <bool kFp32Table>
__device__ __forceinline__ TableChunks<kFp32Table>
load_table(const PrepareParams &p, bool rotary, int first_dim, int64_t position) {
    TableChunks<kFp32Table> chunks;
    if (rotary) {
        const bool ok = (uint64_t)position < (uint64_t)p.max_position;
        const void *row = static_cast<const char *>(p.cos_sin_cache) +
                          (ok ? position : 0) * 2 * kRotaryHalf * (kFp32Table ? 4 : 2);
        chunks.cos = load_table_chunk<kFp32Table>(row, first_dim);
        chunks.sin = load_table_chunk<kFp32Table>(row, kRotaryHalf + first_dim);
    }
    return chunks;
}

/* 8 floats of shared memory, read anew at every call: a plain load would be hoisted out of the
 * token loop into 8 registers per lane, registers the loads in flight need. */
__device__ __forceinline__ void load_shared_volatile8(const float *src, float *out) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(src));
#pragma unroll
    for (int i = 0; i < 2; ++i)
        asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(out[4 * i]), "=f"(out[4 * i + 1]), "=f"(out[4 * i + 2]),
                       "=f"(out[4 * i + 3])
                     : "r"(address + 16 * i));
}

__device__ __forceinline__ void record(uint32_t *error_word, uint32_t bit) {
    if (error_word) atomicOr(error_word, bit);
}

/* Starts the copies of a token's two input chunks (dims [f, f + 8) and [f + 32, f + 40)) from
 * `src` into `stage` (none when `valid` is false), as one group: one group per token and lane,
 * so that waiting for all groups but the kStages - 1 newest waits for exactly the oldest token.
 * Inputs are read once: they pass L2 marked evict-first. */
__device__ __forceinline__ void stage_input(bool valid, const __nv_bfloat16 *src, uint4 *stage,
                                            uint64_t evict_first) {
    if (valid) {
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(stage));
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst),
                     "l"(src), "l"(evict_first)
                     : "memory");
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst + 16),
                     "l"(src + kRotaryHalf), "l"(evict_first)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* sum_d x[d]^2 of the vector in the cpu backend's order: partial m = the 16 squares of dims
 * [16 m, 16 m + 16) in order, then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). Partial m
 * starts on the even lane 2 j of its pair (2 j, 2 j + 1) and ends on the odd one: lanes 1, 3, 5, 7
 * hold (p0, p2), (p1, p3), (p4, p6), (p5, p7) in their two chunks. */
__device__ __forceinline__ float sum_of_squares(const float *x, int lane) {
    float square[kLaneDims];
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) square[i] = __fmul_rn(x[i], x[i]);
    float head[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        head[c] = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunkDims; ++i) head[c] = __fadd_rn(head[c], square[c * kChunkDims + i]);
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
    const float total = __fadd_rn(half, __shfl_xor_sync(kFullWarp, half, 4));
    return __shfl_sync(kFullWarp, total, lane | 1, kLanesPerVector);
}

/* Block (8 (H + 1), R): threadIdx.x / 8 is the head (H: the key), threadIdx.y one of R token
 * rows; block b's row r handles tokens b R + r + k gridDim.x R, k = 0, 1, ... (32-bit token
 * numbers: T < 2^31 and the grid is one wave, so t + kStages gridDim.x R < 2^32). */
template <bool kE4M3, bool kFp32Table>
__global__ void __launch_bounds__(kMaxThreads) index_prepare_kernel(const PrepareParams p) {
    const int lane = threadIdx.x % kLanesPerVector;
    const int head = threadIdx.x / kLanesPerVector;
    const bool is_key = head == p.num_heads;
    const bool rotary = lane < kRotaryLanes;
    const int first_dim = kChunkDims * lane + (rotary ? 0 : kRotaryHalf);
    const int elem = kE4M3 ? 1 : 2;

    /* 1 + w of the queries [0] and of the key [1]. */
    __shared__ __align__(16) float shared_one_plus_weight[2][kHeadDim];
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < 2 * kHeadDim;
         i += blockDim.x * blockDim.y) {
        const __nv_bfloat16 *weight = i < kHeadDim ? p.q_norm_weight : p.k_norm_weight;
        shared_one_plus_weight[i / kHeadDim][i % kHeadDim] =
            __fadd_rn(1.0f, __bfloat162float(weight[i % kHeadDim]));
    }
    __syncthreads();
    const float *one_plus_weight_lane = shared_one_plus_weight[is_key] + first_dim;

    extern __shared__ uint4 staged_inputs[]; /* [kStages][threads][2] */
    const unsigned threads = blockDim.x * blockDim.y;
    uint4 *const ring = staged_inputs + 2 * (threadIdx.y * blockDim.x + threadIdx.x);
    uint64_t evict_first;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));

    /* Each stream of the pipeline walks its own token, `step` tokens per iteration. */
    const uint32_t num_tokens = p.num_tokens;
    const uint32_t step = gridDim.x * blockDim.y;
    const uint32_t first_token = blockIdx.x * blockDim.y + threadIdx.y;
    const int64_t input_stride = is_key ? p.k_in_token_stride : p.q_in_token_stride;
    const int64_t input_step = (int64_t)step * input_stride;
    uint32_t staged_token = first_token;
    const __nv_bfloat16 *staged_src = (is_key ? p.k_in : p.q_in + head * kHeadDim) + first_dim +
                                      (int64_t)first_token * input_stride;
#pragma unroll
    for (int k = 0; k < kStages - 1; ++k) {
        stage_input(staged_token < num_tokens, staged_src, ring + 2 * k * threads, evict_first);
        staged_token += step;
        staged_src += input_step;
    }
    uint32_t slot_token = first_token;
    int64_t next_slot = is_key && slot_token < num_tokens ? p.slot_mapping[slot_token] : -1;
    int64_t next_position = first_token < num_tokens ? p.positions[first_token] : -1;
    TableChunks<kFp32Table> next_table = load_table<kFp32Table>(p, rotary, first_dim, next_position);
    uint32_t position_token = first_token + step;
    int64_t later_position = position_token < num_tokens ? p.positions[position_token] : -1;
    const int64_t q_out_step = (int64_t)step * p.num_heads * kHeadDim * elem;
    char *q_dst = p.q_out + ((int64_t)first_token * p.num_heads + head) * kHeadDim * elem +
                  first_dim * elem;

    unsigned stage = 0;
    /* The loop bound is the block's, so every lane of a warp runs every shuffle. */
    for (uint32_t block_first = blockIdx.x * blockDim.y; block_first < num_tokens;
         block_first += step) {
        const bool token = block_first + threadIdx.y < num_tokens;
        const int64_t slot = next_slot, position = next_position;
        const TableChunks<kFp32Table> table = next_table;
        char *const token_q_dst = q_dst;
        q_dst += q_out_step;

        slot_token += step;
        next_slot = is_key && slot_token < num_tokens ? p.slot_mapping[slot_token] : -1;
        next_position = later_position;
        next_table = load_table<kFp32Table>(p, rotary, first_dim, next_position);
        position_token += step;
        later_position = position_token < num_tokens ? p.positions[position_token] : -1;
        /* The stage this lane read last takes the token kStages - 1 steps ahead. */
        stage_input(staged_token < num_tokens, staged_src,
                    ring + 2 * ((stage + kStages - 1) % kStages) * threads, evict_first);
        staged_token += step;
        staged_src += input_step;
        asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");

        float x[kLaneDims];
        unpack_bf16x8(ring[2 * stage * threads], x);
        unpack_bf16x8(ring[2 * stage * threads + 1], x + kChunkDims);
        stage = (stage + 1) % kStages;
        const float inverse_rms = __frcp_rn(__fsqrt_rn(
            __fadd_rn(__fmul_rn(sum_of_squares(x, lane), 1.0f / kHeadDim), p.eps)));
        float one_plus_weight[kLaneDims], y[kLaneDims];
        load_shared_volatile8(one_plus_weight_lane, one_plus_weight);
        load_shared_volatile8(one_plus_weight_lane + kRotaryHalf, one_plus_weight + kChunkDims);
#pragma unroll
        for (int i = 0; i < kLaneDims; ++i)
            y[i] = __fmul_rn(__fmul_rn(x[i], inverse_rms), one_plus_weight[i]);
        if (rotary) {
            float cos[kChunkDims], sin[kChunkDims];
            unpack_table_chunk<kFp32Table>(table.cos, cos);
            unpack_table_chunk<kFp32Table>(table.sin, sin);
#pragma unroll
            for (int i = 0; i < kChunkDims; ++i) {
                const float first = y[i], second = y[kChunkDims + i];
                y[i] = __fsub_rn(__fmul_rn(first, cos[i]), __fmul_rn(second, sin[i]));
                y[kChunkDims + i] = __fadd_rn(__fmul_rn(second, cos[i]), __fmul_rn(first, sin[i]));
            }
        }

        const bool position_ok = token && (uint64_t)position < (uint64_t)p.max_position;
        const bool slot_ok = (uint64_t)slot < (uint64_t)p.num_slots;
        if (token && !position_ok && lane == 0 && head == 0)
            record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
        if (token && is_key && !slot_ok && slot != -1 && lane == 0)
            record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
        if (!position_ok || (is_key && !slot_ok)) continue;

        char *const dst = is_key ? p.k_cache + (uint64_t)slot / kPageSize * p.page_stride +
                                       (uint64_t)slot % kPageSize * kHeadDim * elem +
                                       first_dim * elem
                                 : token_q_dst;
        if constexpr (kE4M3) {
            uint32_t words[4];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * w], y[4 * w + 1]),
                                                              __NV_SATFINITE, __NV_E4M3);
                const uint32_t high = __nv_cvt_float2_to_fp8x2(
                    make_float2(y[4 * w + 2], y[4 * w + 3]), __NV_SATFINITE, __NV_E4M3);
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
}

/* Resident blocks per SM of one kernel at one block size (registers bound it), asked once per
 * (kernel, H): the occupancy query is host work the launch path need not repeat. */
template <bool kE4M3, bool kFp32Table>
int resident_blocks(int num_heads, int threads, size_t ring_bytes) {
    static std::atomic<int> cached[MSAIDX_MAX_HEADS + 1];
    int blocks = cached[num_heads].load(std::memory_order_relaxed);
    if (blocks > 0) return blocks;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, index_prepare_kernel<kE4M3, kFp32Table>, threads, ring_bytes) != cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    blocks = blocks > 0 ? blocks : 1;
    cached[num_heads].store(blocks, std::memory_order_relaxed);
    return blocks;
}

template <bool kE4M3, bool kFp32Table>
msaidx_status launch(const PrepareParams &p, int num_sms, cudaStream_t stream) {
    const unsigned row_threads = kLanesPerVector * (unsigned)(p.num_heads + 1); /* <= 136 */
    unsigned rows_per_unit = 1;
    while (row_threads * rows_per_unit % 32) rows_per_unit *= 2; /* whole warps: 1, 2 or 4 */
    const unsigned units = max(1u, kTargetThreads / (row_threads * rows_per_unit));
    const dim3 block(row_threads, rows_per_unit * units);
    const size_t ring_bytes = (size_t)kStages * block.x * block.y * kStageBytesPerLane;
    /* Blocks of more than 384 lanes (H = 12, 14, 16) need more than the 48 KiB of shared memory
     * a kernel gets without asking (per device, so asked at every such launch). */
    if (ring_bytes > 48 * 1024)
        MSAIDX_CUDA_TRY(cudaFuncSetAttribute(index_prepare_kernel<kE4M3, kFp32Table>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)ring_bytes),
                        "index_prepare_kernel shared memory");
    const int64_t needed = ((int64_t)p.num_tokens + block.y - 1) / block.y;
    const int64_t resident = (int64_t)max(num_sms, 1) * resident_blocks<kE4M3, kFp32Table>(
                                                            p.num_heads, block.x * block.y, ring_bytes);
    const dim3 grid((unsigned)min(needed, resident));
    index_prepare_kernel<kE4M3, kFp32Table><<<grid, block, ring_bytes, stream>>>(p);
    MSAIDX_CUDA_CHECK_LAUNCH("index_prepare_kernel launch");
    return MSAIDX_SUCCESS;
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
    p.num_tokens = (uint32_t)a->num_tokens; /* >= 1: the entry returns before an empty call */
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
