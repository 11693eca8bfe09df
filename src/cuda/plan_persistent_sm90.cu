/* The persistent backend's device plan: request table -> row tiles and page-chunk size. */
#include "persistent_sm90.cuh"

#include <cub/block/block_scan.cuh>

namespace {

constexpr int kPlanThreads = 1024;
constexpr int kPageKeys = 128;

struct TilePlanArgs {
    const msaidx_cuda_request *requests;
    msaidx_persistent_counts *counts;
    msaidx_persistent_tile *tiles;
    int64_t max_tiles;
    int32_t batch_size, num_heads, num_sms;
};

/* Requests are taken kPlanThreads at a time; a scan places each request's tiles after those of
 * the requests before it. Skipped requests (q_len = 0) add none. */
__global__ void __launch_bounds__(kPlanThreads) plan_tiles_kernel(TilePlanArgs a) {
    using Scan = cub::BlockScan<int32_t, kPlanThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int32_t tiles_before;
    __shared__ unsigned long long total_pages;
    __shared__ int32_t longest;
    if (threadIdx.x == 0) {
        tiles_before = 0;
        total_pages = 0;
        longest = 0;
    }
    __syncthreads();
    for (int32_t first = 0; first < a.batch_size; first += kPlanThreads) {
        const int32_t b = first + (int32_t)threadIdx.x;
        msaidx_cuda_request request = {0, 0, 0, 0};
        if (b < a.batch_size) request = a.requests[b];
        const int64_t rows = (int64_t)request.q_len * a.num_heads;
        const int32_t count = (int32_t)((rows + MSAIDX_PERSISTENT_TILE_ROWS - 1) /
                                        MSAIDX_PERSISTENT_TILE_ROWS);
        int32_t offset, block_count;
        Scan(scan_storage).ExclusiveSum(count, offset, block_count);
        offset += tiles_before;
        unsigned long long my_pages = 0;
        int32_t my_longest = 0;
        const int64_t request_row0 = (int64_t)request.token_begin * a.num_heads;
        for (int32_t i = 0; i < count && offset + i < a.max_tiles; ++i) {
            msaidx_persistent_tile tile;
            tile.row_begin = (int32_t)(request_row0 + (int64_t)i * MSAIDX_PERSISTENT_TILE_ROWS);
            tile.row_end = (int32_t)min(request_row0 + rows,
                                        (int64_t)tile.row_begin + MSAIDX_PERSISTENT_TILE_ROWS);
            tile.pos_base = request.seq_len - request.q_len - request.token_begin;
            const int32_t first_pos = tile.pos_base + tile.row_begin / a.num_heads;
            const int32_t last_pos = tile.pos_base + (tile.row_end - 1) / a.num_heads;
            tile.num_pages = last_pos / kPageKeys + 1;
            tile.full_pages = (first_pos + 1) / kPageKeys;
            tile.bt_row = request.bt_row;
            tile.reserved[0] = tile.reserved[1] = 0;
            a.tiles[offset + i] = tile;
            my_pages += (unsigned long long)tile.num_pages;
            my_longest = max(my_longest, tile.num_pages);
        }
        if (my_pages) atomicAdd(&total_pages, my_pages);
        if (my_longest) atomicMax(&longest, my_longest);
        __syncthreads();
        if (threadIdx.x == 0) tiles_before += block_count;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const int64_t num_tiles = min((int64_t)tiles_before, a.max_tiles);
        const int32_t chunk_pages =
            msaidx_persistent_chunk_pages(total_pages, num_tiles, longest, a.num_sms);
        a.counts->num_tiles = (int32_t)num_tiles;
        a.counts->chunk_pages = chunk_pages;
        a.counts->max_chunks = (longest + chunk_pages - 1) / chunk_pages;
        a.counts->reserved = 0;
    }
}

}  // namespace

msaidx_status msaidx_persistent_plan_tiles(const msaidx_plan *plan, cudaStream_t stream) {
    const msaidx_batch_desc *d = &plan->desc;
    TilePlanArgs args;
    args.requests = msaidx_cuda_requests(plan->workspace, d);
    args.counts = msaidx_persistent_counts_of(plan);
    args.tiles = msaidx_persistent_tiles_of(plan);
    args.max_tiles = msaidx_persistent_max_tiles(d, plan->context->config.num_heads);
    args.batch_size = d->batch_size;
    args.num_heads = plan->context->config.num_heads;
    args.num_sms = plan->context->num_sms;
    plan_tiles_kernel<<<1, kPlanThreads, 0, stream>>>(args);
    MSAIDX_CUDA_CHECK_LAUNCH("persistent plan_tiles_kernel");
    return MSAIDX_SUCCESS;
}
