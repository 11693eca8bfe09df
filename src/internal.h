/* Shared host-side internals: the context and plan objects, the backend table, errors. */
#ifndef MSAIDX_INTERNAL_H
#define MSAIDX_INTERNAL_H

#include "msaidx.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSAIDX_MAX_HEADS 16
#define MSAIDX_MAX_TOPK 64
/* Bounds of config.num_threads (documented at the field). */
#define MSAIDX_MAX_THREADS 1024
#define MSAIDX_THREADS_PER_CORE 4

/* Records `message` as this thread's last error and returns `status`. */
msaidx_status msaidx_fail(msaidx_status status, const char *format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void msaidx_clear_error(void);

/* Returns the status of `call` from the calling function when it is not MSAIDX_SUCCESS. */
#define MSAIDX_CHECK(call)                                                                         \
    do {                                                                                           \
        msaidx_status check_status_ = (call);                                                      \
        if (check_status_ != MSAIDX_SUCCESS) return check_status_;                                 \
    } while (0)

/* The check of an option struct that begins with its own size: `name`.struct_size must be
 * sizeof(type), else INVALID_ARGUMENT with a message that names type##_init. */
msaidx_status msaidx_check_struct_size(const char *name, size_t given, size_t expected,
                                       const char *type);
#define MSAIDX_CHECK_STRUCT_SIZE(name, ptr, type)                                                  \
    msaidx_check_struct_size(name, (ptr)->struct_size, sizeof(type), #type)

/* Argument checks of the public API shared by context.c, plan.c, dispatch.c and index_prepare.c. */

/* topk in [1, MSAIDX_MAX_TOPK], init/local blocks >= 0 and together at most topk; `owner` names
 * the struct in the messages ("config", "args"). */
static inline msaidx_status msaidx_check_topk_params(const char *owner, int32_t topk,
                                                     int32_t init_blocks, int32_t local_blocks) {
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

/* A pointer argument of the public API: `name` (as the message calls it) must be non-NULL and
 * `alignment`-byte aligned. */
static inline msaidx_status msaidx_check_pointer(const void *pointer, size_t alignment,
                                                 const char *name) {
    if (!pointer) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s: NULL pointer", name);
    if ((uintptr_t)pointer % alignment)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s = %p: not %zu-byte aligned", name,
                           pointer, alignment);
    return MSAIDX_SUCCESS;
}

/* A paged key cache of num_pages pages, page_stride bytes apart: at least one page, each stride a
 * multiple of 16 bytes (TMA and 16-byte loads) and at least min_stride, the bytes of one page of
 * keys; every page's offset within 64 bits. `owner` names the struct in the messages ("desc",
 * "args"). */
static inline msaidx_status msaidx_check_page_geometry(const char *owner, int32_t num_pages,
                                                       int64_t page_stride, int64_t min_stride) {
    if (num_pages < 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "%s.num_pages = %d: must be >= 1", owner,
                           num_pages);
    if (page_stride < min_stride || page_stride % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "%s.page_stride = %lld bytes: must be a multiple of 16 and >= "
                           "page_size * head_dim * element size = %lld",
                           owner, (long long)page_stride, (long long)min_stride);
    if (page_stride > INT64_MAX / num_pages)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "%s.page_stride = %lld bytes: %s.num_pages = %d pages of it overflow a "
                           "64-bit offset",
                           owner, (long long)page_stride, owner, num_pages);
    return MSAIDX_SUCCESS;
}

/* The largest config.head_dim a context takes (the cpu backend sizes stack buffers by it). */
#define MSAIDX_MAX_HEAD_DIM 256

static inline int32_t msaidx_elem_size(msaidx_dtype dtype) {
    return dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
}

/* Whether a context's E4M3 dots may sum on FP8 tensor cores (SPEC section 3's default precision);
 * `config` is a context's resolved config. */
static inline bool msaidx_fp8_accumulation(const msaidx_config *config) {
    return config->dtype == MSAIDX_DTYPE_E4M3 && config->precision == MSAIDX_PRECISION_DEFAULT;
}

/* The page-shard helpers below (and merge_candidates.h) run on the host and in CUDA kernels. */
#ifdef __CUDACC__
#define MSAIDX_SHARD_FN static inline __host__ __device__
#else
#define MSAIDX_SHARD_FN static inline
#endif

/* A request's logical pages: P = ceil(seq_len / page_size), in 64 bits then back (seq_len is
 * an int32 >= 0). */
MSAIDX_SHARD_FN int32_t msaidx_request_pages(int32_t seq_len, int32_t page_size) {
    return (int32_t)(((int64_t)seq_len + page_size - 1) / page_size);
}

/* The pages one rank owns (msaidx_batch_desc.cp_*): world 1 owns everything. */
typedef struct msaidx_page_shard {
    int32_t world, rank;
    msaidx_cp_layout layout;
} msaidx_page_shard;

static inline msaidx_page_shard msaidx_shard_of(const msaidx_batch_desc *desc) {
    msaidx_page_shard shard = {1, 0, MSAIDX_CP_INTERLEAVED};
    if (desc->cp_world > 1) {
        shard.world = desc->cp_world;
        shard.rank = desc->cp_rank;
        shard.layout = (msaidx_cp_layout)desc->cp_layout;
    }
    return shard;
}
/* The contiguous layout's pages per rank for a request of request_pages pages. */
MSAIDX_SHARD_FN int64_t msaidx_shard_chunk(msaidx_page_shard s, int32_t request_pages) {
    return ((int64_t)request_pages + s.world - 1) / s.world;
}
/* The most pages a row of a plan's batch can have (its nvp, its score columns): the rank's
 * ceil(P / W) of the P pages of desc.max_seq_len, in either layout. */
static inline int64_t msaidx_plan_row_pages(const msaidx_batch_desc *desc, int32_t page_size) {
    return msaidx_shard_chunk(msaidx_shard_of(desc),
                              msaidx_request_pages(desc->max_seq_len, page_size));
}
/* How many of the pages [0, n) of a request of request_pages pages the rank owns. */
MSAIDX_SHARD_FN int32_t msaidx_shard_count(msaidx_page_shard s, int32_t request_pages, int32_t n) {
    if (s.layout == MSAIDX_CP_CONTIGUOUS) {
        const int64_t chunk = msaidx_shard_chunk(s, request_pages), owned = n - s.rank * chunk;
        return (int32_t)(owned < 0 ? 0 : owned < chunk ? owned : chunk);
    }
    return n > s.rank ? (int32_t)(((int64_t)n - s.rank + s.world - 1) / s.world) : 0;
}
/* The rank's local index of global page p (its block-table entry and score column), or -1. */
MSAIDX_SHARD_FN int32_t msaidx_shard_local(msaidx_page_shard s, int32_t request_pages, int32_t p) {
    if (s.layout == MSAIDX_CP_CONTIGUOUS) {
        const int64_t chunk = msaidx_shard_chunk(s, request_pages), local = p - s.rank * chunk;
        return local >= 0 && local < chunk ? (int32_t)local : -1;
    }
    return p % s.world == s.rank ? p / s.world : -1;
}
/* The global page of the rank's local index i. */
MSAIDX_SHARD_FN int32_t msaidx_shard_global(msaidx_page_shard s, int32_t request_pages, int32_t i) {
    if (s.layout == MSAIDX_CP_CONTIGUOUS)
        return (int32_t)(s.rank * msaidx_shard_chunk(s, request_pages) + i);
    return (int32_t)((int64_t)i * s.world + s.rank);
}

typedef struct msaidx_backend_ops msaidx_backend_ops;

struct msaidx_context {
    msaidx_config config; /* backend resolved: never AUTO */
    const msaidx_backend_ops *ops;
    int32_t num_sms; /* CUDA: multiprocessors of config.device; 0 on the host */
};

struct msaidx_plan {
    /* The plan's own copy of its context (a context is values only), so that destroying the
     * caller's context while plans live leaves them working. */
    msaidx_context context_copy;
    const msaidx_context *context; /* &context_copy */
    msaidx_batch_desc desc;
    size_t workspace_bytes;
    /* Bound by msaidx_plan_batch. */
    const int32_t *cu_seqlens_q;
    const int32_t *seq_lens;
    const int32_t *block_table;
    void *workspace;
};

/* A non-NULL plan must have a batch planned (msaidx_plan_batch binds its workspace) before the
 * calls that read that batch. */
static inline msaidx_status msaidx_check_planned(const msaidx_plan *plan) {
    if (!plan->workspace)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "plan: no batch planned (call msaidx_plan_batch first)");
    return MSAIDX_SUCCESS;
}

