/* The tensor-core scorer of the dense and split backends (decode rows go to score_decode.cu).
 *
 * One CTA (4 warps, 2 x 2 over rows x keys) takes one work item: a tile of 64 query rows of one
 * request and a range of its logical pages. The Q tile is loaded once into registers as mma A
 * fragments; key pages stream through a 3-stage cp.async ring in shared memory (16-byte chunks
 * XOR-swizzled by row so that ldmatrix is conflict free). Keys are the mma N dimension
 * (m16n8k16, FP32 accumulation): BF16 directly; E4M3 converted to F16 in registers (exact:
 * every E4M3 value is an F16 value), Q once per item and each key fragment once per 32 rows.
 * On sm_90 the E4M3 mma.sync is itself lowered to F16 HMMA plus conversions, so converting
 * ourselves only removes repeated conversions of the Q fragments. Each 8-key block's dot
 * products are reduced to a running row max in registers, then across the 4 lanes that share a
 * row by shuffles, then across warps through a small double-buffered shared array that is
 * flushed one page later, so one barrier per page suffices. A cell's arithmetic depends only on
 * its row and page, never on the item that holds it, so any split of the page range gives
 * bitwise identical scores.
 */
#include "cuda_internal.cuh"
#include "device_tiles.cuh"

#include <climits>
#include <cmath>

namespace {

constexpr int kThreads = 128;
constexpr int kTileRows = MSAIDX_CUDA_TILE_ROWS;
constexpr int kStages = MSAIDX_DENSE_STAGES;

template <bool kBf16>
struct Layout {
    static constexpr int kRowBytes = kBf16 ? 2 * kHeadDim : kHeadDim; /* one key or query row */
    static constexpr int kChunks = kRowBytes / 16;                    /* 16-byte chunks per row */
    static constexpr int kLoads = kRowBytes / 32;   /* 32-byte ldmatrix column steps */
    static constexpr int kMmaSteps = kHeadDim / 16; /* m16n8k16 steps over D */
    static constexpr int kWarpsN = 2;               /* warps across the page's keys */
    static constexpr int kWarpsM = 2;               /* warps across the tile's rows */
    static constexpr int kWarpRows = kTileRows / kWarpsM;
    static constexpr int kMTiles = kWarpRows / 16;
    static constexpr int kWarpKeys = kPageKeys / kWarpsN;
    static constexpr int kNTiles = kWarpKeys / 8;
    static constexpr int kPageBytes = kPageKeys * kRowBytes;
    static constexpr int kQBytes = kTileRows * kRowBytes;
    static constexpr int kReduceBytes = 2 * kWarpsN * kTileRows * (int)sizeof(float);
    static constexpr int kSmemBytes = kQBytes + kStages * kPageBytes + kReduceBytes;
};

struct ScoreArgs {
    const uint8_t *q;
    const uint8_t *k_cache;
    float *scores;
    const int32_t *block_table;
    const msaidx_cuda_request *requests;
    const msaidx_cuda_work *items;
    const int32_t *count;
    const int32_t *positions; /* context parallel: local positions per token, else NULL */
    int64_t max_items;
    int32_t batch_size, num_tokens, num_heads, bt_stride, num_pages, pitch;
    int64_t page_stride;
};

__device__ __forceinline__ void cp_async16(uint32_t smem, const void *gmem, bool valid) {
    const int src_bytes = valid ? 16 : 0; /* 0: fill with zeros, read nothing */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem));
}

/*
 * A 32-byte column step of E4M3 fragments as loaded by ldmatrix holds bytes 4q..4q+3 (and
 * 16+4q..) of a row in each register. Split into two m16n8k16 F16 steps with the same
 * permutation of the reduction index for A and B: step one takes bytes 4q..4q+3, step two
 * 16+4q..16+4q+3.
 */
