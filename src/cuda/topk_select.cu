/* The top-k kernels of every CUDA backend (SPEC.md section 4) and the rule that picks them per
 * batch (msaidx_cuda_topk). How one row is selected: topk_select.cuh (a fused call's long row from
 * its chunk maxima: topk_chunked.cuh). */
#include "topk_chunked.cuh"

#include <climits>

namespace {

/* A CTA a row, whatever its length: batches of fewer rows than the GPU holds CTAs (decode). With
 * kPreload > 0 (16-byte aligned rows of at most kPreload float4 a thread) the row's cells up to
 * max_nvp are loaded before its nvp, as in topk_short_kernel. */
template <int kPreload>
__global__ void __launch_bounds__(kBlockThreads) topk_row_kernel(const TopkArgs a) {
    __shared__ SelectShared<kBlockGather> sh;
    msaidx_wait_for_prior_grids();
    const int64_t row = blockIdx.x;
    if constexpr (kPreload == 0) {
        select_block_row<BlockGroup>(a, row, a.nvp[row_token(a, row)], sh, threadIdx.x);
    } else {
        const float *scores = a.scores + row * a.pitch;
        float4 cells[kPreload];
        load_row_vectors<BlockGroup>(scores, a.max_nvp - a.local_blocks, cells, threadIdx.x);
        const int32_t n = a.nvp[row_token(a, row)];
        int32_t lo = 0, count = 0;
        const int32_t slots = prepare_row(a, row, n, &lo, &count, threadIdx.x, kBlockThreads);
        if (slots <= 0) return;
        select_loaded_vectors<BlockGroup>(cells, scores, lo, count, slots,
                                          row_out(a, row) + a.init_blocks, sh, threadIdx.x);
    }
}

/* Short rows (max_nvp bounds them), a warp each. With kPreload > 0 (rows of at most kPreload x 32
 * candidates) a row's cells up to that bound are loaded before its nvp, which only then says how
 * many of them count: the two loads overlap instead of the cells waiting for nvp (cells past nvp
 * lie within the row's pitch, and a row that needs no selection drops them). Rows of up to 1024
 * candidates (kPreload = 0) load theirs after nvp: held across its wait, 32 cells a lane spill. */
template <int kPreload>
__global__ void __launch_bounds__(kBlockThreads, kTopkCtasPerSm)
    topk_short_kernel(const TopkArgs a, int32_t rows_per_cta) {
    __shared__ SelectShared<kWarpGather> sh[kWarpRowsPerCta];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * rows_per_cta + warp;
    if (warp >= rows_per_cta || row >= a.rows) return;
    msaidx_wait_for_prior_grids();
    if constexpr (kPreload == 0) {
        select_warp_row(a, row, a.nvp[row_token(a, row)], sh[warp], lane);
    } else {
        const float *scores = a.scores + row * a.pitch;
        float values[kPreload];
        load_row_cells<WarpGroup>(scores, a.init_blocks, a.max_nvp - a.init_blocks - a.local_blocks,
                                  values, lane);
        const int32_t n = a.nvp[row_token(a, row)];
        int32_t lo = 0, count = 0;
        const int32_t slots = prepare_row(a, row, n, &lo, &count, lane, 32);
        if (slots <= 0) return;
        select_loaded<WarpGroup>(values, scores, lo, count, slots, row_out(a, row) + a.init_blocks,
                                 sh[warp], lane);
    }
}

/* Every row, by a warp when short and by the CTA when long, where max_nvp admits long rows. Only
 * nvp on the device tells which rows are long: max_nvp bounds the batch's longest row (at most the
 * pitch, which engines size for their longest context: vLLM 8192 pages, 1M tokens), and a prefill
 * chunk's rows take every length below it. CTA b owns rows_per_cta consecutive rows (at most
 * kWarpRowsPerCta): warp w selects row b * rows_per_cta + w if it is short, or long in a fused
 * call whose chunk maxima serve it (select_chunked_row), then the CTA selects the other long ones,
 * one after another.
 * Consecutive rows have similar lengths (a causal chunk's rows grow by a page every 128 tokens),
 * so a CTA's warps finish together. */
__global__ void __launch_bounds__(kBlockThreads, kTopkCtasPerSm)
    topk_kernel(const TopkArgs a, int32_t rows_per_cta, const msaidx_cuda_chunk_maxima chunks) {
    __shared__ union {
        SelectShared<kWarpGather> warps[kWarpRowsPerCta];
        SelectShared<kBlockGather> block;
    } sh;
    __shared__ int32_t long_n[kWarpRowsPerCta]; /* a long row's nvp, else 0 */
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int64_t first = (int64_t)blockIdx.x * rows_per_cta, row = first + warp;
    const bool mine = warp < rows_per_cta && row < a.rows;
    msaidx_wait_for_prior_grids();
    /* A fused call's chunk maxima are read with nvp. */
    ChunkKeys chunk_keys;
    if (mine && chunks.maxima) load_chunk_keys(chunks, row, lane, chunk_keys);
    const int32_t n = mine ? a.nvp[row_token(a, row)] : 0;
    const bool long_candidates = mine && long_row(a, n);
    const bool is_long =
        long_candidates &&
        !(chunks.maxima && select_chunked_row(a, chunk_keys, row, n, sh.warps[warp], lane));
    if (lane == 0) long_n[warp] = is_long ? n : 0;
    const bool any_long = __syncthreads_or(is_long);
    if (mine && !long_candidates) select_warp_row(a, row, n, sh.warps[warp], lane);
    if (!any_long) return;
    for (int w = 0; w < kWarpRowsPerCta; ++w) {
        __syncthreads(); /* the warps' (or the last row's) shared memory is free */
        if (long_n[w]) select_block_row<BlockLoopGroup>(a, first + w, long_n[w], sh.block, tid);
    }
}

} // namespace

