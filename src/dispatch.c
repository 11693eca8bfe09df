/* The compute calls (scores, num_valid_pages, top-k, prefill top-k and its context-parallel
 * candidates and merge): argument validation shared by every backend, then dispatch to the
 * context's backend table. Contexts and plans, which these calls take already validated, are made
 * in context.c and plan.c. */
#include "internal.h"

#include <stddef.h>
#include <string.h>

/* An output the call writes must not share memory with what the call (or a later step of it)
 * reads: the plan's workspace holds the validated metadata snapshot (page ids, cu_seqlens) that
 * the scorer and the page mapping index memory with, and the CUDA scorers read the block table
 * the plan was given. */
static msaidx_status check_apart_from_plan(const char *name, const void *pointer, size_t bytes,
                                           const msaidx_plan *plan) {
    MSAIDX_CHECK(msaidx_check_disjoint(name, pointer, bytes, "the plan's workspace",
                                       plan->workspace, plan->workspace_bytes));
    msaidx_span metadata[MSAIDX_METADATA_SPANS];
    msaidx_metadata_spans(&plan->desc, plan->cu_seqlens_q, plan->seq_lens, plan->block_table,
                          metadata);
    for (int i = 0; i < MSAIDX_METADATA_SPANS; ++i)
        if (msaidx_ranges_overlap(pointer, bytes, metadata[i].pointer, metadata[i].bytes))
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "%s = %p (%zu bytes) overlaps the plan's %s = %p (%zu bytes, "
                               "bound by msaidx_plan_batch)",
                               name, pointer, bytes, metadata[i].name, metadata[i].pointer,
                               metadata[i].bytes);
    return MSAIDX_SUCCESS;
}

/* Bytes of a plan's score rows, T * H * pitch floats (check_desc keeps it within PTRDIFF_MAX). */
static size_t score_span_bytes(const msaidx_plan *plan) {
    return msaidx_score_bytes(plan->desc.num_tokens, plan->context->config.num_heads,
                              plan->desc.pitch);
}

/* Bytes spanned by rows of `length` 4-byte entries at t * stride_t + h * stride_h (strides
 * already accepted by check_row_strides, so the sum fits in int64). */
static size_t row_span_bytes(int64_t stride_t, int64_t stride_h, int32_t num_tokens,
                             int32_t num_heads, int32_t length) {
    if (num_tokens == 0 || num_heads == 0) return 0;
    return sizeof(int32_t) * (size_t)((int64_t)(num_tokens - 1) * stride_t +
                                      (int64_t)(num_heads - 1) * stride_h + length);
}

static msaidx_status run_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                float *scores, bool decode, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    MSAIDX_CHECK(msaidx_check_planned(plan));
    /* Nothing to read or write; empty tensors (torch, numpy) may carry NULL data pointers. */
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(msaidx_check_pointer(q, 16, "q"));
    MSAIDX_CHECK(msaidx_check_pointer(k_cache, 16, "k_cache"));
    MSAIDX_CHECK(msaidx_check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(check_apart_from_plan("scores", scores, score_span_bytes(plan), plan));
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(plan->context, &scope));
    return msaidx_device_leave(
        &scope, plan->context->ops->scores(plan, q, k_cache, scores, decode, stream));
}

msaidx_status msaidx_prefill_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                    float *scores, void *stream) {
    return run_scores(plan, q, k_cache, scores, false, stream);
}

msaidx_status msaidx_decode_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                   float *scores, void *stream) {
    return run_scores(plan, q, k_cache, scores, true, stream);
}

