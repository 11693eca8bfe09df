/* The cpu backend: host memory, metadata validated (and kept) at plan time with precise messages.
 */
#include "cpu.h"
#include "merge_candidates.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

static msaidx_status cpu_supports(const msaidx_config *config) {
    (void)config; /* every valid config: generic head_dim, page_size, H and dtype */
    return MSAIDX_SUCCESS;
}

/*
 * The plan's workspace: the common header and nvp, then a snapshot of the metadata as
 * msaidx_plan_batch validated it (cu_seqlens_q [B+1], seq_lens [B], and the visible entries of
 * each block-table row, at a row stride of the pages of max_seq_len). The scorer reads only the
 * snapshot, so metadata rewritten after planning can change nothing but what the next plan sees.
 */
typedef struct snapshot_layout {
    size_t cu_offset, seq_lens_offset, table_offset, total;
    int32_t table_stride;
} snapshot_layout;

static snapshot_layout layout_of(const msaidx_plan *plan) {
    const msaidx_batch_desc *d = &plan->desc;
    const int32_t P = plan->context->config.page_size;
    snapshot_layout l;
    /* A rank's pages of max_seq_len: <= bt_stride (checked at plan creation), so an int32. */
    const int64_t world = msaidx_shard_of(d).world;
    l.table_stride = (int32_t)((((int64_t)d->max_seq_len + P - 1) / P + world - 1) / world);
    const size_t B = (size_t)d->batch_size;
    l.cu_offset = msaidx_workspace_common_bytes(d->num_tokens);
    l.seq_lens_offset = msaidx_size_add(l.cu_offset, msaidx_size_mul(sizeof(int32_t), B + 1));
    l.table_offset = msaidx_size_add(l.seq_lens_offset, msaidx_size_mul(sizeof(int32_t), B));
    l.total = msaidx_size_add(l.table_offset, msaidx_size_mul(msaidx_size_mul(sizeof(int32_t), B),
                                                              (size_t)l.table_stride));
    return l;
}

static size_t cpu_workspace_size(const msaidx_plan *plan) { return layout_of(plan).total; }

static int32_t *workspace_ints(void *workspace, size_t offset) {
    return (int32_t *)((char *)workspace + offset);
}

msaidx_status msaidx_cpu_valid_pages(int32_t page_size, const msaidx_batch_desc *desc,
                                     const int32_t *cu, const int32_t *seq_lens,
                                     const int32_t *block_table, int32_t *table_copy,
                                     int32_t table_stride, int32_t batch_size, int32_t num_tokens,
                                     int32_t *nvp) {
    const msaidx_page_shard shard =
        desc ? msaidx_shard_of(desc) : (msaidx_page_shard){1, 0, MSAIDX_CP_INTERLEAVED};
    if (cu[0] != 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "cu_seqlens_q[0] = %d: must be 0", cu[0]);
    for (int32_t b = 0; b < batch_size; ++b) {
        if (cu[b + 1] < cu[b])
            return msaidx_fail(
                MSAIDX_ERROR_INVALID_ARGUMENT,
                "cu_seqlens_q[%d] = %d: below cu_seqlens_q[%d] = %d (must not decrease)", b + 1,
                cu[b + 1], b, cu[b]);
        const int32_t q_len = cu[b + 1] - cu[b]; /* no overflow: 0 <= cu[b] <= cu[b + 1] */
        if (cu[b + 1] > num_tokens)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "cu_seqlens_q[%d] = %d: more tokens than num_tokens = %d", b + 1,
                               cu[b + 1], num_tokens);
        if (seq_lens[b] < 0)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "seq_lens[%d] = %d: negative", b,
                               seq_lens[b]);
        if (q_len > seq_lens[b])
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "seq_lens[%d] = %d: below the request's q_len = %d", b, seq_lens[b],
                               q_len);
        if (desc && q_len > desc->max_q_len)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "cu_seqlens_q: request %d has q_len = %d > desc.max_q_len = %d", b,
                               q_len, desc->max_q_len);
        if (desc && seq_lens[b] > desc->max_seq_len)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "seq_lens[%d] = %d: above desc.max_seq_len = %d", b, seq_lens[b],
                               desc->max_seq_len);
        if (block_table && q_len > 0) {
            /* The rank's pages of the request: <= table_stride <= bt_stride, as seq_lens[b] <=
             * max_seq_len was checked above. */
            const int32_t request_pages = msaidx_request_pages(seq_lens[b], page_size);
            const int64_t pages = msaidx_shard_count(shard, request_pages, request_pages);
            const int32_t *row = block_table + (size_t)b * desc->bt_stride;
            int32_t *copy = table_copy + (size_t)b * table_stride;
            /* Each entry is read once, into the copy, and the copy is what is checked. */
            for (int64_t p = 0; p < pages; ++p) {
                copy[p] = row[p];
                if (copy[p] < 0 || copy[p] >= desc->num_pages)
                    return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                                       "block_table[%d][%lld] = %d: physical page outside [0, "
                                       "desc.num_pages = %d)",
                                       b, (long long)p, copy[p], desc->num_pages);
            }
        }
    }
    for (int32_t b = 0; b < batch_size; ++b) {
        const int32_t q_len = cu[b + 1] - cu[b];
        const int32_t request_pages = msaidx_request_pages(seq_lens[b], page_size);
        for (int32_t i = 0; i < q_len; ++i)
            nvp[cu[b] + i] =
                msaidx_shard_count(shard, request_pages, (seq_lens[b] - q_len + i) / page_size + 1);
    }
    const int32_t used = batch_size > 0 ? cu[batch_size] : 0;
    for (int32_t t = used; t < num_tokens; ++t) nvp[t] = 0;
    return MSAIDX_SUCCESS;
}