namespace {

/* CTAs of the top-k that fit the GPU at once. */
int64_t resident_ctas(const msaidx_context *context) {
    return (int64_t)kTopkCtasPerSm * (context->num_sms > 0 ? context->num_sms : 1);
}

/* Whether rows may have more candidates than a warp holds and are more than a wave of CTAs: then
 * topk_kernel runs (below), the kernel that reads chunk maxima. */
bool takes_topk_kernel(const msaidx_context *context, int64_t rows, int32_t max_nvp) {
    const msaidx_config *c = &context->config;
    return max_nvp - c->init_blocks - c->local_blocks > kWarpMaxPages &&
           rows > resident_ctas(context);
}

msaidx_status launch_topk(const msaidx_context *context, const float *scores, int32_t pitch,
                          int32_t max_nvp, const int32_t *nvp, int32_t num_tokens, int32_t *out,
                          int64_t out_stride_t, int64_t out_stride_h,
                          const msaidx_cuda_chunk_maxima *chunks, void *stream) {
    const msaidx_config *c = &context->config;
    const int64_t rows = (int64_t)num_tokens * c->num_heads;
    if (rows == 0) return MSAIDX_SUCCESS;
    if (rows > INT_MAX)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "num_tokens = %d: too many rows for one launch", num_tokens);
    const cudaStream_t s = msaidx_cuda_stream(stream);
    const TopkArgs a{scores,
                     nvp,
                     out,
                     out_stride_t,
                     out_stride_h,
                     rows,
                     pitch,
                     max_nvp,
                     c->num_heads,
                     c->topk,
                     c->init_blocks,
                     c->local_blocks,
                     (uintptr_t)scores % 16 == 0 && pitch % 4 == 0};
    /* No more rows than CTAs fit on the GPU (decode) and rows of more than a few hundred pages
     * possible (max_nvp): a CTA each, so that long rows spread over the SMs. Rows no longer than
     * a warp holds: a warp each. Otherwise both kinds of row in one kernel, 2 to 8 consecutive
     * rows a CTA, at least a wave of resident CTAs. The warp kernel preloads as many cells a lane
     * as the longest row's candidates need. */
    const int32_t longest = max_nvp - c->init_blocks - c->local_blocks;
    void (*kernel)(const TopkArgs, int32_t) = longest <= 2 * 32   ? topk_short_kernel<2>
                                              : longest <= 8 * 32 ? topk_short_kernel<8>
                                                                  : topk_short_kernel<0>;
    int32_t rows_per_cta = kWarpRowsPerCta;
    const int64_t resident = resident_ctas(context);
    if (longest > kWarpMaxPages || (rows <= resident && longest > kWaveRowCtaMinPages)) {
        if (rows <= resident) {
            /* float4 a thread that the longest row's cells need (as select_block_row counts). */
            /* In 64 bits: max_nvp may be within 4 * kBlockThreads of INT32_MAX. */
            const int64_t vectors =
                ((int64_t)max_nvp - c->local_blocks + 4 * kBlockThreads - 1) / (4 * kBlockThreads);
            void (*row_kernel)(const TopkArgs) = !a.vector_rows ? topk_row_kernel<0>
                                                 : vectors <= 1 ? topk_row_kernel<1>
                                                 : vectors <= 2 ? topk_row_kernel<2>
                                                 : vectors <= 4 ? topk_row_kernel<4>
                                                 : vectors <= 8 ? topk_row_kernel<8>
                                                                : topk_row_kernel<0>;
            MSAIDX_CUDA_TRY(msaidx_launch_dependent(row_kernel, dim3((unsigned)rows),
                                                    dim3(kBlockThreads), 0, s, a),
                            "topk_row_kernel launch");
            return MSAIDX_SUCCESS;
        }
        rows_per_cta = (int32_t)min((int64_t)kWarpRowsPerCta, (rows + resident - 1) / resident);
        /* Its long rows a warp each from their chunk maxima where a fused call has them: a CTA
         * keeps a row's chain of reads in flight per warp. (Fewer rows than a wave of CTAs wait
         * on one row's latency, which the maxima lengthen: topk_row_kernel reads them whole.) */
        const msaidx_cuda_chunk_maxima none = {nullptr, nullptr, 0};
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(
                            topk_kernel, dim3((unsigned)((rows + rows_per_cta - 1) / rows_per_cta)),
                            dim3(kBlockThreads), 0, s, a, rows_per_cta, chunks ? *chunks : none),
                        "topk_kernel launch");
        return MSAIDX_SUCCESS;
    }
    MSAIDX_CUDA_TRY(
        msaidx_launch_dependent(kernel, dim3((unsigned)((rows + rows_per_cta - 1) / rows_per_cta)),
                                dim3(kBlockThreads), 0, s, a, rows_per_cta),
        "topk_kernel launch");
    return MSAIDX_SUCCESS;
}

} // namespace

msaidx_status msaidx_cuda_topk(const msaidx_context *context, const float *scores, int32_t pitch,
                               int32_t max_nvp, const int32_t *nvp, int32_t num_tokens,
                               int32_t *out, int64_t out_stride_t, int64_t out_stride_h,
                               void *stream) {
    return launch_topk(context, scores, pitch, max_nvp, nvp, num_tokens, out, out_stride_t,
                       out_stride_h, nullptr, stream);
}

bool msaidx_cuda_topk_reads_chunk_maxima(const msaidx_context *context, int32_t num_tokens,
                                         int32_t max_nvp) {
    return takes_topk_kernel(context, (int64_t)num_tokens * context->config.num_heads, max_nvp);
}

msaidx_status msaidx_cuda_topk_chunked(const msaidx_context *context, const float *scores,
                                       int32_t pitch, int32_t max_nvp, const int32_t *nvp,
                                       int32_t num_tokens, int32_t *out, int64_t out_stride_t,
                                       int64_t out_stride_h, const msaidx_cuda_chunk_maxima *chunks,
                                       void *stream) {
    return launch_topk(context, scores, pitch, max_nvp, nvp, num_tokens, out, out_stride_t,
                       out_stride_h, chunks, stream);
}
