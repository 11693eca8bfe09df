/* Top-k block selection (SPEC.md section 4) on the device, shared by every CUDA backend.
 *
 * A page's score maps to an order-preserving 32-bit key (NaN as -inf, -0 as +0); above the
 * inverted page id it makes a unique 64-bit rank key, so "larger rank key" is exactly SPEC's
 * order (higher score first, ties to the lower page) and the answer is the `slots` largest:
 *  1. each thread holds its pages' score keys in registers (page = i * threads + thread, so the
 *     loads are coalesced) and their maximum;
 *  2. in every warp the slots-th largest of the 32 thread maxima is a lower bound of every chosen
 *     page's score key (that many different pages reach it); across a CTA the largest of the
 *     warps' bounds still is one;
 *  3. on real scores few keys reach that bound (tens to ~150 of 8192): they are gathered with
 *     their rank keys in shared memory and each one's rank among them is counted directly.
 * Rows longer than a warp's registers that start 16-byte aligned are read as float4 and tested as
 * floats against the bound (cells outside the row made NaN, which fmaxf skips); keys are formed
 * only for the few candidates. (On the H200 that path made the top-k of the 27 benchmark shapes
 * with rows past 1024 pages 1.14x faster, geomean, up to 1.39x; in the warp-per-row kernel it was
 * 1.3-1.4x slower, so short rows keep the scalar path.)
 * Rows whose candidates overflow the gather buffer (massive ties, adversarial layouts) find the
 * answer by an exact 64-step bitwise search instead. The chosen pages are then written in
 * ascending order, each placed by counting the smaller chosen pages.
 * A warp's rows of at most 64 candidates (two a lane) choosing at most 32 skip the gather: sorting
 * networks give the exact threshold and ballots the output places (select_pair).
 * A row is selected by one warp when its candidates fit the warp's registers and by a whole CTA
 * otherwise; the kernels (topk_select.cu) differ in how they deal rows to warps and CTAs.
 *
 * This header holds the selection a warp or a CTA runs on one row (topk_chunked.cuh: a fused
 * call's long row from its chunk maxima); one translation unit includes it.
 */
#ifndef MSAIDX_TOPK_SELECT_CUH
#define MSAIDX_TOPK_SELECT_CUH

#include "cuda_internal.cuh"

#include <type_traits>