msaidx_status msaidx_num_valid_pages(const msaidx_context *context, const int32_t *cu_seqlens_q,
                                     const int32_t *seq_lens, int32_t batch_size,
                                     int32_t num_tokens, int32_t *nvp, void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    MSAIDX_CHECK(msaidx_check_pointer(cu_seqlens_q, 4, "cu_seqlens_q"));
    if (batch_size < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "batch_size = %d: negative", batch_size);
    /* seq_lens has batch_size entries: with none it is an empty tensor, whose data pointer may
     * be NULL (torch), and no backend reads it. */
    if (batch_size > 0) MSAIDX_CHECK(msaidx_check_pointer(seq_lens, 4, "seq_lens"));
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    if (num_tokens > 0) MSAIDX_CHECK(msaidx_check_pointer(nvp, 4, "nvp"));
    /* The backends read cu_seqlens_q and seq_lens again while they write nvp. */
    const size_t nvp_bytes = sizeof(int32_t) * (size_t)num_tokens;
    MSAIDX_CHECK(msaidx_check_disjoint("nvp", nvp, nvp_bytes, "cu_seqlens_q", cu_seqlens_q,
                                       sizeof(int32_t) * ((size_t)batch_size + 1)));
    MSAIDX_CHECK(msaidx_check_disjoint("nvp", nvp, nvp_bytes, "seq_lens", seq_lens,
                                       sizeof(int32_t) * (size_t)batch_size));
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(context, &scope));
    return msaidx_device_leave(&scope,
                               context->ops->num_valid_pages(context, cu_seqlens_q, seq_lens,
                                                             batch_size, num_tokens, nvp, stream));
}

/* Whether rows of `length` entries, placed at t * stride_t + h * stride_h for t < num_tokens and
 * h < num_heads, are pairwise disjoint: the dimension with the smaller stride must space its
 * rows at least `length` apart and the other must step over all of them. */
static msaidx_status check_row_strides(int64_t stride_t, int64_t stride_h, int32_t num_tokens,
                                       int32_t num_heads, int32_t length) {
    if (stride_t < 0 || stride_h < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "out_stride_t = %lld, out_stride_h = %lld: must be >= 0",
                           (long long)stride_t, (long long)stride_h);
    if (num_tokens == 0 || num_heads == 0) return MSAIDX_SUCCESS; /* no row is written */
    /* The last row's end, (T - 1) * stride_t + (H - 1) * stride_h + length entries, must be a
     * byte offset that int64 (and so every backend's index arithmetic) holds. */
    const int64_t max_entries = INT64_MAX / (int64_t)sizeof(int32_t);
    int64_t end = length;
    const int64_t strides[2] = {stride_t, stride_h}, steps[2] = {num_tokens - 1, num_heads - 1};
    for (int d = 0; d < 2; ++d) {
        if (steps[d] > 0 && strides[d] > (max_entries - end) / steps[d])
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "out_stride_t = %lld, out_stride_h = %lld: the last of num_tokens "
                               "= %d x num_heads = %d rows ends past a 64-bit byte offset",
                               (long long)stride_t, (long long)stride_h, num_tokens, num_heads);
        end += strides[d] * steps[d];
    }
    /* A dimension of extent 1 never steps: only the others can make rows overlap. */
    int64_t inner = num_heads > 1 ? stride_h : INT64_MAX,
            outer = num_tokens > 1 ? stride_t : INT64_MAX;
    int64_t inner_extent = num_heads, outer_extent = num_tokens;
    if (outer < inner) {
        int64_t swap = inner;
        inner = outer;
        outer = swap;
        swap = inner_extent;
        inner_extent = outer_extent;
        outer_extent = swap;
    }
    if (inner == INT64_MAX) return MSAIDX_SUCCESS; /* one row */
    const int64_t span = inner <= INT64_MAX / inner_extent ? inner * inner_extent : INT64_MAX;
    if (inner < length || (outer != INT64_MAX && outer < span))
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "out_stride_t = %lld, out_stride_h = %lld: rows of topk = %d entries "
                           "overlap for num_tokens = %d, num_heads = %d",
                           (long long)stride_t, (long long)stride_h, length, num_tokens, num_heads);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_topk_select_bounded(const msaidx_context *context, const float *scores,
                                         int32_t pitch, int32_t max_nvp, const int32_t *nvp,
                                         int32_t num_tokens, int32_t *out, int64_t out_stride_t,
                                         int64_t out_stride_h, void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (pitch < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "pitch = %d: must be >= 1", pitch);
    if (max_nvp < 1 || max_nvp > pitch)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "max_nvp = %d: must be in [1, pitch = %d]", max_nvp, pitch);
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    MSAIDX_CHECK(check_row_strides(out_stride_t, out_stride_h, num_tokens,
                                   context->config.num_heads, context->config.topk));
    const size_t score_bytes = msaidx_score_bytes(num_tokens, context->config.num_heads, pitch);
    if (score_bytes > (size_t)PTRDIFF_MAX)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "pitch = %d: num_tokens = %d x num_heads = %d rows of it exceed the "
                           "address space",
                           pitch, num_tokens, context->config.num_heads);
    if (num_tokens == 0) return MSAIDX_SUCCESS; /* empty tensors may carry NULL data pointers */
    MSAIDX_CHECK(msaidx_check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(msaidx_check_pointer(nvp, 4, "nvp"));
    MSAIDX_CHECK(msaidx_check_pointer(out, 4, "out"));
    /* The selection reads every row's scores and nvp after earlier rows' picks are written. */
    const int32_t num_heads = context->config.num_heads;
    const size_t out_bytes =
        row_span_bytes(out_stride_t, out_stride_h, num_tokens, num_heads, context->config.topk);
    MSAIDX_CHECK(msaidx_check_disjoint("out", out, out_bytes, "scores", scores, score_bytes));
    MSAIDX_CHECK(msaidx_check_disjoint("out", out, out_bytes, "nvp", nvp,
                                       sizeof(int32_t) * (size_t)num_tokens));
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(context, &scope));
    return msaidx_device_leave(&scope,
                               context->ops->topk(context, scores, pitch, max_nvp, nvp, num_tokens,
                                                  out, out_stride_t, out_stride_h, stream));
}

