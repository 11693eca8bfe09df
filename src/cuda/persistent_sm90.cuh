/* The persistent backend's task list: shared by its plan (plan_persistent_sm90.cu) and its
 * scorer (score_persistent_sm90.cu). */
#ifndef MSAIDX_PERSISTENT_SM90_CUH
#define MSAIDX_PERSISTENT_SM90_CUH

#include "cuda_internal.cuh"
#include "persistent_schedule.h"

/* Query rows per task: two consumer warpgroups x two 64-row wgmma sub-tiles share every key page
 * loaded into shared memory. */
#define MSAIDX_PERSISTENT_TILE_ROWS 256

/* One row tile of one request. A task is one page chunk of one tile (persistent_schedule.h). */
struct __align__(16) msaidx_persistent_tile {
    int32_t row_begin, row_end; /* global rows r = t*H + h */
    int32_t pos_base;           /* the query of token t sits at pos_base + t */
    int32_t num_pages;          /* pages visible to the tile's last row */
    int32_t full_pages;         /* pages every row of the tile sees whole (no causal mask) */
    int32_t bt_row;             /* block-table row of the request */
    int32_t reserved[2];
};

struct __align__(16) msaidx_persistent_counts {
    int32_t num_tiles;
    int32_t chunk_pages;
    int32_t max_chunks; /* chunks of the longest tile */
    int32_t reserved;
};

/* Every request adds at most one partial tile. */
static inline int64_t msaidx_persistent_max_tiles(const msaidx_batch_desc *d, int32_t num_heads) {
    return (int64_t)d->num_tokens * num_heads / MSAIDX_PERSISTENT_TILE_ROWS + d->batch_size + 1;
}

/* After the common plan's areas: [msaidx_persistent_counts][msaidx_persistent_tile max_tiles]. */
static inline msaidx_persistent_counts *msaidx_persistent_counts_of(const msaidx_plan *plan) {
    return (msaidx_persistent_counts *)((char *)plan->workspace +
                                        msaidx_cuda_backend_area_offset(
                                            &plan->desc, plan->context->config.num_heads));
}
static inline msaidx_persistent_tile *msaidx_persistent_tiles_of(const msaidx_plan *plan) {
    return (msaidx_persistent_tile *)(msaidx_persistent_counts_of(plan) + 1);
}
static inline size_t msaidx_persistent_workspace_bytes(const msaidx_plan *plan) {
    return msaidx_cuda_backend_area_offset(&plan->desc, plan->context->config.num_heads) +
           sizeof(msaidx_persistent_counts) +
           sizeof(msaidx_persistent_tile) *
               (size_t)msaidx_persistent_max_tiles(&plan->desc, plan->context->config.num_heads);
}

/* Builds the tile list and chunk size from the request table of a planned workspace (run after
 * msaidx_cuda_plan_requests). One CTA: graph safe, no sync. */
msaidx_status msaidx_persistent_plan_tiles(const msaidx_plan *plan, cudaStream_t stream);

#endif