namespace {

constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kWarpMaxPages = MSAIDX_TOPK_WARP_MAX_PAGES; /* candidates a warp keeps in registers */
constexpr int kWarpGather = MSAIDX_TOPK_WARP_GATHER;      /* candidates a warp ranks by counting */
constexpr int kWarpRowsPerCta = MSAIDX_TOPK_WARP_ROWS_PER_CTA;
constexpr int kBlockThreads = MSAIDX_TOPK_BLOCK_THREADS;
constexpr int kBlockMaxPer = MSAIDX_TOPK_BLOCK_MAX_PER_THREAD; /* registers per thread */
constexpr int kBlockGather = MSAIDX_TOPK_BLOCK_GATHER;
constexpr int kTopkCtasPerSm = MSAIDX_TOPK_CTAS_PER_SM;
constexpr int kWaveRowCtaMinPages = MSAIDX_TOPK_WAVE_ROW_CTA_MIN_PAGES;
constexpr int kTightBoundMaxVectors = MSAIDX_TOPK_TIGHT_BOUND_MAX_VECTORS;
constexpr int kChunkList = MSAIDX_TOPK_CHUNK_LIST; /* chunks select_chunked_row lists */
static_assert(kWarpRowsPerCta * 32 == kBlockThreads, "a CTA is its warps' rows or one long row");

/* Order-preserving; no score maps to 0 (-inf maps to 0x007fffff), so 0 marks an empty slot. */
__device__ __forceinline__ uint32_t sortable_key(float score) {
    uint32_t bits = __float_as_uint(score);
    if (score != score) bits = 0xff800000u; /* NaN ranks as -inf */
    if (bits == 0x80000000u) bits = 0;      /* -0 == +0 */
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

/* The smallest score key of a real page (-inf, and NaN with it). */
constexpr uint32_t kMinusInfinityKey = 0x007fffffu;

/* The float whose key is `key` (key > kMinusInfinityKey): for every score x, x >= the result
 * exactly when sortable_key(x) >= key (false for NaN, and -0 >= +0 as the keys have it). */
__device__ __forceinline__ float key_score(uint32_t key) {
    return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

__device__ __forceinline__ uint64_t rank_key(float score, int32_t page) {
    return ((uint64_t)sortable_key(score) << 32) | (uint32_t) ~(uint32_t)page;
}
__device__ __forceinline__ int32_t key_page(uint64_t key) { return (int32_t) ~(uint32_t)key; }

struct TopkArgs {
    const float *scores;
    const int32_t *nvp;
    int32_t *out;
    int64_t out_stride_t, out_stride_h; /* row (t, h) at out + t * stride_t + h * stride_h */
    int64_t rows;
    int32_t pitch, max_nvp, num_heads, topk, init_blocks, local_blocks; /* max_nvp <= pitch */
    bool vector_rows; /* every row starts 16-byte aligned: long rows are read as float4 */
};

/* Shared memory of one selecting group (a warp, or a CTA). */
template <int kGather>
struct SelectShared {
    uint64_t candidates[kGather];
    int32_t chosen[MSAIDX_MAX_TOPK];
    int32_t num_candidates;
    int32_t num_chosen;
    uint64_t warp_values[kBlockThreads / 32];
    uint32_t warp_tops[32]; /* tight_lower_bound: each warp's largest lane maxima */
    uint32_t bound;
    int32_t chunks[kChunkList]; /* select_chunked_row: the chunks that reach the threshold */
};

/* The 32 lanes' values sorted across the warp, largest in lane 0: a bitonic network of 15
 * exchanges. Counting each lane's value against the 31 others instead took 29 % of all the
 * instructions the top-k issued on rows of 1200 pages (Nsight Compute). */
__device__ __forceinline__ uint32_t warp_sort_descending(uint32_t value) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 2; k <= 32; k *= 2)
#pragma unroll
        for (int j = k / 2; j > 0; j /= 2) {
            const uint32_t other = __shfl_xor_sync(kFullMask, value, j);
            const bool keep_larger = ((lane & k) == 0) == ((lane & j) == 0);
            value = keep_larger ? max(value, other) : min(value, other);
        }
    return value;
}

/* The slots-th largest (with repeats) of the lanes' maxima `lane_max`, or 0 (every key) when
 * slots > 32. Uniform across the warp. At least `slots` lanes hold a key this large, each a
 * different page, so no page below it can be among the `slots` chosen. */
__device__ __forceinline__ uint32_t warp_lower_bound(uint32_t lane_max, int32_t slots) {
    const uint32_t sorted = warp_sort_descending(lane_max);
    return slots > 32 ? 0u : __shfl_sync(kFullMask, sorted, slots - 1);
}

/* A warp: reductions by shuffles, no CTA barrier. */
struct WarpGroup {
    static constexpr int kThreads = 32;
    template <class Shared>
    __device__ static int32_t sum(int32_t value, Shared &) {
        return (int32_t)__reduce_add_sync(kFullMask, (uint32_t)value);
    }
    template <class Shared>
    __device__ static uint64_t max(uint64_t value, Shared &) {
        return value; /* a warp's bound is already uniform */
    }
    __device__ static void sync() { __syncwarp(); }
    static constexpr bool kExactAsCall = false;
};

/* A CTA: warp reductions combined through shared memory. */
struct BlockGroup {
    static constexpr int kThreads = kBlockThreads;
    template <class Shared>
    __device__ static int32_t sum(int32_t value, Shared &sh) {
        value = (int32_t)__reduce_add_sync(kFullMask, (uint32_t)value);
        if (threadIdx.x % 32 == 0) sh.warp_values[threadIdx.x / 32] = (uint64_t)(uint32_t)value;
        __syncthreads();
        int32_t total = 0;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) total += (int32_t)sh.warp_values[w];
        __syncthreads();
        return total;
    }
    template <class Shared>
    __device__ static uint64_t max(uint64_t value, Shared &sh) {
        if (threadIdx.x % 32 == 0) sh.warp_values[threadIdx.x / 32] = value;
        __syncthreads();
        uint64_t best = 0;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w)
            best = best > sh.warp_values[w] ? best : sh.warp_values[w];
        __syncthreads();
        return best;
    }
    __device__ static void sync() { __syncthreads(); }
    static constexpr bool kExactAsCall = false;
    static constexpr bool kTightBound = false;
};

