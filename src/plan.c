/* Plans: the batch description's defaults and validation (callers built before the cp_* fields
 * included), the plan's workspace size, the binding of a batch's metadata (msaidx_plan_batch) and
 * the read-back of the device's metadata check. Apart from context.c and dispatch.c because a
 * plan is the per-batch step between a context and the compute calls. */
#include "internal.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void msaidx_batch_desc_init(msaidx_batch_desc *desc) {
    if (!desc) return;
    memset(desc, 0, sizeof *desc);
    desc->struct_size = sizeof *desc;
}

/* struct_size of callers built before the cp_* fields: the struct ended at pitch. */
static size_t batch_desc_size_before_cp(void) {
    return msaidx_align_up(offsetof(msaidx_batch_desc, cp_world), _Alignof(msaidx_batch_desc));
}

/* `d` is the caller's description as msaidx_plan_create read it (older callers' struct_size
 * already widened, their cp_* zero). */
static msaidx_status check_desc(const msaidx_context *context, const msaidx_batch_desc *d) {
    const msaidx_config *c = &context->config;
    MSAIDX_CHECK(MSAIDX_CHECK_STRUCT_SIZE("desc", d, msaidx_batch_desc));
    if (d->cp_world < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc.cp_world = %d: negative",
                           d->cp_world);
    const int32_t world = d->cp_world > 1 ? d->cp_world : 1;
    if (d->cp_rank < 0 || d->cp_rank >= world)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.cp_rank = %d: must be in [0, %d) for desc.cp_world = %d%s",
                           d->cp_rank, world, d->cp_world, world == 1 ? " (no sharding: 0)" : "");
    if (d->cp_layout != MSAIDX_CP_INTERLEAVED && d->cp_layout != MSAIDX_CP_CONTIGUOUS)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.cp_layout = %d: must be MSAIDX_CP_INTERLEAVED (0) or "
                           "MSAIDX_CP_CONTIGUOUS (1)",
                           d->cp_layout);
    if (world > 1 && !context->ops->merge_candidates)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "desc.cp_world = %d: backend %s does not shard pages (context "
                           "parallel)",
                           d->cp_world, context->ops->name);
    if (d->batch_size < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc.batch_size = %d: negative",
                           d->batch_size);
    if (d->num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc.num_tokens = %d: negative",
                           d->num_tokens);
    if (d->max_q_len < 0 || d->max_q_len > d->num_tokens)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.max_q_len = %d: must be in [0, desc.num_tokens = %d]",
                           d->max_q_len, d->num_tokens);
    if (d->max_seq_len < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc.max_seq_len = %d: negative",
                           d->max_seq_len);
    MSAIDX_CHECK(msaidx_check_page_geometry("desc", d->num_pages, d->page_stride,
                                            (int64_t)c->page_size * c->head_dim *
                                                msaidx_elem_size(c->dtype)));
    const int64_t max_pages = msaidx_plan_row_pages(d, c->page_size);
    if (d->bt_stride < 1 || d->bt_stride < max_pages)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.bt_stride = %d: must be >= 1 and hold the %lld pages of "
                           "desc.max_seq_len = %d (per rank of desc.cp_world)",
                           d->bt_stride, (long long)max_pages, d->max_seq_len);
    if (d->pitch < 1 || d->pitch < max_pages)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.pitch = %d: must be >= 1 and >= the %lld pages of "
                           "desc.max_seq_len = %d (per rank of desc.cp_world)",
                           d->pitch, (long long)max_pages, d->max_seq_len);
    /* Every call indexes the score rows (or the workspace that replaces them) from one base. */
    if (msaidx_score_bytes(d->num_tokens, c->num_heads, d->pitch) > (size_t)PTRDIFF_MAX)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.pitch = %d: desc.num_tokens = %d x num_heads = %d rows of it "
                           "exceed the address space",
                           d->pitch, d->num_tokens, c->num_heads);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_create(msaidx_plan **plan, msaidx_context *context,
                                 const msaidx_batch_desc *desc) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    *plan = NULL;
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (!desc) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc: NULL pointer");
    /* Only the bytes the caller's struct has are read: an older caller's padding is not cp_*. */
    msaidx_batch_desc full;
    msaidx_batch_desc_init(&full);
    if (desc->struct_size == sizeof full)
        full = *desc;
    else if (desc->struct_size == batch_desc_size_before_cp()) {
        memcpy(&full, desc, offsetof(msaidx_batch_desc, cp_world));
        full.struct_size = sizeof full;
    } else
        full.struct_size = desc->struct_size; /* refused by check_desc, naming struct_size */
    desc = &full;
    msaidx_status status = check_desc(context, desc);
    if (status != MSAIDX_SUCCESS) return status;
    msaidx_plan *created = calloc(1, sizeof *created);
    if (!created) return msaidx_fail(MSAIDX_ERROR_OUT_OF_MEMORY, "plan: out of host memory");
    created->context_copy = *context;
    created->context = &created->context_copy;
    created->desc = *desc;
    created->workspace_bytes = context->ops->workspace_size(created);
    if (created->workspace_bytes == SIZE_MAX) {
        free(created);
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc: the workspace of batch_size = %d, num_tokens = %d and "
                           "max_seq_len = %d does not fit in size_t",
                           desc->batch_size, desc->num_tokens, desc->max_seq_len);
    }
    *plan = created;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_destroy(msaidx_plan *plan) {
    free(plan);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_workspace_size(const msaidx_plan *plan, size_t *bytes) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!bytes) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "bytes: NULL pointer");
    *bytes = plan->workspace_bytes;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_batch(msaidx_plan *plan, const int32_t *cu_seqlens_q,
                                const int32_t *seq_lens, const int32_t *block_table,
                                void *workspace, size_t workspace_bytes, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    plan->workspace = NULL; /* any failure below leaves no batch planned */
    MSAIDX_CHECK(msaidx_check_pointer(cu_seqlens_q, 4, "cu_seqlens_q"));
    MSAIDX_CHECK(msaidx_check_pointer(seq_lens, 4, "seq_lens"));
    MSAIDX_CHECK(msaidx_check_pointer(block_table, 4, "block_table"));
    MSAIDX_CHECK(msaidx_check_pointer(workspace, 16, "workspace"));
    if (workspace_bytes < plan->workspace_bytes)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "workspace_bytes = %zu: the plan needs %zu (msaidx_plan_workspace_size)",
                           workspace_bytes, plan->workspace_bytes);
    /* The cpu plan copies the metadata into the workspace (memcpy: overlap is undefined) and
     * every backend writes nvp there: the metadata must lie outside the bytes the plan uses
     * (the rest of a larger caller arena may hold it). */
    msaidx_span metadata[MSAIDX_METADATA_SPANS];
    msaidx_metadata_spans(&plan->desc, cu_seqlens_q, seq_lens, block_table, metadata);
    for (int i = 0; i < MSAIDX_METADATA_SPANS; ++i)
        if (msaidx_ranges_overlap(metadata[i].pointer, metadata[i].bytes, workspace,
                                  plan->workspace_bytes))
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "%s = %p: overlaps the workspace = %p (the %zu bytes the plan uses)",
                               metadata[i].name, metadata[i].pointer, workspace,
                               plan->workspace_bytes);
    plan->cu_seqlens_q = cu_seqlens_q;
    plan->seq_lens = seq_lens;
    plan->block_table = block_table;
    plan->workspace = workspace;
    msaidx_device_scope scope;
    msaidx_status status = msaidx_device_enter(plan->context, &scope);
    if (status == MSAIDX_SUCCESS)
        status = msaidx_device_leave(&scope, plan->context->ops->plan(plan, stream));
    if (status != MSAIDX_SUCCESS) plan->workspace = NULL;
    return status;
}

