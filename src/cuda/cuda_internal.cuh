/* Shared by the CUDA backends: error mapping, the common device plan, workspace layout and the
 * launchers every CUDA backend reuses (num_valid_pages, top-k, decode scores). */
#ifndef MSAIDX_CUDA_INTERNAL_CUH
#define MSAIDX_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>

#include "../internal.h"
#include "tuning_sm90.h"

/* Keys per page (config.page_size) and dims per key (config.head_dim) of every CUDA kernel:
 * supports() admits no other. */
constexpr int kPageKeys = 128;
constexpr int kHeadDim = 128;

/* Maps a CUDA error to MSAIDX_ERROR_CUDA with a message naming `what`. */
msaidx_status msaidx_cuda_status(cudaError_t error, const char *what);

#define MSAIDX_CUDA_TRY(call, what)                                                                \
    do {                                                                                           \
        cudaError_t try_error_ = (call);                                                           \
        if (try_error_ != cudaSuccess) {                                                           \
            cudaGetLastError(); /* a failed launch must not fail the caller's next check */        \
            return msaidx_cuda_status(try_error_, what);                                           \
        }                                                                                          \
    } while (0)

/* After a launch: reports a launch-configuration error naming the kernel. */
#define MSAIDX_CUDA_CHECK_LAUNCH(what) MSAIDX_CUDA_TRY(cudaGetLastError(), what)

#define MSAIDX_CUDA_TRY_STATUS(call)                                                               \
    do {                                                                                           \
        msaidx_status try_status_ = (call);                                                        \
        if (try_status_ != MSAIDX_SUCCESS) return try_status_;                                     \
    } while (0)

/* Programmatic dependent launch (sm_90): every kernel of the CUDA backends is launched with the
 * attribute that lets the GPU prepare its launch while the kernel before it in the stream still
 * runs, so that it starts as soon as that one ends (H200: the top-k after a scorer about 2 us
 * sooner than with an event between them; the engine step 0.5 us less per kernel boundary,
 * bench/experiments/2026-12-02_h200_pdl.md). No kernel triggers its dependents early: an early
 * trigger in the scorers measured slower. A kernel touches no global memory before
 * msaidx_wait_for_prior_grids(), which returns once every grid before it in the stream has
 * finished and its writes are visible (at once when the grid was launched without the attribute):
 * only shared-memory setup runs ahead. (Prefetching the persistent scorer's tensor maps ahead of
 * the wait measured 0.3-0.9 % slower in the engine step, so they are fetched after it.) */
__device__ __forceinline__ void msaidx_wait_for_prior_grids() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
template <class... Params, class... Args>
cudaError_t msaidx_launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block,
                                    size_t dynamic_smem, cudaStream_t stream, Args... args) {
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = dynamic_smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
}

/* The API's NULL stream is the per-thread default stream, never the legacy one. */
static inline cudaStream_t msaidx_cuda_stream(void *stream) {
    return stream ? (cudaStream_t)stream : cudaStreamPerThread;
}

/* Per request, written by the common plan kernel. A request whose metadata failed a check has
 * q_len = 0 (skipped) and its bits are in the workspace error word. */
struct msaidx_cuda_request {
    int32_t token_begin; /* cu_seqlens_q[b] */
    int32_t q_len;       /* tokens of this request (0 when skipped) */
    int32_t seq_len;     /* total context incl. the new tokens */
    int32_t bt_row;      /* b: row of the block table */
};

/* A query tile is MSAIDX_CUDA_TILE_ROWS (tuning_sm90.h) rows r = t*H + h of one request,
 * contiguous. */

/*
 * A unit of scoring work: rows [row_begin, row_begin + num_rows) of request `request` (row
 * indices relative to the request's first row token_begin*H) against logical pages
 * [page_begin, page_end). The common plan writes one item per query tile with its whole causal
 * page range (the dense work list); backends may cut those into page chunks.
 */
struct msaidx_cuda_work {
    int32_t request;
    int32_t row_begin;
    int32_t page_begin;
    int32_t page_end;
};

