/* The persistent scorer's consumers: two warpgroups that score each key page of a task against the
 * task's 256 query rows with wgmma (A = queries from registers, B = keys in shared memory, keys on
 * N) and store each row's page max.
 *   - exact: FP16 wgmma on the FP16 copy of each page that the producer warpgroup's wideners
 *     write to a ring of its own (persistent_widener_sm90.cuh; E4M3 values are exact in FP16, and
 *     FP16 wgmma accumulates in FP32);
 *   - fast accumulation: E4M3 x E4M3 wgmma on the pages as TMA wrote them (FP8 tensor-core
 *     accumulation, SPEC section 3), A from registers as E4M3 fragments: 4-5 % faster than A from
 *     shared memory on compute-bound shapes, and the Q slot is free at the start of the task;
 *   - BF16: BF16 wgmma on the pages as TMA wrote them (two 64-dim halves, the FP16 page's layout);
 *     exact, as BF16 products are exact in FP32 and BF16 wgmma accumulates in FP32.
 * A page max is a register reduction over the accumulators plus a quad shuffle. */
#ifndef MSAIDX_PERSISTENT_CONSUMER_SM90_CUH
#define MSAIDX_PERSISTENT_CONSUMER_SM90_CUH

#include "device_tiles.cuh"
#include "persistent_kernel_sm90.cuh"
#include "sm90_ptx.cuh"

#include <cmath>

namespace {

using namespace sm90;

/* wgmma A fragments of the 64 rows from `row0` of the FP8 Q tile, kSteps k-steps of 8 * kBytes
 * dims. Each register holds kBytes consecutive E4M3 values of one row: kBytes = 2 widened to an
 * FP16 pair (m64k16 FP16 wgmma), kBytes = 4 as they are (m64k32 E4M3 wgmma); the two layouts are
 * the same with k scaled. */
template <int kBytes, int kSteps = kHeadBytes / (8 * kBytes)>
__device__ __forceinline__ void load_query_fragments(uint32_t (&a)[kSteps][4],
                                                     const uint8_t *q_tile, int row0,
                                                     int warp_in_group, int lane) {
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

/* wgmma A fragments (m64k16, BF16) of the 64 rows from `row0` of the BF16 Q tile: two 128-byte
 * swizzled tiles of 64 dims (kQTileBytes each), as TMA wrote them. Register j of k-step s holds
 * dims 16s + 8 (j >> 1) + 2 (lane & 3) + {0, 1} of row 8 (j & 1) + lane / 4 of the warp's 16. */
__device__ __forceinline__ void load_query_fragments_bf16(uint32_t (&a)[8][4],
                                                          const uint8_t *q_tile, int row0,
                                                          int warp_in_group, int lane) {
    const int first_row = row0 + warp_in_group * 16 + (lane >> 2);
#pragma unroll
    for (int step = 0; step < 8; ++step) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = first_row + (j & 1) * 8;
            const int dim = step * 16 + (j >> 1) * 8 + (lane & 3) * 2;
            const int byte = (dim & 63) * 2; /* within the row of its 64-dim tile */
            a[step][j] = *(const uint32_t *)(q_tile + (dim >> 6) * kQTileBytes +
                                             swizzled_chunk(row, byte >> 4) + (byte & 15));
        }
    }
}

/* One 64-row sub-tile against one FP16 (kBf16: BF16) page of two 64-dim halves: 8 k-steps of 16
 * dims. */
