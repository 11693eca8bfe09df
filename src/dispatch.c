/* The public API: argument validation shared by every backend, then dispatch to the table. */
#include "internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const msaidx_backend_ops *msaidx_find_backend(msaidx_backend id) {
    switch (id) {
    case MSAIDX_BACKEND_CPU: return &msaidx_cpu_backend;
#ifdef MSAIDX_WITH_CUDA
    case MSAIDX_BACKEND_DENSE: return &msaidx_dense_backend;
    case MSAIDX_BACKEND_SPLIT: return &msaidx_split_backend;
#endif
#ifdef MSAIDX_WITH_PERSISTENT
    case MSAIDX_BACKEND_PERSISTENT: return &msaidx_persistent_backend;
#endif
    default: return NULL;
    }
}

const char *msaidx_backend_name(msaidx_backend backend) {
    switch (backend) {
    case MSAIDX_BACKEND_AUTO: return "auto";
    case MSAIDX_BACKEND_CPU: return "cpu";
    case MSAIDX_BACKEND_DENSE: return "dense";
    case MSAIDX_BACKEND_SPLIT: return "split";
    case MSAIDX_BACKEND_PERSISTENT: return "persistent";
    }
    return "unknown";
}

void msaidx_config_init(msaidx_config *config) {
    if (!config) return;
    memset(config, 0, sizeof *config);
    config->struct_size = sizeof *config;
    config->head_dim = 128;
    config->page_size = 128;
    config->num_heads = 4;
    config->topk = 16;
    config->init_blocks = 0;
    config->local_blocks = 1;
    config->dtype = MSAIDX_DTYPE_E4M3;
    config->backend = MSAIDX_BACKEND_AUTO;
    config->device = MSAIDX_DEVICE_HOST;
    config->num_threads = 0;
    config->fast_accumulation = -1;
    config->precision = MSAIDX_PRECISION_DEFAULT;
}

void msaidx_batch_desc_init(msaidx_batch_desc *desc) {
    if (!desc) return;
    memset(desc, 0, sizeof *desc);
    desc->struct_size = sizeof *desc;
}

/* The largest config.num_threads: more threads than this only oversubscribe the cores, and
 * OpenMP runtimes fail by aborting (or crash) when asked for a great many. */
static int32_t msaidx_max_threads(void) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const long per_cores = cores > 0 ? cores * MSAIDX_THREADS_PER_CORE : MSAIDX_THREADS_PER_CORE;
    return per_cores < MSAIDX_MAX_THREADS ? (int32_t)per_cores : MSAIDX_MAX_THREADS;
}

/* topk in [1, MSAIDX_MAX_TOPK], init/local blocks >= 0 and together at most topk; `owner` names
 * the struct in the messages ("config", "args"). */
static msaidx_status check_topk_params(const char *owner, int32_t topk, int32_t init_blocks,
                                       int32_t local_blocks) {
    if (topk < 1 || topk > MSAIDX_MAX_TOPK)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s.topk = %d: must be in [1, %d]", owner,
                           topk, MSAIDX_MAX_TOPK);
    if (init_blocks < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s.init_blocks = %d: negative", owner,
                           init_blocks);
    if (local_blocks < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s.local_blocks = %d: negative", owner,
                           local_blocks);
    /* In 64 bits: each may be up to INT32_MAX. */
    const int64_t forced_blocks = (int64_t)init_blocks + local_blocks;
    if (forced_blocks > topk)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "%s.init_blocks + %s.local_blocks = %lld exceeds %s.topk = %d", owner,
                           owner, (long long)forced_blocks, owner, topk);
    return MSAIDX_SUCCESS;
}

