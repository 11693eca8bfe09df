/*
 * The `persistent` backend (sm_90a): one CTA per SM walks a device-built task list (row tile x
 * page chunk, see persistent_sm90.cuh). Per CTA, warp-specialized:
 *   - a producer warp streams key pages through the block table with TMA (one 3D tensor map over
 *     the whole cache, the page stride as its outer stride, 128-byte swizzle) into a ring of FP8
 *     stages completing on mbarriers, and each task's 256-row Q tile into its own slot;
 *   - two consumer warpgroups widen each page to FP16 in shared memory (exact), score it with
 *     wgmma (A = queries from registers, B = keys, keys on N) while the next page is widened, and
 *     take each row's page max from the accumulators (a register reduction plus a quad shuffle).
 * FP16 rather than FP8 wgmma by default: Hopper's FP8 tensor cores sum with ~14 significant bits,
 * which puts some page maxima 1e-3 (relative) off the FP32 reference, beyond the contract's 2e-4;
 * E4M3 values are exact in FP16 and the FP16 path accumulates in FP32. With
 * config.fast_accumulation the consumers skip the widening and run E4M3 x E4M3 wgmma on the TMA
 * pages themselves (A = queries from registers as E4M3 fragments, B = the key page in shared
 * memory; A from registers rather than shared memory measured 4-5 % faster on compute-bound
 * shapes, and frees the Q slot at the start of the task).
 */
#include "persistent_sm90.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>

namespace {

constexpr int kHeadBytes = 128;  /* D = 128 E4M3 values */
constexpr int kPageKeys = 128;
constexpr int kTileRows = MSAIDX_PERSISTENT_TILE_ROWS;
constexpr int kQSlots = 2;
constexpr int kQTileBytes = kTileRows * kHeadBytes;
constexpr int kPageBytes = kPageKeys * kHeadBytes;
constexpr int kWidePageBytes = 2 * kPageBytes;      /* a page widened to FP16 */
constexpr int kConsumerThreads = 256;
constexpr int kThreads = 128 + kConsumerThreads;    /* producer warpgroup + 2 consumer warpgroups */
constexpr int kTaskBytes = 32;                      /* a Task (below), next to its Q slot */
/* Shared memory of one CTA: Q slots, then (exact scorer only) the two FP16 pages, then the ring
 * of FP8 key pages, then the mbarriers, then the task of each Q slot. The fast-accumulation scorer,
 * which widens nothing, spends the FP16 pages' room on a deeper ring. */
template <bool kFastAccumulation>
struct Layout {
    static constexpr int kStages = kFastAccumulation ? 10 : 6; /* FP8 key pages in flight per SM */
    static constexpr int kWideBytes = kFastAccumulation ? 0 : 2 * kWidePageBytes;
    static constexpr size_t kSmemBytes = 1024 /* 1024-byte alignment of the swizzled tiles */ +
                                         kQSlots * kQTileBytes + kWideBytes + kStages * kPageBytes +
                                         (2 * kStages + 2 * kQSlots) * sizeof(uint64_t) +
                                         kQSlots * kTaskBytes;
    static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA on sm_90");
};

struct ScoreArgs {
    const msaidx_persistent_tile *tiles;        /* by chunk count, most first */
    const msaidx_persistent_counts *counts;
    const msaidx_persistent_segment *segments;  /* chunk rows of equal width */
    const msaidx_persistent_resolved_task *resolved_tasks;
    const int32_t *block_table;
    float *scores;
    int32_t bt_stride, num_heads, pitch;
};

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Device code for another architecture: wgmma and setmaxnreg exist on sm_90a only, and
 * supports() keeps this backend off builds without it. */
template <bool kFastAccumulation>
__global__ void persistent_score_kernel(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                                        const ScoreArgs) {}
__device__ int kBuiltForSm90a = 0;
#else
__device__ int kBuiltForSm90a = 1;

constexpr int kSubRows = 64;                        /* rows of one wgmma */
constexpr int kWideHalfBytes = kWidePageBytes / 2;  /* 64 dims of 128 keys: one swizzled tile */
/* The launch gives 168 registers to each of the 384 threads; the producer warpgroup hands what it
 * does not need to the consumers (the producer needs 56 without spilling, the consumers 224). */
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= kThreads * 168,
              "setmaxnreg cannot hand out more registers than the launch gave");

/* ---- shared memory, mbarriers, TMA ---- */

__device__ __forceinline__ uint32_t smem_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count));
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(smem_address(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int32_t x, int32_t y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_address(dst)),
        "l"(map), "r"(smem_address(bar)), "r"(x), "r"(y)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int32_t x, int32_t y, int32_t z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_address(dst)),
        "l"(map), "r"(smem_address(bar)), "r"(x), "r"(y), "r"(z)
        : "memory");
}

/* A ring position: slot index and the mbarrier phase parity of its current use. */
template <int kSlots>
struct RingPosition {
    int slot = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++slot == kSlots) {
            slot = 0;
            phase ^= 1;
        }
    }
};

/* ---- wgmma ---- */

/* Descriptor of a K-major operand tile of 128-byte rows in the 128-byte swizzle (8-row atoms of
 * 1024 bytes, the layout TMA writes and widen_page reproduces); the tile is 1024-byte aligned. */
