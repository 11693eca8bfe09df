/* Shared by the CUDA backends: error mapping, the common device plan and workspace layout. */
#ifndef MSAIDX_CUDA_INTERNAL_CUH
#define MSAIDX_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>

#include "../internal.h"

/* Maps a CUDA error to MSAIDX_ERROR_CUDA with a message naming `what`. */
msaidx_status msaidx_cuda_status(cudaError_t error, const char *what);

#define MSAIDX_CUDA_TRY(call, what)                                                           \
    do {                                                                                      \
        cudaError_t try_error_ = (call);                                                      \
        if (try_error_ != cudaSuccess) return msaidx_cuda_status(try_error_, what);           \
    } while (0)

/* Per request, written by the common plan kernel. A request whose metadata failed a check has
 * q_len = 0 (skipped) and its bits are in the workspace error word. */
struct msaidx_cuda_request {
    int32_t token_begin; /* cu_seqlens_q[b] */
    int32_t q_len;       /* tokens of this request (0 when skipped) */
    int32_t seq_len;     /* total context incl. the new tokens */
    int32_t bt_row;      /* b: row of the block table */
};

/*
 * Workspace layout (device memory):
 *   [msaidx_workspace_header][nvp int32 T]                  msaidx_workspace_common_bytes(T)
 *   [msaidx_cuda_request B]                                  aligned to 256
 *   [backend-specific area]                                  from msaidx_cuda_backend_area()
 */
static inline size_t msaidx_cuda_requests_offset(const msaidx_batch_desc *d) {
    return msaidx_workspace_common_bytes(d->num_tokens);
}
static inline size_t msaidx_cuda_backend_area_offset(const msaidx_batch_desc *d) {
    return msaidx_cuda_requests_offset(d) +
           msaidx_align_up(sizeof(msaidx_cuda_request) * (size_t)(d->batch_size > 0 ? d->batch_size : 1), 256);
}

/* Launches the common plan: validates metadata, fills the error word, nvp [T] and the request
 * table. Grid depends only on desc (graph safe); no sync, no allocation. */
msaidx_status msaidx_cuda_plan_requests(const msaidx_plan *plan, cudaStream_t stream);

#endif
