/* The CUDA backends `dense` and `split`: shared admission, context setup, error word, and the
 * backend tables. The kernels live in plan.cu, score_dense.cu and topk.cu. */
#include "cuda_internal.cuh"

#include <cudaTypedefs.h>

msaidx_status msaidx_cuda_status(cudaError_t error, const char *what) {
    return msaidx_fail(MSAIDX_ERROR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(error),
                       cudaGetErrorName(error));
}

msaidx_status msaidx_cuda_supports_common(const msaidx_config *c, const char *name) {
    if (c->head_dim != kHeadDim)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.head_dim = %d, the CUDA kernels need %d", name,
                           c->head_dim, kHeadDim);
    if (c->page_size != kPageKeys)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.page_size = %d, the CUDA kernels need %d", name,
                           c->page_size, kPageKeys);
    if (c->num_heads < 1 || c->num_heads > MSAIDX_MAX_HEADS)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.num_heads = %d, the CUDA kernels need 1..%d", name,
                           c->num_heads, MSAIDX_MAX_HEADS);
    if (c->topk < 1 || c->topk > MSAIDX_MAX_TOPK)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.topk = %d, the CUDA top-k needs 1..%d", name,
                           c->topk, MSAIDX_MAX_TOPK);
    if (c->dtype != MSAIDX_DTYPE_E4M3 && c->dtype != MSAIDX_DTYPE_BF16)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED, "backend %s: config.dtype = %d unknown",
                           name, (int)c->dtype);
    int devices = 0;
    cudaError_t error = cudaGetDeviceCount(&devices);
    if (error != cudaSuccess) {
        cudaGetLastError(); /* the failed query must not poison the caller's next check */
        /* The runtime reports a missing driver as an insufficient one; the driver version, 0 when
         * no driver is installed, tells the two apart. */
        int driver = 0, runtime = 0;
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        if (error == cudaErrorNoDevice)
            return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED, "backend %s: no CUDA device is present",
                               name);
        if (error == cudaErrorInsufficientDriver && driver == 0)
            return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                               "backend %s: no CUDA driver is installed, so no CUDA "
                               "device is usable",
                               name);
        if (error == cudaErrorInsufficientDriver)
            return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                               "backend %s: the CUDA driver (%d.%d) is older than the CUDA runtime "
                               "this build uses (%d.%d)",
                               name, driver / 1000, driver % 1000 / 10, runtime / 1000,
                               runtime % 1000 / 10);
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED, "backend %s: no usable CUDA device (%s)",
                           name, cudaGetErrorString(error));
    }
    if (c->device >= devices) /* asked before any query on it, so no CUDA error is raised */
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.device = %d, but only %d CUDA device(s) exist", name,
                           c->device, devices);
    int major = 0, minor = 0;
    error = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device);
    if (error == cudaSuccess)
        error = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->device);
    if (error != cudaSuccess) {
        cudaGetLastError(); /* the failed query must not poison the caller's next check */
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.device = %d is not a usable CUDA device (%s)", name,
                           c->device, cudaGetErrorString(error));
    }
    if (major != 9 || minor != 0)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: config.device = %d has compute capability %d.%d, this "
                           "build holds sm_90a code only",
                           name, c->device, major, minor);
    return MSAIDX_SUCCESS;
}

namespace {

/* The driver's current-context calls, reached through the runtime (no -lcuda): only they can give
 * a thread back exactly the context it had, or none. NULL where the driver lacks them. */
template <typename Function>
Function driver_function(const char *name) {
    void *function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &function, 4000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return (Function)function;
}

struct context_calls {
    PFN_cuCtxGetCurrent_v4000 get;
    PFN_cuCtxSetCurrent_v4000 set;
};

const context_calls &driver_context_calls() {
    static const context_calls calls = {
        driver_function<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent"),
        driver_function<PFN_cuCtxSetCurrent_v4000>("cuCtxSetCurrent")};
    return calls;
}

} // namespace

msaidx_status msaidx_cuda_device_enter(int32_t device, msaidx_device_scope *scope) {
    scope->switched = false;
    int current = 0;
    MSAIDX_CUDA_TRY(cudaGetDevice(&current), "cudaGetDevice");
    if (current == device) return MSAIDX_SUCCESS;
    const context_calls &calls = driver_context_calls();
    if (!calls.get || !calls.set)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "config.device = %d is not the current device (%d), and the CUDA driver "
                           "has no cuCtxGetCurrent / cuCtxSetCurrent to switch to it and back",
                           device, current);
    CUcontext previous = nullptr;
    if (calls.get(&previous) != CUDA_SUCCESS)
        return msaidx_fail(MSAIDX_ERROR_CUDA, "cuCtxGetCurrent failed");
    MSAIDX_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(config.device)");
    scope->previous_context = previous;
    scope->switched = true;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_device_leave(const msaidx_device_scope *scope, msaidx_status status) {
    const CUresult restored = driver_context_calls().set((CUcontext)scope->previous_context);
    if (restored == CUDA_SUCCESS || status != MSAIDX_SUCCESS) return status;
    return msaidx_fail(MSAIDX_ERROR_CUDA,
                       "cuCtxSetCurrent: the caller's CUDA context could not be made current "
                       "again (CUresult %d)",
                       (int)restored);
}