/* A CTA that selects several rows one after another (topk_kernel): inlined into that loop,
 * the exact search kept its 64-bit threshold in local memory, so there it is a call. Its rows are
 * many, so a tighter bound pays for a little more latency (tight_lower_bound). */
struct BlockLoopGroup : BlockGroup {
    static constexpr bool kExactAsCall = true;
    static constexpr bool kTightBound = true;
};

/* A CTA's lower bound of the slots-th largest page key, tighter than the largest of its warps'
 * bounds: also the slots-th largest of the 32 values made of every warp's top kTops lane maxima
 * (that many different pages reach it too). That is the CTA's exact slots-th largest lane maximum
 * unless one warp holds more than kTops of the top `slots`, where that warp's own bound is the
 * tight one. On independent page scores it leaves 16 candidates a row for 15 slots instead of
 * 86-103 (bench/probes/topk_bound_candidates.py). It costs a serial step in warp 0: the
 * CTA-a-row kernel, whose batches fit one wave and wait on a row's latency, keeps the plain
 * bound. */
template <class Shared>
__device__ uint32_t tight_lower_bound(uint32_t lane_max, int32_t slots, Shared &sh) {
    constexpr int kWarps = kBlockThreads / 32, kTops = 32 / kWarps;
    static_assert(kWarps * kTops == 32, "the warps' tops fill one warp");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t sorted = warp_sort_descending(lane_max);
    const uint32_t own = slots > 32 ? 0u : __shfl_sync(kFullMask, sorted, slots - 1);
    if (lane == 0) sh.warp_values[warp] = own;
    if (lane < kTops) sh.warp_tops[warp * kTops + lane] = sorted;
    __syncthreads();
    if (warp == 0) {
        /* The slots-th largest of the tops by counting (a second sort here made ptxas spill). */
        const uint32_t top = sh.warp_tops[lane];
        int32_t greater = 0, equal = 0;
        for (int j = 0; j < 32; ++j) {
            const uint32_t other = sh.warp_tops[j];
            greater += other > top;
            equal += other == top;
        }
        const uint32_t hit = __ballot_sync(kFullMask, greater < slots && slots <= greater + equal);
        uint32_t bound = slots > 32 ? 0u : __shfl_sync(kFullMask, top, __ffs(hit) - 1);
#pragma unroll
        for (int w = 0; w < kWarps; ++w) bound = max(bound, (uint32_t)sh.warp_values[w]);
        if (lane == 0) sh.bound = bound;
    }
    __syncthreads();
    return sh.bound;
}

/* Writes the `slots` chosen pages (already in sh.chosen) to out in ascending order. */
template <class Group, class Shared>
__device__ void write_ascending(Shared &sh, int32_t slots, int32_t *out, int tid) {
    Group::sync();
    for (int32_t i = tid; i < slots; i += Group::kThreads) {
        const int32_t page = sh.chosen[i];
        int32_t place = 0;
        for (int32_t j = 0; j < slots; ++j) place += sh.chosen[j] < page;
        out[place] = page;
    }
}

/* The exact search for rows whose candidates overflow the gather buffer or the registers:
 * the slots-th largest key bit by bit, re-reading the row from memory for each bit. */
template <class Group, class Shared>
__device__ void select_exact(const float *scores, int32_t lo, int32_t count, int32_t slots,
                             Shared &sh, int tid) {
    uint64_t threshold = 0;
    for (int bit = 63; bit >= 0; --bit) {
        const uint64_t candidate = threshold | (1ull << bit);
        int32_t at_least = 0;
        /* int64 steps: a row may hold up to INT32_MAX pages. */
        for (int64_t i = tid; i < count; i += Group::kThreads)
            at_least += rank_key(scores[lo + i], (int32_t)(lo + i)) >= candidate;
        if (Group::sum(at_least, sh) >= slots) threshold = candidate;
    }
    for (int64_t i = tid; i < count; i += Group::kThreads)
        if (rank_key(scores[lo + i], (int32_t)(lo + i)) >= threshold)
            sh.chosen[atomicAdd(&sh.num_chosen, 1)] = (int32_t)(lo + i);
}