template <bool kBf16 = false>
__device__ __forceinline__ void score_subtile(float (&acc)[64], const uint32_t (&a)[8][4],
                                              const uint8_t *wide_page) {
#pragma unroll
    for (int step = 0; step < 8; ++step) {
        const uint64_t desc_b =
            smem_descriptor_sw128(wide_page + (step >> 2) * kWideHalfBytes + (step & 3) * 32);
        if constexpr (kBf16)
            wgmma_m64n128k16_bf16(acc, a[step], desc_b, step);
        else
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

/* The two rows this thread holds in a sub-tile's accumulators (registers i with (i/2)%2 = 0, 1). */
struct RowPair {
    int32_t row[2]; /* global rows; -1 past the tile's end */
    int32_t pos[2]; /* query positions */
};

/* Both rows' maxima over a page every row sees whole: a tree, not a chain (5 dependent max levels
 * per row instead of 32), as this max sits between the wgmma of consecutive pages. A row's maximum
 * is NaN only where all its dots are (fmaxf drops a NaN operand, but returns NaN when both are);
 * the stores fold that into -inf, as on every other backend. */
__device__ __forceinline__ void page_row_maxima(const float (&acc)[64], float (&best)[2]) {
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

/* page_row_maxima folded into best (-inf from the caller). */
__device__ __forceinline__ void whole_page_max(const float (&acc)[64], float (&best)[2]) {
    float page[2];
    page_row_maxima(acc, page);
    best[0] = fmaxf(best[0], page[0]);
    best[1] = fmaxf(best[1], page[1]);
}

/* A fused call's running maximum of one row over a task's pages (-inf at the task's start;
 * kKeep, else nothing: the scorer of every other call is compiled without it). Lane q of a quad
 * keeps row (q >> 1) & 1 of sub-tile q & 1, the row whose two-page stores it makes in the
 * two-sub-tile loop, folding the quad maxima it stores or, after a quad reduction that leaves both
 * rows in every lane, its own row's (store_chunk_maximum). */
template <bool kKeep>
struct RowMaximum {
    float value = -INFINITY;
};
template <>
struct RowMaximum<false> {};
__device__ __forceinline__ void keep_max(RowMaximum<true> &own, float value) {
    own.value = fmaxf(own.value, value);
}
__device__ __forceinline__ void keep_max(RowMaximum<false> &, float) {}
/* Lanes q and q ^ 1 kept the same row over pages of either parity (one sub-tile's whole-page
 * loop): the pair's maximum to both, lane q & 1 = 0 the owner. */
__device__ __forceinline__ void keep_pair_max(RowMaximum<true> &own) {
    keep_max(own, __shfl_xor_sync(0xffffffffu, own.value, 1));
}
__device__ __forceinline__ void keep_pair_max(RowMaximum<false> &) {}
/* Lane's own row of sub-tile s from both rows' quad maxima. */
template <class Run>
__device__ __forceinline__ void keep_own_row(Run &own, const float (&best)[2], int s, int lane) {
    if ((lane & 1) == s) keep_max(own, (lane & 2) != 0 ? best[1] : best[0]);
}

/* The same over the keys j <= pos of each row (the causal page). */
__device__ __forceinline__ void causal_page_max(const float (&acc)[64], const RowPair &rows,
                                                int32_t page, int lane, float (&best)[2]) {
    const int32_t last_key[2] = {rows.pos[0] - page * kPageKeys, rows.pos[1] - page * kPageKeys};
    const int lane_col = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int r = (i >> 1) & 1;
        const int col = (i >> 2) * 8 + lane_col + (i & 1);
        if (col <= last_key[r]) best[r] = fmaxf(best[r], acc[i]);
    }
}

/* The rows' maxima across each quad, stored by its lanes 0 and 1 (rows of sub-tile s). Rows that
 * do not see `page` (p >= nvp) store nothing. */
template <class Run>
__device__ __forceinline__ void store_quad_max(float (&best)[2], const RowPair &rows, int32_t page,
                                               int lane, const ScoreArgs &args, int s, Run &own) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        best[r] = fmaxf(best[r], __shfl_xor_sync(0xffffffffu, best[r], 1));
        best[r] = fmaxf(best[r], __shfl_xor_sync(0xffffffffu, best[r], 2));
    }
    keep_own_row(own, best, s, lane);
    const bool second = (lane & 1) != 0;
    const int32_t row = second ? rows.row[1] : rows.row[0];
    const int32_t pos = second ? rows.pos[1] : rows.pos[0];
    if ((lane & 2) == 0 && row >= 0 && page * kPageKeys <= pos)
        args.scores[(size_t)row * args.pitch + page] = second ? best[1] : best[0];
}