/* Counters written by the device plan (in the workspace, after the request table). */
struct msaidx_cuda_plan_counts {
    int32_t num_tiles;   /* entries of the tile list */
    int32_t num_items;   /* entries of the backend's item list (split), else num_tiles */
    int32_t chunk_pages; /* pages per split item (split), else 0 */
    int32_t reserved;
};

/* Upper bound of query tiles of any batch within desc: each request adds at most one partial
 * tile. */
static inline int64_t msaidx_cuda_max_tiles(const msaidx_batch_desc *d, int32_t num_heads) {
    return ((int64_t)d->num_tokens * num_heads + MSAIDX_CUDA_TILE_ROWS - 1) /
               MSAIDX_CUDA_TILE_ROWS +
           d->batch_size;
}

/*
 * Workspace layout (device memory):
 *   [msaidx_workspace_header][nvp int32 T]                  msaidx_workspace_common_bytes(T)
 *   context parallel only: [positions int32 T][request pages int32 T], aligned to 256
 *   [msaidx_cuda_request B]                                  aligned to 256
 *   [msaidx_cuda_plan_counts][msaidx_cuda_work max_tiles]    aligned to 256 (the tile list)
 *   [backend-specific area]                                  from msaidx_cuda_backend_area_offset()
 *
 * Context parallel (desc.cp_world > 1): a rank scores the pages it owns as if they were the whole
 * request, each token at its LOCAL position. A token at global position pos, on global page
 * g = pos / 128, sees whole the n owned pages below g, and the owned page g (if owned) up to its
 * key pos % 128: exactly what an unsharded request shows the local position n * 128 + pos % 128
 * when g is owned, n * 128 - 1 otherwise (-1: nothing is visible). The plan writes that position
 * per token (and nvp = position / 128 + 1 from it, the owned visible pages); the scorers read it
 * in place of seq_len - q_len + i. Positions never decrease along a request, as the unsharded
 * ones. Request pages (P of the token's request) map local candidate columns to global pages.
 */
static inline bool msaidx_cuda_sharded(const msaidx_batch_desc *d) { return d->cp_world > 1; }
static inline size_t msaidx_cuda_positions_offset(const msaidx_batch_desc *d) {
    return msaidx_workspace_common_bytes(d->num_tokens);
}
static inline size_t msaidx_cuda_requests_offset(const msaidx_batch_desc *d) {
    const size_t shard_bytes =
        msaidx_cuda_sharded(d) ? msaidx_align_up(2 * sizeof(int32_t) * (size_t)d->num_tokens, 256)
                               : 0;
    return msaidx_cuda_positions_offset(d) + shard_bytes;
}
static inline size_t msaidx_cuda_counts_offset(const msaidx_batch_desc *d) {
    return msaidx_cuda_requests_offset(d) +
           msaidx_align_up(
               sizeof(msaidx_cuda_request) * (size_t)(d->batch_size > 0 ? d->batch_size : 1), 256);
}
static inline size_t msaidx_cuda_tiles_offset(const msaidx_batch_desc *d) {
    return msaidx_cuda_counts_offset(d) + msaidx_align_up(sizeof(msaidx_cuda_plan_counts), 16);
}
static inline size_t msaidx_cuda_backend_area_offset(const msaidx_batch_desc *d,
                                                     int32_t num_heads) {
    return msaidx_align_up(msaidx_cuda_tiles_offset(d) +
                               sizeof(msaidx_cuda_work) *
                                   (size_t)msaidx_cuda_max_tiles(d, num_heads),
                           256);
}

