/* Index Q/K preparation on the device (SPEC.md section 11): one pass, 8 lanes per 128-wide
 * vector (each of a token's H query heads and its key), each lane 16 dims = two 16-byte BF16
 * loads and one 16-byte E4M3 (two BF16) store. A block row (threadIdx.y) is one token's H + 1
 * vectors, so no lane divides to find its token; each lane issues the loads of two tokens before
 * it waits for any, positions included, so that its bytes are in flight together. The FP32
 * operations are written out with _rn intrinsics so that nothing is contracted into an FMA: the
 * cpu backend evaluates the same expressions in the same order and the two agree bitwise. */
#include "cuda_internal.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kHeadDim = 128;
constexpr int kLanesPerVector = 8;
constexpr int kDimsPerLane = kHeadDim / kLanesPerVector;     /* 16 */
constexpr int kRotaryHalf = 32;                              /* pairs (d, d + 32), d < 32 */
constexpr int kRotaryLanes = 2 * kRotaryHalf / kDimsPerLane; /* lanes 0-3 hold dims [0, 64) */
constexpr int kPageSize = 128;      /* the CUDA backends admit page_size 128 only */
constexpr int kTargetThreads = 256; /* per block: as many tokens as fit */
constexpr int kTokensPerLane = 2;

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
    int32_t num_tokens;
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

/* cos (or sin) of dims [first, first + 16) of one table row. */
template <bool kFp32Table>
__device__ __forceinline__ void load_table16(const void *row, int first, float *out) {
    if constexpr (kFp32Table) {
        const float4 *quads =
            reinterpret_cast<const float4 *>(static_cast<const float *>(row) + first);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 quad = __ldg(quads + i);
            out[4 * i] = quad.x;
            out[4 * i + 1] = quad.y;
            out[4 * i + 2] = quad.z;
            out[4 * i + 3] = quad.w;
        }
    } else {
        const uint4 *raw =
            reinterpret_cast<const uint4 *>(static_cast<const __nv_bfloat16 *>(row) + first);
        unpack_bf16x8(__ldg(raw), out);
        unpack_bf16x8(__ldg(raw + 1), out + 8);
    }
}

__device__ __forceinline__ void record(uint32_t *error_word, uint32_t bit) {
    if (error_word) atomicOr(error_word, bit);
}

/* One token's inputs of one lane, loaded before any is used. */
struct LaneInput {
    uint4 x[2];
    int64_t position;
    int64_t slot; /* the key's lanes only */
};

/* Normalise, rotate, cast and store one vector (the 8 lanes of `group` call it together). */
template <bool kE4M3, bool kFp32Table>
__device__ __forceinline__ void prepare_vector(const PrepareParams &p, unsigned group, int lane,
                                               int head, int64_t t, const LaneInput &in,
                                               uint4 weight0, uint4 weight1) {
    const bool is_key = head == p.num_heads;
    if (in.position < 0 || in.position >= p.max_position) {
        if (lane == 0 && head == 0) record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
        return;
    }
    if (is_key && (in.slot < 0 || in.slot >= p.num_slots)) {
        if (lane == 0 && in.slot != -1) record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
        return;
    }

    float x[kDimsPerLane], weight[kDimsPerLane];
    unpack_bf16x8(in.x[0], x);
    unpack_bf16x8(in.x[1], x + 8);
    unpack_bf16x8(weight0, weight);
    unpack_bf16x8(weight1, weight + 8);

    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) sum = __fadd_rn(sum, __fmul_rn(x[i], x[i]));
#pragma unroll
    for (int width = 1; width < kLanesPerVector; width *= 2)
        sum = __fadd_rn(sum, __shfl_xor_sync(group, sum, width));
    const float inverse_rms =
        __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(sum, 1.0f / kHeadDim), p.eps)));

    float y[kDimsPerLane], partner[kDimsPerLane];
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i)
        y[i] = __fmul_rn(__fmul_rn(x[i], inverse_rms), __fadd_rn(1.0f, weight[i]));
        /* Lane l < 4 holds dims [16 l, 16 l + 16); its NeoX partner dims are on lane l ^ 2. */
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) partner[i] = __shfl_xor_sync(group, y[i], 2);
    if (lane < kRotaryLanes) {
        const void *row = static_cast<const char *>(p.cos_sin_cache) +
                          in.position * 2 * kRotaryHalf * (kFp32Table ? 4 : 2);
        const int first = kDimsPerLane * (lane % 2); /* dims of this lane, modulo 32 */
        float cos[kDimsPerLane], sin[kDimsPerLane];
        load_table16<kFp32Table>(row, first, cos);
        load_table16<kFp32Table>(row, kRotaryHalf + first, sin);
        const bool first_half = lane < kRotaryLanes / 2;
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) {
            const float along = __fmul_rn(y[i], cos[i]), across = __fmul_rn(partner[i], sin[i]);
            y[i] = first_half ? __fsub_rn(along, across) : __fadd_rn(along, across);
        }
    }

    const int elem = kE4M3 ? 1 : 2;
    char *dst = is_key ? p.k_cache + in.slot / kPageSize * p.page_stride +
                             in.slot % kPageSize * kHeadDim * elem
                       : p.q_out + (t * p.num_heads + head) * kHeadDim * elem;
    uint4 *dst_lane = reinterpret_cast<uint4 *>(dst + lane * kDimsPerLane * elem);
    if constexpr (kE4M3) {
        uint32_t words[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            uint32_t word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b)
                word |= (uint32_t)__nv_cvt_float_to_fp8(y[4 * w + b], __NV_SATFINITE, __NV_E4M3)
                        << (8 * b);
            words[w] = word;
        }
        *dst_lane = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
        uint4 packed[2];
        __nv_bfloat162 *pairs = reinterpret_cast<__nv_bfloat162 *>(packed);