/* The fast scorer's quad reduction of whole pages, in two rounds of exchanges instead of a
 * butterfly per value. The four lanes q of a quad hold the same two rows of other keys.
 * First round, one page at a time, once its row maxima are known (where a page wait follows,
 * ptxas keeps the shuffle there, and its latency hides behind the next page's work): lanes q and
 * q ^ 2 swap rows, each keeping row (q >> 1) & 1 over both lanes' keys. */
__device__ __forceinline__ float quad_row_half_max(const float (&page)[2], int lane) {
    const bool second_row = (lane & 2) != 0;
    const float given = second_row ? page[0] : page[1];
    return fmaxf(second_row ? page[1] : page[0], __shfl_xor_sync(0xffffffffu, given, 2));
}

/* Second round, once two first-round values are known: lanes q and q ^ 1 swap them, lane q keeping
 * the full quad maximum of `second` if q is odd, of `first` if even. */
__device__ __forceinline__ float quad_keep_max(float first, float second, int lane) {
    const bool keeps_second = (lane & 1) != 0;
    const float given = keeps_second ? first : second;
    return fmaxf(keeps_second ? second : first, __shfl_xor_sync(0xffffffffu, given, 1));
}

/* A whole page's score: -inf where every dot was NaN (page_row_maxima). */
__device__ __forceinline__ float page_score(float quad_max) { return fmaxf(quad_max, -INFINITY); }

/* Scores of columns col and col + 1 of a row (-1: none), one 8-byte store where aligned. */
template <class Run>
__device__ __forceinline__ void store_adjacent_scores(int32_t row, int32_t col, float first,
                                                      float second, const ScoreArgs &args,
                                                      Run &own) {
    keep_max(own, fmaxf(first, second));
    if (row < 0) return;
    float *at = args.scores + (size_t)row * args.pitch + col;
    if (((uintptr_t)at & 7) == 0) {
        *(float2 *)at = make_float2(page_score(first), page_score(second));
    } else {
        at[0] = page_score(first);
        at[1] = page_score(second);
    }
}

/* Page max of both rows, stored: kWholePage when every row sees every key of the page (the fast
 * scorer's loops know it), else masked to each row's keys j <= pos. */
template <bool kWholePage, class Run>
__device__ __forceinline__ void store_page_max(const float (&acc)[64], const RowPair &rows,
                                               int32_t page, int lane, const ScoreArgs &args, int s,
                                               Run &own) {
    float best[2] = {-INFINITY, -INFINITY};
    if constexpr (kWholePage)
        whole_page_max(acc, best);
    else
        causal_page_max(acc, rows, page, lane, best);
    store_quad_max(best, rows, page, lane, args, s, own);
}

/* The same with the page's kind known at run time (the exact scorer). */
template <class Run>
__device__ __forceinline__ void store_page_max(const float (&acc)[64], const RowPair &rows,
                                               int32_t page, bool whole_page, int lane,
                                               const ScoreArgs &args, int s, Run &own) {
    float best[2] = {-INFINITY, -INFINITY};
    if (whole_page)
        whole_page_max(acc, best);
    else
        causal_page_max(acc, rows, page, lane, best);
    store_quad_max(best, rows, page, lane, args, s, own);
}

/* The task's maximum of the lane's own row (RowMaximum) over the pages it sees (NaN dots skipped,
 * -inf where none is real, as the page scores have it) to the row's cell of the task's chunk row.
 */
__device__ __forceinline__ void store_chunk_maximum(const RowMaximum<true> &own,
                                                    const RowPair (&rows)[2], int32_t chunk_row,
                                                    int lane, const ScoreArgs &args) {
    /* By selects: an indexed read would put rows in local memory. */
    const bool second_row = (lane & 2) != 0;
    const int32_t row = (lane & 1) != 0 ? (second_row ? rows[1].row[1] : rows[1].row[0])
                                        : (second_row ? rows[0].row[1] : rows[0].row[0]);
    if (row >= 0 && chunk_row < args.maxima_pitch)
        args.chunk_maxima[(size_t)row * args.maxima_pitch + chunk_row] =
            fmaxf(own.value, -INFINITY);
}

