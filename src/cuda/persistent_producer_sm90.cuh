/* The persistent scorer's producer: one warp that walks the CTA's tasks (the first ones resolved by
 * the plan, the later ones located here, persistent_schedule.h) and streams, per task, its Q tile
 * into a Q slot and its key pages through the block table into the ring, all with TMA (BF16: two
 * boxes of 64 dims each). One 3D
 * tensor map covers the whole cache (the page stride as its outer stride), so a page is one copy
 * whatever the cache's layout; both maps use the 128-byte swizzle that the wgmma descriptors read.
 */
#ifndef MSAIDX_PERSISTENT_PRODUCER_SM90_CUH
#define MSAIDX_PERSISTENT_PRODUCER_SM90_CUH

#include "persistent_kernel_sm90.cuh"
#include "persistent_widener_sm90.cuh"
#include "sm90_ptx.cuh"

namespace {

using namespace sm90;

/* The producer's walk over the CTA's tasks after those the plan resolved (blockIdx.x + k *
 * gridDim.x, k >= MSAIDX_PERSISTENT_RESOLVED_WAVES, persistent_schedule.h). Tasks are located 32 at
 * a time, one per lane (each lane with its own segment cursor), and handed out by shuffles, so that
 * the latency of the segment and tile reads is paid once per 32 tasks rather than in front of every
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
                msaidx_persistent_locate(args.segments, &segment, (int32_t)lane_index, &chunk_row,
                                         &position);
                const msaidx_persistent_tile tile = args.tiles[position];
                mine.row_begin = tile.row_begin;
                mine.row_end = tile.row_end;
                mine.pos_base = tile.pos_base;
                mine.full_pages = tile.full_pages;
                mine.bt_row = tile.bt_row;
                mine.page_begin = chunk_row * (int32_t)chunk_pages;
                mine.page_end = min(tile.num_pages, mine.page_begin + (int32_t)chunk_pages);
                mine.chunk_row = chunk_row;
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
        task.chunk_row = __shfl_sync(0xffffffffu, mine.chunk_row, source);
        index += gridDim.x;
        return true;
    }
};

/* values[wave] by selects, not an indexed load: the array stays in registers. */
__device__ __forceinline__ int32_t
resolved_word(const int32_t (&values)[MSAIDX_PERSISTENT_RESOLVED_WAVES], int wave) {
    int32_t value = values[0];
#pragma unroll
    for (int k = 1; k < MSAIDX_PERSISTENT_RESOLVED_WAVES; ++k)
        value = wave == k ? values[k] : value;
    return value;
}

/* Lane i: block-table entry `first + i` of the task (0 past its pages), one coalesced read. */
__device__ __forceinline__ int32_t load_block_table(const ScoreArgs &args, const Task &task,
                                                    int32_t first) {
    const int lane = threadIdx.x & 31;
    const int32_t *bt_row = args.block_table + (size_t)task.bt_row * args.bt_stride;
    return first + lane < task.page_end ? __ldg(bt_row + first + lane) : 0;
}

/* The producer warpgroup's side of the kernel. Its Q tile and task are written before the arrive
 * that the Q tile's bytes complete, so the consumers' wait on q_full acquires both. */
template <KeyPath kPath>
__device__ __forceinline__ void run_producer(const SharedState &smem, const void *q_map,
                                             const void *k_map, const ScoreArgs &args, int lane) {
    using L = Layout<kPath>;
    release_registers<kProducerRegisters>();
    /* One warp issues; on the exact path the next two widen (persistent_widener_sm90.cuh); the
     * rest only gave registers away. */
    if (threadIdx.x >= 32) {
        if constexpr (kPath == KeyPath::kE4m3Exact)
            if (threadIdx.x < 32 + kWidenerThreads)
                run_wideners<L::kStages, L::kWideStages>(smem, args);
        return;
    }
    if (lane == 0) {
        prefetch_tensor_map(q_map);
        prefetch_tensor_map(k_map);
    }
    /* The CTA's first tasks come resolved by the plan, all read at once: lane i holds page i and
     * word i of each. */
    static_assert(MSAIDX_PERSISTENT_RESOLVED_PAGES == 32, "one resolved page per lane");
    int32_t resolved_pages[MSAIDX_PERSISTENT_RESOLVED_WAVES];
    int32_t resolved_words[MSAIDX_PERSISTENT_RESOLVED_WAVES];
#pragma unroll
    for (int wave = 0; wave < MSAIDX_PERSISTENT_RESOLVED_WAVES; ++wave) {
        const int32_t *record =
            (const int32_t *)&args.resolved_tasks[blockIdx.x + wave * gridDim.x];
        resolved_pages[wave] = __ldg(record + lane);
        resolved_words[wave] =
            lane < 8 ? __ldg(record + MSAIDX_PERSISTENT_RESOLVED_PAGES + lane) : 0;
    }
    RingPosition<L::kStages> ring;
    RingPosition<kQSlots> q_ring;
    /* Q tile and task to the next Q slot, then the task's pages to the ring; lane i of
     * physical_pages holds the physical page of task.page_begin + i. */
    auto issue = [&](const Task &task, int32_t physical_pages) {
        if (lane == 0) {
            mbarrier_wait(&smem.q_empty[q_ring.slot], q_ring.phase ^ 1);
            smem.q_tasks[q_ring.slot] = task;
            mbarrier_expect_bytes(&smem.q_full[q_ring.slot], L::kQSlotBytes);
#pragma unroll
            for (int box = 0; box < L::kBoxes; ++box)
                tma_load_2d(smem.q_tiles + q_ring.slot * L::kQSlotBytes + box * kQTileBytes, q_map,
                            &smem.q_full[q_ring.slot], box * kHeadBytes, task.row_begin);
        }
        q_ring.advance();
#pragma unroll 1
        for (int32_t first_page = task.page_begin; first_page < task.page_end; first_page += 32) {
            if (first_page != task.page_begin)
                physical_pages = load_block_table(args, task, first_page);
            const int count = min(32, task.page_end - first_page);
#pragma unroll 1
            for (int i = 0; i < count; ++i) {
                const int32_t physical = __shfl_sync(0xffffffffu, physical_pages, i);
                if (lane == 0) {
                    mbarrier_wait(&smem.page_empty[ring.slot], ring.phase ^ 1);
                    mbarrier_expect_bytes(&smem.page_full[ring.slot], L::kStageBytes);
#pragma unroll
                    for (int box = 0; box < L::kBoxes; ++box)
                        tma_load_3d(smem.pages + ring.slot * L::kStageBytes + box * kPageBytes,
                                    k_map, &smem.page_full[ring.slot], box * kHeadBytes, 0,
                                    physical);
                }
                ring.advance();
            }
        }
    };
    /* The CTA's tasks in order, the resolved ones first, through one loop and one copy of `issue`:
     * unrolling the resolved tasks would double the kernel's code. */
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
            task.chunk_row = __shfl_sync(0xffffffffu, words, 7);
            if (task.page_begin >= task.page_end) continue; /* the CTA has fewer tasks */
            physical_pages = resolved_word(resolved_pages, nth);
        } else if (cursor.next(task)) {
            physical_pages = load_block_table(args, task, task.page_begin);
        } else {
            break;
        }
        issue(task, physical_pages);
    }
}

} // namespace

#endif
