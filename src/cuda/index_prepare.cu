/* Index Q/K preparation on the device (SPEC.md section 11): one pass, 8 lanes per 128-wide
 * vector (each of a token's H query heads and its key; at H = 1 one group of 8 lanes holds both,
 * below). Lane q of a vector holds the NeoX pairs (d, d + 32) for d in [4 q, 4 q + 4) and the
 * pass-through dims [64 + 8 q, 64 + 8 q + 8): every lane rotates 4 pairs with its own 4 cos and
 * 4 sin (no shuffles, no lanes idle in a branch), and each of its three loads and three stores,
 * over the vector's 8 lanes, covers whole 32-byte sectors.
 *
 * The kernel is bound by latency, not by its bytes (at T <= 16384 a call's inputs are L2 hits): a
 * block is resident for the whole pass (a grid of one wave) and walks its tokens. Each step issues
 * the next token's inputs and cos/sin row and the position after that before its math, so that no
 * load waits for another, and the arithmetic is the fewest FP32 operations that round as section
 * 11 allows: the sum of squares, the weight and the rotation as fused multiply-adds, one division
 * a vector (about 220 instructions a lane and token, against 260-330 for two tokens a lane or one
 * with idle lanes). The kernel then takes 0.96-1.15x the time of its loads and stores alone
 * (bench/probes/index_prepare_no_math.patch; bench/experiments/2026-12-01_h200_index_prepare.md).
 * The cpu backend performs the same operations in the same order (fmaf), so the backends agree
 * bitwise.
 *
 * With MSAIDX_COS_SIN_THETA there is no table row to load: each lane computes its 4 cos and 4 sin
 * from the token's position (src/rope_theta.h, about 29 instructions a pair, a third of a
 * vector's): 256 bytes a token of an FP32 table traded for arithmetic, which with a group a
 * vector was 1.05-1.23x as fast where the call streams from HBM and 0.72-0.98x where its inputs
 * are L2 hits and instructions bound it. Sharing the angles among a token's vectors costs more
 * than it saves when they sit in different groups: shuffled from one warp's lanes 1.3x slower at
 * small T (on the math's critical path), through shared memory 1.1-1.8x (a barrier a step). At
 * H = 1 one group holds a token's query and its key and computes (or loads) the angles once for
 * both, with no exchange: with theta 1.04-1.24x as fast as a group a vector at T >= 4096 (E4M3
 * 1.12-1.24x), the table paths within 0.95-1.04x (128 registers, 16 warps an SM, twice the
 * independent work a lane). At H = 2-4 with theta and T >= 4096 one group holds all H + 1 of a
 * token's vectors (the queries share one set of norm weights; 149-166 registers): E4M3 at H = 4
 * 1.06-1.16x as fast; with a table, or at smaller T, that many registers a lane cost more than the
 * angles (launch, below). Past H = 4 a token's vectors would not fit one lane's registers. */
#include "cuda_internal.cuh"

#include "../rope_theta.h"

#include <atomic>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kLanesPerVector = 8;
constexpr int kRotaryHalf = 32;  /* pairs (d, d + 32), d < 32 */
constexpr int kPairsPerLane = 4; /* d in [4 q, 4 q + 4) */
constexpr int kPassFirst = 64;   /* dims [64, 128) pass through */
constexpr int kPassDims = 8;     /* [64 + 8 q, 64 + 8 q + 8) */
constexpr int kPageSize = 128;   /* the CUDA backends admit page_size 128 only */
/* A block step covers R tokens, R = 4 per unit of whole warps (the shuffles name the full warp),
 * as many units as fit kTargetThreads, at least one. */
constexpr int kTargetThreads = 128;
constexpr int kMaxBlock = 4 * kLanesPerVector * (MSAIDX_MAX_HEADS + 1);
/* A group per token (all of its vectors in one group): R = kTargetThreads / 8 tokens a step. */
constexpr int kMaxBlockOfTokenGroups = kTargetThreads;
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
    uint64_t rope_turns[MSAIDX_ROPE_PAIRS]; /* MSAIDX_COS_SIN_THETA (src/rope_theta.h) */
};

