/* The persistent backend's schedule arithmetic: the page-chunk size its plan picks and the task
 * each CTA of its scorer runs. Plain C, host and device, so that a host test checks it. */
#ifndef MSAIDX_PERSISTENT_SCHEDULE_H
#define MSAIDX_PERSISTENT_SCHEDULE_H

#include <stdint.h>

#ifdef __CUDACC__
#define MSAIDX_HOST_DEVICE __host__ __device__
#else
#define MSAIDX_HOST_DEVICE
#endif

/* Page chunks are sized so that the tasks number about this many per SM (a few waves, so that
 * the round-robin deal ends evenly), within these bounds: a chunk below the minimum does not pay
 * for its Q tile and task switch (except in a batch small enough for one wave of smaller chunks),
 * one above the maximum leaves the last wave uneven. */
#define MSAIDX_PERSISTENT_TASKS_PER_SM 8
#define MSAIDX_PERSISTENT_MIN_CHUNK_PAGES 4
#define MSAIDX_PERSISTENT_MAX_CHUNK_PAGES 64

/* Pages per task for a batch of `num_tiles` row tiles holding `total_pages` tile-pages, the
 * longest `longest` pages, on `num_sms` CTAs. A batch whose task slots (tiles x chunks of the
 * longest tile, dealt round-robin) fit one wave with a chunk below the minimum gets the smallest
 * such chunk: there, finishing sooner beats paying for fewer Q tiles. The slot count stays below
 * 2^31, as the scorer counts tasks in 32 bits. */
static inline MSAIDX_HOST_DEVICE int32_t msaidx_persistent_chunk_pages(uint64_t total_pages, int64_t num_tiles,
                                                                       int32_t longest, int32_t num_sms) {
    const uint64_t target = (uint64_t)num_sms * MSAIDX_PERSISTENT_TASKS_PER_SM;
    uint64_t chunk = (total_pages + target - 1) / target;
    if (chunk < MSAIDX_PERSISTENT_MIN_CHUNK_PAGES) {
        chunk = MSAIDX_PERSISTENT_MIN_CHUNK_PAGES;
        for (int32_t smaller = 1; smaller < MSAIDX_PERSISTENT_MIN_CHUNK_PAGES; ++smaller)
            if (num_tiles * ((longest + smaller - 1) / smaller) <= num_sms) {
                chunk = (uint64_t)smaller;
                break;
            }
    }
    if (chunk > MSAIDX_PERSISTENT_MAX_CHUNK_PAGES) chunk = MSAIDX_PERSISTENT_MAX_CHUNK_PAGES;
    while ((uint64_t)num_tiles * (((uint64_t)longest + chunk - 1) / chunk) > INT32_MAX) chunk *= 2;
    return (int32_t)chunk;
}

/* Task k is chunk k / num_tiles of tile (k + k / num_tiles) % num_tiles, and CTA c runs tasks
 * c, c + grid, ... The tasks that run at the same time (consecutive k) share one chunk row, so their
 * key pages meet in L2; the skew by chunk row deals each CTA tiles of every residue rather than only
 * those congruent to c modulo gcd(grid, num_tiles), which gave a quarter of the CTAs 1.8x the average
 * work on a batch of 16 requests with contexts 4K..1M. It spreads some batches (not all: 32 tiles on
 * 132 CTAs stay confined, as 132 / 32 rows ~ 4) and balances none: every CTA gets the same number of
 * slots, empty or not, so ragged batches finish on their busiest CTA
 * (bench/results/2026-11-30_h200_v3.md). Dealing only the non-empty tasks would balance them. */
static inline MSAIDX_HOST_DEVICE uint32_t msaidx_persistent_task_tile(uint32_t task, uint32_t num_tiles) {
    return (task % num_tiles + task / num_tiles) % num_tiles;
}

#endif