/* Per-warpgroup state of the consumer side. */
template <int kStages>
struct Consumer {
    const uint8_t *pages; /* the ring the consumers read: key pages, or FP16 pages (exact E4M3) */
    uint64_t *page_full, *page_empty;
    RingPosition<kStages> ring;
    int lane;
};

/* A task's pages [page_begin, page_end) on a ring of 32 KB 16-bit pages: BF16 keys as TMA wrote
 * them (kBf16), or the FP16 pages the wideners fill from E4M3 keys (exact E4M3); kSubtiles (0, 1 or
 * 2) 64-row sub-tiles of real rows in this warpgroup. Both sub-tiles' wgmma are issued on a page,
 * the first one's maxima taken while the second one's run, and the stage released once both have
 * read it. The warpgroups do not wait for each other, so one's wgmma run while the other takes
 * maxima. (The fast-accumulation loops, which overlap pages too, need more registers than the 64
 * registers of 16-bit Q fragments leave.) */
template <bool kBf16, int kSubtiles, int kStages, class Run>
__device__ __forceinline__ void
consume_16bit_pages(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                    const uint32_t (&qa)[2][8][4], const RowPair (&rows)[2], int32_t page_begin,
                    int32_t page_end, int32_t full_pages, const ScoreArgs &args, Run &own) {
    static_assert(Layout<KeyPath::kBf16>::kStageBytes == kWidePageBytes, "one 16-bit page size");
    for (int32_t page = page_begin; page < page_end; ++page) {
        mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
        const uint8_t *stage = c.pages + c.ring.slot * kWidePageBytes;
        const bool whole_page = page < full_pages;
        if (kSubtiles >= 1) {
            wgmma_fence();
            score_subtile<kBf16>(acc0, qa[0], stage);
            wgmma_commit();
        }
        if (kSubtiles == 2) {
            score_subtile<kBf16>(acc1, qa[1], stage);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc0);
            store_page_max(acc0, rows[0], page, whole_page, c.lane, args, 0, own);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            store_page_max(acc1, rows[1], page, whole_page, c.lane, args, 1, own);
        } else if (kSubtiles == 1) {
            wgmma_wait<0>();
            accumulators_settled(acc0);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            store_page_max(acc0, rows[0], page, whole_page, c.lane, args, 0, own);
        } else {
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
        }
        c.ring.advance();
    }
}

/* One 64-row sub-tile with fast accumulation on the next two pages of the ring, in acc0 and acc1:
 * the first page's maxima are taken while the second page's wgmma runs, which one sub-tile alone
 * could not overlap. Both stages are released; half[k] is page k's first quad round. */
template <int kStages>
__device__ __forceinline__ void score_page_pair_fp8(Consumer<kStages> &c, float (&acc0)[64],
                                                    float (&acc1)[64], const uint32_t (&qa)[4][4],
                                                    float (&half)[2]) {
    RingPosition<kStages> second = c.ring;
    second.advance();
    mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
    wgmma_fence();
    score_subtile_fp8(acc0, qa, c.pages + c.ring.slot * kPageBytes);
    wgmma_commit();
    mbarrier_wait(&c.page_full[second.slot], second.phase);
    score_subtile_fp8(acc1, qa, c.pages + second.slot * kPageBytes);
    wgmma_commit();
    wgmma_wait<1>();
    accumulators_settled(acc0);
    mbarrier_arrive(&c.page_empty[c.ring.slot]);
    float page[2];
    page_row_maxima(acc0, page);
    half[0] = quad_row_half_max(page, c.lane);
    wgmma_wait<0>();
    accumulators_settled(acc1);
    mbarrier_arrive(&c.page_empty[second.slot]);
    page_row_maxima(acc1, page);
    half[1] = quad_row_half_max(page, c.lane);
    c.ring = second;
    c.ring.advance();
}

/* The whole pages of one 64-row sub-tile with fast accumulation, four per round (two page pairs):
 * lane q of a quad ends with row (q >> 1) & 1 of pages 2 (q & 1) and 2 (q & 1) + 1, one 8-byte
 * store, so that a round of four pages pays the quad's second exchange round and the store's
 * address once. Then a last pair, and a last page. */