/* A BF16 value is the top half of its FP32 value: one shift or one mask a value. */
__device__ __forceinline__ float bf16_low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(uint32_t word) {
    return __uint_as_float(word & 0xFFFF0000u);
}

/* One lane's 16 BF16 inputs of one vector, as loaded. */
struct LaneBits {
    uint2 first;  /* dims [4 q, 4 q + 4) */
    uint2 second; /* dims [32 + 4 q, 32 + 4 q + 4) */
    uint4 pass;   /* dims [64 + 8 q, 64 + 8 q + 8) */
};

/* One lane's input loads of one token: its kVectors vectors. */
template <int kVectors>
struct TokenInputs {
    LaneBits x[kVectors];
    int64_t slot; /* lanes that hold the key; -1 elsewhere */
};

/* A token's position, loaded a token ahead of its inputs, so that its cos/sin row is loaded with
 * them instead of after a wait for the position. */
struct TokenPosition {
    uint32_t row; /* the position when ok (a table of 2^32 rows would be 512 GiB) */
    bool ok;      /* the token exists and its position is inside the table */
};

/* Where a position's angles come from: msaidx_cos_sin_format. */
enum class Rotation { kFp32Table, kBf16Table, kTheta };

/* The lane's 4 cos and 4 sin of one position, as loaded; from theta, the position itself (the
 * math computes them). */
template <Rotation kRotation>
struct LaneTable {
    float4 cos, sin;
};
template <>
struct LaneTable<Rotation::kBf16Table> {
    uint2 cos, sin;
};
template <>
struct LaneTable<Rotation::kTheta> {
    uint32_t position;
};

template <Rotation kRotation>
__device__ __forceinline__ LaneTable<kRotation> load_table(const void *table, uint32_t row,
                                                           int quarter) {
    LaneTable<kRotation> out;
    if constexpr (kRotation == Rotation::kTheta) {
        out.position = row;
    } else if constexpr (kRotation == Rotation::kFp32Table) {
        const float *entries = static_cast<const float *>(table) + (uint64_t)row * 2 * kRotaryHalf;
        out.cos = __ldg(reinterpret_cast<const float4 *>(entries + kPairsPerLane * quarter));
        out.sin = __ldg(
            reinterpret_cast<const float4 *>(entries + kRotaryHalf + kPairsPerLane * quarter));
    } else {
        const __nv_bfloat16 *entries =
            static_cast<const __nv_bfloat16 *>(table) + (uint64_t)row * 2 * kRotaryHalf;
        out.cos = __ldg(reinterpret_cast<const uint2 *>(entries + kPairsPerLane * quarter));
        out.sin =
            __ldg(reinterpret_cast<const uint2 *>(entries + kRotaryHalf + kPairsPerLane * quarter));
    }
    return out;
}

/* turns: the lane's 4 pairs' rotations per position (theta only). */
template <Rotation kRotation>
__device__ __forceinline__ void unpack_table(const LaneTable<kRotation> &t, const uint64_t *turns,
                                             float *cos, float *sin) {
    if constexpr (kRotation == Rotation::kTheta) {
#pragma unroll
        for (int i = 0; i < kPairsPerLane; ++i)
            msaidx_rope_cos_sin(turns[i], t.position, &cos[i], &sin[i]);
    } else if constexpr (kRotation == Rotation::kFp32Table) {
        const float c[4] = {t.cos.x, t.cos.y, t.cos.z, t.cos.w};
        const float s[4] = {t.sin.x, t.sin.y, t.sin.z, t.sin.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) cos[i] = c[i], sin[i] = s[i];
    } else {
        cos[0] = bf16_low(t.cos.x), cos[1] = bf16_high(t.cos.x);
        cos[2] = bf16_low(t.cos.y), cos[3] = bf16_high(t.cos.y);
        sin[0] = bf16_low(t.sin.x), sin[1] = bf16_high(t.sin.x);
        sin[2] = bf16_low(t.sin.y), sin[3] = bf16_high(t.sin.y);
    }
}

