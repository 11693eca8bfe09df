/* The persistent backend's device plan: request table -> row tiles and page-chunk size. */
#include "persistent_sm90.cuh"

#include <cub/block/block_scan.cuh>

namespace {

constexpr int kPlanThreads = 1024;

struct TilePlanArgs {
    const msaidx_cuda_request *requests;
    const int32_t *block_table;
    const int32_t *positions; /* context parallel: local positions per token, else NULL */
    msaidx_persistent_views out;
    int64_t max_tiles;
    int32_t batch_size, num_heads, num_sms, bt_stride;
};

using Scan = cub::BlockScan<int32_t, kPlanThreads>;

/* A block of requests and the place of each one's first tile among the block's (plan_tiles). */
struct RequestSlots {
    int32_t first_tile[kPlanThreads];
    msaidx_cuda_request request[kPlanThreads];
};

/*
 * Context parallel: the scorer places row r of a tile at pos_base + r / H, so a tile's local
 * positions (cuda_internal.cuh) must be a line. Within one global page they are: pos - g * 128 +
 * n * 128 when the rank owns page g, else the constant n * 128 - 1. So a sharded request's tiles
 * are cut where a global page ends too. The constant run is given the line through its first
 * position, n * 128 - 1, with num_pages = full_pages = n: its rows then see the n owned pages
 * below whole and nothing of page n, which the tile never reaches, as the run's true positions do.
 */
/* The end (exclusive) of the sharded tile that starts at token i of a request. */
__device__ __forceinline__ int32_t sharded_tile_end(int32_t i, int32_t q_len, int32_t first_pos,
                                                    int32_t tile_tokens) {
    const int32_t page_end = i + (kPageKeys - (first_pos + i) % kPageKeys);
    return min(min(q_len, i + tile_tokens), page_end);
}

/* Tile i of a request that is not sharded: MSAIDX_PERSISTENT_TILE_ROWS consecutive rows. */
__device__ msaidx_persistent_tile plain_tile(const TilePlanArgs &a,
                                             const msaidx_cuda_request &request, int32_t i) {
    const int64_t request_row0 = (int64_t)request.token_begin * a.num_heads;
    const int64_t rows = (int64_t)request.q_len * a.num_heads;
    msaidx_persistent_tile tile;
    tile.row_begin = (int32_t)(request_row0 + (int64_t)i * MSAIDX_PERSISTENT_TILE_ROWS);
    tile.row_end =
        (int32_t)min(request_row0 + rows, (int64_t)tile.row_begin + MSAIDX_PERSISTENT_TILE_ROWS);
    tile.pos_base = request.seq_len - request.q_len - request.token_begin;
    const int32_t tile_first_pos = tile.pos_base + tile.row_begin / a.num_heads;
    const int32_t last_pos = tile.pos_base + (tile.row_end - 1) / a.num_heads;
    tile.num_pages = last_pos / kPageKeys + 1;
    tile.full_pages = (tile_first_pos + 1) / kPageKeys;
    tile.bt_row = request.bt_row;
    tile.reserved[0] = tile.reserved[1] = 0;
    return tile;
}

/* Fills a.out.tiles in request order; returns the tile count and leaves the total page count and
 * the most pages of a tile. Requests are taken kPlanThreads at a time; a scan places each
 * request's tiles after those of the requests before it. Skipped requests (q_len = 0) add none.
 * A long prompt has thousands of tiles, so the block's tiles are then written a thread each, each
 * finding its request among the block's first tiles (`slots`); a sharded request's tiles end where
 * its pages do, so its thread walks them. */
__device__ int32_t plan_tiles(const TilePlanArgs &a, Scan::TempStorage &scan_storage,
                              RequestSlots &slots, unsigned long long &total_pages,
                              int32_t &max_pages) {
    __shared__ int32_t tiles_before;
    if (threadIdx.x == 0) tiles_before = 0;
    __syncthreads();
    for (int32_t first = 0; first < a.batch_size; first += kPlanThreads) {
        const int32_t b = first + (int32_t)threadIdx.x;
        msaidx_cuda_request request = {0, 0, 0, 0};
        if (b < a.batch_size) request = a.requests[b];
        const int32_t first_pos = request.seq_len - request.q_len;
        const int32_t tile_tokens = MSAIDX_PERSISTENT_TILE_ROWS / a.num_heads; /* H: 1, 2 or 4 */
        int32_t count =
            (int32_t)(((int64_t)request.q_len * a.num_heads + MSAIDX_PERSISTENT_TILE_ROWS - 1) /
                      MSAIDX_PERSISTENT_TILE_ROWS);
        if (a.positions) {
            count = 0;
            for (int32_t i = 0; i < request.q_len;
                 i = sharded_tile_end(i, request.q_len, first_pos, tile_tokens))
                ++count;
        }
        int32_t offset, block_count;
        Scan(scan_storage).ExclusiveSum(count, offset, block_count);
        unsigned long long my_pages = 0;
        int32_t my_most_pages = 0;
        const int64_t block_end = min((int64_t)block_count, a.max_tiles - tiles_before);
        if (a.positions) {
            for (int32_t i = 0, token = 0; i < count && offset + i < block_end; ++i) {
                msaidx_persistent_tile tile;
                const int32_t end = sharded_tile_end(token, request.q_len, first_pos, tile_tokens);
                const int32_t t0 = request.token_begin + token, t1 = request.token_begin + end - 1;
                tile.row_begin = t0 * a.num_heads;
                tile.row_end = (t1 + 1) * a.num_heads;
                tile.pos_base = a.positions[t0] - t0;
                tile.num_pages = msaidx_cuda_pages_at(a.positions[t1]);
                tile.full_pages = (a.positions[t0] + 1) / kPageKeys;
                tile.bt_row = request.bt_row;
                tile.reserved[0] = tile.reserved[1] = 0;
                token = end;
                a.out.tiles[tiles_before + offset + i] = tile;
                my_pages += (unsigned long long)tile.num_pages;
                my_most_pages = max(my_most_pages, tile.num_pages);
            }
        } else {
            slots.first_tile[threadIdx.x] = offset;
            slots.request[threadIdx.x] = request;
            __syncthreads();
            const int32_t requests = min(kPlanThreads, a.batch_size - first);
            for (int32_t t = threadIdx.x; t < block_end; t += kPlanThreads) {
                /* the last request whose first tile is at or before t: the one that has t */
                int32_t lo = 0, hi = requests;
                while (hi - lo > 1) {
                    const int32_t mid = (lo + hi) / 2;
                    if (slots.first_tile[mid] <= t)
                        lo = mid;
                    else
                        hi = mid;
                }
                const msaidx_persistent_tile tile =
                    plain_tile(a, slots.request[lo], t - slots.first_tile[lo]);
                a.out.tiles[tiles_before + t] = tile;
                my_pages += (unsigned long long)tile.num_pages;
                my_most_pages = max(my_most_pages, tile.num_pages);
            }
        }
        /* a warp's sums first: a thousand atomics on one shared word take their turns */
#pragma unroll
        for (int lanes = 16; lanes > 0; lanes /= 2)
            my_pages += __shfl_xor_sync(0xffffffffu, my_pages, lanes);
        my_most_pages = __reduce_max_sync(0xffffffffu, my_most_pages);
        if (threadIdx.x % 32 == 0 && my_pages) {
            atomicAdd(&total_pages, my_pages);
            atomicMax(&max_pages, my_most_pages);
        }
        __syncthreads();
        if (threadIdx.x == 0) tiles_before += block_count;
        __syncthreads();
    }
    return (int32_t)min((int64_t)tiles_before, a.max_tiles);
}

/* Places every tile at its histogram slot (the first place of its page count), in request order
 * among tiles of equal count, so that the deal, and so its timing, repeats exactly: one warp at a
 * time, and within the warp one atomic per group of equal counts. */
__device__ void sort_tiles_stably(const TilePlanArgs &a, int32_t num_tiles) {
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    for (int32_t first = 0; first < num_tiles; first += kPlanThreads) {
        const int32_t t = first + (int32_t)threadIdx.x;
        const bool mine = t < num_tiles;
        msaidx_persistent_tile tile = {};
        if (mine) tile = a.out.tiles[t]; /* before the turns: every warp's load in flight at once */
        const int turns = (min(num_tiles - first, kPlanThreads) + 31) / 32; /* warps with tiles */
        for (int turn = 0; turn < turns; ++turn) {
            if (turn == warp) {
                const int32_t pages = mine ? tile.num_pages : -1;
                const unsigned peers = __match_any_sync(0xffffffffu, pages);
                const int leader = __ffs(peers) - 1;
                int32_t place = 0;
                if (lane == leader && mine)
                    place = atomicAdd(&a.out.histogram[pages], __popc(peers));
                place =
                    __shfl_sync(0xffffffffu, place, leader) + __popc(peers & ((1u << lane) - 1));
                if (mine) a.out.sorted_tiles[place] = tile;
            }
            __syncthreads();
        }
    }
    __syncthreads();
}

/* Tasks k < MSAIDX_PERSISTENT_RESOLVED_WAVES x num_sms: one thread per task locates it (a thread
 * takes increasing tasks, so its segment cursor only moves forward) and stages its pages in
 * shared memory; then each warp copies one task's first block-table entries at a time, kCopyBatch
 * rounds of loads issued before any store, so that the ~16,900 entries of 4 x 132 tasks cost a
 * few memory round trips rather than a load then a store per 1024 entries. The producer reads no
 * entry past a task's last page, nor any of a task that does not exist: those are not written. */
constexpr int kCopyBatch = 8;
__device__ void write_resolved_tasks(const TilePlanArgs &a, int32_t num_tasks, int32_t chunk_pages,
                                     int4 *staged) {
    const int32_t resolved = MSAIDX_PERSISTENT_RESOLVED_WAVES * a.num_sms;
    int32_t segment = 0;
    for (int32_t k = threadIdx.x; k < resolved; k += kPlanThreads) {
        msaidx_persistent_task task = {0, 0, 0, 0, 0, 0, 0, 0};
        if (k < num_tasks) {
            int32_t chunk_row, position;
            msaidx_persistent_locate(a.out.segments, &segment, k, &chunk_row, &position);
            const msaidx_persistent_tile tile = a.out.sorted_tiles[position];
            task = msaidx_persistent_task{tile.row_begin,
                                          tile.row_end,
                                          tile.pos_base,
                                          tile.full_pages,
                                          chunk_row * chunk_pages,
                                          min(tile.num_pages, (chunk_row + 1) * chunk_pages),
                                          tile.bt_row,
                                          chunk_row};
            staged[k] = make_int4(task.page_begin, task.page_end, task.bt_row, 0);
        }
        a.out.resolved_tasks[k].task = task;
    }
    __syncthreads();
    const int32_t entries = min(num_tasks, resolved) * MSAIDX_PERSISTENT_RESOLVED_PAGES;
    for (int32_t first = 0; first < entries; first += kCopyBatch * kPlanThreads) {
        int32_t physical[kCopyBatch];
        bool page_of_task[kCopyBatch];
#pragma unroll
        for (int j = 0; j < kCopyBatch; ++j) {
            const int32_t i = first + j * kPlanThreads + (int32_t)threadIdx.x;
            page_of_task[j] = false;
            if (i < entries) {
                const int4 task = staged[i / MSAIDX_PERSISTENT_RESOLVED_PAGES];
                const int32_t page = task.x + i % MSAIDX_PERSISTENT_RESOLVED_PAGES;
                page_of_task[j] = page < task.y;
                if (page_of_task[j])
                    physical[j] = __ldg(&a.block_table[(size_t)task.z * a.bt_stride + page]);
            }
        }
#pragma unroll
        for (int j = 0; j < kCopyBatch; ++j) {
            const int32_t i = first + j * kPlanThreads + (int32_t)threadIdx.x;
            if (page_of_task[j])
                a.out.resolved_tasks[i / MSAIDX_PERSISTENT_RESOLVED_PAGES]
                    .physical_pages[i % MSAIDX_PERSISTENT_RESOLVED_PAGES] = physical[j];
        }
    }
}

/* Turns a.out.histogram[0, max_pages] into "tiles with more than p pages" at p: the tiles counted
 * by page count, then summed from the longest down. */
__device__ void count_tiles_above(const TilePlanArgs &a, Scan::TempStorage &scan_storage,
                                  int32_t num_tiles, int32_t max_pages) {
    __shared__ int32_t longer; /* tiles with at least the block's first page count */
    for (int32_t p = threadIdx.x; p <= max_pages; p += kPlanThreads) a.out.histogram[p] = 0;
    if (threadIdx.x == 0) longer = num_tiles;
    __syncthreads();
    for (int32_t t = threadIdx.x; t < num_tiles; t += kPlanThreads)
        atomicAdd(&a.out.histogram[a.out.tiles[t].num_pages], 1);
    __syncthreads();
    /* kScanBlocks blocks of page counts loaded at once, then scanned one after the other: 1M keys
     * are 8 blocks, which would otherwise wait for their loads in turn */
    constexpr int kScanBlocks = 8;
    for (int32_t round = 0; round <= max_pages; round += kScanBlocks * kPlanThreads) {
        int32_t tiles[kScanBlocks];
#pragma unroll
        for (int j = 0; j < kScanBlocks; ++j) {
            const int32_t p = round + j * kPlanThreads + (int32_t)threadIdx.x;
            tiles[j] = p <= max_pages ? a.out.histogram[p] : 0;
        }
#pragma unroll
        for (int j = 0; j < kScanBlocks; ++j) {
            const int32_t first = round + j * kPlanThreads;
            if (first > max_pages) break; /* the same for every thread */
            const int32_t p = first + (int32_t)threadIdx.x;
            int32_t up_to_p, block_tiles;
            Scan(scan_storage).InclusiveSum(tiles[j], up_to_p, block_tiles);
            __syncthreads();
            if (p <= max_pages) a.out.histogram[p] = longer - up_to_p;
            __syncthreads();
            if (threadIdx.x == 0) longer -= block_tiles;
            __syncthreads();
        }
    }
}

/* Tiles with more than p pages (count_tiles_above), 0 past the longest tile. */
__device__ __forceinline__ int32_t tiles_above(const TilePlanArgs &a, int32_t p,
                                               int32_t max_pages) {
    return p < max_pages ? a.out.histogram[p] : 0;
}

/* The task count of every chunk choice (persistent_schedule.h): a tile has more than r chunks of c
 * pages when it has more than r * c pages, so chunks of c make sum over r of tiles_above(r * c)
 * tasks: max_pages * (1/2 + ... + 1/64) reads for c >= 2, where counting per tile would take 64
 * divisions a tile; chunks of one page make total_pages. The counts pass through shared memory
 * kCountWindow pages at a time, and each c >= 2 gets kThreadsPerChoice threads that take turns
 * over its multiples in the window (a single-CTA plan is latency-bound: no serial chain longer
 * than kCountWindow / (2 * kThreadsPerChoice) reads). */
constexpr int kCountWindow = 8192;
constexpr int kThreadsPerChoice = 16;
static_assert((MSAIDX_PERSISTENT_CHUNK_CHOICES - 1) * kThreadsPerChoice <= kPlanThreads,
              "a team of threads for every chunk choice above one page");
static_assert(kCountWindow % kPlanThreads == 0, "whole loads a thread per window");

/* Shared memory that the plan's phases use one after the other: plan_tiles' requests,
 * count_tasks' window of tile counts, then write_resolved_tasks' staged tasks (page_begin,
 * page_end, bt_row), which bound the SM count. */
constexpr int kMaxResolvedTasks = kCountWindow / 4;
union PlanScratch {
    RequestSlots slots;
    int32_t above[kCountWindow];
    int4 staged[kMaxResolvedTasks];
};
static_assert(sizeof(RequestSlots) <= sizeof(int32_t) * kCountWindow,
              "the requests fit the count window");

__device__ void count_tasks(const TilePlanArgs &a, int32_t max_pages, uint64_t total_pages,
                            uint64_t (&tasks)[MSAIDX_PERSISTENT_CHUNK_CHOICES], int32_t *above) {
    const int32_t team = (int32_t)threadIdx.x / kThreadsPerChoice,
                  member = (int32_t)threadIdx.x % kThreadsPerChoice;
    const int32_t chunk = team + 2; /* this thread's choice, if team < CHOICES - 1 */
    const bool counting = team < MSAIDX_PERSISTENT_CHUNK_CHOICES - 1;
    uint64_t count = 0;
    for (int32_t first = 0; first < max_pages; first += kCountWindow) {
#pragma unroll
        for (int i = 0; i < kCountWindow / kPlanThreads; ++i) {
            const int32_t slot = i * kPlanThreads + (int32_t)threadIdx.x;
            above[slot] = tiles_above(a, first + slot, max_pages);
        }
        __syncthreads();
        if (counting) {
            const int32_t window_end = min(kCountWindow, max_pages - first);
            /* the window's multiples of chunk, the team's members taking turns; eight reads in
             * flight at a time (a window holds fewer than 2^31 / 8 tiles above any count) */
            const int32_t stride = kThreadsPerChoice * chunk;
            int32_t p = (first + chunk - 1) / chunk * chunk - first + member * chunk;
            for (; p + 7 * stride < window_end; p += 8 * stride) {
                uint32_t eight = 0;
#pragma unroll
                for (int k = 0; k < 8; ++k) eight += (uint32_t)above[p + k * stride];
                count += eight;
            }
            for (; p < window_end; p += stride) count += (uint64_t)above[p];
        }
        __syncthreads();
    }
#pragma unroll
    for (int offset = kThreadsPerChoice / 2; offset > 0; offset /= 2)
        count += __shfl_xor_sync(0xffffffffu, count, offset);
    if (counting && member == 0) tasks[chunk - 1] = count;
    if (threadIdx.x == 0) tasks[0] = total_pages;
}

/* msaidx_persistent_chunk_pages in one warp: each lane keys two chunk choices, and the smallest
 * keys meet in shuffles, where one thread walking the choices is a chain of dependent reads. */
__device__ int32_t pick_chunk(const TilePlanArgs &a,
                              const uint64_t (&tasks)[MSAIDX_PERSISTENT_CHUNK_CHOICES],
                              uint64_t total_pages, int32_t num_tiles) {
    uint64_t best = UINT64_MAX, best_power = UINT64_MAX;
    for (int i = (int)threadIdx.x % 32; i < MSAIDX_PERSISTENT_CHUNK_CHOICES; i += 32) {
        const uint64_t key =
            msaidx_persistent_chunk_key(msaidx_persistent_chunk_cost(tasks[i], i, a.num_sms), i);
        best = min(best, key);
        if (msaidx_persistent_chunk_is_power(i)) best_power = min(best_power, key);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        best = min(best, __shfl_xor_sync(0xffffffffu, best, offset));
        best_power = min(best_power, __shfl_xor_sync(0xffffffffu, best_power, offset));
    }
    return msaidx_persistent_chunk_of_keys(best, best_power, total_pages, num_tiles);
}

/* The tile list, the chunk size, then the deal of persistent_schedule.h: the tiles above each page
 * count give the task count of every chunk choice, each chunk row's width (the tiles with more
 * than r chunks) and the segments (rows where the width changes), and each page count's first
 * place among the sorted tiles. */
__global__ void __launch_bounds__(kPlanThreads) plan_tiles_kernel(TilePlanArgs a) {
    __shared__ Scan::TempStorage scan_storage;
    __shared__ PlanScratch scratch;
    __shared__ uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES];
    __shared__ unsigned long long total_pages;
    __shared__ int32_t chunk_pages, max_chunks, max_pages;
    __shared__ int32_t tasks_before, segments_before; /* carried across row blocks */
    msaidx_wait_for_prior_grids();
    if (threadIdx.x == 0) {
        total_pages = 0;
        max_pages = 0;
    }
    __syncthreads();
    const int32_t num_tiles = plan_tiles(a, scan_storage, scratch.slots, total_pages, max_pages);
    __syncthreads();
    count_tiles_above(a, scan_storage, num_tiles, max_pages);
    count_tasks(a, max_pages, total_pages, tasks, scratch.above);
    __syncthreads();
    if (threadIdx.x < 32) {
        const int32_t chunk = pick_chunk(a, tasks, total_pages, num_tiles);
        if (threadIdx.x == 0) {
            chunk_pages = chunk;
            max_chunks = (max_pages + chunk - 1) / chunk;
            tasks_before = segments_before = 0;
        }
    }
    __syncthreads();