template <int kStages, class Run>
__device__ __forceinline__ void
consume_whole_pages_fp8(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                        const uint32_t (&qa)[4][4], const RowPair &rows, int32_t page_begin,
                        int32_t page_end, const ScoreArgs &args, Run &own) {
    const int32_t row = (c.lane & 2) != 0 ? rows.row[1] : rows.row[0];
    const int32_t lane_page = c.lane & 1;
    int32_t page = page_begin;
    for (; page + 3 < page_end; page += 4) {
        float first_pair[2], second_pair[2];
        score_page_pair_fp8(c, acc0, acc1, qa, first_pair);
        score_page_pair_fp8(c, acc0, acc1, qa, second_pair);
        store_adjacent_scores(row, page + 2 * lane_page,
                              quad_keep_max(first_pair[0], second_pair[0], c.lane),
                              quad_keep_max(first_pair[1], second_pair[1], c.lane), args, own);
    }
    if (page + 1 < page_end) {
        float pair[2];
        score_page_pair_fp8(c, acc0, acc1, qa, pair);
        const float best = page_score(quad_keep_max(pair[0], pair[1], c.lane));
        keep_max(own, best);
        if (row >= 0) args.scores[(size_t)row * args.pitch + page + lane_page] = best;
        page += 2;
    }
    if (page < page_end) {
        mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
        wgmma_fence();
        score_subtile_fp8(acc0, qa, c.pages + c.ring.slot * kPageBytes);
        wgmma_commit();
        wgmma_wait<0>();
        accumulators_settled(acc0);
        mbarrier_arrive(&c.page_empty[c.ring.slot]);
        c.ring.advance();
        store_page_max<true>(acc0, rows, page, c.lane, args, 0, own);
    }
}

/* Waits for the page at the ring position, issues both of the warpgroup's sub-tiles on it (FP8)
 * and takes the first sub-tile's maxima while the second one's wgmma, left in flight, runs. */
template <bool kWholePage, int kStages, class Run>
__device__ __forceinline__ void
score_page_fp8_first_max(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                         const uint32_t (&qa)[2][4][4], const RowPair &first_rows, int32_t page,
                         const ScoreArgs &args, Run &own) {
    mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
    const uint8_t *stage = c.pages + c.ring.slot * kPageBytes;
    wgmma_fence();
    score_subtile_fp8(acc0, qa[0], stage);
    wgmma_commit();
    score_subtile_fp8(acc1, qa[1], stage);
    wgmma_commit();
    wgmma_wait<1>();
    accumulators_settled(acc0);
    store_page_max<kWholePage>(acc0, first_rows, page, c.lane, args, 0, own);
}

/* consume_16bit_pages with fast accumulation (E4M3 fragments): no widening, so each warpgroup
 * scores the FP8 stages directly and releases a stage once its wgmma have read it. */