/* The lane's 16 values in its order: first half, second half, pass-through. */
__device__ __forceinline__ void unpack_lane(const LaneBits &bits, float *x) {
    const uint32_t words[8] = {bits.first.x, bits.first.y, bits.second.x, bits.second.y,
                               bits.pass.x,  bits.pass.y,  bits.pass.z,   bits.pass.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) x[2 * i] = bf16_low(words[i]), x[2 * i + 1] = bf16_high(words[i]);
}

__device__ __forceinline__ void record(uint32_t *error_word, uint32_t bit) {
    if (error_word) atomicOr(error_word, bit);
}

/* 4 values in the cache dtype: E4M3 saturating, BF16, round to nearest even. */
template <bool kE4M3>
struct Packed4 {
    uint32_t bits;
};
template <>
struct Packed4<false> {
    uint2 bits;
};
template <bool kE4M3>
__device__ __forceinline__ Packed4<kE4M3> pack4(const float *v) {
    Packed4<kE4M3> out;
    if constexpr (kE4M3) {
        const uint32_t low =
            __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, __NV_E4M3);
        const uint32_t high =
            __nv_cvt_float2_to_fp8x2(make_float2(v[2], v[3]), __NV_SATFINITE, __NV_E4M3);
        out.bits = low | high << 16;
    } else {
        const __nv_bfloat162 low = __floats2bfloat162_rn(v[0], v[1]);
        const __nv_bfloat162 high = __floats2bfloat162_rn(v[2], v[3]);
        out.bits = make_uint2(*reinterpret_cast<const uint32_t *>(&low),
                              *reinterpret_cast<const uint32_t *>(&high));
    }
    return out;
}

/* A lane group (8 lanes) holds kVectors vectors of one token: one (a query head or the key), or
 * all H + 1 of them (kVectors = H + 1: at H = 1 its query and key, at H = 2-4 with theta its
 * queries and key), which then share one cos/sin row, loaded or computed once (with theta the
 * angles are a third of a vector's instructions).
 *
 * A block step covers R consecutive tokens of a row of blocks. With one vector a group, its first
 * 8 H R threads hold the query vectors (vector v: token v / H, head v % H), the last 8 R the keys
 * (token v - H R), so that a warp holds queries only or keys only (R is a multiple of 4) and no
 * branch on the vector's kind diverges; with all of a token's, group g holds token g. Block b
 * handles tokens b R + k gridDim.x R + r, k = 0, 1, ... */
