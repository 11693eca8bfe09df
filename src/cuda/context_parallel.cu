/* Context parallel on the CUDA backends (SPEC.md section 12): a rank's candidates (each slot's
 * score and global page, a thread per slot), and the merge of every rank's gathered candidates (a
 * warp per row). Grids from the arguments alone (graph safe), on the caller's stream, no
 * allocation. */
#include "cuda_internal.cuh"
#include "merge_candidates.h"

#include <climits>

namespace {

constexpr int kSlotThreads = 256;

/* One thread per (row, slot) of the selection just written: the slot's score as a candidate
 * carries it (NaN as -inf, -inf beside -1), and on a sharded plan (request_pages not NULL) its
 * page from the rank's score column to the global page. */
__global__ void __launch_bounds__(kSlotThreads)
    candidates_kernel(const float *scores, int32_t *pages, float *candidate_scores,
                      const int32_t *request_pages, msaidx_page_shard shard, int64_t slots,
                      int32_t pitch, int32_t num_heads, int32_t topk, int64_t stride_t,
                      int64_t stride_h) {
    msaidx_wait_for_prior_grids();
    const int64_t slot = (int64_t)blockIdx.x * kSlotThreads + threadIdx.x;
    if (slot >= slots) return;
    const int64_t row = slot / topk, t = row / num_heads;
    const int64_t at = t * stride_t + row % num_heads * stride_h + slot % topk;
    const int32_t page = pages[at];
    float score = -INFINITY;
    if (page >= 0) { /* from the selection: in [0, nvp), nvp <= pitch */
        score = scores[row * pitch + page];
        if (isnan(score)) score = -INFINITY;
        if (request_pages) pages[at] = msaidx_shard_global(shard, request_pages[t], page);
    }
    candidate_scores[at] = score;
}

/* The merge runs a warp per row. One thread per row would read its W x topk candidates one after
 * another: about 40 us for any batch on an H200. Rows of at most 64 candidates (W = 2 at top-16
 * is 32) are ranked with one or two candidates per lane in registers: two passes of 32 shuffle
 * pairs per candidate a lane holds, none waiting on another. Longer rows walk the order: a
 * warp-wide maximum (10 dependent shuffles) per chosen page. Ranking four a lane (W = 8 at top-16)
 * measured 2.5x slower than the walk on an H200: its passes grow as the square of the held. */
constexpr int kMergeWarps = 8;
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kWalking = 0; /* merge_row's "held" for rows walked, not ranked */

struct MergeRow {
    const float *scores;  /* the row in rank 0's block */
    const int32_t *pages; /* the row in rank 0's block */
    int64_t rank_stride;
    int64_t candidates; /* W x topk */
    int32_t world_size, topk;
    int32_t lo, hi, slots; /* the free slots take pages in [lo, hi) */
};

__device__ void clear(float &score, int32_t &page) {
    score = MSAIDX_MERGE_NONE_SCORE;
    page = MSAIDX_MERGE_NONE_PAGE;
}

/* Lane l's candidates l, l + 32, ... (as msaidx_merge_candidate reads them), none past the row. */
template <int kHeld>
__device__ void load_held(const MergeRow &row, int32_t lane, float score[], int32_t page[]) {
#pragma unroll
    for (int32_t held = 0; held < kHeld; ++held) {
        const int32_t c = held * 32 + lane;
        clear(score[held], page[held]);
        if (c < row.candidates)
            msaidx_merge_candidate(row.scores, row.pages, row.rank_stride, c / row.topk,
                                   c % row.topk, &score[held], &page[held]);
    }
}

/* visit(score, page, candidate) of each of the 32 x kHeld held candidates, in every lane; unrolled,
 * so the shuffles of a pass overlap. */
template <int kHeld, typename Visit>
__device__ __forceinline__ void for_each_held(const float score[], const int32_t page[],
                                              Visit visit) {
#pragma unroll
    for (int32_t block = 0; block < kHeld; ++block)
#pragma unroll
        for (int32_t source = 0; source < 32; ++source)
            visit(__shfl_sync(kAllLanes, score[block], source),
                  __shfl_sync(kAllLanes, page[block], source), block * 32 + source);
}

/* The ranked merge of at most 32 x kHeld held candidates: a candidate stays when no other copy of
 * its page is above it (of equal copies the lower candidate stays), and is chosen when fewer than
 * `slots` staying candidates are above it: msaidx_merge_row's pages (the best `slots` distinct
 * pages, each at its best copy). Leaves the lane's chosen pages in chosen[] (any order), none
 * elsewhere. */
template <int kHeld>
__device__ void choose_ranked(const MergeRow &row, int32_t lane, float score[], int32_t page[],
                              int32_t chosen[]) {
    bool copied[kHeld] = {};
    int32_t above[kHeld] = {};
#pragma unroll
    for (int32_t held = 0; held < kHeld; ++held)
        if (page[held] < row.lo || page[held] >= row.hi) clear(score[held], page[held]);
    for_each_held<kHeld>(score, page, [&](float v, int32_t p, int32_t other) {
#pragma unroll
        for (int32_t held = 0; held < kHeld; ++held)
            copied[held] |= p == page[held] &&
                            (v > score[held] || (v == score[held] && other < held * 32 + lane));
    });
#pragma unroll
    for (int32_t held = 0; held < kHeld; ++held)
        if (copied[held]) clear(score[held], page[held]);
    for_each_held<kHeld>(score, page, [&](float v, int32_t p, int32_t) {
#pragma unroll
        for (int32_t held = 0; held < kHeld; ++held)
            above[held] += msaidx_candidate_above(v, p, score[held], page[held]);
    });
#pragma unroll
    for (int32_t held = 0; held < kHeld; ++held)
        chosen[held] = above[held] < row.slots ? page[held] : MSAIDX_MERGE_NONE_PAGE;
}

/* msaidx_merge_row's pages from any number of candidates, walking the order down: per step each
 * lane's best below the last step (lane l reads candidates l, l + 32, ...), then the warp's; a page
 * already taken is passed over (its best copy came first). Chosen page j lands in lane j % 32,
 * chosen[j / 32] (topk <= 64); none elsewhere. */
__device__ void choose_walking(const MergeRow &row, int32_t lane, int32_t chosen[2]) {
    const int32_t first_rank = lane / row.topk, first_position = lane % row.topk;
    const int32_t step_ranks = 32 / row.topk, step_positions = 32 % row.topk;
    chosen[0] = chosen[1] = MSAIDX_MERGE_NONE_PAGE;
    int32_t num = 0;
    float last_score = INFINITY;
    int32_t last_page = -1;
    while (num < row.slots) {
        float best_score, v;
        int32_t best_page, p;
        clear(best_score, best_page);
        int32_t i = first_position;
        for (int64_t r = first_rank; r < row.world_size;) {
            msaidx_merge_candidate(row.scores, row.pages, row.rank_stride, r, i, &v, &p);
            if (p >= row.lo && p < row.hi && msaidx_candidate_above(last_score, last_page, v, p) &&
                msaidx_candidate_above(v, p, best_score, best_page)) {
                best_score = v;
                best_page = p;
            }
            r += step_ranks;
            i += step_positions;
            if (i >= row.topk) {
                i -= row.topk;
                ++r;
            }
        }
        for (int32_t offset = 16; offset > 0; offset /= 2) { /* every lane ends with the best */
            v = __shfl_xor_sync(kAllLanes, best_score, offset);
            p = __shfl_xor_sync(kAllLanes, best_page, offset);
            if (msaidx_candidate_above(v, p, best_score, best_page)) {
                best_score = v;
                best_page = p;
            }
        }
        if (best_page == MSAIDX_MERGE_NONE_PAGE) break;
        last_score = best_score;
        last_page = best_page;
        if (__any_sync(kAllLanes, chosen[0] == best_page || chosen[1] == best_page)) continue;
        if (lane == num % 32) {
            if (num < 32)
                chosen[0] = best_page;
            else
                chosen[1] = best_page;
        }
        ++num;
    }
}

/* The merged row from the chosen pages spread over the lanes (kChosen registers each): each at
 * init_blocks + (chosen pages below it), the forced pages and -1 around them
 * (msaidx_merge_forced). */
template <int kChosen>
__device__ void write_row(int32_t *entry, int32_t lane, const int32_t chosen[], int32_t topk,
                          int32_t init_blocks, int32_t local_blocks, int32_t hi) {
    int32_t num = 0, below[kChosen] = {};
#pragma unroll
    for (int32_t block = 0; block < kChosen; ++block) {
        const uint32_t held = __ballot_sync(kAllLanes, chosen[block] != MSAIDX_MERGE_NONE_PAGE);
        num += __popc(held);
        if (held == 0) continue;
#pragma unroll
        for (int32_t source = 0; source < 32; ++source) {
            const int32_t p = __shfl_sync(kAllLanes, chosen[block], source);
#pragma unroll
            for (int32_t mine = 0; mine < kChosen; ++mine) below[mine] += p < chosen[mine];
        }
    }
    /* Every lane's reads are done (the shuffles consumed them) before any write: out may be rank
     * 0's candidate_pages. */
    __syncwarp();
#pragma unroll
    for (int32_t mine = 0; mine < kChosen; ++mine)
        if (chosen[mine] != MSAIDX_MERGE_NONE_PAGE) entry[init_blocks + below[mine]] = chosen[mine];
    for (int32_t k = lane; k < topk; k += 32)
        if (k < init_blocks || k >= init_blocks + num)
            entry[k] = msaidx_merge_forced(k, init_blocks, local_blocks, num, hi);
}

/* One row by a warp: ranked with kHeld candidates a lane, or walked (kWalking). The held
 * candidates are read before the row's nvp arrives, so the two loads overlap. */
template <int kHeld>
__device__ void merge_row(MergeRow row, int32_t lane, const int32_t *row_nvp, int32_t *entry,
                          int32_t init_blocks, int32_t local_blocks) {
    constexpr int kChosen = kHeld == kWalking ? 2 : kHeld;
    float score[kChosen];
    int32_t page[kChosen], chosen[kChosen];
    if constexpr (kHeld != kWalking) load_held<kHeld>(row, lane, score, page);
    const int32_t n = *row_nvp;
    if (n <= row.topk) {
        for (int32_t k = lane; k < row.topk; k += 32) entry[k] = k < n ? k : -1;
        return;
    }
    row.lo = init_blocks;
    row.hi = n - local_blocks;
    row.slots = row.topk - init_blocks - local_blocks;
    if constexpr (kHeld != kWalking)
        choose_ranked<kHeld>(row, lane, score, page, chosen);
    else
        choose_walking(row, lane, chosen);
    write_row<kChosen>(entry, lane, chosen, row.topk, init_blocks, local_blocks, row.hi);
}

__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_kernel(int32_t world_size, int32_t num_tokens, int32_t num_heads, int32_t topk,
                 int32_t init_blocks, int32_t local_blocks, const int32_t *nvp,
                 const float *candidate_scores, const int32_t *candidate_pages, int64_t rank_stride,
                 int32_t *out, int64_t stride_t, int64_t stride_h) {
    msaidx_wait_for_prior_grids();
    const int32_t lane = (int32_t)(threadIdx.x % 32);
    const int64_t row_id = (int64_t)blockIdx.x * kMergeWarps + threadIdx.x / 32;
    if (row_id >= (int64_t)num_tokens * num_heads) return; /* the whole warp */
    MergeRow row;
    row.scores = candidate_scores + row_id * topk;
    row.pages = candidate_pages + row_id * topk;
    row.rank_stride = rank_stride;
    row.candidates = (int64_t)world_size * topk;
    row.world_size = world_size;
    row.topk = topk;
    const int32_t *row_nvp = nvp + row_id / num_heads;
    int32_t *entry = out + row_id / num_heads * stride_t + row_id % num_heads * stride_h;
    if (row.candidates <= 32)
        merge_row<1>(row, lane, row_nvp, entry, init_blocks, local_blocks);
    else if (row.candidates <= 64)
        merge_row<2>(row, lane, row_nvp, entry, init_blocks, local_blocks);
    else
        merge_row<kWalking>(row, lane, row_nvp, entry, init_blocks, local_blocks);
}

} // namespace