/*
 * Every workspace begins with this header; the backend owns the bytes after it.
 * nvp [T] follows the header at msaidx_workspace_nvp().
 */
typedef struct msaidx_workspace_header {
    uint32_t error_word; /* MSAIDX_BAD_* bits, set on the device */
    uint32_t reserved[3];
} msaidx_workspace_header;

static inline size_t msaidx_align_up(size_t bytes, size_t alignment) {
    return (bytes + alignment - 1) / alignment * alignment;
}
/* Size arithmetic on caller-provided counts: SIZE_MAX (never a valid size) on overflow, and
 * SIZE_MAX stays SIZE_MAX through further steps. */
static inline size_t msaidx_size_add(size_t a, size_t b) {
    return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}
static inline size_t msaidx_size_mul(size_t a, size_t b) {
    if (a == SIZE_MAX || b == SIZE_MAX) return SIZE_MAX;
    return b != 0 && a > SIZE_MAX / b ? SIZE_MAX : a * b;
}
/* Bytes of T x H score rows of `pitch` floats (SIZE_MAX on overflow). */
static inline size_t msaidx_score_bytes(int32_t num_tokens, int32_t num_heads, int32_t pitch) {
    return msaidx_size_mul(
        msaidx_size_mul(msaidx_size_mul((size_t)num_tokens, (size_t)num_heads), (size_t)pitch),
        sizeof(float));
}
/* Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte (no overflow for
 * sizes up to SIZE_MAX; an empty or NULL range shares none). */