#pragma unroll
        for (int i = 0; i < kDimsPerLane / 2; ++i)
            pairs[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
        dst_lane[0] = packed[0];
        dst_lane[1] = packed[1];
    }
}

/* Block (8 (H + 1), R): threadIdx.x / 8 is the head (H: the key), threadIdx.y one of R tokens;
 * a block covers kTokensPerLane * R consecutive tokens, a lane tokens y and y + R of them. */
template <bool kE4M3, bool kFp32Table>
__global__ void __launch_bounds__(kTargetThreads) index_prepare_kernel(const PrepareParams p) {
    const int lane = threadIdx.x % kLanesPerVector;
    const int head = threadIdx.x / kLanesPerVector;
    const bool is_key = head == p.num_heads;
    /* blockDim.x is a multiple of 8, so a vector's 8 lanes sit in one warp, aligned. */
    const unsigned linear = threadIdx.y * blockDim.x + threadIdx.x;
    const unsigned group = 0xFFu << (linear % 32 / kLanesPerVector * kLanesPerVector);
    const int64_t first_token = (int64_t)blockIdx.x * kTokensPerLane * blockDim.y + threadIdx.y;

    const uint4 *weight_lane =
        reinterpret_cast<const uint4 *>(is_key ? p.k_norm_weight : p.q_norm_weight) + 2 * lane;
    const uint4 weight0 = __ldg(weight_lane), weight1 = __ldg(weight_lane + 1);
    LaneInput in[kTokensPerLane];
#pragma unroll
    for (int k = 0; k < kTokensPerLane; ++k) {
        const int64_t t = first_token + k * blockDim.y;
        if (t >= p.num_tokens) continue;
        in[k].position = p.positions[t];
        in[k].slot = is_key ? p.slot_mapping[t] : 0;
        /* Inputs are read once: stream them past the caches. */
        const __nv_bfloat16 *src = is_key ? p.k_in + t * p.k_in_token_stride
                                          : p.q_in + t * p.q_in_token_stride + head * kHeadDim;
        const uint4 *src_lane = reinterpret_cast<const uint4 *>(src) + 2 * lane;
        in[k].x[0] = __ldcs(src_lane);
        in[k].x[1] = __ldcs(src_lane + 1);
    }
#pragma unroll
    for (int k = 0; k < kTokensPerLane; ++k) {
        const int64_t t = first_token + k * blockDim.y;
        if (t < p.num_tokens)
            prepare_vector<kE4M3, kFp32Table>(p, group, lane, head, t, in[k], weight0, weight1);
    }
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

    const unsigned row_threads = kLanesPerVector * (unsigned)(config->num_heads + 1); /* <= 136 */
    const dim3 block(row_threads, kTargetThreads / row_threads);
    const int64_t tokens_per_block = (int64_t)block.y * kTokensPerLane;
    const dim3 grid((unsigned)((a->num_tokens + tokens_per_block - 1) / tokens_per_block));
    const cudaStream_t s = msaidx_cuda_stream(stream);
    const bool e4m3 = config->dtype == MSAIDX_DTYPE_E4M3;
    const bool fp32_table = a->cos_sin_format == MSAIDX_COS_SIN_FP32;
    if (e4m3 && fp32_table)
        index_prepare_kernel<true, true><<<grid, block, 0, s>>>(p);
    else if (e4m3)
        index_prepare_kernel<true, false><<<grid, block, 0, s>>>(p);
    else if (fp32_table)
        index_prepare_kernel<false, true><<<grid, block, 0, s>>>(p);
    else
        index_prepare_kernel<false, false><<<grid, block, 0, s>>>(p);
    MSAIDX_CUDA_CHECK_LAUNCH("index_prepare_kernel launch");
    return MSAIDX_SUCCESS;
}
