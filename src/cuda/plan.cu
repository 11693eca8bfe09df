/* The device plan shared by the CUDA backends: metadata validation, nvp, the request table and
 * the tile list; plus split's page chunking. Grids depend only on the batch description. */
#include "cuda_internal.cuh"

#include <cub/block/block_scan.cuh>

#include <climits>

namespace {

constexpr int kRequestThreads = 256;
constexpr int kPageChecks = 8;
constexpr int kListThreads = 1024;

struct PlanArgs {
    const int32_t *cu;
    const int32_t *seq_lens;
    const int32_t *block_table;
    uint32_t *error_word;
    int32_t *nvp;
    int32_t *positions, *request_pages; /* context parallel, else NULL (cuda_internal.cuh) */
    msaidx_page_shard shard;
    msaidx_cuda_request *requests;
    msaidx_cuda_plan_counts *counts;
    msaidx_cuda_work *tiles;
    int64_t max_tiles;
    int32_t batch_size, num_tokens, max_q_len, max_seq_len, num_pages, bt_stride, pitch;
    int32_t page_size, num_heads;
};

__device__ int32_t block_max(int32_t value, int32_t *scratch) {
    value = __reduce_max_sync(0xffffffffu, value);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    if (warp == 0) {
        value = lane < (int)(blockDim.x / 32) ? scratch[lane] : INT_MIN;
        value = __reduce_max_sync(0xffffffffu, value);
        if (lane == 0) scratch[0] = value;
    }
    __syncthreads();
    return scratch[0];
}

/* CTA b checks request b. Its token range must start at or past every earlier cu entry, so that
 * the ranges of the accepted requests never overlap, whatever the bad entries hold. */
__global__ void __launch_bounds__(kRequestThreads) plan_requests_kernel(PlanArgs a) {
    __shared__ int32_t scratch[32];
    msaidx_wait_for_prior_grids();
    const int32_t b = blockIdx.x;
    int32_t earlier_max = INT_MIN;
    for (int32_t i = threadIdx.x; i <= b; i += blockDim.x) earlier_max = max(earlier_max, a.cu[i]);
    earlier_max = block_max(earlier_max, scratch);

    const int32_t begin = a.cu[b], end = a.cu[b + 1], seq_len = a.seq_lens[b];
    const int64_t q_len = (int64_t)end - begin;
    uint32_t bits = 0;
    if (a.cu[0] != 0 || begin < earlier_max || q_len < 0)
        bits |= MSAIDX_BAD_CU_SEQLENS;
    else if (end > a.num_tokens || q_len > a.max_q_len)
        bits |= MSAIDX_BAD_TOKEN_COUNT;
    if (seq_len < 0 || q_len > seq_len || seq_len > a.max_seq_len) bits |= MSAIDX_BAD_SEQ_LEN;
    const int32_t request_pages = msaidx_request_pages(max(seq_len, 0), a.page_size);
    /* The block-table row lists the rank's pages only (all of them without sharding). */
    const int64_t pages = msaidx_shard_count(a.shard, request_pages, request_pages);
    if (pages > a.pitch || pages > a.bt_stride) bits |= MSAIDX_BAD_NVP;
    if (!bits && q_len > 0) {
        /* kPageChecks loads in flight a thread: a 1M-token row is 32 rounds of 256 entries */
        const int32_t *row = a.block_table + (size_t)b * a.bt_stride;
        bool bad_page = false;
        for (int64_t first = threadIdx.x; first < pages;
             first += (int64_t)kPageChecks * kRequestThreads) {
            int32_t page[kPageChecks];
#pragma unroll
            for (int j = 0; j < kPageChecks; ++j) {
                const int64_t p = first + (int64_t)j * kRequestThreads;
                page[j] = p < pages ? row[p] : 0;
            }
#pragma unroll
            for (int j = 0; j < kPageChecks; ++j) bad_page |= page[j] < 0 || page[j] >= a.num_pages;
        }
        if (__syncthreads_or(bad_page)) bits |= MSAIDX_BAD_PAGE_ID;
    }
    const bool accepted = !bits;
    if (threadIdx.x == 0) {
        if (bits) atomicOr(a.error_word, bits);
        a.requests[b] = msaidx_cuda_request{begin, accepted ? (int32_t)q_len : 0, seq_len, b};
    }
    if (!accepted) return;
    const int32_t first_pos = seq_len - (int32_t)q_len;
    if (!a.positions) {
        for (int32_t i = threadIdx.x; i < q_len; i += blockDim.x)
            a.nvp[begin + i] = (first_pos + i) / a.page_size + 1;
        return;
    }
    for (int32_t i = threadIdx.x; i < q_len; i += blockDim.x) {
        const int32_t pos = first_pos + i, page = pos / a.page_size;
        const int32_t below = msaidx_shard_count(a.shard, request_pages, page);
        const bool owned = msaidx_shard_local(a.shard, request_pages, page) >= 0;
        a.positions[begin + i] = below * a.page_size + (owned ? pos % a.page_size : -1);
        a.request_pages[begin + i] = request_pages;
        a.nvp[begin + i] = below + owned;
    }
}

using ListScan = cub::BlockScan<int32_t, kListThreads>;

/* The tile list, in request order: one item per MSAIDX_CUDA_TILE_ROWS rows of a request, with its
 * whole causal page range. Requests are taken kListThreads at a time; their tiles are written by
 * all threads, each finding its request by binary search in the chunk's tile offsets. */
__global__ void __launch_bounds__(kListThreads) plan_tiles_kernel(PlanArgs a) {
    __shared__ typename ListScan::TempStorage scan_storage;
    __shared__ int32_t tile_offset[kListThreads + 1];
    __shared__ int32_t carry;
    msaidx_wait_for_prior_grids();
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int32_t base = 0; base < a.batch_size; base += kListThreads) {
        const int32_t b = base + threadIdx.x;
        int32_t tiles = 0;
        if (b < a.batch_size)
            tiles = (a.requests[b].q_len * a.num_heads + MSAIDX_CUDA_TILE_ROWS - 1) /
                    MSAIDX_CUDA_TILE_ROWS;
        int32_t offset, chunk_total;
        ListScan(scan_storage).ExclusiveSum(tiles, offset, chunk_total);
        tile_offset[threadIdx.x] = offset;
        if (threadIdx.x == 0) tile_offset[kListThreads] = chunk_total;
        __syncthreads();
        for (int32_t j = threadIdx.x; j < chunk_total; j += kListThreads) {
            int32_t lo = 0, hi = kListThreads - 1; /* last request whose offset <= j */
            while (lo < hi) {
                const int32_t mid = (lo + hi + 1) / 2;
                if (tile_offset[mid] <= j)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const int64_t index = (int64_t)carry + j;
            if (index >= a.max_tiles) continue;
            const msaidx_cuda_request r = a.requests[base + lo];
            const int32_t rows = r.q_len * a.num_heads;
            const int32_t row_begin = (j - tile_offset[lo]) * MSAIDX_CUDA_TILE_ROWS;
            const int32_t last_token =
                (min(row_begin + MSAIDX_CUDA_TILE_ROWS, rows) - 1) / a.num_heads;
            /* The pages its last row sees (plan_requests_kernel wrote them; local ones when
             * sharded). */
            a.tiles[index] =
                msaidx_cuda_work{base + lo, row_begin, 0, a.nvp[r.token_begin + last_token]};
        }
        __syncthreads();
        if (threadIdx.x == 0) carry += chunk_total;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const int32_t total = (int32_t)min((int64_t)carry, a.max_tiles);
        *a.counts = msaidx_cuda_plan_counts{total, total, 0, 0};
    }
}

/* split: one chunk size for the whole batch, so that the items number about `target`; tiles
 * shorter than a chunk stay whole. Items keep tile order; chunks of a tile are consecutive. */
__global__ void __launch_bounds__(kListThreads)
    plan_split_kernel(msaidx_cuda_plan_counts *counts, const msaidx_cuda_work *tiles,
                      msaidx_cuda_work *items, int64_t max_tiles, int64_t max_items,
                      int32_t target) {
    __shared__ typename ListScan::TempStorage scan_storage;
    __shared__ int32_t carry;
    msaidx_wait_for_prior_grids();
    const int32_t num_tiles = (int32_t)min((int64_t)max(counts->num_tiles, 0), max_tiles);
    int64_t pages = 0;
    for (int32_t j = threadIdx.x; j < num_tiles; j += kListThreads)
        pages += tiles[j].page_end - tiles[j].page_begin;
    for (int offset = 16; offset > 0; offset /= 2)
        pages += __shfl_xor_sync(0xffffffffu, pages, offset);
    __shared__ int64_t warp_pages[kListThreads / 32];
    if (threadIdx.x % 32 == 0) warp_pages[threadIdx.x / 32] = pages;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    int64_t total_pages = 0;
    for (int w = 0; w < kListThreads / 32; ++w) total_pages += warp_pages[w];
    const int64_t chunk64 =
        max((total_pages + target - 1) / target, (int64_t)MSAIDX_CUDA_SPLIT_MIN_PAGES);
    const int32_t chunk = (int32_t)min(chunk64, (int64_t)INT_MAX);
    for (int32_t base = 0; base < num_tiles; base += kListThreads) {
        const int32_t j = base + threadIdx.x;
        msaidx_cuda_work tile{0, 0, 0, 0};
        int32_t pieces = 0;
        if (j < num_tiles) {
            tile = tiles[j];
            const int64_t tile_pages = max((int64_t)tile.page_end - tile.page_begin, (int64_t)0);
            pieces = (int32_t)((tile_pages + chunk - 1) / chunk);
        }
        int32_t offset, chunk_total;
        ListScan(scan_storage).ExclusiveSum(pieces, offset, chunk_total);
        for (int32_t k = 0; k < pieces; ++k) {
            const int64_t index = (int64_t)carry + offset + k;
            if (index >= max_items) break;
            const int64_t page_begin = tile.page_begin + (int64_t)k * chunk;
            items[index] =
                msaidx_cuda_work{tile.request, tile.row_begin, (int32_t)page_begin,
                                 (int32_t)min(page_begin + chunk, (int64_t)tile.page_end)};
        }
        __syncthreads();
        if (threadIdx.x == 0) carry += chunk_total;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        counts->num_items = (int32_t)min((int64_t)carry, max_items);
        counts->chunk_pages = chunk;
    }
}

} // namespace