__device__ __forceinline__ uint64_t smem_descriptor_sw128(const void *p) {
    uint64_t desc = (uint64_t)(smem_address(p) & 0x3FFFF) >> 4;
    desc |= (uint64_t)1 << 16;           /* leading byte offset: unused by swizzled K-major */
    desc |= (uint64_t)(1024 >> 4) << 32; /* stride byte offset: next 8-row atom */
    desc |= (uint64_t)1 << 62;           /* 128-byte swizzle */
    return desc;
}

/* The 64 FP32 accumulators of an m64n128 wgmma: their place in the instruction (operands %0..%63)
 * and the matching read-write operands. */
#define WGMMA_ACCUMULATOR_LIST                                                                     \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define WGMMA_ACCUMULATOR_OPERANDS(d)                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),   \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),         \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),       \
    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),       \
    "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),       \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),       \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),       \
    "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),       \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* d (+)= A * B for one m64n128k16 FP16 wgmma: A (queries) from registers, B (keys) K-major in
 * shared memory; scale_d = 0 overwrites d. */
__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], const uint32_t (&a)[4],
                                                     uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        WGMMA_ACCUMULATOR_LIST
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : WGMMA_ACCUMULATOR_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

/* d (+)= A * B for one m64n128k32 E4M3 wgmma (FP8 tensor-core accumulation): A (queries) from
 * registers, B (keys) K-major in shared memory; scale_d = 0 overwrites d. */
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        WGMMA_ACCUMULATOR_LIST
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
        "}\n"
        : WGMMA_ACCUMULATOR_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
/* Keeps the compiler from touching the accumulators while a wgmma may still write them. */
__device__ __forceinline__ void accumulators_settled(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t pair) {
    uint32_t out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(pair));
    return out;
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile of 128-byte rows. */
__device__ __forceinline__ uint32_t swizzled_chunk(int row, int chunk) {
    return row * 128 + ((chunk ^ (row & 7)) << 4);
}

/* wgmma A fragments of the 64 rows from `row0` of the FP8 Q tile, kSteps k-steps of 8 * kBytes
 * dims. Each register holds kBytes consecutive E4M3 values of one row: kBytes = 2 widened to an FP16
 * pair (m64k16 FP16 wgmma), kBytes = 4 as they are (m64k32 E4M3 wgmma); the two layouts are the same
 * with k scaled. */
template <int kBytes, int kSteps = kHeadBytes / (8 * kBytes)>
__device__ __forceinline__ void load_query_fragments(uint32_t (&a)[kSteps][4], const uint8_t *q_tile,
                                                     int row0, int warp_in_group, int lane) {
    const int first_row = row0 + warp_in_group * 16 + (lane >> 2);
    const int lane_k = (lane & 3) * kBytes;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = first_row + (j & 1) * 8;
            const int k = step * 8 * kBytes + (j >> 1) * 4 * kBytes + lane_k;
            const uint8_t *values = q_tile + swizzled_chunk(row, k >> 4) + (k & 15);
            if constexpr (kBytes == 2)
                a[step][j] = e4m3x2_to_f16x2(*(const uint16_t *)values);
            else
                a[step][j] = *(const uint32_t *)values;
        }
    }
}

/* This thread's share (4 of 1024 16-byte chunks) of widening an FP8 page into the FP16 page: two
 * swizzled tiles of 64 dims, the K-major layout the wgmma B descriptors read. */
__device__ __forceinline__ void widen_page(uint8_t *wide_page, const uint8_t *page, int consumer_tid) {
    /* Opaque to the compiler, so that it recomputes these few addresses per page instead of
     * hoisting them out of the page loop into registers it does not have (they were spilled). */
    asm volatile("" : "+r"(consumer_tid));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int index = consumer_tid + i * kConsumerThreads;
        const int row = index >> 3, chunk = index & 7;
        const uint4 raw = *(const uint4 *)(page + swizzled_chunk(row, chunk));
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t h[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            h[2 * j] = e4m3x2_to_f16x2((uint16_t)(words[j] & 0xffff));
            h[2 * j + 1] = e4m3x2_to_f16x2((uint16_t)(words[j] >> 16));
        }
        uint8_t *half = wide_page + (chunk >> 2) * kWideHalfBytes;
        const int wide_chunk = (chunk & 3) * 2;
        *(uint4 *)(half + swizzled_chunk(row, wide_chunk)) = make_uint4(h[0], h[1], h[2], h[3]);
        *(uint4 *)(half + swizzled_chunk(row, wide_chunk + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
    }
}

/* One 64-row sub-tile against one FP16 page: 8 k-steps of 16 dims. */
__device__ __forceinline__ void score_subtile(float (&acc)[64], const uint32_t (&a)[8][4],
                                              const uint8_t *wide_page) {
#pragma unroll
    for (int step = 0; step < 8; ++step) {
        const uint64_t desc_b = smem_descriptor_sw128(wide_page + (step >> 2) * kWideHalfBytes +
                                                      (step & 3) * 32);
        wgmma_m64n128k16_f16(acc, a[step], desc_b, step);
    }
}

/* One 64-row sub-tile against one FP8 page as TMA wrote it: 4 k-steps of 32 dims. */
__device__ __forceinline__ void score_subtile_fp8(float (&acc)[64], const uint32_t (&a)[4][4],
                                                  const uint8_t *page) {
    const uint64_t desc_b = smem_descriptor_sw128(page);
#pragma unroll
    for (int step = 0; step < 4; ++step) /* +32 bytes along the swizzled rows: +2 in units of 16 */
        wgmma_m64n128k32_e4m3(acc, a[step], desc_b + 2 * step, step);
}

/* Widened-page writes (generic proxy) become visible to the consumers' wgmma (async proxy). */
__device__ __forceinline__ void consumers_sync() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
}