template <int kSubtiles, int kStages, class Run>
__device__ __forceinline__ void
consume_fp8_pages(Consumer<kStages> &c, float (&acc0)[64], float (&acc1)[64],
                  const uint32_t (&qa)[2][4][4], const RowPair (&rows)[2], int32_t page_begin,
                  int32_t page_end, int32_t full_pages, const ScoreArgs &args, Run &own) {
    /* Whole pages [page_begin, whole_end) in the pipelined loops, whose epilogues then hold no
     * masking code; the few causal pages after them one at a time. */
    const int32_t whole_end = min(page_end, max(page_begin, full_pages));
    if constexpr (kSubtiles == 1) {
        consume_whole_pages_fp8(c, acc0, acc1, qa[0], rows[0], page_begin, whole_end, args, own);
        for (int32_t page = whole_end; page < page_end; ++page) {
            mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
            wgmma_fence();
            score_subtile_fp8(acc0, qa[0], c.pages + c.ring.slot * kPageBytes);
            wgmma_commit();
            wgmma_wait<0>();
            accumulators_settled(acc0);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
            store_page_max<false>(acc0, rows[0], page, c.lane, args, 0, own);
        }
        keep_pair_max(own);
    } else if constexpr (kSubtiles == 2) {
        /* Two pages per round: the second page's first sub-tile is issued as soon as acc0 is free,
         * so the tensor cores keep running while the first page's second maxima are taken. Each
         * round drains its wgmma and has no branch between issue and wait: otherwise ptxas loses
         * track of the groups in flight and serializes every wgmma. Lane q of a quad stores row
         * (q >> 1) & 1 of sub-tile q & 1 on both pages: one 8-byte store. The first page's second
         * quad round stays before the second page's last wgmma: pairing both pages' rounds after
         * the drain made ptxas 13.0 drop the first page's sub-tile 1 wgmma and store the second
         * page's maxima in its place (the SASS must hold 16 QGMMA here). */
        const bool second_subtile = (c.lane & 1) != 0;
        const int32_t row = (c.lane & 2) != 0 ? (second_subtile ? rows[1].row[1] : rows[0].row[1])
                                              : (second_subtile ? rows[1].row[0] : rows[0].row[0]);
        int32_t page = page_begin;
        for (; page + 1 < whole_end; page += 2) {
            RingPosition<kStages> second = c.ring;
            second.advance();
            const uint8_t *second_stage = c.pages + second.slot * kPageBytes;
            /* Per page, sub-tile 0's first quad round waits in first_subtile for sub-tile 1's. */
            float maxima[2], first_subtile;
            mbarrier_wait(&c.page_full[c.ring.slot], c.ring.phase);
            wgmma_fence();
            score_subtile_fp8(acc0, qa[0], c.pages + c.ring.slot * kPageBytes);
            wgmma_commit();
            score_subtile_fp8(acc1, qa[1], c.pages + c.ring.slot * kPageBytes);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc0);
            page_row_maxima(acc0, maxima);
            first_subtile = quad_row_half_max(maxima, c.lane);
            mbarrier_wait(&c.page_full[second.slot], second.phase);
            wgmma_fence();
            score_subtile_fp8(acc0, qa[0], second_stage);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            page_row_maxima(acc1, maxima);
            const float first_page =
                quad_keep_max(first_subtile, quad_row_half_max(maxima, c.lane), c.lane);
            wgmma_fence();
            score_subtile_fp8(acc1, qa[1], second_stage);
            wgmma_commit();
            wgmma_wait<1>();
            accumulators_settled(acc0);
            page_row_maxima(acc0, maxima);
            first_subtile = quad_row_half_max(maxima, c.lane);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[second.slot]);
            page_row_maxima(acc1, maxima);
            store_adjacent_scores(
                row, page, first_page,
                quad_keep_max(first_subtile, quad_row_half_max(maxima, c.lane), c.lane), args, own);
            c.ring = second;
            c.ring.advance();
        }
        for (; page < page_end; ++page) { /* an odd whole page, then the causal ones */
            if (page < whole_end)
                score_page_fp8_first_max<true>(c, acc0, acc1, qa, rows[0], page, args, own);
            else
                score_page_fp8_first_max<false>(c, acc0, acc1, qa, rows[0], page, args, own);
            wgmma_wait<0>();
            accumulators_settled(acc1);
            mbarrier_arrive(&c.page_empty[c.ring.slot]);
            c.ring.advance();
            store_page_max<false>(acc1, rows[1], page, c.lane, args, 1, own);
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

/* What the consumers read of a task slot: two vector loads of the fields they use. (A plain struct
 * copy leaves the consumers short of registers: they spill.) */
__device__ __forceinline__ Task load_task(const Task *slot) {
    Task task;
    const uint32_t at = smem_address(slot);
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(task.row_begin), "=r"(task.row_end), "=r"(task.pos_base),
                   "=r"(task.full_pages)
                 : "r"(at));
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(task.page_begin), "=r"(task.page_end), "=r"(task.bt_row),
                   "=r"(task.chunk_row)
                 : "r"(at + 16));
    return task;
}

/* The consumer warpgroups' side of the kernel: per task of the CTA, the Q tile to registers, then
 * its pages scored against it (kMaxima: and each row's maximum over them kept,
 * ScoreArgs::chunk_maxima). */