__device__ __forceinline__ void e4m3_a_step(const uint32_t (&r)[4], uint32_t (&first)[4],
                                            uint32_t (&second)[4]) {
    first[0] = e4m3x2_to_f16x2((uint16_t)r[0]);
    first[1] = e4m3x2_to_f16x2((uint16_t)r[1]);
    first[2] = e4m3x2_to_f16x2((uint16_t)(r[0] >> 16));
    first[3] = e4m3x2_to_f16x2((uint16_t)(r[1] >> 16));
    second[0] = e4m3x2_to_f16x2((uint16_t)r[2]);
    second[1] = e4m3x2_to_f16x2((uint16_t)r[3]);
    second[2] = e4m3x2_to_f16x2((uint16_t)(r[2] >> 16));
    second[3] = e4m3x2_to_f16x2((uint16_t)(r[3] >> 16));
}

template <bool kBf16>
__global__ void __launch_bounds__(kThreads) score_kernel(const ScoreArgs a) {
    using L = Layout<kBf16>;
    extern __shared__ __align__(128) uint8_t smem[];
    msaidx_wait_for_prior_grids();

    /* The item, every index clamped: a corrupt workspace must not send us out of bounds. */
    const int64_t index = blockIdx.x;
    if (index >= min((int64_t)max(*a.count, 0), a.max_items)) return;
    const msaidx_cuda_work item = a.items[index];
    int64_t page_begin = item.page_begin, page_end = item.page_end;
    if (item.request < 0 || item.request >= a.batch_size) return;
    const msaidx_cuda_request req = a.requests[item.request];
    if (req.q_len <= 0 || req.token_begin < 0 ||
        (int64_t)req.token_begin + req.q_len > a.num_tokens || req.bt_row < 0 ||
        req.bt_row >= a.batch_size)
        return;
    const int32_t rows = req.q_len * a.num_heads;
    if (item.row_begin < 0 || item.row_begin >= rows) return;
    const int32_t tile_rows = min(kTileRows, rows - item.row_begin);
    page_begin = max(page_begin, (int64_t)0);
    page_end = min(page_end, (int64_t)min(a.bt_stride, a.pitch));
    if (page_begin >= page_end) return;
    const int32_t first_page = (int32_t)page_begin;
    const int32_t num_item_pages = (int32_t)(page_end - page_begin);

    const int64_t q_row0 = (int64_t)req.token_begin * a.num_heads + item.row_begin;
    const int32_t first_pos = req.seq_len - req.q_len; /* position of the request's token 0 */
    /* Query position of the request's row `row` (a row past the request: its last token's). */
    auto position = [&](int32_t row) -> int32_t {
        if (!a.positions) return first_pos + row / a.num_heads;
        return a.positions[req.token_begin + min(row / a.num_heads, req.q_len - 1)];
    };
    const int32_t tile_min_pos = position(item.row_begin);
    const int32_t *pages = a.block_table + (size_t)req.bt_row * a.bt_stride;

    const uint32_t smem_q = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t smem_k = smem_q + L::kQBytes;
    float *reduce = reinterpret_cast<float *>(smem + L::kQBytes + kStages * L::kPageBytes);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / L::kWarpsN, warp_n = warp % L::kWarpsN;
    const int group = lane / 4, quad = lane % 4;

    for (int i = tid; i < kTileRows * L::kChunks; i += kThreads) {
        const int r = i / L::kChunks, chunk = i % L::kChunks;
        const bool valid = r < tile_rows;
        const uint8_t *src = a.q + (q_row0 + (valid ? r : 0)) * L::kRowBytes + chunk * 16;
        cp_async16(smem_q + swizzled_chunk<L::kRowBytes>(r, chunk), src, valid);
    }
    cp_async_commit();

    auto load_page = [&](int stage, int32_t logical) {
        const int32_t physical = min(max(pages[logical], 0), a.num_pages - 1);
        const uint8_t *src = a.k_cache + (int64_t)physical * a.page_stride;
        const uint32_t dst = smem_k + stage * L::kPageBytes;
        for (int i = tid; i < kPageKeys * L::kChunks; i += kThreads) {
            const int key = i / L::kChunks, chunk = i % L::kChunks;
            cp_async16(dst + swizzled_chunk<L::kRowBytes>(key, chunk),
                       src + key * L::kRowBytes + chunk * 16, true);
        }
    };
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_item_pages) load_page(s, first_page + s);
        cp_async_commit();
    }

    /* Q fragments for the whole item. */
    cp_async_wait<kStages - 1>();
    __syncthreads();
    uint32_t qa[L::kMTiles][L::kMmaSteps][4];