/* Typed views of a planned workspace. */
static inline msaidx_workspace_header *msaidx_cuda_header(void *workspace) {
    return (msaidx_workspace_header *)workspace;
}
static inline int32_t *msaidx_cuda_nvp(void *workspace) {
    return (int32_t *)((char *)workspace + msaidx_workspace_nvp_offset());
}
/* Context parallel: local positions [T] and request pages [T]; NULL on an unsharded plan. */
static inline int32_t *msaidx_cuda_positions(void *workspace, const msaidx_batch_desc *d) {
    return msaidx_cuda_sharded(d) ? (int32_t *)((char *)workspace + msaidx_cuda_positions_offset(d))
                                  : nullptr;
}
static inline int32_t *msaidx_cuda_request_pages(void *workspace, const msaidx_batch_desc *d) {
    int32_t *positions = msaidx_cuda_positions(workspace, d);
    return positions ? positions + d->num_tokens : nullptr;
}
/* Visible pages of a (local) position >= -1: floor(position / 128) + 1 (in 64 bits: a position
 * within 128 of INT32_MAX is admitted). */
__host__ __device__ __forceinline__ int32_t msaidx_cuda_pages_at(int32_t position) {
    return (int32_t)(((int64_t)position + kPageKeys) / kPageKeys);
}
static inline msaidx_cuda_request *msaidx_cuda_requests(void *workspace,
                                                        const msaidx_batch_desc *d) {
    return (msaidx_cuda_request *)((char *)workspace + msaidx_cuda_requests_offset(d));
}
static inline msaidx_cuda_plan_counts *msaidx_cuda_counts(void *workspace,
                                                          const msaidx_batch_desc *d) {
    return (msaidx_cuda_plan_counts *)((char *)workspace + msaidx_cuda_counts_offset(d));
}
static inline msaidx_cuda_work *msaidx_cuda_tiles(void *workspace, const msaidx_batch_desc *d) {
    return (msaidx_cuda_work *)((char *)workspace + msaidx_cuda_tiles_offset(d));
}

/* Items of a split plan: chunks of >= total/target pages add at most `target` to the tiles. */
static inline int64_t msaidx_cuda_split_max_items(const msaidx_plan *plan) {
    return msaidx_cuda_max_tiles(&plan->desc, plan->context->config.num_heads) +
           (int64_t)MSAIDX_CUDA_SPLIT_ITEMS_PER_SM * plan->context->num_sms;
}
static inline msaidx_cuda_work *msaidx_cuda_split_items(const msaidx_plan *plan) {
    return (msaidx_cuda_work *)((char *)plan->workspace +
                                msaidx_cuda_backend_area_offset(&plan->desc,
                                                                plan->context->config.num_heads));
}

/* Rules every CUDA backend shares (sm_90 device, D = 128, page = 128, H <= 16, topk <= 64):
 * SUCCESS or NOT_SUPPORTED naming the failed rule as backend `name`. */
msaidx_status msaidx_cuda_supports_common(const msaidx_config *config, const char *name);

/* init_context of every CUDA backend: checks the device, fills num_sms, raises the kernels'
 * dynamic shared memory limits (once per device). */
msaidx_status msaidx_cuda_init_context(msaidx_context *context);

/* Launches the common plan: zeroes the error word and nvp, validates metadata (error word bits),
 * fills nvp [T] and the request table, and with `tile_list` the counters and the tile list of
 * dense and split (persistent plans its own tasks). Grid depends only on desc (graph safe); no
 * sync, no allocation. Refuses T x H past 2^31 - MSAIDX_CUDA_TILE_ROWS query rows, which the
 * kernels count in int32. */
msaidx_status msaidx_cuda_plan_requests(const msaidx_plan *plan, bool tile_list,
                                        cudaStream_t stream);

/* Cuts the tile list of a planned workspace into page chunks (the split item list, with its
 * count in msaidx_cuda_plan_counts.num_items). One CTA; run after msaidx_cuda_plan_requests. */
msaidx_status msaidx_cuda_plan_split(const msaidx_plan *plan, cudaStream_t stream);

/* read_error_word of every CUDA backend (host call: copies and synchronises the stream). */
msaidx_status msaidx_cuda_read_error_word(const msaidx_plan *plan, void *stream, uint32_t *word);

/* num_valid_pages of every CUDA backend (device pointers; clamps, never validates). */
msaidx_status msaidx_cuda_num_valid_pages(const msaidx_context *context,
                                          const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                          int32_t batch_size, int32_t num_tokens, int32_t *nvp,
                                          void *stream);

