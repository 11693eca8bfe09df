/* The persistent backend's task list, shared by its plan (plan_persistent_sm90.cu), its scorer
 * (score_persistent_sm90.cu) and its host side (persistent_backend_sm90.cu), and the scorer's
 * entry points. */
#ifndef MSAIDX_PERSISTENT_SM90_CUH
#define MSAIDX_PERSISTENT_SM90_CUH

#include <cuda.h>

#include "cuda_internal.cuh"
#include "persistent_schedule.h"

/* One row tile of one request. A task is one page chunk of one tile (persistent_schedule.h). */
struct __align__(16) msaidx_persistent_tile {
    int32_t row_begin, row_end; /* global rows r = t*H + h */
    int32_t pos_base;           /* the query of token t sits at pos_base + t */
    int32_t num_pages;          /* pages visible to the tile's last row */
    int32_t full_pages;         /* pages every row of the tile sees whole (no causal mask) */
    int32_t bt_row;             /* block-table row of the request */
    int32_t reserved[2];
};

struct __align__(8) msaidx_persistent_counts {
    int32_t chunk_pages;
    int32_t num_tasks;
};

/* Every request adds at most one partial tile. A context-parallel plan also cuts tiles where a
 * global page ends (plan_persistent_sm90.cu): at most T / 128 + B more. */
static inline int64_t msaidx_persistent_max_tiles(const msaidx_batch_desc *d, int32_t num_heads) {
    const int64_t page_cuts =
        msaidx_cuda_sharded(d) ? (int64_t)d->num_tokens / kPageKeys + d->batch_size : 0;
    return (int64_t)d->num_tokens * num_heads / MSAIDX_PERSISTENT_TILE_ROWS + d->batch_size + 1 +
           page_cuts;
}
/* A tile has at most this many pages, so as many chunk rows; one more entry for a sentinel. */
static inline int64_t msaidx_persistent_max_rows(const msaidx_batch_desc *d) {
    return ((int64_t)d->max_seq_len + kPageKeys - 1) / kPageKeys + 1;
}

/* A task as the scorer's producer hands it to its consumers: the fields of its tile they need and
 * its pages, chunk row chunk_row of the deal (page_begin = chunk_row * chunk_pages). */
struct __align__(16) msaidx_persistent_task {
    int32_t row_begin, row_end, pos_base, full_pages; /* of its tile */
    int32_t page_begin, page_end, bt_row, chunk_row;
};

/* Block-table entries of a resolved task (MSAIDX_PERSISTENT_RESOLVED_WAVES, tuning_sm90.h) that
 * the plan copies out: one per lane of the producer warp. */
#define MSAIDX_PERSISTENT_RESOLVED_PAGES 32

/* A task resolved by the plan (page_begin = page_end: there is no such task). */
struct __align__(16) msaidx_persistent_resolved_task {
    int32_t physical_pages[MSAIDX_PERSISTENT_RESOLVED_PAGES]; /* of task.page_begin + i, while <
                                                                 page_end */
    msaidx_persistent_task task;
};

/* After the common plan's areas: [counts][tiles: max_tiles, request order][tiles: max_tiles, by
 * chunk count][segments: max_rows][tiles above each page count: max_rows int32][resolved tasks:
 * waves x num_sms], as byte offsets from the workspace. */
struct msaidx_persistent_layout {
    size_t counts, tiles, sorted_tiles, segments, histogram, resolved_tasks, end;
};
static inline msaidx_persistent_layout msaidx_persistent_layout_of(const msaidx_plan *plan) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t num_heads = plan->context->config.num_heads;
    const size_t max_tiles = (size_t)msaidx_persistent_max_tiles(d, num_heads);
    const size_t max_rows = (size_t)msaidx_persistent_max_rows(d);
    msaidx_persistent_layout l;
    l.counts = msaidx_cuda_backend_area_offset(d, num_heads);
    l.tiles = msaidx_align_up(l.counts + sizeof(msaidx_persistent_counts), 16);
    l.sorted_tiles = l.tiles + sizeof(msaidx_persistent_tile) * max_tiles;
    l.segments = l.sorted_tiles + sizeof(msaidx_persistent_tile) * max_tiles;
    l.histogram = l.segments + sizeof(msaidx_persistent_segment) * max_rows;
    l.resolved_tasks = msaidx_align_up(l.histogram + sizeof(int32_t) * max_rows, 16);
    l.end = l.resolved_tasks + sizeof(msaidx_persistent_resolved_task) *
                                   MSAIDX_PERSISTENT_RESOLVED_WAVES *
                                   (size_t)plan->context->num_sms;
    return l;
}
static inline size_t msaidx_persistent_workspace_bytes(const msaidx_plan *plan) {
    return msaidx_persistent_layout_of(plan).end;
}
/* Typed views of a planned workspace. */
struct msaidx_persistent_views {
    msaidx_persistent_counts *counts;
    msaidx_persistent_tile *tiles, *sorted_tiles;
    msaidx_persistent_segment *segments;
    int32_t *histogram;
    msaidx_persistent_resolved_task *resolved_tasks; /* task k at k */
};
static inline msaidx_persistent_views msaidx_persistent_views_of(const msaidx_plan *plan) {
    const msaidx_persistent_layout l = msaidx_persistent_layout_of(plan);
    char *base = (char *)plan->workspace;
    return msaidx_persistent_views{(msaidx_persistent_counts *)(base + l.counts),
                                   (msaidx_persistent_tile *)(base + l.tiles),
                                   (msaidx_persistent_tile *)(base + l.sorted_tiles),
                                   (msaidx_persistent_segment *)(base + l.segments),
                                   (int32_t *)(base + l.histogram),
                                   (msaidx_persistent_resolved_task *)(base + l.resolved_tasks)};
}

/* Builds the tile list, the chunk size, the tiles by chunk count, the chunk-row segments
 * (persistent_schedule.h) and the resolved tasks from the request table of a planned workspace
 * (run after msaidx_cuda_plan_requests). One CTA: graph safe, no sync. */
msaidx_status msaidx_persistent_plan_tiles(const msaidx_plan *plan, cudaStream_t stream);

/* NOT_SUPPORTED unless this build holds the scorer's sm_90a code (on the current device). */
msaidx_status msaidx_persistent_check_sm90a_code(void);

/* Raises the scorer kernels' dynamic shared memory limits on the current device. */
msaidx_status msaidx_persistent_set_attributes(void);

/* Chunk rows of each row's maxima in a fused call's workspace (ScoreArgs::chunk_maxima): enough for
 * every chunk row of a deal whose chunks have at least MSAIDX_PERSISTENT_MAXIMA_MIN_CHUNK pages
 * (tuning_sm90.h), the only deals whose maxima the top-k reads. */
static inline int32_t msaidx_persistent_maxima_pitch(const msaidx_plan *plan) {
    return (plan->desc.pitch + MSAIDX_PERSISTENT_MAXIMA_MIN_CHUNK - 1) /
           MSAIDX_PERSISTENT_MAXIMA_MIN_CHUNK;
}

/* Launches the scorer over a planned workspace: q_map and k_map are the TMA maps of Q (boxes of
 * one task's MSAIDX_PERSISTENT_TILE_ROWS rows) and of the key cache (boxes of one page), both
 * 128-byte swizzled. chunk_maxima: NULL, or the fused call's maxima area (rows x
 * msaidx_persistent_maxima_pitch floats). */
msaidx_status msaidx_persistent_launch_scores(const msaidx_plan *plan, const CUtensorMap *q_map,
                                              const CUtensorMap *k_map, float *scores,
                                              float *chunk_maxima, cudaStream_t stream);

#endif
