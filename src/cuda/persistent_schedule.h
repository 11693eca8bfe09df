/* The persistent backend's schedule arithmetic: the page-chunk size its plan picks and the task
 * each CTA of its scorer runs. Plain C, host and device, so that a host test checks it.
 *
 * A task is one chunk of consecutive pages of one row tile. Only real tasks are dealt: task k
 * (CTA c runs k = c, c + grid, ...) lies in chunk row r (pages [r * chunk, (r + 1) * chunk)) at
 * position j, and scores the j-th tile by chunk count, most first (the plan stores the tiles in
 * that order).
 * Row r then holds exactly the tiles with more than r chunks, so every task is real, every CTA gets
 * the same number of tasks (+-1), and the tasks that run at the same time share a chunk row, whose
 * key pages meet in L2. Rows of equal width form a segment, so a CTA finds its row with a cursor
 * that only moves forward and one division. */
#ifndef MSAIDX_PERSISTENT_SCHEDULE_H
#define MSAIDX_PERSISTENT_SCHEDULE_H

#include <stdint.h>

#include "tuning_sm90.h"

#ifdef __CUDACC__
#define MSAIDX_HOST_DEVICE __host__ __device__
#else
#define MSAIDX_HOST_DEVICE
#endif

/* Chunk sizes the plan weighs: 2^i pages for i < MSAIDX_PERSISTENT_CHUNK_CHOICES (tuning_sm90.h).
 */
#define MSAIDX_PERSISTENT_MAX_CHUNK_PAGES (1 << (MSAIDX_PERSISTENT_CHUNK_CHOICES - 1))

/* Tasks number at most this, as the scorer counts them in 32 bits. */
#define MSAIDX_PERSISTENT_MAX_TASKS INT32_MAX

/* The chunk size from tasks[i], the task count of a batch with chunks of 2^i pages (the sum over
 * its tiles of ceil(pages / 2^i)), on `num_sms` CTAs: the one whose busiest CTA finishes first,
 * counting ceil(tasks / num_sms) tasks of 2^i pages plus MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS;
 * the larger on a tie. Batches too large for 2^31 tasks of 64 pages get longer chunks
 * (`total_pages` bounds them). */
static inline MSAIDX_HOST_DEVICE int32_t
msaidx_persistent_chunk_pages(const uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES],
                              uint64_t total_pages, int64_t num_tiles, int32_t num_sms) {
    int32_t best = 0;
    uint64_t best_cost = 0;
    for (int i = MSAIDX_PERSISTENT_CHUNK_CHOICES - 1; i >= 0; --i) {
        if (tasks[i] > MSAIDX_PERSISTENT_MAX_TASKS) continue;
        const uint64_t waves = (tasks[i] + (uint64_t)num_sms - 1) / (uint64_t)num_sms;
        const uint64_t cost =
            waves * (4 * ((uint64_t)1 << i) + MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS);
        if (best == 0 || cost < best_cost) {
            best = (int32_t)1 << i;
            best_cost = cost;
        }
    }
    if (best) return best;
    int64_t chunk = MSAIDX_PERSISTENT_MAX_CHUNK_PAGES;
    while (total_pages / (uint64_t)chunk + (uint64_t)num_tiles > MSAIDX_PERSISTENT_MAX_TASKS)
        chunk *= 2;
    return (int32_t)chunk;
}

/* Chunk rows [chunk_row, next segment's chunk_row) all hold `width` tasks; the first of them is
 * task task_begin. The plan ends the list with a sentinel segment whose task_begin is the task
 * count. */
typedef struct {
    int32_t task_begin, chunk_row, width, reserved;
} msaidx_persistent_segment;

/* Chunk row and position of task `task` (< the task count). *segment is the caller's cursor: 0 at
 * first, and tasks asked in increasing order only move it forward. */
static inline MSAIDX_HOST_DEVICE void
msaidx_persistent_locate(const msaidx_persistent_segment *segments, int32_t *segment, int32_t task,
                         int32_t *chunk_row, int32_t *position) {
    while (segments[*segment + 1].task_begin <= task) ++*segment;
    const msaidx_persistent_segment s = segments[*segment];
    const int32_t offset = task - s.task_begin;
    *chunk_row = s.chunk_row + offset / s.width;
    *position = offset % s.width;
}

#endif