template <bool kE4M3, Rotation kRotation, int kVectors>
__global__ void __launch_bounds__(kVectors == 1 ? kMaxBlock : kMaxBlockOfTokenGroups)
    index_prepare_kernel(const PrepareParams p) {
    static_assert(kVectors >= 1 && kVectors <= 5, "a group holds one vector, or all of a token's");
    const int quarter = threadIdx.x % kLanesPerVector;
    const unsigned heads = (unsigned)p.num_heads;
    const unsigned groups_per_token = (heads + 1) / kVectors;
    const unsigned rows = blockDim.x / (kLanesPerVector * groups_per_token);
    const unsigned group = threadIdx.x / kLanesPerVector;
    /* The group's token row and, per vector, whether it is the key and its head (H for the key). */
    unsigned row;
    bool is_key[kVectors];
    unsigned head[kVectors];
    if constexpr (kVectors == 1) {
        is_key[0] = group >= heads * rows;
        row = is_key[0] ? group - heads * rows : group / heads;
        head[0] = is_key[0] ? heads : group % heads;
    } else { /* all of the token's vectors: its H = kVectors - 1 queries, then its key */
        row = group;
#pragma unroll
        for (int v = 0; v < kVectors; ++v)
            is_key[v] = v == kVectors - 1, head[v] = is_key[v] ? heads : v;
    }
    const bool holds_key = is_key[kVectors - 1];
    const int elem = kE4M3 ? 1 : 2;
    const unsigned num_tokens = (unsigned)p.num_tokens; /* < 2^31: int32 in the API */
    const unsigned step = gridDim.x * rows;
    const int first_dim = kPairsPerLane * quarter, pass_dim = kPassFirst + kPassDims * quarter;
    /* Per vector: bytes from one token to the next, and token 0's dims of this lane (the rotary
     * first half, the second half kRotaryHalf dims on, and the pass-through dims); where a
     * query's output row starts: q_out + t H 128 elem + head 128 elem. */
    int64_t stride_bytes[kVectors];
    const char *src_first[kVectors], *src_pass[kVectors];
    char *q_lane[kVectors];
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
        stride_bytes[v] = 2 * (is_key[v] ? p.k_in_token_stride : p.q_in_token_stride);
        const char *src =
            reinterpret_cast<const char *>(is_key[v] ? p.k_in : p.q_in + head[v] * kHeadDim);
        src_first[v] = src + 2 * first_dim, src_pass[v] = src + 2 * pass_dim;
        q_lane[v] = p.q_out + head[v] * kHeadDim * elem;
    }
    const uint64_t q_token_bytes = (uint64_t)heads * kHeadDim * elem;

    /* Tokens past the end load the last token's (no branch, no zeroing) and are not written. */
    auto load_position = [&](unsigned t) {
        const int64_t position = p.positions[min(t, num_tokens - 1)];
        TokenPosition out;
        out.ok = t < num_tokens && (uint64_t)position < (uint64_t)p.max_position;
        out.row = out.ok ? (uint32_t)position : 0;
        return out;
    };
    auto load_inputs = [&](unsigned t) {
        const unsigned source = min(t, num_tokens - 1);
        TokenInputs<kVectors> in;
        in.slot = holds_key ? p.slot_mapping[source] : -1;
#pragma unroll
        for (int v = 0; v < kVectors; ++v) {
            const int64_t offset = (int64_t)source * stride_bytes[v];
            /* Inputs are read once: stream them past the caches. */
            in.x[v].first = __ldcs(reinterpret_cast<const uint2 *>(src_first[v] + offset));
            in.x[v].second =
                __ldcs(reinterpret_cast<const uint2 *>(src_first[v] + offset + 2 * kRotaryHalf));
            in.x[v].pass = __ldcs(reinterpret_cast<const uint4 *>(src_pass[v] + offset));
        }
        return in;
    };

    msaidx_wait_for_prior_grids();
    const unsigned first_token = blockIdx.x * rows + row;
    TokenPosition position = load_position(first_token);
    TokenInputs<kVectors> inputs = load_inputs(first_token);
    TokenPosition next_position = load_position(first_token + step);
    LaneTable<kRotation> table = load_table<kRotation>(p.cos_sin_cache, position.row, quarter);
    uint64_t turns[kPairsPerLane];
#pragma unroll
    for (int i = 0; i < kPairsPerLane; ++i)
        turns[i] = kRotation == Rotation::kTheta ? p.rope_turns[first_dim + i] : 0;

    /* The norm weights of each vector; past two vectors, the queries' (every head's) and the
     * key's. */
    constexpr int kWeights = kVectors <= 2 ? kVectors : 2;
    float weight[kWeights][16];