/* The two rows this thread holds in a sub-tile's accumulators (registers i with (i/2)%2 = 0, 1). */
struct RowPair {
    int32_t row[2]; /* global rows; -1 past the tile's end */
    int32_t pos[2]; /* query positions */
};

/* Both rows' maxima over a page every row sees whole: a tree, not a chain (5 dependent max levels
 * per row instead of 32), as this max sits between the wgmma of consecutive pages. */
__device__ __forceinline__ void whole_page_max(const float (&acc)[64], float (&best)[2]) {
    float row0[16], row1[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        row0[j] = fmaxf(acc[4 * j], acc[4 * j + 1]);
        row1[j] = fmaxf(acc[4 * j + 2], acc[4 * j + 3]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        row0[j] = fmaxf(row0[j], row0[j + 8]);
        row1[j] = fmaxf(row1[j], row1[j + 8]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        row0[j] = fmaxf(row0[j], row0[j + 4]);
        row1[j] = fmaxf(row1[j], row1[j + 4]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        row0[j] = fmaxf(row0[j], row0[j + 2]);
        row1[j] = fmaxf(row1[j], row1[j + 2]);
    }
    best[0] = fmaxf(row0[0], row0[1]);
    best[1] = fmaxf(row1[0], row1[1]);
}

/* The same over the keys j <= pos of each row (the causal page). */
__device__ __forceinline__ void causal_page_max(const float (&acc)[64], const RowPair &rows, int32_t page,
                                                int lane, float (&best)[2]) {
    const int32_t last_key[2] = {rows.pos[0] - page * kPageKeys, rows.pos[1] - page * kPageKeys};
    const int lane_col = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int r = (i >> 1) & 1;
        const int col = (i >> 2) * 8 + lane_col + (i & 1);
        if (col <= last_key[r]) best[r] = fmaxf(best[r], acc[i]);
    }
}

/* The rows' maxima across each quad, stored by its lanes 0 and 1. Rows that do not see `page`
 * (p >= nvp) store nothing. */
__device__ __forceinline__ void store_quad_max(float (&best)[2], const RowPair &rows, int32_t page, int lane,
                                               const ScoreArgs &args) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        best[r] = fmaxf(best[r], __shfl_xor_sync(0xffffffffu, best[r], 1));
        best[r] = fmaxf(best[r], __shfl_xor_sync(0xffffffffu, best[r], 2));
    }
    const bool second = (lane & 1) != 0;
    const int32_t row = second ? rows.row[1] : rows.row[0];
    const int32_t pos = second ? rows.pos[1] : rows.pos[0];
    if ((lane & 2) == 0 && row >= 0 && page * kPageKeys <= pos)
        args.scores[(size_t)row * args.pitch + page] = second ? best[1] : best[0];
}

/* Page max of both rows, stored: kWholePage when every row sees every key of the page (the fast
 * scorer's loops know it), else masked to each row's keys j <= pos. */
template <bool kWholePage>
__device__ __forceinline__ void store_page_max(const float (&acc)[64], const RowPair &rows,
                                               int32_t page, int lane, const ScoreArgs &args) {
    float best[2] = {-INFINITY, -INFINITY};
    if constexpr (kWholePage) whole_page_max(acc, best);
    else causal_page_max(acc, rows, page, lane, best);
    store_quad_max(best, rows, page, lane, args);
}

/* The same with the page's kind known at run time (the exact scorer). */
__device__ __forceinline__ void store_page_max(const float (&acc)[64], const RowPair &rows,
                                               int32_t page, bool whole_page, int lane,
                                               const ScoreArgs &args) {
    float best[2] = {-INFINITY, -INFINITY};
    if (whole_page) whole_page_max(acc, best);
    else causal_page_max(acc, rows, page, lane, best);
    store_quad_max(best, rows, page, lane, args);
}

/* Per-warpgroup state of the consumer side. */
template <int kStages>
struct Consumer {
    uint8_t *wide_pages;  /* two FP16 pages: one scored while the other is widened */
    const uint8_t *pages; /* the FP8 ring */
    uint64_t *page_full, *page_empty;
    RingPosition<kStages> ring;
    int consumer_tid, lane;
};

template <int kStages>
__device__ __forceinline__ void widen_next(Consumer<kStages> &c, uint8_t *wide_page) {
    mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
    widen_page(wide_page, c.pages + c.ring.slot * kPageBytes, c.consumer_tid);
    mbarrier_arrive(&c.page_empty[c.ring.slot]);
    c.ring.advance();
}

/* Pages [page_begin, page_end) of one task, kSubtiles (0, 1 or 2) 64-row sub-tiles of real rows
 * in this warpgroup. Both warpgroups widen every page together; the tensor cores score page p while
 * the next one is widened, and the second sub-tile's wgmma runs while the first one's maxima are
 * taken. */