/* select_exact as a call (BlockLoopGroup). */
template <class Group, class Shared>
__device__ __noinline__ void select_exact_call(const float *scores, int32_t lo, int32_t count,
                                               int32_t slots, Shared &sh, int tid) {
    select_exact<Group>(scores, lo, count, slots, sh, tid);
}

/* select_exact, as Group::kExactAsCall says. */
template <class Group, class Shared>
__device__ __forceinline__ void search_exact(const float *scores, int32_t lo, int32_t count,
                                             int32_t slots, Shared &sh, int tid) {
    if constexpr (Group::kExactAsCall)
        select_exact_call<Group>(scores, lo, count, slots, sh, tid);
    else
        select_exact<Group>(scores, lo, count, slots, sh, tid);
}

/* Ranks the `total` gathered candidates and puts the `slots` largest in sh.chosen. */
template <class Group, class Shared>
__device__ void rank_candidates(Shared &sh, int32_t total, int32_t slots, int tid) {
    Group::sync();
    for (int32_t c = tid; c < total; c += Group::kThreads) {
        const uint64_t candidate = sh.candidates[c];
        int32_t rank = 0;
        for (int32_t j = 0; j < total; ++j) rank += sh.candidates[j] > candidate;
        if (rank < slots) sh.chosen[rank] = key_page(candidate);
    }
}

/* Loads cells [lo, lo + load_count) of a row, kPer a thread (page lo + i * kThreads + tid), all in
 * flight before the first use; 0 past them. */
template <class Group, int kPer>
__device__ __forceinline__ void load_row_cells(const float *scores, int32_t lo, int32_t load_count,
                                               float (&values)[kPer], int tid) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int32_t index = i * Group::kThreads + tid;
        values[i] = index < load_count ? scores[lo + index] : 0.f;
    }
}

/* select_loaded for a warp's row of at most 64 candidates, two a lane (pages lo + lane and
 * lo + 32 + lane), when at most 32 are chosen. The slots-th largest score key comes from bitonic
 * networks: each register's 32 keys sorted across the warp, the larger of each pair of opposite
 * places (the 32 largest of the 64) sorted again. Every key above it is chosen and, of the keys
 * equal to it, those of the lowest pages (SPEC's ties), which in page order are the first lanes of
 * the first register; a chosen page's place in the ascending output is a count of ballot bits.
 * The general path ranks its gathered candidates by counting and places each chosen page by
 * counting again: 44 % of the instructions of a top-k of 64-page rows, bound by issuing them
 * (Nsight Compute, bench/experiments/2026-12-04_h200_topk_short_rows.md). count > slots
 * (prepare_row), so the threshold is a real page's key, above the 0 of cells past the row. */
__device__ __forceinline__ void select_pair(const float (&values)[2], int32_t lo, int32_t count,
                                            int32_t slots, int32_t *out, int lane) {
    uint32_t key[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) key[i] = i * 32 + lane < count ? sortable_key(values[i]) : 0u;
    const uint32_t first = warp_sort_descending(key[0]);
    const uint32_t second = __shfl_xor_sync(kFullMask, warp_sort_descending(key[1]), 31);
    uint32_t top = max(first, second); /* the 32 largest, a bitonic sequence */
#pragma unroll
    for (int j = 16; j > 0; j /= 2) {
        const uint32_t other = __shfl_xor_sync(kFullMask, top, j);
        top = (lane & j) == 0 ? max(top, other) : min(top, other);
    }
    const uint32_t threshold = __shfl_sync(kFullMask, top, slots - 1);
    const uint32_t before = (1u << lane) - 1u; /* the lanes below this one */
    const uint32_t equal0 = __ballot_sync(kFullMask, key[0] == threshold);
    const uint32_t equal1 = __ballot_sync(kFullMask, key[1] == threshold);
    const int32_t ties = slots - __popc(__ballot_sync(kFullMask, key[0] > threshold)) -
                         __popc(__ballot_sync(kFullMask, key[1] > threshold));
    const bool chosen0 =
        key[0] > threshold || (key[0] == threshold && __popc(equal0 & before) < ties);
    const bool chosen1 = key[1] > threshold ||
                         (key[1] == threshold && __popc(equal0) + __popc(equal1 & before) < ties);
    const uint32_t taken0 = __ballot_sync(kFullMask, chosen0);
    const uint32_t taken1 = __ballot_sync(kFullMask, chosen1);
    if (chosen0) out[__popc(taken0 & before)] = lo + lane;
    if (chosen1) out[__popc(taken0) + __popc(taken1 & before)] = lo + 32 + lane;
}