#pragma unroll
    for (int mt = 0; mt < L::kMTiles; ++mt)
#pragma unroll
        for (int s = 0; s < L::kLoads; ++s) {
            const int row = warp_m * L::kWarpRows + mt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
            uint32_t r[4];
            ldmatrix_x4(r, smem_q + swizzled_chunk<L::kRowBytes>(row, 2 * s + (lane >> 4)));
            if constexpr (kBf16) {
#pragma unroll
                for (int j = 0; j < 4; ++j) qa[mt][s][j] = r[j];
            } else {
                e4m3_a_step(r, qa[mt][2 * s], qa[mt][2 * s + 1]);
            }
        }
    int32_t pos[L::kMTiles][2]; /* query position of this thread's accumulator rows */
#pragma unroll
    for (int mt = 0; mt < L::kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = warp_m * L::kWarpRows + mt * 16 + group + 8 * half;
            pos[mt][half] = position(item.row_begin + r);
        }

    /* Threads 0..63 own one tile row each when writing scores. */
    const bool writer = tid < tile_rows;
    const int32_t writer_nvp = msaidx_cuda_pages_at(position(item.row_begin + tid));
    float *writer_scores = a.scores + (q_row0 + (writer ? tid : 0)) * a.pitch;
    auto flush = [&](int32_t page, int buffer) {
        if (!writer || page >= writer_nvp) return;
        const float *partial = reduce + buffer * L::kWarpsN * kTileRows;
        float best = partial[tid];
#pragma unroll
        for (int w = 1; w < L::kWarpsN; ++w) best = fmaxf(best, partial[w * kTileRows + tid]);
        writer_scores[page] = best;
    };

    for (int32_t i = 0; i < num_item_pages; ++i) {
        cp_async_wait<kStages - 2>();
        __syncthreads(); /* page i landed for all; stage (i-1)%S and reduce[(i-1)&1] are final */
        if (i > 0) flush(first_page + i - 1, (i - 1) & 1);
        if (i + kStages - 1 < num_item_pages)
            load_page((i + kStages - 1) % kStages, first_page + i + kStages - 1);
        cp_async_commit();

        const int32_t page = first_page + i;
        const uint32_t stage_k = smem_k + (i % kStages) * L::kPageBytes;
        const bool masked = (int64_t)(page + 1) * kPageKeys - 1 > tile_min_pos;
        float row_max[L::kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < L::kMTiles; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;
        /* One 8-key block at a time keeps the register count down; the next block's fragments
         * are loaded before this one's mma so ldmatrix latency hides behind them. */
        auto load_block = [&](uint32_t(&kb)[L::kMmaSteps][2], int nt) {
            const int key0 = warp_n * L::kWarpKeys + nt * 8;
#pragma unroll
            for (int s2 = 0; s2 < L::kLoads / 2; ++s2) {
                uint32_t r[4];
                ldmatrix_x4(r, stage_k + swizzled_chunk<L::kRowBytes>(key0 + (lane & 7),
                                                                      4 * s2 + (lane >> 3)));
                if constexpr (kBf16) {
                    kb[2 * s2][0] = r[0];
                    kb[2 * s2][1] = r[1];
                    kb[2 * s2 + 1][0] = r[2];
                    kb[2 * s2 + 1][1] = r[3];
                } else { /* column steps 2*s2 and 2*s2+1, each split as in e4m3_a_step */
#pragma unroll
                    for (int h = 0; h < 4; ++h) {
                        kb[4 * s2 + h][0] = e4m3x2_to_f16x2((uint16_t)r[h]);
                        kb[4 * s2 + h][1] = e4m3x2_to_f16x2((uint16_t)(r[h] >> 16));
                    }
                }
            }
        };
        auto score_block = [&](const uint32_t(&kb)[L::kMmaSteps][2], int nt) {
            const int32_t key = page * kPageKeys + warp_n * L::kWarpKeys + nt * 8 + 2 * quad;
#pragma unroll
            for (int mt = 0; mt < L::kMTiles; ++mt) {
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int s = 0; s < L::kMmaSteps; ++s) mma<kBf16>(acc, qa[mt][s], kb[s]);
                if (masked) {
                    if (key > pos[mt][0]) acc[0] = -INFINITY;
                    if (key + 1 > pos[mt][0]) acc[1] = -INFINITY;
                    if (key > pos[mt][1]) acc[2] = -INFINITY;
                    if (key + 1 > pos[mt][1]) acc[3] = -INFINITY;
                }
                row_max[mt][0] = fmaxf(row_max[mt][0], fmaxf(acc[0], acc[1]));
                row_max[mt][1] = fmaxf(row_max[mt][1], fmaxf(acc[2], acc[3]));
            }
        };
        uint32_t kb_even[L::kMmaSteps][2], kb_odd[L::kMmaSteps][2];
        load_block(kb_even, 0);
#pragma unroll 1
        for (int nt = 0; nt < L::kNTiles; nt += 2) {
            load_block(kb_odd, nt + 1);
            score_block(kb_even, nt);
            if (nt + 2 < L::kNTiles) load_block(kb_even, nt + 2);
            score_block(kb_odd, nt + 1);
        }
        float *partial = reduce + (i & 1) * L::kWarpsN * kTileRows + warp_n * kTileRows;
#pragma unroll
        for (int mt = 0; mt < L::kMTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float v = row_max[mt][half];
                v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
                v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
                if (quad == 0) partial[warp_m * L::kWarpRows + mt * 16 + group + 8 * half] = v;
            }
    }
    cp_async_wait<0>();
    __syncthreads();
    flush(first_page + num_item_pages - 1, (num_item_pages - 1) & 1);
}