msaidx_status msaidx_cuda_plan_requests(const msaidx_plan *plan, bool tile_list,
                                        cudaStream_t stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const msaidx_config *c = &plan->context->config;
    if ((int64_t)d->num_tokens * c->num_heads > INT32_MAX - MSAIDX_CUDA_TILE_ROWS)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: desc.num_tokens = %d times %d heads exceeds the 2^31 - %d "
                           "query rows the CUDA kernels count",
                           plan->context->ops->name, d->num_tokens, c->num_heads,
                           MSAIDX_CUDA_TILE_ROWS);
    void *ws = plan->workspace;
    MSAIDX_CUDA_TRY(cudaMemsetAsync(ws, 0, msaidx_workspace_common_bytes(d->num_tokens), stream),
                    "cudaMemsetAsync(workspace header and nvp)");
    PlanArgs a;
    a.cu = plan->cu_seqlens_q;
    a.seq_lens = plan->seq_lens;
    a.block_table = plan->block_table;
    a.error_word = &msaidx_cuda_header(ws)->error_word;
    a.nvp = msaidx_cuda_nvp(ws);
    a.positions = msaidx_cuda_positions(ws, d);
    a.request_pages = msaidx_cuda_request_pages(ws, d);
    a.shard = msaidx_shard_of(d);
    a.requests = msaidx_cuda_requests(ws, d);
    a.counts = msaidx_cuda_counts(ws, d);
    a.tiles = msaidx_cuda_tiles(ws, d);
    a.max_tiles = msaidx_cuda_max_tiles(d, c->num_heads);
    a.batch_size = d->batch_size;
    a.num_tokens = d->num_tokens;
    a.max_q_len = d->max_q_len;
    a.max_seq_len = d->max_seq_len;
    a.num_pages = d->num_pages;
    a.bt_stride = d->bt_stride;
    a.pitch = d->pitch;
    a.page_size = c->page_size;
    a.num_heads = c->num_heads;
    if (d->batch_size > 0) {
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(plan_requests_kernel, dim3(d->batch_size),
                                                dim3(kRequestThreads), 0, stream, a),
                        "plan_requests_kernel launch");
    }
    if (tile_list)
        MSAIDX_CUDA_TRY(
            msaidx_launch_dependent(plan_tiles_kernel, dim3(1), dim3(kListThreads), 0, stream, a),
            "plan_tiles_kernel launch");
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_plan_split(const msaidx_plan *plan, cudaStream_t stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t target = MSAIDX_CUDA_SPLIT_ITEMS_PER_SM * plan->context->num_sms;
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(
                        plan_split_kernel, dim3(1), dim3(kListThreads), 0, stream,
                        msaidx_cuda_counts(plan->workspace, d),
                        msaidx_cuda_tiles(plan->workspace, d), msaidx_cuda_split_items(plan),
                        msaidx_cuda_max_tiles(d, plan->context->config.num_heads),
                        msaidx_cuda_split_max_items(plan), target > 0 ? target : 1),
                    "plan_split_kernel launch");
    return MSAIDX_SUCCESS;
}