static inline bool msaidx_ranges_overlap(const void *a, size_t a_bytes, const void *b,
                                         size_t b_bytes) {
    if (!a || !b || !a_bytes || !b_bytes) return false;
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x >= y ? x - y < b_bytes : y - x < a_bytes;
}
/* MSAIDX_ERROR_INVALID_ARGUMENT naming the written buffer `name_a` when the two ranges share a
 * byte (the header's overlap rule). */
static inline msaidx_status msaidx_check_disjoint(const char *name_a, const void *a, size_t a_bytes,
                                                  const char *name_b, const void *b,
                                                  size_t b_bytes) {
    if (!msaidx_ranges_overlap(a, a_bytes, b, b_bytes)) return MSAIDX_SUCCESS;
    return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                       "%s = %p (%zu bytes) overlaps %s = %p (%zu bytes)", name_a, a, a_bytes,
                       name_b, b, b_bytes);
}
/* A buffer of a batch's metadata: cu_seqlens_q [B + 1], seq_lens [B], block_table [B, bt_stride]
 * int32 (bytes SIZE_MAX on overflow). */
typedef struct msaidx_span {
    const char *name;
    const void *pointer;
    size_t bytes;
} msaidx_span;
enum { MSAIDX_METADATA_SPANS = 3 };
static inline void msaidx_metadata_spans(const msaidx_batch_desc *d, const int32_t *cu_seqlens_q,
                                         const int32_t *seq_lens, const int32_t *block_table,
                                         msaidx_span spans[MSAIDX_METADATA_SPANS]) {
    const size_t B = (size_t)d->batch_size;
    const char *names[MSAIDX_METADATA_SPANS] = {"cu_seqlens_q", "seq_lens", "block_table"};
    const int32_t *pointers[MSAIDX_METADATA_SPANS] = {cu_seqlens_q, seq_lens, block_table};
    const size_t bytes[MSAIDX_METADATA_SPANS] = {
        sizeof(int32_t) * (B + 1), sizeof(int32_t) * B,
        msaidx_size_mul(sizeof(int32_t) * B, (size_t)d->bt_stride)};
    for (int i = 0; i < MSAIDX_METADATA_SPANS; ++i) {
        spans[i].name = names[i];
        spans[i].pointer = pointers[i];
        spans[i].bytes = bytes[i];
    }
}
/* Whether [a, a + a_bytes) shares a byte with one of `count` blocks [b + r * stride,
 * + b_bytes), r < count, stride >= b_bytes (a gather of ranks' rows): O(1) for any count. */