msaidx_status msaidx_plan_nvp(const msaidx_plan *plan, const int32_t **nvp) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!nvp) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "nvp: NULL pointer");
    MSAIDX_CHECK(msaidx_check_planned(plan));
    *nvp = (const int32_t *)((const char *)plan->workspace + msaidx_workspace_nvp_offset());
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_check(const msaidx_plan *plan, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    MSAIDX_CHECK(msaidx_check_planned(plan));
    uint32_t word = 0;
    msaidx_device_scope scope;
    MSAIDX_CHECK(msaidx_device_enter(plan->context, &scope));
    MSAIDX_CHECK(
        msaidx_device_leave(&scope, plan->context->ops->read_error_word(plan, stream, &word)));
    if (!word) return MSAIDX_SUCCESS;
    static const struct {
        uint32_t bit;
        const char *cause;
    } causes[] = {
        {MSAIDX_BAD_CU_SEQLENS, "cu_seqlens_q not 0-based or decreasing"},
        {MSAIDX_BAD_SEQ_LEN, "seq_lens negative, below q_len or above desc.max_seq_len"},
        {MSAIDX_BAD_TOKEN_COUNT, "tokens exceed desc.num_tokens or desc.max_q_len"},
        {MSAIDX_BAD_PAGE_ID, "block_table entry outside [0, desc.num_pages)"},
        {MSAIDX_BAD_NVP, "visible pages exceed desc.pitch or desc.bt_stride"},
    };
    char listed[320] = "";
    size_t used = 0;
    for (size_t i = 0; i < sizeof causes / sizeof causes[0]; ++i)
        if ((word & causes[i].bit) && used < sizeof listed)
            used += (size_t)snprintf(listed + used, sizeof listed - used, "%s%s", used ? "; " : "",
                                     causes[i].cause);
    return msaidx_fail(MSAIDX_ERROR_BAD_METADATA,
                       "device metadata check failed (error word 0x%x): %s. The affected "
                       "requests were skipped",
                       word, listed);
}