ScoreArgs make_args(const msaidx_plan *plan, const void *q, const void *k_cache, float *scores,
                    const msaidx_cuda_work *items, const int32_t *count, int64_t max_items) {
    const msaidx_batch_desc *d = &plan->desc;
    ScoreArgs a;
    a.q = static_cast<const uint8_t *>(q);
    a.k_cache = static_cast<const uint8_t *>(k_cache);
    a.scores = scores;
    a.block_table = plan->block_table;
    a.requests = msaidx_cuda_requests(plan->workspace, d);
    a.items = items;
    a.count = count;
    a.positions = msaidx_cuda_positions(plan->workspace, d);
    a.max_items = max_items;
    a.batch_size = d->batch_size;
    a.num_tokens = d->num_tokens;
    a.num_heads = plan->context->config.num_heads;
    a.bt_stride = d->bt_stride;
    a.num_pages = d->num_pages;
    a.pitch = d->pitch;
    a.page_stride = d->page_stride;
    return a;
}

msaidx_status launch(const msaidx_plan *plan, const ScoreArgs &a, dim3 grid, cudaStream_t stream) {
    if (plan->context->config.dtype == MSAIDX_DTYPE_BF16)
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(score_kernel<true>, grid, dim3(kThreads),
                                                Layout<true>::kSmemBytes, stream, a),
                        "score_kernel launch");
    else
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(score_kernel<false>, grid, dim3(kThreads),
                                                Layout<false>::kSmemBytes, stream, a),
                        "score_kernel launch");
    return MSAIDX_SUCCESS;
}

} // namespace

msaidx_status msaidx_cuda_score_set_attributes(void) {
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(score_kernel<false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Layout<false>::kSmemBytes),
                    "cudaFuncSetAttribute(score_kernel e4m3 shared memory)");
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(score_kernel<true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Layout<true>::kSmemBytes),
                    "cudaFuncSetAttribute(score_kernel bf16 shared memory)");
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_score_items(const msaidx_plan *plan, const void *q, const void *k_cache,
                                      float *scores, const msaidx_cuda_work *items,
                                      const int32_t *count, int64_t max_items,
                                      cudaStream_t stream) {
    if (max_items <= 0) return MSAIDX_SUCCESS;
    if (max_items > INT_MAX)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "desc: %lld work items exceed one launch (fewer num_tokens)",
                           (long long)max_items);
    const ScoreArgs a = make_args(plan, q, k_cache, scores, items, count, max_items);
    return launch(plan, a, dim3((unsigned)max_items), stream);
}