static inline bool msaidx_ranges_overlap_strided(const void *a, size_t a_bytes, const void *b,
                                                 size_t b_bytes, size_t stride, size_t count) {
    if (!a || !b || !a_bytes || !b_bytes || !count) return false;
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    if (x + a_bytes <= y) return false;
    /* The first block that ends past x; the ones before it end at or before x. */
    const size_t first = x >= y + b_bytes ? (x - y - b_bytes) / stride + 1 : 0;
    return first < count && y + first * stride < x + a_bytes;
}
static inline size_t msaidx_workspace_nvp_offset(void) { return sizeof(msaidx_workspace_header); }
static inline size_t msaidx_workspace_common_bytes(int32_t num_tokens) {
    return msaidx_align_up(sizeof(msaidx_workspace_header) + sizeof(int32_t) * (size_t)num_tokens,
                           256);
}

/*
 * A backend: a table of function pointers (like ggml's backends) so that dispatch and tests can
 * force each one. Arguments reaching these have passed the shared validation in context.c,
 * plan.c and dispatch.c.
 */
struct msaidx_backend_ops {
    msaidx_backend id;
    const char *name;
    bool on_device; /* buffers live in CUDA device memory */
    /* SUCCESS when admitted for `config`, else NOT_SUPPORTED naming the failed rule. */
    msaidx_status (*supports)(const msaidx_config *config);
    /* Fill context fields that depend on the machine (e.g. num_sms). */
    msaidx_status (*init_context)(msaidx_context *context);
    /* Bytes of workspace; SIZE_MAX when the batch's bounds make it overflow size_t. */
    size_t (*workspace_size)(const msaidx_plan *plan);
    msaidx_status (*plan)(msaidx_plan *plan, void *stream);
    msaidx_status (*scores)(const msaidx_plan *plan, const void *q, const void *k_cache,
                            float *scores, bool decode, void *stream);
    msaidx_status (*num_valid_pages)(const msaidx_context *context, const int32_t *cu_seqlens_q,
                                     const int32_t *seq_lens, int32_t batch_size,
                                     int32_t num_tokens, int32_t *nvp, void *stream);
    /* Row (t, h) of the output at out + t * out_stride_t + h * out_stride_h (int32 elements).
     * max_nvp <= pitch bounds every row's nvp (msaidx_topk_select_bounded; a plan's rows:
     * msaidx_plan_row_pages): the CUDA top-k picks its kernels by it and leaves rows above it
     * all -1, the cpu backend refuses them. */
    msaidx_status (*topk)(const msaidx_context *context, const float *scores, int32_t pitch,
                          int32_t max_nvp, const int32_t *nvp, int32_t num_tokens, int32_t *out,
                          int64_t out_stride_t, int64_t out_stride_h, void *stream);
    /* The candidates of msaidx_prefill_topk_candidates from the selection just written into
     * `pages` (the plan's rows; context's topk; row (t, h) at t * stride_t + h * stride_h): each
     * slot's score of its row (NaN as -inf, -inf beside -1) into candidate_scores at the same
     * place, and on a sharded plan (desc.cp_world > 1) each page >= 0 rewritten in place from the
     * rank's score column to its global page id. One pass (one kernel on a CUDA backend). */
    msaidx_status (*candidates)(const msaidx_plan *plan, const msaidx_context *context,
                                const float *scores, int32_t *pages, float *candidate_scores,
                                int64_t stride_t, int64_t stride_h, void *stream);
    /* Reads the device error word of the plan's workspace (host call, synchronises). */
    msaidx_status (*read_error_word)(const msaidx_plan *plan, void *stream, uint32_t *word);
    /* msaidx_merge_candidates, arguments validated; `context` carries args' topk/init/local.
     * After the required ops, so tables that leave it out get NULL: a backend that does not shard
     * (plans with desc.cp_world > 1 are then NOT_SUPPORTED). */
    msaidx_status (*merge_candidates)(const msaidx_context *context, int32_t world_size,
                                      int32_t num_tokens, const int32_t *nvp,
                                      const float *candidate_scores, const int32_t *candidate_pages,
                                      int64_t rank_stride, int32_t *out, int64_t stride_t,
                                      int64_t stride_h, void *stream);
    /* msaidx_prefill_topk and msaidx_prefill_topk_candidates without a score buffer where the
     * backend fuses them (NULL: the scores op, then the topk op): the scores op's scores into
     * `scores`, all of them (the candidates op reads its picks' scores there), and their
     * selection, bitwise, into `out` (row (t, h) at t * stride_t + h * stride_h), `context`
     * carrying the call's topk / init / local, max_nvp as for topk. `scores` (the plan's score
     * span) and `extra` (fused_topk_extra_bytes(plan) bytes, 256-byte aligned) are the call's
     * workspace. Last, so tables that leave them out get NULL. */
    size_t (*fused_topk_extra_bytes)(const msaidx_plan *plan);
    msaidx_status (*fused_topk)(const msaidx_plan *plan, const msaidx_context *context,
                                const void *q, const void *k_cache, float *scores, void *extra,
                                int32_t max_nvp, int32_t *out, int64_t stride_t, int64_t stride_h,
                                void *stream);
};

