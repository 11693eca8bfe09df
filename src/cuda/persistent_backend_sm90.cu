/* The `persistent` backend's host side: admission, context, plan and the scorer's launch with its
 * TMA tensor maps. The scorer itself is score_persistent_sm90.cu; the plan's kernel is
 * plan_persistent_sm90.cu. */
#include "persistent_sm90.cuh"

#include <cudaTypedefs.h>

namespace {

/* The driver's tensor-map encoder, reached through the runtime (no -lcuda). */
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encoder = []() {
        void *function = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                             cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return (PFN_cuTensorMapEncodeTiled_v12000) nullptr;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)function;
    }();
    return encoder;
}

/* q: [rows, D] values, boxes of 128 bytes of one task's 256 rows. k: [pages, 128 keys, D] values
 * with the page stride as the outer stride, boxes of 128 bytes of one page's keys. Both 128-byte
 * swizzled for wgmma, the widest rows that swizzle takes: an E4M3 row is one box, a BF16 row two.
 */
msaidx_status encode_tensor_maps(const msaidx_plan *plan, const void *q, const void *k_cache,
                                 CUtensorMap *q_map, CUtensorMap *k_map) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "backend persistent: the CUDA driver has no cuTensorMapEncodeTiled");
    const msaidx_batch_desc *d = &plan->desc;
    const cuuint64_t row_bytes =
        (cuuint64_t)kHeadDim * (plan->context->config.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1);
    const cuuint32_t box_bytes = 128;
    const cuuint64_t q_dims[2] = {row_bytes,
                                  (cuuint64_t)d->num_tokens * plan->context->config.num_heads};
    const cuuint64_t q_strides[1] = {row_bytes};
    const cuuint32_t q_box[2] = {box_bytes, MSAIDX_PERSISTENT_TILE_ROWS};
    const cuuint32_t unit[3] = {1, 1, 1};
    CUresult result =
        encode(q_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(q), q_dims, q_strides,
               q_box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "backend persistent: cuTensorMapEncodeTiled(q = %p, %llu rows) failed "
                           "(CUresult %d)",
                           q, (unsigned long long)q_dims[1], (int)result);
    const cuuint64_t k_dims[3] = {row_bytes, kPageKeys, (cuuint64_t)d->num_pages};
    /* TMA strides must stay below 2^40 bytes; one page is never stepped over, so any stride the
     * API admits (persistent_plan refuses larger ones with more pages) stands for itself. */
    const cuuint64_t page_stride =
        d->num_pages == 1 ? kPageKeys * row_bytes : (cuuint64_t)d->page_stride;
    const cuuint64_t k_strides[2] = {row_bytes, page_stride};
    const cuuint32_t k_box[3] = {box_bytes, kPageKeys, 1};
    result =
        encode(k_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void *>(k_cache), k_dims,
               k_strides, k_box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
        return msaidx_fail(
            MSAIDX_ERROR_CUDA,
            "backend persistent: cuTensorMapEncodeTiled(k_cache = %p, desc.num_pages "
            "= %d, desc.page_stride = %lld) failed (CUresult %d)",
            k_cache, d->num_pages, (long long)d->page_stride, (int)result);
    return MSAIDX_SUCCESS;
}

/* Runs `check` with config.device current, then gives the caller its context back. */
template <typename Check>
msaidx_status on_device(int32_t device, Check check) {
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_cuda_device_enter(device, &scope));
    return msaidx_device_leave(&scope, check());
}

msaidx_status persistent_supports(const msaidx_config *config) {
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_supports_common(config, "persistent"));
    if (config->num_heads != 1 && config->num_heads != 2 && config->num_heads != 4)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: config.num_heads = %d, it needs 1, 2 or 4",
                           config->num_heads);
    return on_device(config->device, msaidx_persistent_check_sm90a_code);
}

msaidx_status persistent_init_context(msaidx_context *context) {
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_init_context(context));
    return on_device(context->config.device, msaidx_persistent_set_attributes);
}

size_t persistent_workspace_size(const msaidx_plan *plan) {
    return msaidx_persistent_workspace_bytes(plan);
}

msaidx_status persistent_plan(msaidx_plan *plan, void *stream) {
    if (plan->desc.num_pages > 1 && plan->desc.page_stride >= ((int64_t)1 << 40))
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: desc.page_stride = %lld bytes: its TMA key map "
                           "needs page strides below 2^40 (or desc.num_pages = 1)",
                           (long long)plan->desc.page_stride);
    cudaStream_t s = msaidx_cuda_stream(stream);
    MSAIDX_CUDA_TRY_STATUS(msaidx_cuda_plan_requests(plan, false, s));
    return msaidx_persistent_plan_tiles(plan, s);
}