msaidx_status msaidx_topk_select_strided(const msaidx_context *context, const float *scores,
                                         int32_t pitch, const int32_t *nvp, int32_t num_tokens,
                                         int32_t *out, int64_t out_stride_t, int64_t out_stride_h,
                                         void *stream) {
    return msaidx_topk_select_bounded(context, scores, pitch, pitch, nvp, num_tokens, out,
                                      out_stride_t, out_stride_h, stream);
}

msaidx_status msaidx_topk_select(const msaidx_context *context, const float *scores, int32_t pitch,
                                 const int32_t *nvp, int32_t num_tokens, int32_t *out,
                                 void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    return msaidx_topk_select_strided(context, scores, pitch, nvp, num_tokens, out,
                                      (int64_t)context->config.num_heads * context->config.topk,
                                      context->config.topk, stream);
}

void msaidx_topk_args_init(msaidx_topk_args *args) {
    if (!args) return;
    msaidx_config defaults; /* the MiniMax-M3 selection, as msaidx_config_init sets it */
    msaidx_config_init(&defaults);
    memset(args, 0, sizeof *args);
    args->struct_size = sizeof *args;
    args->topk = defaults.topk;
    args->init_blocks = defaults.init_blocks;
    args->local_blocks = defaults.local_blocks;
}

msaidx_status msaidx_prefill_topk_workspace_size(const msaidx_plan *plan, int32_t with_scores,
                                                 size_t *bytes) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!bytes) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "bytes: NULL pointer");
    if (with_scores != 0 && with_scores != 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "with_scores = %d: must be 0 or 1",
                           with_scores);
    *bytes = 0;
    if (with_scores) return MSAIDX_SUCCESS;
    /* The score area, which every backend scores into and selects from, then what a fused path
     * keeps beside it. */
    const msaidx_backend_ops *ops = plan->context->ops;
    const size_t area = msaidx_align_up(score_span_bytes(plan), 256);
    const size_t extra = ops->fused_topk_extra_bytes ? ops->fused_topk_extra_bytes(plan) : 0;
    if (extra > SIZE_MAX - area)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: its workspace without a score buffer overflows size_t");
    *bytes = area + extra;
    return MSAIDX_SUCCESS;
}