template <int kSubtiles, int kStages>
__device__ __forceinline__ void consume_pages(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                                              const uint32_t (&qa)[2][8][4],
                                              const RowPair (&rows)[2], int32_t page_begin,
                                              int32_t page_end, int32_t full_pages,
                                              const ScoreArgs &args) {
    widen_next(c, c.wide_pages);
    consumers_sync();
    int buffer = 0;
    for (int32_t page = page_begin; page < page_end; ++page) {
        const uint8_t *wide_page = c.wide_pages + buffer * kWidePageBytes;
        const bool whole_page = page < full_pages;
        if (kSubtiles >= 1) {
            wgmma_fence();
            score_subtile(acc0, qa[0], wide_page);
            wgmma_commit();
        }
        if (kSubtiles == 2) {
            score_subtile(acc1, qa[1], wide_page);
            wgmma_commit();
        }
        if (page + 1 < page_end) widen_next(c, c.wide_pages + (buffer ^ 1) * kWidePageBytes);
        if (kSubtiles == 2) {
            wgmma_wait<1>();
            accumulators_settled(acc0);
            store_page_max(acc0, rows[0], page, whole_page, c.lane, args);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            store_page_max(acc1, rows[1], page, whole_page, c.lane, args);
        } else if (kSubtiles == 1) {
            wgmma_wait<0>();
            accumulators_settled(acc0);
            store_page_max(acc0, rows[0], page, whole_page, c.lane, args);
        }
        consumers_sync();
        buffer ^= 1;
    }
}

/* One 64-row sub-tile with fast accumulation, two pages per round in acc0 and acc1: the first
 * page's maxima are taken while the second page's wgmma runs, which one sub-tile alone could not
 * overlap. */
template <int kStages>
__device__ __forceinline__ void consume_page_pairs_fp8(Consumer<kStages> &c, float (&acc0)[64],
                                                       float (&acc1)[64], const uint32_t (&qa)[4][4],
                                                       const RowPair &rows, int32_t page_begin,
                                                       int32_t page_end, const ScoreArgs &args) {
    for (int32_t page = page_begin; page < page_end; page += 2) {
        const bool pair = page + 1 < page_end;
        RingPosition<kStages> second = c.ring;
        second.advance();
        mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
        wgmma_fence();
        score_subtile_fp8(acc0, qa, c.pages + c.ring.slot * kPageBytes);
        wgmma_commit();
        if (pair) {
            mbarrier_wait(&c.page_full[second.slot], second.phase);
            score_subtile_fp8(acc1, qa, c.pages + second.slot * kPageBytes);
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        accumulators_settled(acc0);
        mbarrier_arrive(&c.page_empty[c.ring.slot]);
        c.ring.advance();
        store_page_max<true>(acc0, rows, page, c.lane, args);
        if (pair) {
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
            store_page_max<true>(acc1, rows, page + 1, c.lane, args);
        }
    }
}

/* Waits for the page at the ring position, issues both of the warpgroup's sub-tiles on it (FP8)
 * and takes the first sub-tile's maxima while the second one's wgmma, left in flight, runs. */
template <bool kWholePage, int kStages>
__device__ __forceinline__ void score_page_fp8_first_max(Consumer<kStages> &c, float (&acc0)[64],
                                                         float (&acc1)[64],
                                                         const uint32_t (&qa)[2][4][4],
                                                         const RowPair &first_rows, int32_t page,
                                                         const ScoreArgs &args) {
    mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
    const uint8_t *stage = c.pages + c.ring.slot * kPageBytes;
    wgmma_fence();
    score_subtile_fp8(acc0, qa[0], stage);
    wgmma_commit();
    score_subtile_fp8(acc1, qa[1], stage);
    wgmma_commit();
    wgmma_wait<1>();
    accumulators_settled(acc0);
    store_page_max<kWholePage>(acc0, first_rows, page, c.lane, args);
}

/* consume_pages with fast accumulation (E4M3 fragments): no widening, so each warpgroup scores the
 * FP8 stages directly and releases a stage once its wgmma have read it. */
template <int kSubtiles, int kStages>
__device__ __forceinline__ void consume_pages(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                                              const uint32_t (&qa)[2][4][4],
                                              const RowPair (&rows)[2], int32_t page_begin,
                                              int32_t page_end, int32_t full_pages,
                                              const ScoreArgs &args) {
    /* Whole pages [page_begin, whole_end) in the pipelined loops, whose epilogues then hold no
     * masking code; the few causal pages after them one at a time. */
    const int32_t whole_end = min(page_end, max(page_begin, full_pages));
    if constexpr (kSubtiles == 1) {
        consume_page_pairs_fp8(c, acc0, acc1, qa[0], rows[0], page_begin, whole_end, args);
        for (int32_t page = whole_end; page < page_end; ++page) {
            mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
            wgmma_fence();
            score_subtile_fp8(acc0, qa[0], c.pages + c.ring.slot * kPageBytes);
            wgmma_commit();
            wgmma_wait<0>();
            accumulators_settled(acc0);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
            store_page_max<false>(acc0, rows[0], page, c.lane, args);
        }
    } else if constexpr (kSubtiles == 2) {
        /* Two pages per round: the second page's first sub-tile is issued as soon as acc0 is free,
         * so the tensor cores keep running while the first page's second maxima are taken. Each
         * round drains its wgmma and has no branch between issue and wait: otherwise ptxas loses
         * track of the groups in flight and serializes every wgmma. */
        int32_t page = page_begin;
        for (; page + 1 < whole_end; page += 2) {
            RingPosition<kStages> second = c.ring;
            second.advance();
            const uint8_t *second_stage = c.pages + second.slot * kPageBytes;
            score_page_fp8_first_max<true>(c, acc0, acc1, qa, rows[0], page, args);
            mbarrier_wait(&c.page_full[second.slot], second.phase);
            wgmma_fence();
            score_subtile_fp8(acc0, qa[0], second_stage);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            store_page_max<true>(acc1, rows[1], page, c.lane, args);
            wgmma_fence();
            score_subtile_fp8(acc1, qa[1], second_stage);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc0);
            store_page_max<true>(acc0, rows[0], page + 1, c.lane, args);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[second.slot]);
            store_page_max<true>(acc1, rows[1], page + 1, c.lane, args);
            c.ring = second;
            c.ring.advance();
        }
        for (; page < page_end; ++page) { /* an odd whole page, then the causal ones */
            if (page < whole_end) score_page_fp8_first_max<true>(c, acc0, acc1, qa, rows[0], page, args);
            else score_page_fp8_first_max<false>(c, acc0, acc1, qa, rows[0], page, args);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
            store_page_max<false>(acc1, rows[1], page, c.lane, args);
        }
    } else {
        /* No rows in this warpgroup: release the pages it would have read. */
        for (int32_t page = page_begin; page < page_end; ++page) {
            mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
        }
    }
}