static msaidx_status cpu_plan(msaidx_plan *plan, void *stream) {
    (void)stream;
    const snapshot_layout l = layout_of(plan);
    const size_t B = (size_t)plan->desc.batch_size;
    int32_t *cu = workspace_ints(plan->workspace, l.cu_offset);
    int32_t *seq_lens = workspace_ints(plan->workspace, l.seq_lens_offset);
    memset(plan->workspace, 0, sizeof(msaidx_workspace_header));
    memcpy(cu, plan->cu_seqlens_q, sizeof(int32_t) * (B + 1));
    memcpy(seq_lens, plan->seq_lens, sizeof(int32_t) * B);
    return msaidx_cpu_valid_pages(
        plan->context->config.page_size, &plan->desc, cu, seq_lens, plan->block_table,
        workspace_ints(plan->workspace, l.table_offset), l.table_stride, plan->desc.batch_size,
        plan->desc.num_tokens, workspace_ints(plan->workspace, msaidx_workspace_nvp_offset()));
}

static msaidx_status cpu_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                float *scores, bool decode, void *stream) {
    (void)decode; /* one host path serves prefill and decode rows */
    (void)stream;
    const snapshot_layout l = layout_of(plan);
    /* The snapshot's block table has its own row stride. */
    msaidx_batch_desc snapshot_desc = plan->desc;
    snapshot_desc.bt_stride = l.table_stride;
    msaidx_cpu_batch batch = {
        .config = &plan->context->config,
        .desc = &snapshot_desc,
        .cu_seqlens_q = workspace_ints(plan->workspace, l.cu_offset),
        .seq_lens = workspace_ints(plan->workspace, l.seq_lens_offset),
        .block_table = workspace_ints(plan->workspace, l.table_offset),
        .q = q,
        .k_cache = k_cache,
        .scores = scores,
    };
    msaidx_cpu_scores_fast(&batch);
    return MSAIDX_SUCCESS;
}

static msaidx_status cpu_num_valid_pages(const msaidx_context *context, const int32_t *cu,
                                         const int32_t *seq_lens, int32_t batch_size,
                                         int32_t num_tokens, int32_t *nvp, void *stream) {
    (void)stream;
    return msaidx_cpu_valid_pages(context->config.page_size, NULL, cu, seq_lens, NULL, NULL, 0,
                                  batch_size, num_tokens, nvp);
}