msaidx_status msaidx_cuda_candidates(const msaidx_plan *plan, const msaidx_context *context,
                                     const float *scores, int32_t *pages, float *candidate_scores,
                                     int64_t stride_t, int64_t stride_h, void *stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const msaidx_config *c = &context->config;
    const int64_t slots = (int64_t)d->num_tokens * c->num_heads * c->topk;
    if (slots == 0) return MSAIDX_SUCCESS;
    const int64_t blocks = (slots + kSlotThreads - 1) / kSlotThreads;
    if (blocks > INT_MAX)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "num_tokens = %d: too many candidates for one launch", d->num_tokens);
    const int32_t *request_pages =
        d->cp_world > 1 ? msaidx_cuda_request_pages(plan->workspace, d) : NULL;
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(candidates_kernel, dim3((unsigned)blocks),
                                            dim3(kSlotThreads), 0, msaidx_cuda_stream(stream),
                                            scores, pages, candidate_scores, request_pages,
                                            msaidx_shard_of(d), slots, d->pitch, c->num_heads,
                                            c->topk, stride_t, stride_h),
                    "candidates_kernel launch");
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_merge_candidates(const msaidx_context *context, int32_t world_size,
                                           int32_t num_tokens, const int32_t *nvp,
                                           const float *candidate_scores,
                                           const int32_t *candidate_pages, int64_t rank_stride,
                                           int32_t *out, int64_t stride_t, int64_t stride_h,
                                           void *stream) {
    const msaidx_config *c = &context->config;
    const int64_t rows = (int64_t)num_tokens * c->num_heads;
    if (rows == 0) return MSAIDX_SUCCESS;
    const unsigned blocks = (unsigned)((rows + kMergeWarps - 1) / kMergeWarps);
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(merge_kernel, dim3(blocks), dim3(kMergeWarps * 32), 0,
                                            msaidx_cuda_stream(stream), world_size, num_tokens,
                                            c->num_heads, c->topk, c->init_blocks, c->local_blocks,
                                            nvp, candidate_scores, candidate_pages, rank_stride,
                                            out, stride_t, stride_h),
                    "merge_kernel launch");
    return MSAIDX_SUCCESS;
}