/* A task as the producer hands it to the consumers, next to its Q tile. */
using Task = msaidx_persistent_task;
static_assert(sizeof(Task) == kTaskBytes, "task slot size");

/* What the consumers read of a task slot: two vector loads of the fields they use. (A plain struct
 * copy left the consumers short of registers: they spilled.) */
__device__ __forceinline__ Task load_task(const Task *slot) {
    Task task;
    const uint32_t at = smem_address(slot);
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(task.row_begin), "=r"(task.row_end), "=r"(task.pos_base), "=r"(task.full_pages)
                 : "r"(at));
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];"
                 : "=r"(task.page_begin), "=r"(task.page_end)
                 : "r"(at + 16));
    task.bt_row = task.reserved = 0;
    return task;
}

/* The producer's walk over the CTA's tasks after those the plan resolved (blockIdx.x + k * gridDim.x,
 * k >= MSAIDX_PERSISTENT_RESOLVED_WAVES, persistent_schedule.h). Tasks are located 32 at a time,
 * one per lane (each lane with its own segment cursor), and handed out by shuffles, so that the
 * latency of the segment and tile reads is paid once per 32 tasks rather than in front of every
 * task; each task's first block-table entries are prefetched to L2 at the same time. Every lane of
 * the warp calls next(). */
struct TaskCursor {
    const ScoreArgs &args;
    uint32_t chunk_pages, num_tasks; /* the plan keeps num_tasks below 2^31 */
    uint32_t index;                  /* next task of this CTA */
    uint32_t window_end = 0;         /* first task past the located window */
    int32_t segment = 0;             /* this lane's segment cursor */
    Task mine;                       /* lane i: window task i */

    __device__ __forceinline__ explicit TaskCursor(const ScoreArgs &a) : args(a) {
        chunk_pages = (uint32_t)args.counts->chunk_pages;
        num_tasks = (uint32_t)args.counts->num_tasks;
        index = blockIdx.x + MSAIDX_PERSISTENT_RESOLVED_WAVES * gridDim.x;
    }

    /* Returns false when the CTA has no task left. */
    __device__ __forceinline__ bool next(Task &task) {
        if (index >= num_tasks) return false;
        const uint32_t lane = threadIdx.x & 31;
        if (index >= window_end) {
            const uint32_t lane_index = index + lane * gridDim.x;
            if (lane_index < num_tasks) {
                int32_t chunk_row, position;
                msaidx_persistent_locate(args.segments, &segment, (int32_t)lane_index, &chunk_row, &position);
                const msaidx_persistent_tile tile = args.tiles[position];
                mine.row_begin = tile.row_begin;
                mine.row_end = tile.row_end;
                mine.pos_base = tile.pos_base;
                mine.full_pages = tile.full_pages;
                mine.bt_row = tile.bt_row;
                mine.page_begin = chunk_row * (int32_t)chunk_pages;
                mine.page_end = min(tile.num_pages, mine.page_begin + (int32_t)chunk_pages);
                mine.reserved = 0;
                /* The task's first block-table entries, to L2 ahead of their use. */
                const int32_t *first_entry =
                    args.block_table + (size_t)tile.bt_row * args.bt_stride + mine.page_begin;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(first_entry));
            }
            window_end = index + 32 * gridDim.x;
        }
        const int source = (int)((index - (window_end - 32 * gridDim.x)) / gridDim.x);
        task.row_begin = __shfl_sync(0xffffffffu, mine.row_begin, source);
        task.row_end = __shfl_sync(0xffffffffu, mine.row_end, source);
        task.pos_base = __shfl_sync(0xffffffffu, mine.pos_base, source);
        task.full_pages = __shfl_sync(0xffffffffu, mine.full_pages, source);
        task.bt_row = __shfl_sync(0xffffffffu, mine.bt_row, source);
        task.page_begin = __shfl_sync(0xffffffffu, mine.page_begin, source);
        task.page_end = __shfl_sync(0xffffffffu, mine.page_end, source);
        task.reserved = 0;
        index += gridDim.x;
        return true;
    }
};