static msaidx_status check_config(const msaidx_config *c) {
    if (!c) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config: NULL pointer");
    MSAIDX_CHECK(MSAIDX_CHECK_STRUCT_SIZE("config", c, msaidx_config));
    if (c->head_dim < 16 || c->head_dim > 256 || c->head_dim % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.head_dim = %d: must be a multiple of 16 in [16, 256]",
                           c->head_dim);
    if (c->page_size < 16 || c->page_size > 512 || c->page_size % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.page_size = %d: must be a multiple of 16 in [16, 512]",
                           c->page_size);
    if (c->num_heads < 1 || c->num_heads > MSAIDX_MAX_HEADS)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.num_heads = %d: must be in [1, %d]", c->num_heads,
                           MSAIDX_MAX_HEADS);
    MSAIDX_CHECK(check_topk_params("config", c->topk, c->init_blocks, c->local_blocks));
    if (c->dtype != MSAIDX_DTYPE_E4M3 && c->dtype != MSAIDX_DTYPE_BF16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config.dtype = %d: not an msaidx_dtype",
                           (int)c->dtype);
    if ((int)c->backend < MSAIDX_BACKEND_AUTO || c->backend > MSAIDX_BACKEND_PERSISTENT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.backend = %d: not an msaidx_backend", (int)c->backend);
    if (c->device < MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.device = %d: must be a CUDA ordinal or MSAIDX_DEVICE_HOST",
                           c->device);
    if (c->num_threads < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config.num_threads = %d: negative",
                           c->num_threads);
    const int32_t max_threads = msaidx_max_threads();
    if (c->num_threads > max_threads)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.num_threads = %d: above %d (at most %d and %d per online core)",
                           c->num_threads, max_threads, MSAIDX_MAX_THREADS,
                           MSAIDX_THREADS_PER_CORE);
    if (c->precision != MSAIDX_PRECISION_DEFAULT && c->precision != MSAIDX_PRECISION_EXACT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.precision = %d: must be MSAIDX_PRECISION_DEFAULT (0) or "
                           "MSAIDX_PRECISION_EXACT (1)",
                           (int)c->precision);
    if (c->fast_accumulation < -1 || c->fast_accumulation > 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.fast_accumulation = %d: must be -1 (follow config.precision), 0 "
                           "(exact) or 1 (default precision)",
                           c->fast_accumulation);
    if (c->fast_accumulation == 1 && c->precision == MSAIDX_PRECISION_EXACT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.fast_accumulation = 1 contradicts config.precision = "
                           "MSAIDX_PRECISION_EXACT");
    return MSAIDX_SUCCESS;
}

/* The admission of one concrete backend for a valid config. */
static msaidx_status admit(msaidx_backend id, const msaidx_config *c) {
    const msaidx_backend_ops *ops = msaidx_find_backend(id);
    if (!ops)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: not compiled into this build of msaidx",
                           msaidx_backend_name(id));
    if (ops->on_device && c->device == MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: needs a CUDA device, but config.device is "
                           "MSAIDX_DEVICE_HOST",
                           ops->name);
    if (!ops->on_device && c->device != MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend cpu: works on host memory, but config.device = %d", c->device);
    return ops->supports(c);
}

static msaidx_backend resolve_auto(const msaidx_config *c) {
    if (c->device == MSAIDX_DEVICE_HOST) return MSAIDX_BACKEND_CPU;
    if (admit(MSAIDX_BACKEND_PERSISTENT, c) == MSAIDX_SUCCESS) return MSAIDX_BACKEND_PERSISTENT;
    return MSAIDX_BACKEND_DENSE;
}

msaidx_status msaidx_backend_supported(msaidx_backend backend, const msaidx_config *config) {
    msaidx_status status = check_config(config);
    if (status != MSAIDX_SUCCESS) return status;
    if (backend == MSAIDX_BACKEND_AUTO) backend = resolve_auto(config);
    if ((int)backend < MSAIDX_BACKEND_AUTO || backend > MSAIDX_BACKEND_PERSISTENT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "backend = %d: not an msaidx_backend",
                           (int)backend);
    return admit(backend, config);
}

msaidx_status msaidx_context_create(msaidx_context **context, const msaidx_config *config) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    *context = NULL;
    msaidx_status status = check_config(config);
    if (status != MSAIDX_SUCCESS) return status;
    msaidx_config resolved = *config;
    if (resolved.backend == MSAIDX_BACKEND_AUTO) resolved.backend = resolve_auto(config);
    /* The deprecated field, once read, is folded into precision: backends read precision only. */
    if (resolved.fast_accumulation == 0) resolved.precision = MSAIDX_PRECISION_EXACT;
    resolved.fast_accumulation = -1;
    status = admit(resolved.backend, &resolved);
    if (status != MSAIDX_SUCCESS) return status;

    msaidx_context *created = calloc(1, sizeof *created);
    if (!created) return msaidx_fail(MSAIDX_ERROR_OUT_OF_MEMORY, "context: out of host memory");
    created->config = resolved;
    created->ops = msaidx_find_backend(resolved.backend);
    if (created->ops->init_context) {
        status = created->ops->init_context(created);
        if (status != MSAIDX_SUCCESS) {
            free(created);
            return status;
        }
    }
    *context = created;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_context_destroy(msaidx_context *context) {
    free(context);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_context_backend(const msaidx_context *context, msaidx_backend *backend) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (!backend) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "backend: NULL pointer");
    *backend = context->config.backend;
    return MSAIDX_SUCCESS;
}