#pragma unroll
    for (int v = 0; v < kWeights; ++v) {
        const __nv_bfloat16 *w =
            is_key[kVectors <= 2 ? v : v * (kVectors - 1)] ? p.k_norm_weight : p.q_norm_weight;
        LaneBits bits;
        bits.first = __ldg(reinterpret_cast<const uint2 *>(w + first_dim));
        bits.second = __ldg(reinterpret_cast<const uint2 *>(w + kRotaryHalf + first_dim));
        bits.pass = __ldg(reinterpret_cast<const uint4 *>(w + pass_dim));
        unpack_lane(bits, weight[v]);
    }

    /* The loop bound is the block's, so every lane of a warp runs every shuffle. Each step issues
     * the next token's inputs and cos/sin row and the position after it before the math. */
    for (unsigned block_first = blockIdx.x * rows; block_first < num_tokens; block_first += step) {
        const unsigned t = block_first + row;
        const TokenInputs<kVectors> in = inputs;
        const TokenPosition at = position;
        const LaneTable<kRotation> rotation = table;
        inputs = load_inputs(t + step);
        table = load_table<kRotation>(p.cos_sin_cache, next_position.row, quarter);
        position = next_position;
        next_position = load_position(t + 2 * step);

        float cos[kPairsPerLane], sin[kPairsPerLane];
        unpack_table<kRotation>(rotation, turns, cos, sin);
        const bool slot_ok = (uint64_t)in.slot < (uint64_t)p.num_slots;
#pragma unroll
        for (int v = 0; v < kVectors; ++v) {
            float x[16];
            unpack_lane(in.x[v], x);
            /* Sum of squares: the lane's 16 in its order, then the 8 lanes pairwise (every lane
             * of the vector ends with the same ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))).
             */
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) sum = __fmaf_rn(x[i], x[i], sum);
#pragma unroll
            for (int width = 1; width < kLanesPerVector; width *= 2)
                sum = __fadd_rn(sum, __shfl_xor_sync(kFullWarp, sum, width));
            const float inverse_rms = __frcp_rn(__fsqrt_rn(__fmaf_rn(sum, 1.0f / kHeadDim, p.eps)));
            /* y = u (1 + w) as u + u w, u = x / rms: one rounding. */
            float y[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const float u = __fmul_rn(x[i], inverse_rms);
                y[i] = __fmaf_rn(u, weight[kVectors <= 2 ? v : is_key[v]][i], u);
            }
            float rotated[2 * kPairsPerLane];
#pragma unroll
            for (int i = 0; i < kPairsPerLane; ++i) {
                const float first = y[i], second = y[kPairsPerLane + i];
                rotated[i] = __fmaf_rn(first, cos[i], -__fmul_rn(second, sin[i]));
                rotated[kPairsPerLane + i] = __fmaf_rn(second, cos[i], __fmul_rn(first, sin[i]));
            }

            const bool write = at.ok && (!is_key[v] || slot_ok);
            if (!write && t < num_tokens && quarter == 0) { /* rare: a bad token */
                if (!at.ok && head[v] == 0) record(p.error_word, MSAIDX_BAD_PREPARE_POSITION);
                if (is_key[v] && !slot_ok && in.slot != -1)
                    record(p.error_word, MSAIDX_BAD_PREPARE_SLOT);
            }
            if (!write) continue;
            char *dst = is_key[v] ? p.k_cache + (uint64_t)in.slot / kPageSize * p.page_stride +
                                        (uint64_t)in.slot % kPageSize * kHeadDim * elem
                                  : q_lane[v] + t * q_token_bytes;
            const Packed4<kE4M3> first = pack4<kE4M3>(rotated),
                                 second = pack4<kE4M3>(rotated + kPairsPerLane),
                                 pass_low = pack4<kE4M3>(y + 2 * kPairsPerLane),
                                 pass_high = pack4<kE4M3>(y + 2 * kPairsPerLane + 4);
            if constexpr (kE4M3) {
                *reinterpret_cast<uint32_t *>(dst + first_dim) = first.bits;
                *reinterpret_cast<uint32_t *>(dst + kRotaryHalf + first_dim) = second.bits;
                *reinterpret_cast<uint2 *>(dst + pass_dim) =
                    make_uint2(pass_low.bits, pass_high.bits);
            } else {
                *reinterpret_cast<uint2 *>(dst + 2 * first_dim) = first.bits;
                *reinterpret_cast<uint2 *>(dst + 2 * (kRotaryHalf + first_dim)) = second.bits;
                *reinterpret_cast<uint4 *>(dst + 2 * pass_dim) = make_uint4(
                    pass_low.bits.x, pass_low.bits.y, pass_high.bits.x, pass_high.bits.y);
            }
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

/* Blocks the call needs (a block step covers R tokens, groups_per_token groups each), and how
 * many of them are resident at once on the device. */
struct Grid {
    int64_t needed, resident;
};
template <auto kKernel>
Grid grid_of(const PrepareParams &p, dim3 block, unsigned groups_per_token, int num_sms) {
    const int64_t tile = block.x / (kLanesPerVector * groups_per_token);
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

template <bool kE4M3, Rotation kRotation, int kVectors>
msaidx_status launch_groups(const PrepareParams &p, int num_sms, cudaStream_t stream) {
    /* R tokens a block step, R a multiple of 4 (whole warps of queries, then of keys). */
    const unsigned groups = ((unsigned)p.num_heads + 1) / kVectors;
    const unsigned rows = 4 * max(1u, kTargetThreads / (4 * kLanesPerVector * groups));
    const dim3 block(kLanesPerVector * groups * rows);
    constexpr auto kKernel = index_prepare_kernel<kE4M3, kRotation, kVectors>;
    return launch_kernel<kKernel>(p, block, grid_of<kKernel>(p, block, groups, num_sms), stream);
}

/* At H = 1 a group holds a token's query and key. At H = 2-4 with theta and at least
 * kTokensForTokenGroups tokens a group holds all of a token's vectors and computes its angles
 * once (H200, H = 4: E4M3 1.06-1.16x as fast at T = 4096-262144, BF16 1.17x at 4096 and 1.0x
 * above; 0.86-0.88x at T = 1024, where each lane's five vectors in a row lengthen a call of one
 * or two steps; 149-166 registers, 12 warps an SM). Otherwise a group holds one vector: with a
 * table the angles are one load, and a group a token took up to 1.3x the time at T <= 16384. */
constexpr int64_t kTokensForTokenGroups = 4096;

template <bool kE4M3, Rotation kRotation>
msaidx_status launch(const PrepareParams &p, int num_sms, cudaStream_t stream) {
    if (p.num_heads == 1) return launch_groups<kE4M3, kRotation, 2>(p, num_sms, stream);
    if constexpr (kRotation == Rotation::kTheta) {
        if (p.num_tokens >= kTokensForTokenGroups) {
            switch (p.num_heads) {
            case 2: return launch_groups<kE4M3, kRotation, 3>(p, num_sms, stream);
            case 3: return launch_groups<kE4M3, kRotation, 4>(p, num_sms, stream);
            case 4: return launch_groups<kE4M3, kRotation, 5>(p, num_sms, stream);
            default: break;
            }
        }
    }
    return launch_groups<kE4M3, kRotation, 1>(p, num_sms, stream);
}

} // namespace

msaidx_status msaidx_cuda_index_prepare(const msaidx_context *context,
                                        const msaidx_index_prepare_args *a, void *stream) {
    const msaidx_config *config = &context->config;
    if (a->max_position > ((int64_t)1 << 32)) /* theta positions are capped far below */
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "args.max_position = %lld: the CUDA kernel reads cos_sin_cache rows by "
                           "32-bit index (at most 2^32 rows, 1 TiB of FP32 table)",
                           (long long)a->max_position);
    PrepareParams p;
    p.q_in = static_cast<const __nv_bfloat16 *>(a->q_in);
    p.q_in_token_stride = a->q_in_token_stride;
    p.k_in = static_cast<const __nv_bfloat16 *>(a->k_in);
    p.k_in_token_stride = a->k_in_token_stride;
    p.positions = a->positions;
    p.q_norm_weight = static_cast<const __nv_bfloat16 *>(a->q_norm_weight);
    p.k_norm_weight = static_cast<const __nv_bfloat16 *>(a->k_norm_weight);
    p.cos_sin_cache = a->cos_sin_cache;
    if (a->cos_sin_format == MSAIDX_COS_SIN_THETA) msaidx_rope_turns(a->rope_theta, p.rope_turns);
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
    switch (a->cos_sin_format) {
    case MSAIDX_COS_SIN_FP32:
        return e4m3 ? launch<true, Rotation::kFp32Table>(p, sms, s)
                    : launch<false, Rotation::kFp32Table>(p, sms, s);
    case MSAIDX_COS_SIN_BF16:
        return e4m3 ? launch<true, Rotation::kBf16Table>(p, sms, s)
                    : launch<false, Rotation::kBf16Table>(p, sms, s);
    default: /* MSAIDX_COS_SIN_THETA (src/index_prepare.c admits no other) */
        return e4m3 ? launch<true, Rotation::kTheta>(p, sms, s)
                    : launch<false, Rotation::kTheta>(p, sms, s);
    }
}