/* Chooses the `slots` largest rank keys of pages [lo, lo + count) from `values` (load_row_cells of
 * at least count cells) and writes them ascending to out. */
template <class Group, int kPer, class Shared>
__device__ void select_loaded(const float (&values)[kPer], const float *scores, int32_t lo,
                              int32_t count, int32_t slots, int32_t *out, Shared &sh, int tid) {
    if constexpr (std::is_same_v<Group, WarpGroup> && kPer == 2) {
        if (slots <= 32) {
            select_pair(values, lo, count, slots, out, tid);
            return;
        }
    }
    constexpr int kGather = sizeof(sh.candidates) / sizeof(sh.candidates[0]);
    /* Score keys only (0 past the row); a page's rank key is implied by the register's place. */
    uint32_t score_keys[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
        score_keys[i] = i * Group::kThreads + tid < count ? sortable_key(values[i]) : 0u;
    if (tid == 0) {
        sh.num_candidates = 0;
        sh.num_chosen = 0;
    }
    Group::sync();
    /* The bound and the candidate test use the 32-bit score keys alone (a superset of the
     * answer when scores tie); only the few candidates get their full 64-bit rank keys. */
    uint32_t best = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) best = max(best, score_keys[i]);
    const uint32_t bound = (uint32_t)Group::max(warp_lower_bound(best, slots), sh);
    int32_t mine = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) mine += score_keys[i] != 0 && score_keys[i] >= bound;
    const int32_t total = Group::sum(mine, sh);

    if (total <= kGather) {
#pragma unroll
        for (int i = 0; i < kPer; ++i)
            if (score_keys[i] != 0 && score_keys[i] >= bound) {
                const int32_t page = lo + i * Group::kThreads + tid;
                sh.candidates[atomicAdd(&sh.num_candidates, 1)] =
                    ((uint64_t)score_keys[i] << 32) | (uint32_t) ~(uint32_t)page;
            }
        rank_candidates<Group>(sh, total, slots, tid);
    } else {
        search_exact<Group>(scores, lo, count, slots, sh, tid);
    }
    write_ascending<Group>(sh, slots, out, tid);
}

/* Chooses the `slots` largest rank keys of pages [lo, lo + count), kPer pages per thread, and
 * writes them ascending to out. */
template <class Group, int kPer, class Shared>
__device__ void select_row(const float *scores, int32_t lo, int32_t count, int32_t slots,
                           int32_t *out, Shared &sh, int tid) {
    float values[kPer];
    load_row_cells<Group>(scores, lo, count, values, tid);
    select_loaded<Group>(values, scores, lo, count, slots, out, sh, tid);
}

/* select_row for a 16-byte aligned row read as float4: kVec vectors per thread (cells
 * 4 * (v * kThreads + tid) .. + 3 of the row, read while below lo + count, which the caller keeps
 * within the row's pitch). Cells outside [lo, lo + count) become NaN, which fmaxf skips, so the
 * maxima and the candidate test run on the floats themselves. Each thread marks its candidates in
 * a bit mask and re-reads just those (few, and in L1) to form their rank keys: a short loop where
 * a gather from registers would unroll into code that the instruction cache pays for. */