/* Validates msaidx_topk_args for num_tokens rows of `base` (init/local only when `forced`
 * counts) and resolves the output strides; `context` becomes `base` with the args' top-k
 * parameters, which is what the backends' top-k reads. */
static msaidx_status check_topk_args(const msaidx_context *base, int32_t num_tokens,
                                     const msaidx_topk_args *args, bool forced,
                                     msaidx_context *context, int64_t *stride_t,
                                     int64_t *stride_h) {
    if (!args) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "args: NULL pointer");
    MSAIDX_CHECK(MSAIDX_CHECK_STRUCT_SIZE("args", args, msaidx_topk_args));
    MSAIDX_CHECK(msaidx_check_topk_params("args", args->topk, forced ? args->init_blocks : 0,
                                          forced ? args->local_blocks : 0));
    *context = *base;
    context->config.topk = args->topk;
    context->config.init_blocks = forced ? args->init_blocks : 0;
    context->config.local_blocks = forced ? args->local_blocks : 0;
    const int32_t H = base->config.num_heads;
    *stride_t = args->out_stride_t;
    *stride_h = args->out_stride_h;
    if (*stride_t == 0 && *stride_h == 0) {
        *stride_t = (int64_t)H * args->topk;
        *stride_h = args->topk;
    }
    return check_row_strides(*stride_t, *stride_h, num_tokens, H, args->topk);
}

/* msaidx_prefill_topk's work, arguments validated: scores into `target` (the caller's buffer when
 * `scores_out`), then the selection (`candidates`: with each pick's score, then for a sharded plan
 * as global pages). `context` carries the call's top-k parameters. */
static msaidx_status prefill_topk_steps(const msaidx_plan *plan, const msaidx_context *context,
                                        const void *q, const void *k_cache, float *target,
                                        bool scores_out, int32_t *out, bool candidates,
                                        float *candidate_scores, int64_t stride_t, int64_t stride_h,
                                        void *stream) {
    const msaidx_backend_ops *ops = plan->context->ops;
    const int32_t *nvp =
        (const int32_t *)((const char *)plan->workspace + msaidx_workspace_nvp_offset());
    /* The plan's bound on every row's pages: under the pitch engines size for their longest
     * context, the CUDA top-k then runs the kernels a batch of this length needs. */
    const int64_t row_pages = msaidx_plan_row_pages(&plan->desc, plan->context->config.page_size);
    const int32_t max_nvp = row_pages < plan->desc.pitch ? (int32_t)row_pages : plan->desc.pitch;
    /* A row of at most topk pages takes them all and a row past the bound none (SPEC section 4),
     * whatever the scores: where the bound leaves no row more, as in a batch of prompts of at
     * most topk pages (2048 tokens at MiniMax-M3's top-16), a selection that returns no score
     * scores nothing. */
    /* The fused path still writes every score into the workspace, so candidates read their
     * scores from it as from the scores op's. */
    if (!scores_out && ops->fused_topk && max_nvp > context->config.topk) {
        MSAIDX_CHECK(ops->fused_topk(plan, context, q, k_cache, target,
                                     (char *)target + msaidx_align_up(score_span_bytes(plan), 256),
                                     max_nvp, out, stride_t, stride_h, stream));
    } else {
        if (scores_out || candidates || max_nvp > context->config.topk)
            MSAIDX_CHECK(ops->scores(plan, q, k_cache, target, false, stream));
        MSAIDX_CHECK(ops->topk(context, target, plan->desc.pitch, max_nvp, nvp,
                               plan->desc.num_tokens, out, stride_t, stride_h, stream));
    }
    if (!candidates) return MSAIDX_SUCCESS;
    return ops->candidates(plan, context, target, out, candidate_scores, stride_t, stride_h,
                           stream);
}

