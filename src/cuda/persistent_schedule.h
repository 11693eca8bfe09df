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

/* Chunk sizes the plan weighs: every size from 1 to MSAIDX_PERSISTENT_CHUNK_CHOICES pages
 * (tuning_sm90.h). */
#define MSAIDX_PERSISTENT_MAX_CHUNK_PAGES MSAIDX_PERSISTENT_CHUNK_CHOICES

/* Tasks number at most this, as the scorer counts them in 32 bits. */
#define MSAIDX_PERSISTENT_MAX_TASKS INT32_MAX

/* What chunks of i + 1 pages cost a batch that they cut into `tasks` tasks, on `num_sms` CTAs: the
 * time of the busiest CTA, ceil(tasks / num_sms) tasks of i + 1 pages plus
 * MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS, in quarters of a page; UINT64_MAX past
 * MSAIDX_PERSISTENT_MAX_TASKS tasks. */
static inline MSAIDX_HOST_DEVICE uint64_t msaidx_persistent_chunk_cost(uint64_t tasks, int i,
                                                                       int32_t num_sms) {
    if (tasks > MSAIDX_PERSISTENT_MAX_TASKS) return UINT64_MAX;
    const uint32_t waves = ((uint32_t)tasks + (uint32_t)num_sms - 1) / (uint32_t)num_sms;
    return (uint64_t)waves * (4 * (uint64_t)(i + 1) + MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS);
}

/* Orders the chunk choices: the cost above MSAIDX_PERSISTENT_CHUNK_KEY_BITS bits that hold
 * MSAIDX_PERSISTENT_CHUNK_KEY_MASK - i, so that the smaller key is the cheaper choice and, on a
 * tie, the larger chunk (UINT64_MAX: no choice). Costs stay below 2^40. */
#define MSAIDX_PERSISTENT_CHUNK_KEY_BITS 6
#define MSAIDX_PERSISTENT_CHUNK_KEY_MASK ((1u << MSAIDX_PERSISTENT_CHUNK_KEY_BITS) - 1u)
#if MSAIDX_PERSISTENT_CHUNK_CHOICES > MSAIDX_PERSISTENT_CHUNK_KEY_MASK + 1
#error "chunk keys hold the choice in MSAIDX_PERSISTENT_CHUNK_KEY_BITS bits"
#endif
static inline MSAIDX_HOST_DEVICE uint64_t msaidx_persistent_chunk_key(uint64_t cost, int i) {
    return cost == UINT64_MAX ? UINT64_MAX
                              : cost << MSAIDX_PERSISTENT_CHUNK_KEY_BITS |
                                    (uint64_t)(MSAIDX_PERSISTENT_CHUNK_KEY_MASK - (unsigned)i);
}
static inline MSAIDX_HOST_DEVICE uint64_t msaidx_persistent_key_cost(uint64_t key) {
    return key >> MSAIDX_PERSISTENT_CHUNK_KEY_BITS;
}
static inline MSAIDX_HOST_DEVICE int32_t msaidx_persistent_key_chunk(uint64_t key) {
    return (int32_t)(MSAIDX_PERSISTENT_CHUNK_KEY_MASK - (key & MSAIDX_PERSISTENT_CHUNK_KEY_MASK)) +
           1;
}

/* Whether chunks of i + 1 pages are a power of two. */
static inline MSAIDX_HOST_DEVICE int msaidx_persistent_chunk_is_power(int i) {
    return (i & (i + 1)) == 0;
}

/* The chunk size from the smallest key of all choices and of the powers of two: the cheapest
 * chunk; a size that is not a power of two only where it beats the best power of two by
 * MSAIDX_PERSISTENT_ODD_CHUNK_MIN_SAVING_PERCENT (tuning_sm90.h). Any size can fill the last wave:
 * a causal 8K-token prefill on 132 SMs takes one wave of 9-page tasks where powers of two take
 * four waves of 2. Batches too large for 2^31 tasks of the largest chunk get longer chunks
 * (`total_pages` bounds them). */
static inline MSAIDX_HOST_DEVICE int32_t msaidx_persistent_chunk_of_keys(uint64_t best,
                                                                         uint64_t best_power,
                                                                         uint64_t total_pages,
                                                                         int64_t num_tiles) {
    if (best_power != UINT64_MAX && 100 * msaidx_persistent_key_cost(best) >
                                        (100 - MSAIDX_PERSISTENT_ODD_CHUNK_MIN_SAVING_PERCENT) *
                                            msaidx_persistent_key_cost(best_power))
        return msaidx_persistent_key_chunk(best_power);
    if (best != UINT64_MAX) return msaidx_persistent_key_chunk(best);
    int64_t chunk = MSAIDX_PERSISTENT_MAX_CHUNK_PAGES;
    while (total_pages / (uint64_t)chunk + (uint64_t)num_tiles > MSAIDX_PERSISTENT_MAX_TASKS)
        chunk *= 2;
    return (int32_t)chunk;
}

/* The chunk size from tasks[i], the task count of a batch with chunks of i + 1 pages (the sum over
 * its tiles of ceil(pages / (i + 1))). (The device plan takes the smallest keys in a warp.) */
static inline int32_t
msaidx_persistent_chunk_pages(const uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES],
                              uint64_t total_pages, int64_t num_tiles, int32_t num_sms) {
    uint64_t best = UINT64_MAX, best_power = UINT64_MAX;
    for (int i = 0; i < MSAIDX_PERSISTENT_CHUNK_CHOICES; ++i) {
        const uint64_t key =
            msaidx_persistent_chunk_key(msaidx_persistent_chunk_cost(tasks[i], i, num_sms), i);
        if (key < best) best = key;
        if (msaidx_persistent_chunk_is_power(i) && key < best_power) best_power = key;
    }
    return msaidx_persistent_chunk_of_keys(best, best_power, total_pages, num_tiles);
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