static int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
                           "desc.cp_rank = %d: must be in [0, desc.cp_world = %d)", d->cp_rank,
                           world);
    if (d->cp_layout != MSAIDX_CP_INTERLEAVED && d->cp_layout != MSAIDX_CP_CONTIGUOUS)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.cp_layout = %d: must be MSAIDX_CP_INTERLEAVED (0) or "
                           "MSAIDX_CP_CONTIGUOUS (1)",
                           d->cp_layout);
    if (world > 1 && !context->ops->global_pages)
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
    if (d->num_pages < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "desc.num_pages = %d: must be >= 1",
                           d->num_pages);
    /* A rank holds at most ceil(P / W) of a request's P pages in either layout. */
    int64_t max_pages = ceil_div64(ceil_div64(d->max_seq_len, c->page_size), world);
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
    int64_t min_stride = (int64_t)c->page_size * c->head_dim * msaidx_elem_size(c->dtype);
    if (d->page_stride < min_stride || d->page_stride % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "desc.page_stride = %lld bytes: must be a multiple of 16 and >= "
                           "page_size * head_dim * element size = %lld",
                           (long long)d->page_stride, (long long)min_stride);
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
    created->context = context;
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

static msaidx_status check_pointer(const void *pointer, size_t alignment, const char *name) {
    if (!pointer) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s: NULL pointer", name);
    if ((uintptr_t)pointer % alignment)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s = %p: not %zu-byte aligned", name,
                           pointer, alignment);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_batch(msaidx_plan *plan, const int32_t *cu_seqlens_q,
                                const int32_t *seq_lens, const int32_t *block_table,
                                void *workspace, size_t workspace_bytes, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    plan->workspace = NULL; /* any failure below leaves no batch planned */
    MSAIDX_CHECK(check_pointer(cu_seqlens_q, 4, "cu_seqlens_q"));
    MSAIDX_CHECK(check_pointer(seq_lens, 4, "seq_lens"));
    MSAIDX_CHECK(check_pointer(block_table, 4, "block_table"));
    MSAIDX_CHECK(check_pointer(workspace, 16, "workspace"));
    if (workspace_bytes < plan->workspace_bytes)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "workspace_bytes = %zu: the plan needs %zu (msaidx_plan_workspace_size)",
                           workspace_bytes, plan->workspace_bytes);
    plan->cu_seqlens_q = cu_seqlens_q;
    plan->seq_lens = seq_lens;
    plan->block_table = block_table;
    plan->workspace = workspace;
    msaidx_status status = plan->context->ops->plan(plan, stream);
    if (status != MSAIDX_SUCCESS) plan->workspace = NULL;
    return status;
}

static msaidx_status run_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                float *scores, bool decode, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!plan->workspace)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: no batch planned (call msaidx_plan_batch first)");
    /* Nothing to read or write; empty tensors (torch, numpy) may carry NULL data pointers. */
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(check_pointer(q, 16, "q"));
    MSAIDX_CHECK(check_pointer(k_cache, 16, "k_cache"));
    MSAIDX_CHECK(check_pointer(scores, 4, "scores"));
    return plan->context->ops->scores(plan, q, k_cache, scores, decode, stream);
}

msaidx_status msaidx_prefill_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                    float *scores, void *stream) {
    return run_scores(plan, q, k_cache, scores, false, stream);
}

msaidx_status msaidx_decode_scores(const msaidx_plan *plan, const void *q, const void *k_cache,
                                   float *scores, void *stream) {
    return run_scores(plan, q, k_cache, scores, true, stream);
}