    for (int32_t first = 0; first < max_chunks; first += kPlanThreads) {
        const int32_t r = first + (int32_t)threadIdx.x;
        const bool row = r < max_chunks;
        /* tiles with more than r chunks */
        const int32_t width = row ? tiles_above(a, r * chunk_pages, max_pages) : 0;
        int32_t task_begin, block_tasks;
        Scan(scan_storage).ExclusiveSum(width, task_begin, block_tasks);
        __syncthreads();
        const int32_t starts_segment =
            row && (r == 0 || tiles_above(a, (r - 1) * chunk_pages, max_pages) != width);
        int32_t segment, block_segments;
        Scan(scan_storage).ExclusiveSum(starts_segment, segment, block_segments);
        if (starts_segment)
            a.out.segments[segments_before + segment] =
                msaidx_persistent_segment{tasks_before + task_begin, r, width, 0};
        __syncthreads();
        if (threadIdx.x == 0) {
            tasks_before += block_tasks;
            segments_before += block_segments;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        a.out.segments[segments_before] = msaidx_persistent_segment{tasks_before, max_chunks, 0, 0};
        a.out.counts->chunk_pages = chunk_pages;
        a.out.counts->num_tasks = tasks_before;
    }
    /* The tiles by page count, most first (the histogram holds each page count's first place): so
     * also by chunk count, as the segments want, and among tiles of equal chunk count the longest
     * first. */
    sort_tiles_stably(a, num_tiles);
    write_resolved_tasks(a, tasks_before, chunk_pages, scratch.staged);
}

} // namespace