static msaidx_status cpu_topk(const msaidx_context *context, const float *scores, int32_t pitch,
                              int32_t max_nvp, const int32_t *nvp, int32_t num_tokens, int32_t *out,
                              int64_t out_stride_t, int64_t out_stride_h, void *stream) {
    (void)stream;
    for (int32_t t = 0; t < num_tokens; ++t)
        if (nvp[t] > max_nvp)
            return max_nvp == pitch
                       ? msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                                     "nvp[%d] = %d: more pages than the score pitch = %d", t,
                                     nvp[t], pitch)
                       : msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                                     "nvp[%d] = %d: more pages than max_nvp = %d", t, nvp[t],
                                     max_nvp);
    msaidx_cpu_topk_fast_strided(&context->config, scores, pitch, nvp, num_tokens, out,
                                 out_stride_t, out_stride_h);
    return MSAIDX_SUCCESS;
}

static msaidx_status cpu_candidates(const msaidx_plan *plan, const msaidx_context *context,
                                    const float *scores, int32_t *pages, float *candidate_scores,
                                    int64_t stride_t, int64_t stride_h, void *stream) {
    (void)stream;
    const int32_t H = context->config.num_heads, K = context->config.topk;
    const int32_t pitch = plan->desc.pitch;
    for (int64_t row = 0; row < (int64_t)plan->desc.num_tokens * H; ++row) {
        const int64_t at = row / H * stride_t + row % H * stride_h;
        for (int32_t k = 0; k < K; ++k) {
            const int32_t page = pages[at + k];
            /* Pages come from the selection just written: in [0, nvp), nvp <= pitch. */
            const float score = page >= 0 && page < pitch ? scores[row * pitch + page] : -INFINITY;
            candidate_scores[at + k] = isnan(score) ? -INFINITY : score;
        }
    }
    if (plan->desc.cp_world <= 1) return MSAIDX_SUCCESS;
    const snapshot_layout l = layout_of(plan);
    const int32_t *cu = workspace_ints(plan->workspace, l.cu_offset);
    const int32_t *seq_lens = workspace_ints(plan->workspace, l.seq_lens_offset);
    const int32_t P = plan->context->config.page_size;
    const msaidx_page_shard shard = msaidx_shard_of(&plan->desc);
    /* Padding rows past cu[B] hold only -1. */
    for (int32_t b = 0; b < plan->desc.batch_size; ++b) {
        const int32_t request_pages = msaidx_request_pages(seq_lens[b], P);
        for (int64_t row = (int64_t)cu[b] * H; row < (int64_t)cu[b + 1] * H; ++row) {
            int32_t *entry = pages + row / H * stride_t + row % H * stride_h;
            for (int32_t k = 0; k < K; ++k)
                if (entry[k] >= 0) entry[k] = msaidx_shard_global(shard, request_pages, entry[k]);
        }
    }
    return MSAIDX_SUCCESS;
}

static msaidx_status cpu_merge_candidates(const msaidx_context *context, int32_t world_size,
                                          int32_t num_tokens, const int32_t *nvp,
                                          const float *candidate_scores,
                                          const int32_t *candidate_pages, int64_t rank_stride,
                                          int32_t *out, int64_t stride_t, int64_t stride_h,
                                          void *stream) {
    (void)stream;
    const msaidx_config *c = &context->config;
    const int32_t H = c->num_heads, K = c->topk;
    const int64_t rows = (int64_t)num_tokens * H;
#pragma omp parallel for schedule(dynamic, 16) num_threads(msaidx_cpu_threads(c))
    for (int64_t row = 0; row < rows; ++row)
        msaidx_merge_row(world_size, K, c->init_blocks, c->local_blocks, nvp[row / H],
                         candidate_scores + row * K, candidate_pages + row * K, rank_stride,
                         out + row / H * stride_t + row % H * stride_h);
    return MSAIDX_SUCCESS;
}

static msaidx_status cpu_read_error_word(const msaidx_plan *plan, void *stream, uint32_t *word) {
    (void)stream;
    *word = ((const msaidx_workspace_header *)plan->workspace)->error_word;
    return MSAIDX_SUCCESS;
}

const msaidx_backend_ops msaidx_cpu_backend = {
    .id = MSAIDX_BACKEND_CPU,
    .name = "cpu",
    .on_device = false,
    .supports = cpu_supports,
    .init_context = NULL,
    .workspace_size = cpu_workspace_size,
    .plan = cpu_plan,
    .scores = cpu_scores,
    .num_valid_pages = cpu_num_valid_pages,
    .topk = cpu_topk,
    .candidates = cpu_candidates,
    .read_error_word = cpu_read_error_word,
    .merge_candidates = cpu_merge_candidates,
};