msaidx_status msaidx_plan_nvp(const msaidx_plan *plan, const int32_t **nvp) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!nvp) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "nvp: NULL pointer");
    if (!plan->workspace)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: no batch planned (call msaidx_plan_batch first)");
    *nvp = (const int32_t *)((const char *)plan->workspace + msaidx_workspace_nvp_offset());
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_plan_check(const msaidx_plan *plan, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    if (!plan->workspace)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: no batch planned (call msaidx_plan_batch first)");
    uint32_t word = 0;
    MSAIDX_CHECK(plan->context->ops->read_error_word(plan, stream, &word));
    if (!word) return MSAIDX_SUCCESS;
    return msaidx_fail(
        MSAIDX_ERROR_BAD_METADATA,
        "device metadata check failed (error word 0x%x):%s%s%s%s%s; the affected "
        "requests were skipped",
        word, word & MSAIDX_BAD_CU_SEQLENS ? " cu_seqlens_q not 0-based/non-decreasing" : "",
        word & MSAIDX_BAD_SEQ_LEN ? " seq_lens negative, below q_len or above desc.max_seq_len"
                                  : "",
        word & MSAIDX_BAD_TOKEN_COUNT ? " tokens exceed desc.num_tokens or desc.max_q_len" : "",
        word & MSAIDX_BAD_PAGE_ID ? " block_table entry outside [0, desc.num_pages)" : "",
        word & MSAIDX_BAD_NVP ? " visible pages exceed desc.pitch or desc.bt_stride" : "");
}

msaidx_status msaidx_num_valid_pages(const msaidx_context *context, const int32_t *cu_seqlens_q,
                                     const int32_t *seq_lens, int32_t batch_size,
                                     int32_t num_tokens, int32_t *nvp, void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    MSAIDX_CHECK(check_pointer(cu_seqlens_q, 4, "cu_seqlens_q"));
    MSAIDX_CHECK(check_pointer(seq_lens, 4, "seq_lens"));
    if (batch_size < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "batch_size = %d: negative", batch_size);
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    if (num_tokens > 0) MSAIDX_CHECK(check_pointer(nvp, 4, "nvp"));
    return context->ops->num_valid_pages(context, cu_seqlens_q, seq_lens, batch_size, num_tokens,
                                         nvp, stream);
}