msaidx_status msaidx_cuda_init_context(msaidx_context *context) {
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_cuda_device_enter(context->config.device, &scope));
    int sms = 0;
    cudaError_t error =
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, context->config.device);
    msaidx_status status = error == cudaSuccess
                               ? msaidx_cuda_score_set_attributes()
                               : msaidx_cuda_status(error, "cudaDeviceGetAttribute(SM count)");
    if (status == MSAIDX_SUCCESS) status = msaidx_cuda_decode_set_attributes();
    status = msaidx_device_leave(&scope, status);
    if (status != MSAIDX_SUCCESS) return status;
    context->num_sms = sms;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_cuda_read_error_word(const msaidx_plan *plan, void *stream, uint32_t *word) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    MSAIDX_CUDA_TRY(cudaMemcpyAsync(word, &msaidx_cuda_header(plan->workspace)->error_word,
                                    sizeof *word, cudaMemcpyDeviceToHost, s),
                    "cudaMemcpyAsync(error word)");
    MSAIDX_CUDA_TRY(cudaStreamSynchronize(s), "cudaStreamSynchronize(error word)");
    return MSAIDX_SUCCESS;
}

/* ---- dense: the tile list of the common plan is its work list ---- */

static msaidx_status dense_supports(const msaidx_config *config) {
    return msaidx_cuda_supports_common(config, "dense");
}

static size_t dense_workspace_size(const msaidx_plan *plan) {
    return msaidx_cuda_backend_area_offset(&plan->desc, plan->context->config.num_heads);
}

static msaidx_status dense_plan(msaidx_plan *plan, void *stream) {
    return msaidx_cuda_plan_requests(plan, true, msaidx_cuda_stream(stream));
}

static msaidx_status dense_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                  float *scores, bool decode, void *stream) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    if (decode) return msaidx_cuda_score_decode(plan, q, k_cache, scores, s);
    const msaidx_batch_desc *d = &plan->desc;
    return msaidx_cuda_score_items(plan, q, k_cache, scores, msaidx_cuda_tiles(plan->workspace, d),
                                   &msaidx_cuda_counts(plan->workspace, d)->num_tiles,
                                   msaidx_cuda_max_tiles(d, plan->context->config.num_heads), s);
}

const msaidx_backend_ops msaidx_dense_backend = {
    MSAIDX_BACKEND_DENSE,
    "dense",
    true,
    dense_supports,
    msaidx_cuda_init_context,
    dense_workspace_size,
    dense_plan,
    dense_scores,
    msaidx_cuda_num_valid_pages,
    msaidx_cuda_topk,
    msaidx_cuda_candidates,
    msaidx_cuda_read_error_word,
    msaidx_cuda_merge_candidates,
};

/* ---- split: tiles cut into page chunks so that every SM has work ---- */

static msaidx_status split_supports(const msaidx_config *config) {
    return msaidx_cuda_supports_common(config, "split");
}

static size_t split_workspace_size(const msaidx_plan *plan) {
    return msaidx_cuda_backend_area_offset(&plan->desc, plan->context->config.num_heads) +
           sizeof(msaidx_cuda_work) * (size_t)msaidx_cuda_split_max_items(plan);
}

static msaidx_status split_plan(msaidx_plan *plan, void *stream) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_plan_requests(plan, true, s));
    return msaidx_cuda_plan_split(plan, s);
}

static msaidx_status split_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                  float *scores, bool decode, void *stream) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    if (decode) return msaidx_cuda_score_decode(plan, q, k_cache, scores, s);
    const msaidx_batch_desc *d = &plan->desc;
    return msaidx_cuda_score_items(plan, q, k_cache, scores, msaidx_cuda_split_items(plan),
                                   &msaidx_cuda_counts(plan->workspace, d)->num_items,
                                   msaidx_cuda_split_max_items(plan), s);
}

const msaidx_backend_ops msaidx_split_backend = {
    MSAIDX_BACKEND_SPLIT,
    "split",
    true,
    split_supports,
    msaidx_cuda_init_context,
    split_workspace_size,
    split_plan,
    split_scores,
    msaidx_cuda_num_valid_pages,
    msaidx_cuda_topk,
    msaidx_cuda_candidates,
    msaidx_cuda_read_error_word,
    msaidx_cuda_merge_candidates,
};