template <KeyPath kPath, bool kMaxima>
__device__ __forceinline__ void run_consumers(const SharedState &smem, const ScoreArgs &args,
                                              int32_t num_tasks, int lane) {
    constexpr bool kWidened = Layout<kPath>::kWideStages > 0;
    constexpr int kStages = Layout<kPath>::kConsumedStages;
    claim_registers<kConsumerRegisters>();
    const int group = threadIdx.x / 128 - 1; /* consumer warpgroup 0 or 1 */
    const int warp_in_group = (threadIdx.x / 32) & 3;
    Consumer<kStages> c;
    c.pages = kWidened ? smem.wide_pages : smem.pages;
    c.page_full = kWidened ? smem.wide_full : smem.page_full;
    c.page_empty = kWidened ? smem.wide_empty : smem.page_empty;
    c.lane = lane;
    RingPosition<kQSlots> q_ring;
    float acc0[64], acc1[64];
    for (int64_t k = blockIdx.x; k < num_tasks; k += gridDim.x) {
        mbarrier_wait(&smem.q_full[q_ring.slot], q_ring.phase);
        const Task task = load_task(&smem.q_tasks[q_ring.slot]);

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
        RowMaximum<kMaxima> own;

        /* The queries go to registers (E4M3 for the FP8 wgmma, widened to FP16 for the exact E4M3
         * scorer, BF16 as they are) and the Q slot is free for the producer's next task. */
        const uint8_t *q_tile = smem.q_tiles + q_ring.slot * Layout<kPath>::kQSlotBytes;
        if constexpr (kPath == KeyPath::kBf16) {
            uint32_t qa[2][8][4];
            load_query_fragments_bf16(qa[0], q_tile, group * kSubRows, warp_in_group, lane);
            if (subtiles == 2)
                load_query_fragments_bf16(qa[1], q_tile, (2 + group) * kSubRows, warp_in_group,
                                          lane);
            mbarrier_arrive(&smem.q_empty[q_ring.slot]);
            q_ring.advance();
            if (subtiles == 2)
                consume_16bit_pages<true, 2>(c, acc0, acc1, qa, rows, task.page_begin,
                                             task.page_end, task.full_pages, args, own);
            else if (subtiles == 1)
                consume_16bit_pages<true, 1>(c, acc0, acc1, qa, rows, task.page_begin,
                                             task.page_end, task.full_pages, args, own);
            else
                consume_16bit_pages<true, 0>(c, acc0, acc1, qa, rows, task.page_begin,
                                             task.page_end, task.full_pages, args, own);
        } else {
            constexpr int kQueryBytes = kPath == KeyPath::kE4m3Fast ? 4 : 2;
            uint32_t qa[2][kHeadBytes / (8 * kQueryBytes)][4];
            load_query_fragments<kQueryBytes>(qa[0], q_tile, group * kSubRows, warp_in_group, lane);
            if (subtiles == 2)
                load_query_fragments<kQueryBytes>(qa[1], q_tile, (2 + group) * kSubRows,
                                                  warp_in_group, lane);
            mbarrier_arrive(&smem.q_empty[q_ring.slot]);
            q_ring.advance();
            if constexpr (kPath == KeyPath::kE4m3Fast) {
                if (subtiles == 2)
                    consume_fp8_pages<2>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end,
                                         task.full_pages, args, own);
                else if (subtiles == 1)
                    consume_fp8_pages<1>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end,
                                         task.full_pages, args, own);
                else
                    consume_fp8_pages<0>(c, acc0, acc1, qa, rows, task.page_begin, task.page_end,
                                         task.full_pages, args, own);
            } else {
                if (subtiles == 2)
                    consume_16bit_pages<false, 2>(c, acc0, acc1, qa, rows, task.page_begin,
                                                  task.page_end, task.full_pages, args, own);
                else if (subtiles == 1)
                    consume_16bit_pages<false, 1>(c, acc0, acc1, qa, rows, task.page_begin,
                                                  task.page_end, task.full_pages, args, own);
                else
                    consume_16bit_pages<false, 0>(c, acc0, acc1, qa, rows, task.page_begin,
                                                  task.page_end, task.full_pages, args, own);
            }
        }
        if constexpr (kMaxima) store_chunk_maximum(own, rows, task.chunk_row, lane, args);
    }
}

} // namespace

#endif