msaidx_status persistent_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                float *scores, bool decode, void *stream) {
    cudaStream_t s = msaidx_cuda_stream(stream);
    /* Decode rows are few per request: the shared decode scorer splits their pages finer. */
    if (decode || msaidx_cuda_decode_only(&plan->desc))
        return msaidx_cuda_score_decode(plan, q, k_cache, scores, s);
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    CUtensorMap q_map, k_map;
    MSAIDX_CUDA_TRY_STATUS(encode_tensor_maps(plan, q, k_cache, &q_map, &k_map));
    return msaidx_persistent_launch_scores(plan, &q_map, &k_map, scores, nullptr, s);
}

/* The fused call's chunk maxima beside its score area: a row's maximum over each task's pages. */
size_t persistent_fused_topk_extra_bytes(const msaidx_plan *plan) {
    const size_t rows = (size_t)plan->desc.num_tokens * (size_t)plan->context->config.num_heads;
    const size_t pitch = (size_t)msaidx_persistent_maxima_pitch(plan);
    if (pitch != 0 && rows > (SIZE_MAX - 256) / sizeof(float) / pitch) return SIZE_MAX;
    return msaidx_align_up(rows * pitch * sizeof(float), 256);
}

/* Scores with each task's row maxima, then a top-k whose long rows read the maxima first and
 * only the chunks that can hold a chosen page (msaidx_cuda_topk_chunked). */
msaidx_status persistent_fused_topk(const msaidx_plan *plan, const msaidx_context *context,
                                    const void *q, const void *k_cache, float *scores, void *extra,
                                    int32_t max_nvp, int32_t *out, int64_t stride_t,
                                    int64_t stride_h, void *stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t *nvp =
        (const int32_t *)((const char *)plan->workspace + msaidx_workspace_nvp_offset());
    /* The decode scorer has no deal; the top-k of short rows, of a wave of rows or of few score
     * cells no maxima. */
    const int64_t cells = (int64_t)d->num_tokens * context->config.num_heads * max_nvp;
    if (msaidx_cuda_decode_only(d) || cells < MSAIDX_PERSISTENT_MAXIMA_MIN_CELLS ||
        !msaidx_cuda_topk_reads_chunk_maxima(context, d->num_tokens, max_nvp)) {
        MSAIDX_CHECK(persistent_scores(plan, q, k_cache, scores, false, stream));
        return msaidx_cuda_topk(context, scores, d->pitch, max_nvp, nvp, d->num_tokens, out,
                                stride_t, stride_h, stream);
    }
    CUtensorMap q_map, k_map;
    MSAIDX_CUDA_TRY_STATUS(encode_tensor_maps(plan, q, k_cache, &q_map, &k_map));
    float *maxima = (float *)extra;
    MSAIDX_CHECK(msaidx_persistent_launch_scores(plan, &q_map, &k_map, scores, maxima,
                                                 msaidx_cuda_stream(stream)));
    const msaidx_cuda_chunk_maxima chunks = {maxima,
                                             &msaidx_persistent_views_of(plan).counts->chunk_pages,
                                             msaidx_persistent_maxima_pitch(plan)};
    return msaidx_cuda_topk_chunked(context, scores, d->pitch, max_nvp, nvp, d->num_tokens, out,
                                    stride_t, stride_h, &chunks, stream);
}

} // namespace

extern "C" msaidx_status msaidx_persistent_deal(const msaidx_plan *plan, void *stream,
                                                int32_t *chunk_pages, int32_t *num_tasks) {
    *chunk_pages = *num_tasks = 0;
    if (plan->context->ops != &msaidx_persistent_backend)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: not a persistent backend plan");
    MSAIDX_CHECK(msaidx_check_planned(plan));
    if (msaidx_cuda_decode_only(&plan->desc)) return MSAIDX_SUCCESS;
    msaidx_persistent_counts counts;
    cudaStream_t s = msaidx_cuda_stream(stream);
    MSAIDX_CUDA_TRY(cudaMemcpyAsync(&counts, msaidx_persistent_views_of(plan).counts, sizeof counts,
                                    cudaMemcpyDeviceToHost, s),
                    "persistent deal: copy of the plan's counts");
    MSAIDX_CUDA_TRY(cudaStreamSynchronize(s), "persistent deal: the plan's stream");
    *chunk_pages = counts.chunk_pages;
    *num_tasks = counts.num_tasks;
    return MSAIDX_SUCCESS;
}

extern "C" const msaidx_backend_ops msaidx_persistent_backend = {
    MSAIDX_BACKEND_PERSISTENT,
    "persistent",
    true,
    persistent_supports,
    persistent_init_context,
    persistent_workspace_size,
    persistent_plan,
    persistent_scores,
    msaidx_cuda_num_valid_pages,
    msaidx_cuda_topk,
    msaidx_cuda_candidates,
    msaidx_cuda_read_error_word,
    msaidx_cuda_merge_candidates,
    persistent_fused_topk_extra_bytes,
    persistent_fused_topk,
};