template <class Group, int kVec>
__device__ __forceinline__ void load_row_vectors(const float *row, int32_t end,
                                                 float4 (&cells)[kVec], int tid) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) { /* all loads in flight before the first use */
        const int32_t first = 4 * (v * Group::kThreads + tid);
        cells[v] =
            first < end ? __ldg((const float4 *)(row + first)) : make_float4(NAN, NAN, NAN, NAN);
    }
}

/* select_row_vectors on cells that load_row_vectors read up to at least lo + count. */
template <class Group, int kVec, class Shared>
__device__ void select_loaded_vectors(float4 (&cells)[kVec], const float *row, int32_t lo,
                                      int32_t count, int32_t slots, int32_t *out, Shared &sh,
                                      int tid) {
    static_assert(4 * kVec <= 32, "one mask bit per cell");
    constexpr int kGather = sizeof(sh.candidates) / sizeof(sh.candidates[0]);
    if (tid == 0) {
        sh.num_candidates = 0;
        sh.num_chosen = 0;
    }
    Group::sync();
    float best = NAN;
    uint32_t valid = 0; /* bit 4v + e: cell e of vector v lies in [lo, lo + count) */
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
        const int32_t first = 4 * (v * Group::kThreads + tid);
        float *x = &cells[v].x;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool inside = (uint32_t)(first + e - lo) < (uint32_t)count;
            x[e] = inside ? x[e] : NAN;
            best = fmaxf(best, x[e]);
            valid |= (uint32_t)inside << (4 * v + e);
        }
    }
    const uint32_t lane_max = valid ? sortable_key(best) : 0u;
    uint32_t bound;
    if constexpr (Group::kTightBound && kVec <= kTightBoundMaxVectors)
        bound = tight_lower_bound(lane_max, slots, sh);
    else
        bound = (uint32_t)Group::max(warp_lower_bound(lane_max, slots), sh);
    /* A bound at -inf or below (every real page's key is at least -inf's) takes every cell. */
    uint32_t hits = valid;
    if (bound > kMinusInfinityKey) {
        const float threshold = key_score(bound);
        hits = 0;
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
            const float *x = &cells[v].x;
#pragma unroll
            for (int e = 0; e < 4; ++e) hits |= (uint32_t)(x[e] >= threshold) << (4 * v + e);
        }
    }
    const int32_t total = Group::sum(__popc(hits), sh);
    if (total <= kGather) {
        for (; hits; hits &= hits - 1) {
            const int bit = __ffs(hits) - 1;
            const int32_t page = 4 * ((bit >> 2) * Group::kThreads + tid) + (bit & 3);
            sh.candidates[atomicAdd(&sh.num_candidates, 1)] = rank_key(row[page], page);
        }
        rank_candidates<Group>(sh, total, slots, tid);
    } else {
        search_exact<Group>(row, lo, count, slots, sh, tid);
    }
    write_ascending<Group>(sh, slots, out, tid);
}

template <class Group, int kVec, class Shared>
__device__ void select_row_vectors(const float *row, int32_t lo, int32_t count, int32_t slots,
                                   int32_t *out, Shared &sh, int tid) {
    float4 cells[kVec];
    load_row_vectors<Group>(row, lo + count, cells, tid);
    select_loaded_vectors<Group>(cells, row, lo, count, slots, out, sh, tid);
}

/* Row (t, h)'s token t. Rows fit 32 bits (msaidx_cuda_topk refuses more), and a 32-bit division
 * is shorter than a 64-bit one, which tests the high words first. */
__device__ __forceinline__ int32_t row_token(const TopkArgs &a, int64_t row) {
    return (int32_t)row / a.num_heads;
}

__device__ __forceinline__ int32_t *row_out(const TopkArgs &a, int64_t row) {
    const int32_t t = row_token(a, row), h = (int32_t)row - t * a.num_heads;
    return a.out + t * a.out_stride_t + h * a.out_stride_h;
}

/* Forced blocks and rows needing no selection, for a row of n visible pages. Returns the number of
 * pages still to choose among [lo, lo + count), or 0 when the row is done. */