/* msaidx_prefill_topk and (`candidates`) msaidx_prefill_topk_candidates. */
static msaidx_status run_prefill_topk(const msaidx_plan *plan, const void *q, const void *k_cache,
                                      const msaidx_topk_args *args, float *scores, int32_t *out,
                                      bool candidates, float *candidate_scores, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (plan->desc.cp_world > 1 && !candidates)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: context parallel (desc.cp_world = %d) forces global pages: use "
                           "msaidx_prefill_topk_candidates, then msaidx_merge_candidates",
                           plan->desc.cp_world);
    msaidx_context context;
    int64_t stride_t = 0, stride_h = 0;
    MSAIDX_CHECK(check_topk_args(plan->context, plan->desc.num_tokens, args, !candidates, &context,
                                 &stride_t, &stride_h));
    MSAIDX_CHECK(msaidx_check_planned(plan));
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(msaidx_check_pointer(q, 16, "q"));
    MSAIDX_CHECK(msaidx_check_pointer(k_cache, 16, "k_cache"));
    if (scores) MSAIDX_CHECK(msaidx_check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(msaidx_check_pointer(out, 4, candidates ? "candidate_pages" : "out"));
    if (candidates) MSAIDX_CHECK(msaidx_check_pointer(candidate_scores, 4, "candidate_scores"));
    size_t needed = 0;
    MSAIDX_CHECK(msaidx_prefill_topk_workspace_size(plan, scores != NULL, &needed));
    if (needed) {
        MSAIDX_CHECK(msaidx_check_pointer(args->workspace, 16, "args.workspace"));
        if (args->workspace_bytes < needed)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.workspace_bytes = %zu: the call needs %zu with scores %s "
                               "(msaidx_prefill_topk_workspace_size)",
                               args->workspace_bytes, needed, scores ? "given" : "= NULL");
    }
    /* Outputs apart from the plan's workspace and from each other: the steps read back the
     * workspace's metadata, the scores and the selected pages (as indices) after writing. */
    const char *target_name = scores ? "scores" : "args.workspace";
    const void *target = scores ? (const void *)scores : args->workspace;
    const size_t target_bytes = scores ? score_span_bytes(plan) : needed;
    const char *out_name = candidates ? "candidate_pages" : "out";
    const size_t out_bytes = row_span_bytes(stride_t, stride_h, plan->desc.num_tokens,
                                            plan->context->config.num_heads, args->topk);
    MSAIDX_CHECK(check_apart_from_plan(target_name, target, target_bytes, plan));
    MSAIDX_CHECK(check_apart_from_plan(out_name, out, out_bytes, plan));
    MSAIDX_CHECK(
        msaidx_check_disjoint(out_name, out, out_bytes, target_name, target, target_bytes));
    if (candidates) {
        MSAIDX_CHECK(msaidx_check_disjoint("candidate_scores", candidate_scores, out_bytes,
                                           "candidate_pages", out, out_bytes));
        MSAIDX_CHECK(check_apart_from_plan("candidate_scores", candidate_scores, out_bytes, plan));
        MSAIDX_CHECK(msaidx_check_disjoint("candidate_scores", candidate_scores, out_bytes,
                                           target_name, target, target_bytes));
    }
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(plan->context, &scope));
    return msaidx_device_leave(
        &scope, prefill_topk_steps(plan, &context, q, k_cache, scores ? scores : args->workspace,
                                   scores != NULL, out, candidates, candidate_scores, stride_t,
                                   stride_h, stream));
}

msaidx_status msaidx_prefill_topk(const msaidx_plan *plan, const void *q, const void *k_cache,
                                  const msaidx_topk_args *args, float *scores, int32_t *out,
                                  void *stream) {
    return run_prefill_topk(plan, q, k_cache, args, scores, out, false, NULL, stream);
}