msaidx_status msaidx_persistent_plan_tiles(const msaidx_plan *plan, cudaStream_t stream) {
    const msaidx_batch_desc *d = &plan->desc;
    /* A decode-only batch is scored by the decode scorer (persistent_scores routes it there):
     * it reads the request table alone, so the deal is not built. */
    if (msaidx_cuda_decode_only(d)) return MSAIDX_SUCCESS;
    if (MSAIDX_PERSISTENT_RESOLVED_WAVES * plan->context->num_sms > kMaxResolvedTasks)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: %d SMs exceed the plan's %d resolved tasks",
                           plan->context->num_sms, kMaxResolvedTasks);
    TilePlanArgs args;
    args.requests = msaidx_cuda_requests(plan->workspace, d);
    args.block_table = plan->block_table;
    args.positions = msaidx_cuda_positions(plan->workspace, d);
    args.bt_stride = d->bt_stride;
    args.out = msaidx_persistent_views_of(plan);
    args.max_tiles = msaidx_persistent_max_tiles(d, plan->context->config.num_heads);
    args.batch_size = d->batch_size;
    args.num_heads = plan->context->config.num_heads;
    args.num_sms = plan->context->num_sms;
    MSAIDX_CUDA_TRY(
        msaidx_launch_dependent(plan_tiles_kernel, dim3(1), dim3(kPlanThreads), 0, stream, args),
        "persistent plan_tiles_kernel launch");
    return MSAIDX_SUCCESS;
}