msaidx_status msaidx_topk_select(const msaidx_context *context, const float *scores, int32_t pitch,
                                 const int32_t *nvp, int32_t num_tokens, int32_t *out,
                                 void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (pitch < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "pitch = %d: must be >= 1", pitch);
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    if (num_tokens == 0) return MSAIDX_SUCCESS; /* empty tensors may carry NULL data pointers */
    MSAIDX_CHECK(check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(check_pointer(nvp, 4, "nvp"));
    MSAIDX_CHECK(check_pointer(out, 4, "out"));
    return context->ops->topk(context, scores, pitch, nvp, num_tokens, out,
                              (int64_t)context->config.num_heads * context->config.topk,
                              context->config.topk, stream);
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

msaidx_status msaidx_topk_select_strided(const msaidx_context *context, const float *scores,
                                         int32_t pitch, const int32_t *nvp, int32_t num_tokens,
                                         int32_t *out, int64_t out_stride_t, int64_t out_stride_h,
                                         void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (pitch < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "pitch = %d: must be >= 1", pitch);
    if (num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens = %d: negative", num_tokens);
    MSAIDX_CHECK(check_row_strides(out_stride_t, out_stride_h, num_tokens,
                                   context->config.num_heads, context->config.topk));
    if (num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(check_pointer(nvp, 4, "nvp"));
    MSAIDX_CHECK(check_pointer(out, 4, "out"));
    return context->ops->topk(context, scores, pitch, nvp, num_tokens, out, out_stride_t,
                              out_stride_h, stream);
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

/* The score area of msaidx_prefill_topk with scores = NULL: every backend scores into it and
 * selects from it (none has a fused path yet). SIZE_MAX on overflow. */
static size_t score_area_bytes(const msaidx_plan *plan) {
    const size_t cells = msaidx_size_mul(
        msaidx_size_mul((size_t)plan->desc.num_tokens, (size_t)plan->context->config.num_heads),
        (size_t)plan->desc.pitch);
    const size_t bytes = msaidx_size_mul(cells, sizeof(float));
    return bytes == SIZE_MAX ? SIZE_MAX : msaidx_align_up(bytes, 256);
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
    const size_t area = score_area_bytes(plan);
    if (area == SIZE_MAX)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: T = %d x H = %d x desc.pitch = %d scores do not fit in size_t",
                           plan->desc.num_tokens, plan->context->config.num_heads,
                           plan->desc.pitch);
    *bytes = area;
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
    MSAIDX_CHECK(check_topk_params("args", args->topk, forced ? args->init_blocks : 0,
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

/* msaidx_prefill_topk (candidate_scores NULL) and msaidx_prefill_topk_candidates. */
static msaidx_status run_prefill_topk(const msaidx_plan *plan, const void *q, const void *k_cache,
                                      const msaidx_topk_args *args, float *scores, int32_t *out,
                                      float *candidate_scores, void *stream) {
    if (!plan) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "plan: NULL pointer");
    const bool candidates = candidate_scores != NULL;
    const bool sharded = plan->desc.cp_world > 1;
    if (sharded && !candidates)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: context parallel (desc.cp_world = %d) forces global pages: use "
                           "msaidx_prefill_topk_candidates, then msaidx_merge_candidates",
                           plan->desc.cp_world);
    msaidx_context context;
    int64_t stride_t = 0, stride_h = 0;
    MSAIDX_CHECK(check_topk_args(plan->context, plan->desc.num_tokens, args, !candidates, &context,
                                 &stride_t, &stride_h));
    if (!plan->workspace)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: no batch planned (call msaidx_plan_batch first)");
    if (plan->desc.num_tokens == 0) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(check_pointer(q, 16, "q"));
    MSAIDX_CHECK(check_pointer(k_cache, 16, "k_cache"));
    if (scores) MSAIDX_CHECK(check_pointer(scores, 4, "scores"));
    MSAIDX_CHECK(check_pointer(out, 4, candidates ? "candidate_pages" : "out"));
    if (candidates) MSAIDX_CHECK(check_pointer(candidate_scores, 4, "candidate_scores"));
    size_t needed = 0;
    MSAIDX_CHECK(msaidx_prefill_topk_workspace_size(plan, scores != NULL, &needed));
    if (needed) {
        MSAIDX_CHECK(check_pointer(args->workspace, 16, "args.workspace"));
        if (args->workspace_bytes < needed)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.workspace_bytes = %zu: the call needs %zu with scores %s "
                               "(msaidx_prefill_topk_workspace_size)",
                               args->workspace_bytes, needed, scores ? "given" : "= NULL");
    }
    const msaidx_backend_ops *ops = plan->context->ops;
    float *target = scores ? scores : (float *)args->workspace;
    const int32_t *nvp =
        (const int32_t *)((const char *)plan->workspace + msaidx_workspace_nvp_offset());
    MSAIDX_CHECK(ops->scores(plan, q, k_cache, target, false, stream));
    MSAIDX_CHECK(ops->topk(&context, target, plan->desc.pitch, nvp, plan->desc.num_tokens, out,
                           stride_t, stride_h, stream));
    if (!candidates) return MSAIDX_SUCCESS;
    MSAIDX_CHECK(ops->candidate_scores(&context, target, plan->desc.pitch, plan->desc.num_tokens,
                                       out, candidate_scores, stride_t, stride_h, stream));
    if (!sharded) return MSAIDX_SUCCESS;
    return ops->global_pages(plan, out, args->topk, stride_t, stride_h, stream);
}

msaidx_status msaidx_prefill_topk(const msaidx_plan *plan, const void *q, const void *k_cache,
                                  const msaidx_topk_args *args, float *scores, int32_t *out,
                                  void *stream) {
    return run_prefill_topk(plan, q, k_cache, args, scores, out, NULL, stream);
}

msaidx_status msaidx_prefill_topk_candidates(const msaidx_plan *plan, const void *q,
                                             const void *k_cache, const msaidx_topk_args *args,
                                             float *scores, float *candidate_scores,
                                             int32_t *candidate_pages, void *stream) {
    if (!candidate_scores)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "candidate_scores: NULL pointer");
    return run_prefill_topk(plan, q, k_cache, args, scores, candidate_pages, candidate_scores,
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
    MSAIDX_CHECK(check_pointer(nvp, 4, "nvp"));
    MSAIDX_CHECK(check_pointer(candidate_scores, 4, "candidate_scores"));
    MSAIDX_CHECK(check_pointer(candidate_pages, 4, "candidate_pages"));
    MSAIDX_CHECK(check_pointer(out, 4, "out"));
    if (!context->ops->merge_candidates)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "msaidx_merge_candidates: backend %s has no context-parallel merge",
                           context->ops->name);
    return context->ops->merge_candidates(&merging, world_size, num_tokens, nvp, candidate_scores,
                                          candidate_pages, rank_stride, out, stride_t, stride_h,
                                          stream);
}