msaidx_status msaidx_prefill_topk_candidates(const msaidx_plan *plan, const void *q,
                                             const void *k_cache, const msaidx_topk_args *args,
                                             float *scores, float *candidate_scores,
                                             int32_t *candidate_pages, void *stream) {
    return run_prefill_topk(plan, q, k_cache, args, scores, candidate_pages, true, candidate_scores,
                            stream);
}

msaidx_status msaidx_merge_candidates(const msaidx_context *context, const msaidx_topk_args *args,
                                      int32_t world_size, int32_t num_tokens, const int32_t *nvp,
                                      const float *candidate_scores, const int32_t *candidate_pages,
                                      int64_t rank_stride, int32_t *out, void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    msaidx_context merging;
    int64_t stride_t = 0, stride_h = 0;
    MSAIDX_CHECK(check_topk_args(context, num_tokens, args, true, &merging, &stride_t, &stride_h));
    if (world_size < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "world_size = %d: must be >= 1",
                           world_size);
    const size_t rank_rows = msaidx_size_mul(
        msaidx_size_mul((size_t)num_tokens, (size_t)context->config.num_heads), (size_t)args->topk);
    if (rank_stride < 0 || (uint64_t)rank_stride < rank_rows)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "rank_stride = %lld: must hold a rank's T = %d x H = %d x args.topk = "
                           "%d candidates",
                           (long long)rank_stride, num_tokens, context->config.num_heads,
                           args->topk);
    if (msaidx_size_mul((size_t)rank_stride, (size_t)world_size) > (size_t)PTRDIFF_MAX / 4)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "rank_stride = %lld x world_size = %d: candidates do not fit in memory",
                           (long long)rank_stride, world_size);
    if (num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(msaidx_check_pointer(nvp, 4, "nvp"));
    MSAIDX_CHECK(msaidx_check_pointer(candidate_scores, 4, "candidate_scores"));
    MSAIDX_CHECK(msaidx_check_pointer(candidate_pages, 4, "candidate_pages"));
    MSAIDX_CHECK(msaidx_check_pointer(out, 4, "out"));
    /* A row's inputs are read while other rows' selections are written: out may not overlap
     * them, except as rank 0's pages themselves, row for row (each row's candidates are read
     * before its selection is written). */
    const int32_t H = context->config.num_heads;
    const size_t out_bytes = row_span_bytes(stride_t, stride_h, num_tokens, H, args->topk);
    const bool in_place =
        out == candidate_pages && stride_h == args->topk && stride_t == (int64_t)H * args->topk;
    /* Each rank's rows, not the gaps between them (a packed gather interleaves the ranks'
     * scores and pages). */
    const struct {
        const char *name;
        const void *rows;
    } gathered[2] = {{"candidate_pages", candidate_pages}, {"candidate_scores", candidate_scores}};
    for (int i = in_place ? 1 : 0; i < 2; ++i)
        if (msaidx_ranges_overlap_strided(
                out, out_bytes, gathered[i].rows, rank_rows * sizeof(int32_t),
                (size_t)rank_stride * sizeof(int32_t), (size_t)world_size))
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "out = %p (%zu bytes) overlaps %s = %p (rows of %zu bytes every "
                               "%lld bytes, %d ranks)",
                               (void *)out, out_bytes, gathered[i].name, gathered[i].rows,
                               rank_rows * sizeof(int32_t),
                               (long long)rank_stride * (long long)sizeof(int32_t), world_size);
    MSAIDX_CHECK(msaidx_check_disjoint("out", out, out_bytes, "nvp", nvp,
                                       sizeof(int32_t) * (size_t)num_tokens));
    if (!context->ops->merge_candidates)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "msaidx_merge_candidates: backend %s has no context-parallel merge",
                           context->ops->name);
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(context, &scope));
    return msaidx_device_leave(
        &scope, context->ops->merge_candidates(&merging, world_size, num_tokens, nvp,
                                               candidate_scores, candidate_pages, rank_stride, out,
                                               stride_t, stride_h, stream));
}