/* values[wave] by selects, not an indexed load: the array stays in registers. */
__device__ __forceinline__ int32_t resolved_word(const int32_t (&values)[MSAIDX_PERSISTENT_RESOLVED_WAVES],
                                                 int wave) {
    int32_t value = values[0];
#pragma unroll
    for (int k = 1; k < MSAIDX_PERSISTENT_RESOLVED_WAVES; ++k) value = wave == k ? values[k] : value;
    return value;
}

/* Lane i: block-table entry `first + i` of the task (0 past its pages), one coalesced read. */
__device__ __forceinline__ int32_t load_block_table(const ScoreArgs &args, const Task &task,
                                                    int32_t first) {
    const int lane = threadIdx.x & 31;
    const int32_t *bt_row = args.block_table + (size_t)task.bt_row * args.bt_stride;
    return first + lane < task.page_end ? __ldg(bt_row + first + lane) : 0;
}

template <bool kFastAccumulation>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_score_kernel(const __grid_constant__ CUtensorMap q_map,
                            const __grid_constant__ CUtensorMap k_map, const ScoreArgs args) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *q_tiles = smem;
    constexpr int kStages = Layout<kFastAccumulation>::kStages;
    uint8_t *wide_pages = q_tiles + kQSlots * kQTileBytes;
    uint8_t *pages = wide_pages + Layout<kFastAccumulation>::kWideBytes;
    uint64_t *page_full = (uint64_t *)(pages + kStages * kPageBytes);
    uint64_t *page_empty = page_full + kStages;
    uint64_t *q_full = page_empty + kStages;
    uint64_t *q_empty = q_full + kQSlots;
    Task *q_tasks = (Task *)(q_empty + kQSlots);

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&page_full[s], 1);
            mbarrier_init(&page_empty[s], kConsumerThreads);
        }
        for (int s = 0; s < kQSlots; ++s) {
            mbarrier_init(&q_full[s], 1);
            mbarrier_init(&q_empty[s], kConsumerThreads);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    /* The producer locates the CTA's tasks and hands each to the consumers with its Q tile (written
     * before the arrive that the Q tile's bytes complete, so the consumers' wait acquires it). */
    const int32_t num_tasks = args.counts->num_tasks;
    const int lane = threadIdx.x & 31;

    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
        if (threadIdx.x >= 32) return;
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&q_map) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&k_map) : "memory");
        }
        /* The CTA's first tasks come resolved by the plan, all read at once: lane i holds page i and
         * word i of each. */
        static_assert(MSAIDX_PERSISTENT_RESOLVED_PAGES == 32, "one resolved page per lane");
        int32_t resolved_pages[MSAIDX_PERSISTENT_RESOLVED_WAVES];
        int32_t resolved_words[MSAIDX_PERSISTENT_RESOLVED_WAVES];
#pragma unroll
        for (int wave = 0; wave < MSAIDX_PERSISTENT_RESOLVED_WAVES; ++wave) {
            const int32_t *record = (const int32_t *)&args.resolved_tasks[blockIdx.x + wave * gridDim.x];
            resolved_pages[wave] = __ldg(record + lane);
            resolved_words[wave] = lane < 8 ? __ldg(record + MSAIDX_PERSISTENT_RESOLVED_PAGES + lane) : 0;
        }
        RingPosition<kStages> ring;
        RingPosition<kQSlots> q_ring;
        /* Q tile and task to the next Q slot, then the task's pages to the ring; lane i of
         * physical_pages holds the physical page of task.page_begin + i. */
        auto issue = [&](const Task &task, int32_t physical_pages) {
            if (lane == 0) {
                mbarrier_wait(&q_empty[q_ring.slot], q_ring.phase ^ 1);
                q_tasks[q_ring.slot] = task;
                mbarrier_expect_bytes(&q_full[q_ring.slot], kQTileBytes);
                tma_load_2d(q_tiles + q_ring.slot * kQTileBytes, &q_map, &q_full[q_ring.slot], 0,
                            task.row_begin);
            }
            q_ring.advance();
#pragma unroll 1
            for (int32_t first_page = task.page_begin; first_page < task.page_end; first_page += 32) {
                if (first_page != task.page_begin) physical_pages = load_block_table(args, task, first_page);
                const int count = min(32, task.page_end - first_page);
#pragma unroll 1
                for (int i = 0; i < count; ++i) {
                    const int32_t physical = __shfl_sync(0xffffffffu, physical_pages, i);
                    if (lane == 0) {
                        mbarrier_wait(&page_empty[ring.slot], ring.phase ^ 1);
                        mbarrier_expect_bytes(&page_full[ring.slot], kPageBytes);
                        tma_load_3d(pages + ring.slot * kPageBytes, &k_map, &page_full[ring.slot], 0,
                                    0, physical);
                    }
                    ring.advance();
                }
            }
        };
        /* The CTA's tasks in order, the resolved ones first. One loop and one copy of `issue`: with
         * the resolved tasks unrolled, the producer was half of the kernel's code. */
        TaskCursor cursor(args);
        Task task;