/* topk of every CUDA backend (SPEC section 4; rows with nvp > max_nvp are all -1). */
msaidx_status msaidx_cuda_topk(const msaidx_context *context, const float *scores, int32_t pitch,
                               int32_t max_nvp, const int32_t *nvp, int32_t num_tokens,
                               int32_t *out, int64_t out_stride_t, int64_t out_stride_h,
                               void *stream);

/* Each row's maxima over the chunks of a persistent deal, which a fused call's scorer wrote
 * (persistent_sm90.cuh): row r's chunk j at maxima[r * pitch + j], chunks of *chunk_pages pages
 * (the plan's device value). */
typedef struct {
    const float *maxima;
    const int32_t *chunk_pages;
    int32_t pitch;
} msaidx_cuda_chunk_maxima;

/* Whether msaidx_cuda_topk_chunked reads chunk maxima for a batch of num_tokens rows of at most
 * max_nvp pages (else it runs msaidx_cuda_topk, and a scorer need not keep them): rows longer than
 * a warp holds, more than a wave of the top-k's CTAs. */
bool msaidx_cuda_topk_reads_chunk_maxima(const msaidx_context *context, int32_t num_tokens,
                                         int32_t max_nvp);

/* msaidx_cuda_topk whose long rows read only the chunks that can hold a chosen page. The same
 * selection, bitwise. */
msaidx_status msaidx_cuda_topk_chunked(const msaidx_context *context, const float *scores,
                                       int32_t pitch, int32_t max_nvp, const int32_t *nvp,
                                       int32_t num_tokens, int32_t *out, int64_t out_stride_t,
                                       int64_t out_stride_h, const msaidx_cuda_chunk_maxima *chunks,
                                       void *stream);

/* candidates and merge_candidates of every CUDA backend (context_parallel.cu). */
msaidx_status msaidx_cuda_candidates(const msaidx_plan *plan, const msaidx_context *context,
                                     const float *scores, int32_t *pages, float *candidate_scores,
                                     int64_t stride_t, int64_t stride_h, void *stream);
msaidx_status msaidx_cuda_merge_candidates(const msaidx_context *context, int32_t world_size,
                                           int32_t num_tokens, const int32_t *nvp,
                                           const float *candidate_scores,
                                           const int32_t *candidate_pages, int64_t rank_stride,
                                           int32_t *out, int64_t stride_t, int64_t stride_h,
                                           void *stream);

/* Batches whose requests have at most this many tokens (desc.max_q_len) are decode-only: the
 * persistent backend skips its prefill deal when planning them and scores their prefill_scores
 * with the decode scorer too (the deal pays off on full query tiles, not on a few rows per
 * request, and planning it costs a kernel per forward). */
#define MSAIDX_CUDA_DECODE_MAX_Q_LEN 8
static inline bool msaidx_cuda_decode_only(const msaidx_batch_desc *d) {
    return d->max_q_len <= MSAIDX_CUDA_DECODE_MAX_Q_LEN;
}

/* The decode scorer of every CUDA backend (score_decode.cu): few rows per request, split over
 * (row group, page) units so that every SM streams keys; grid from desc alone (graph safe); reads
 * the request table of a planned workspace. Exact (SPEC section 3) for any batch. */
msaidx_status msaidx_cuda_score_decode(const msaidx_plan *plan, const void *q, const void *k_cache,
                                       float *scores, cudaStream_t stream);

/* Raises the dense scorer's dynamic shared memory limit on the current device. */
msaidx_status msaidx_cuda_score_set_attributes(void);
/* Raises the decode scorer's dynamic shared memory limit (its key rings) on the current device. */
msaidx_status msaidx_cuda_decode_set_attributes(void);

/* The dense scorer over an item list in device memory (`items`, count at `count`), launched with
 * `max_items` CTAs (those past *count exit). */
msaidx_status msaidx_cuda_score_items(const msaidx_plan *plan, const void *q, const void *k_cache,
                                      float *scores, const msaidx_cuda_work *items,
                                      const int32_t *count, int64_t max_items, cudaStream_t stream);

#endif