__device__ int32_t prepare_row(const TopkArgs &a, int64_t row, int32_t n, int32_t *lo,
                               int32_t *count, int tid, int threads) {
    int32_t *out = row_out(a, row);
    if (n <= a.topk || n > a.max_nvp) { /* padding or invalid rows: -1; short rows: 0..n-1 */
        const bool valid = n > 0 && n <= a.max_nvp;
        for (int k = tid; k < a.topk; k += threads) out[k] = valid && k < n ? k : -1;
        return 0;
    }
    const int32_t slots = a.topk - a.init_blocks - a.local_blocks;
    *lo = a.init_blocks;
    *count = n - a.local_blocks - a.init_blocks;
    for (int k = tid; k < a.init_blocks; k += threads) out[k] = k;
    for (int k = tid; k < a.local_blocks; k += threads)
        out[a.init_blocks + slots + k] = n - a.local_blocks + k;
    return slots;
}

/* Whether a row of n visible pages has more candidates than a warp's registers hold. */
__device__ __forceinline__ bool long_row(const TopkArgs &a, int32_t n) {
    return n > a.topk && n <= a.max_nvp && n - a.init_blocks - a.local_blocks > kWarpMaxPages;
}

/* A short row (not long_row) by one warp. */
__device__ void select_warp_row(const TopkArgs &a, int64_t row, int32_t n,
                                SelectShared<kWarpGather> &sh, int lane) {
    int32_t lo = 0, count = 0;
    const int32_t slots = prepare_row(a, row, n, &lo, &count, lane, 32);
    if (slots <= 0) return;
    const float *scores = a.scores + row * a.pitch;
    int32_t *out = row_out(a, row) + a.init_blocks;
    if (count <= 32 * 2)
        select_row<WarpGroup, 2>(scores, lo, count, slots, out, sh, lane);
    else if (count <= 32 * 8)
        select_row<WarpGroup, 8>(scores, lo, count, slots, out, sh, lane);
    else
        select_row<WarpGroup, kWarpMaxPages / 32>(scores, lo, count, slots, out, sh, lane);
}

/* A row by the whole CTA (Group: BlockGroup or BlockLoopGroup): any length, though a short one
 * wastes most of the CTA. */
template <class Group>
__device__ void select_block_row(const TopkArgs &a, int64_t row, int32_t n,
                                 SelectShared<kBlockGather> &sh, int tid) {
    int32_t lo = 0, count = 0;
    const int32_t slots = prepare_row(a, row, n, &lo, &count, tid, kBlockThreads);
    if (slots <= 0) return; /* uniform across the CTA: every thread has the same n */
    const float *scores = a.scores + row * a.pitch;
    int32_t *out = row_out(a, row) + a.init_blocks;
    const int64_t per = ((int64_t)count + kBlockThreads - 1) / kBlockThreads;
    const int64_t vectors = ((int64_t)lo + count + 4 * kBlockThreads - 1) / (4 * kBlockThreads);
    if (a.vector_rows && vectors <= 8) {
        if (vectors <= 1)
            select_row_vectors<Group, 1>(scores, lo, count, slots, out, sh, tid);
        else if (vectors <= 2)
            select_row_vectors<Group, 2>(scores, lo, count, slots, out, sh, tid);
        else if (vectors <= 4)
            select_row_vectors<Group, 4>(scores, lo, count, slots, out, sh, tid);
        else
            select_row_vectors<Group, 8>(scores, lo, count, slots, out, sh, tid);
    } else if (per <= 2)
        select_row<Group, 2>(scores, lo, count, slots, out, sh, tid);
    else if (per <= 8)
        select_row<Group, 8>(scores, lo, count, slots, out, sh, tid);
    else if (per <= 16)
        select_row<Group, 16>(scores, lo, count, slots, out, sh, tid);
    else if (per <= kBlockMaxPer)
        select_row<Group, kBlockMaxPer>(scores, lo, count, slots, out, sh, tid);
    else { /* contexts past 1M tokens: no register copy of the row */
        if (tid == 0) sh.num_chosen = 0;
        __syncthreads();
        search_exact<Group>(scores, lo, count, slots, sh, tid);
        write_ascending<Group>(sh, slots, out, tid);
    }
}

} // namespace

#endif