#pragma unroll 1
        for (int nth = 0;; ++nth) {
            int32_t physical_pages;
            if (nth < MSAIDX_PERSISTENT_RESOLVED_WAVES) {
                const int32_t words = resolved_word(resolved_words, nth);
                task.row_begin = __shfl_sync(0xffffffffu, words, 0);
                task.row_end = __shfl_sync(0xffffffffu, words, 1);
                task.pos_base = __shfl_sync(0xffffffffu, words, 2);
                task.full_pages = __shfl_sync(0xffffffffu, words, 3);
                task.page_begin = __shfl_sync(0xffffffffu, words, 4);
                task.page_end = __shfl_sync(0xffffffffu, words, 5);
                task.bt_row = __shfl_sync(0xffffffffu, words, 6);
                task.reserved = 0;
                if (task.page_begin >= task.page_end) continue; /* the CTA has fewer tasks */
                physical_pages = resolved_word(resolved_pages, nth);
            } else if (cursor.next(task)) {
                physical_pages = load_block_table(args, task, task.page_begin);
            } else {
                break;
            }
            issue(task, physical_pages);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
    const int group = threadIdx.x / 128 - 1; /* consumer warpgroup 0 or 1 */
    const int warp_in_group = (threadIdx.x / 32) & 3;
    Consumer<kStages> c;
    c.wide_pages = wide_pages;
    c.pages = pages;
    c.page_full = page_full;
    c.page_empty = page_empty;
    c.consumer_tid = threadIdx.x - 128;
    c.lane = lane;
    RingPosition<kQSlots> q_ring;
    float acc0[64], acc1[64];
    for (int64_t k = blockIdx.x; k < num_tasks; k += gridDim.x) {
        mbarrier_wait(&q_full[q_ring.slot], q_ring.phase);
        const Task task = load_task(&q_tasks[q_ring.slot]);

        /* Sub-tile s of this warpgroup: tile rows (2s + group) * 64 ..+ 63, so that a short tile
         * keeps both warpgroups busy. */
        RowPair rows[2];
        int subtiles = 0;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int32_t sub_row0 = task.row_begin + (2 * s + group) * kSubRows;
            subtiles += sub_row0 < task.row_end;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int32_t row = sub_row0 + warp_in_group * 16 + (lane >> 2) + 8 * r;
                const bool real = row < task.row_end;
                rows[s].row[r] = real ? row : -1;
                rows[s].pos[r] = real ? task.pos_base + row / args.num_heads : -1;
            }
        }
        /* Uniform over the warpgroup; the shuffle lets the compiler see it (wgmma must not sit
         * on a divergent path). */
        subtiles = __shfl_sync(0xffffffffu, subtiles, 0);

        /* The queries go to registers (E4M3 for the FP8 wgmma, widened to FP16 otherwise) and the
         * Q slot is free for the producer's next task. */
        const uint8_t *q_tile = q_tiles + q_ring.slot * kQTileBytes;
        constexpr int kQueryBytes = kFastAccumulation ? 4 : 2;
        uint32_t qa[2][kHeadBytes / (8 * kQueryBytes)][4];
        load_query_fragments<kQueryBytes>(qa[0], q_tile, group * kSubRows, warp_in_group, lane);
        if (subtiles == 2)
            load_query_fragments<kQueryBytes>(qa[1], q_tile, (2 + group) * kSubRows, warp_in_group, lane);
        mbarrier_arrive(&q_empty[q_ring.slot]);
        q_ring.advance();

        if (subtiles == 2)
            consume_pages<2>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end, task.full_pages, args);
        else if (subtiles == 1)
            consume_pages<1>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end, task.full_pages, args);
        else
            consume_pages<0>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end, task.full_pages, args);
    }
}
#endif

/* ---- host ---- */

/* The driver's tensor-map encoder, reached through the runtime (no -lcuda). */
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encoder = []() {
        void *function = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                             cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return (PFN_cuTensorMapEncodeTiled_v12000) nullptr;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)function;
    }();
    return encoder;
}

/* q: [rows, 128] bytes, boxes of one task's 256 rows. k: [pages, 128 keys, 128] bytes with the
 * page stride as the outer stride, boxes of one page. Both 128-byte swizzled for wgmma. */
msaidx_status encode_tensor_maps(const msaidx_plan *plan, const void *q, const void *k_cache,
                                 CUtensorMap *q_map, CUtensorMap *k_map) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "backend persistent: the CUDA driver has no cuTensorMapEncodeTiled");
    const msaidx_batch_desc *d = &plan->desc;
    const cuuint64_t q_dims[2] = {kHeadBytes,
                                  (cuuint64_t)d->num_tokens * plan->context->config.num_heads};
    const cuuint64_t q_strides[1] = {kHeadBytes};
    const cuuint32_t q_box[2] = {kHeadBytes, kTileRows};
    const cuuint32_t unit[3] = {1, 1, 1};
    CUresult result = encode(q_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(q), q_dims,
                             q_strides, q_box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "backend persistent: cuTensorMapEncodeTiled(q = %p, %llu rows) failed "
                           "(CUresult %d)",
                           q, (unsigned long long)q_dims[1], (int)result);
    const cuuint64_t k_dims[3] = {kHeadBytes, kPageKeys, (cuuint64_t)d->num_pages};
    const cuuint64_t k_strides[2] = {kHeadBytes, (cuuint64_t)d->page_stride};
    const cuuint32_t k_box[3] = {kHeadBytes, kPageKeys, 1};
    result = encode(k_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void *>(k_cache), k_dims,
                    k_strides, k_box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "backend persistent: cuTensorMapEncodeTiled(k_cache = %p, desc.num_pages "
                           "= %d, desc.page_stride = %lld) failed (CUresult %d)",
                           k_cache, d->num_pages, (long long)d->page_stride, (int)result);
    return MSAIDX_SUCCESS;
}