extern const msaidx_backend_ops msaidx_cpu_backend;
#ifdef MSAIDX_WITH_CUDA
extern const msaidx_backend_ops msaidx_dense_backend;
extern const msaidx_backend_ops msaidx_split_backend;
#endif
#ifdef MSAIDX_WITH_PERSISTENT
extern const msaidx_backend_ops msaidx_persistent_backend;
/* The deal of a persistent plan's batch (src/cuda/persistent_schedule.h): its chunk size and task
 * count, read back once `stream` has run the plan. For tests and reports: it synchronizes the
 * stream, so it is never on a run path. A decode-only batch has no deal: 0 and 0. */
msaidx_status msaidx_persistent_deal(const msaidx_plan *plan, void *stream, int32_t *chunk_pages,
                                     int32_t *num_tasks);
#endif

/* The backend compiled in for `id`, or NULL. */
const msaidx_backend_ops *msaidx_find_backend(msaidx_backend id);

/* MSAIDX_COS_SIN_THETA: pair i's rotation per position, theta^(-i/32) / (2 pi) turns, in 0.64
 * fixed point (src/rope_theta.h); theta >= 1. */
#define MSAIDX_ROPE_PAIRS 32
void msaidx_rope_turns(double theta, uint64_t turns[MSAIDX_ROPE_PAIRS]);

/* msaidx_index_prepare on host memory and on the context's CUDA device; arguments validated by
 * src/index_prepare.c, num_tokens > 0. */
msaidx_status msaidx_cpu_index_prepare(const msaidx_context *context,
                                       const msaidx_index_prepare_args *args);
#ifdef MSAIDX_WITH_CUDA
msaidx_status msaidx_cuda_index_prepare(const msaidx_context *context,
                                        const msaidx_index_prepare_args *args, void *stream);
#endif

/* A call of a device backend runs with config.device as the thread's current CUDA device
 * whatever the caller's is (the NULL stream, the kernels' attributes and the launches all follow
 * the current device). msaidx_device_enter switches to it only when the caller's is another one;
 * msaidx_device_leave then makes the caller's CUDA context current again exactly (none, if none
 * was), so no context is created on a device the caller never used. */
typedef struct msaidx_device_scope {
    void *previous_context; /* the caller's CUcontext, valid when switched */
    bool switched;
} msaidx_device_scope;
#ifdef MSAIDX_WITH_CUDA
msaidx_status msaidx_cuda_device_enter(int32_t device, msaidx_device_scope *scope);
msaidx_status msaidx_cuda_device_leave(const msaidx_device_scope *scope, msaidx_status status);
#endif
static inline msaidx_status msaidx_device_enter(const msaidx_context *context,
                                                msaidx_device_scope *scope) {
    scope->switched = false;
    scope->previous_context = NULL;
#ifdef MSAIDX_WITH_CUDA
    if (context->ops->on_device) return msaidx_cuda_device_enter(context->config.device, scope);
#else
    (void)context;
#endif
    return MSAIDX_SUCCESS;
}
/* `status` (the call's), or the failure to switch back when the call succeeded. */
static inline msaidx_status msaidx_device_leave(const msaidx_device_scope *scope,
                                                msaidx_status status) {
#ifdef MSAIDX_WITH_CUDA
    if (scope->switched) return msaidx_cuda_device_leave(scope, status);
#else
    (void)scope;
#endif
    return status;
}

#ifdef __cplusplus
}
#endif

#endif /* MSAIDX_INTERNAL_H */