/* Runs `check` with config.device current, restoring the caller's device. */
template <typename Check>
msaidx_status on_device(int32_t device, Check check) {
    int previous = 0;
    MSAIDX_CUDA_TRY(cudaGetDevice(&previous), "cudaGetDevice");
    MSAIDX_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(config.device)");
    const msaidx_status status = check();
    MSAIDX_CUDA_TRY(cudaSetDevice(previous), "cudaSetDevice(restore)");
    return status;
}

msaidx_status persistent_supports(const msaidx_config *config) {
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_supports_common(config, "persistent"));
    if (config->dtype != MSAIDX_DTYPE_E4M3)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: config.dtype is BF16, it scores FP8 E4M3 only");
    if (config->num_heads != 1 && config->num_heads != 2 && config->num_heads != 4)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: config.num_heads = %d, it needs 1, 2 or 4",
                           config->num_heads);
    return on_device(config->device, []() {
        int built = 0;
        cudaError_t error = cudaMemcpyFromSymbolAsync(&built, kBuiltForSm90a, sizeof built, 0,
                                                      cudaMemcpyDeviceToHost, cudaStreamPerThread);
        if (error == cudaSuccess) error = cudaStreamSynchronize(cudaStreamPerThread);
        if (error != cudaSuccess || !built) {
            cudaGetLastError();
            return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                               "backend persistent: this build of msaidx has no sm_90a code "
                               "(CMAKE_CUDA_ARCHITECTURES must include 90a)");
        }
        return MSAIDX_SUCCESS;
    });
}

msaidx_status persistent_init_context(msaidx_context *context) {
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_init_context(context));
    return on_device(context->config.device, []() {
        MSAIDX_CUDA_TRY(cudaFuncSetAttribute(persistent_score_kernel<false>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)Layout<false>::kSmemBytes),
                        "cudaFuncSetAttribute(persistent scorer shared memory)");
        MSAIDX_CUDA_TRY(cudaFuncSetAttribute(persistent_score_kernel<true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)Layout<true>::kSmemBytes),
                        "cudaFuncSetAttribute(persistent fast-accumulation scorer shared memory)");
        return MSAIDX_SUCCESS;
    });
}

size_t persistent_workspace_size(const msaidx_plan *plan) {
    return msaidx_persistent_workspace_bytes(plan);
}

msaidx_status persistent_plan(msaidx_plan *plan, void *stream) {
    if ((int64_t)plan->desc.num_tokens * plan->context->config.num_heads > INT32_MAX)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: desc.num_tokens = %d times %d heads exceeds 2^31 "
                           "query rows",
                           plan->desc.num_tokens, plan->context->config.num_heads);
    cudaStream_t s = msaidx_cuda_stream(stream);
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_plan_requests(plan, s));
    return msaidx_persistent_plan_tiles(plan, s);
}

msaidx_status persistent_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                float *scores, bool decode, void *stream) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    /* Decode rows are few per request: the shared decode scorer splits their pages finer. */
    if (decode || msaidx_cuda_decode_only(&plan->desc)) return msaidx_cuda_score_decode(plan, q, k_cache, scores, s);
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    CUtensorMap q_map, k_map;
    MSAIDX_CUDA_TRY_STATUS(encode_tensor_maps(plan, q, k_cache, &q_map, &k_map));
    ScoreArgs args;
    const msaidx_persistent_views views = msaidx_persistent_views_of(plan);
    args.tiles = views.sorted_tiles;
    args.counts = views.counts;
    args.segments = views.segments;
    args.resolved_tasks = views.resolved_tasks;
    args.block_table = plan->block_table;
    args.scores = scores;
    args.bt_stride = plan->desc.bt_stride;
    args.num_heads = plan->context->config.num_heads;
    args.pitch = plan->desc.pitch;
    if (plan->context->config.fast_accumulation)
        persistent_score_kernel<true><<<plan->context->num_sms, kThreads, Layout<true>::kSmemBytes, s>>>(
            q_map, k_map, args);
    else
        persistent_score_kernel<false><<<plan->context->num_sms, kThreads, Layout<false>::kSmemBytes, s>>>(
            q_map, k_map, args);
    MSAIDX_CUDA_CHECK_LAUNCH("persistent_score_kernel");
    return MSAIDX_SUCCESS;
}

}  // namespace

extern "C" const msaidx_backend_ops msaidx_persistent_backend = {
    MSAIDX_BACKEND_PERSISTENT,
    "persistent",
    true,
    persistent_supports,
    persistent_init_context,
    persistent_workspace_size,
    persistent_plan,
    persistent_scores,
    msaidx_cuda_num_valid_pages,
    msaidx_cuda_topk,
    msaidx_cuda_read_error_word,
};
