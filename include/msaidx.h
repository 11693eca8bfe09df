/*
 * msaidx: the MiniMax-M3 sparse-attention lightning indexer.
 *
 * One public header. Semantics are those of SPEC.md: per query token and index head, the
 * max over each visible 128-key page of dot(q, k) (FP32 accumulation of exact E4M3 or BF16
 * products), then top-k block selection with forced init/local blocks.
 *
 * Conventions (in the manner of cuBLASLt and NCCL):
 *  - every function that takes something it can check returns an msaidx_status; on failure
 *    msaidx_last_error() (thread-local) holds a message naming the bad argument. The library
 *    never aborts and never prints. The *_init helpers (a NULL struct is a no-op) and the host
 *    conversions msaidx_*_from_float / _to_float (n elements at src and dst, as memcpy) return
 *    nothing.
 *  - structs that may grow begin with their own size (set by the *_init helpers).
 *  - device calls take the stream last (a cudaStream_t passed as void *; NULL is the
 *    per-thread default stream, never the legacy one). The cpu backend ignores it.
 *  - all buffers are caller-owned; workspaces have size queries. After plan creation nothing
 *    allocates, synchronises or copies to the host, so plan + run can be captured in a CUDA graph.
 *  - what a call writes (outputs, workspaces) must share no memory with what it reads or with
 *    each other, except msaidx_merge_candidates in place (its comment). The calls refuse the
 *    overlaps they can see with MSAIDX_ERROR_INVALID_ARGUMENT naming the buffer written: with a
 *    plan's workspace or metadata, between one call's outputs, and of a selection over the scores
 *    or candidates it reads. They compare each buffer's span from its first to its last byte
 *    used, so layouts that interleave without touching are refused too.
 *  - threads and streams: a context holds values only, so any number of threads may use one
 *    at once. The calls that take a const plan only read it and its workspace: several threads
 *    and streams may run them on one plan at once, each call with its own outputs (and
 *    msaidx_topk_args workspace). msaidx_plan_batch rewrites the plan and its workspace: no
 *    other call on that plan may run meanwhile, on the host or (stream order, as for any buffer)
 *    on the device. Destroying a context or plan frees host memory only: work already queued on
 *    a stream is unaffected.
 */
#ifndef MSAIDX_H
#define MSAIDX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MSAIDX_VERSION_MAJOR / _MINOR / _PATCH / _STRING, generated from CMake's project version. */
#include "msaidx_version.h"

/* Marks the library's exported functions; everything else in it is hidden. */
#ifndef MSAIDX_API
#if defined(__GNUC__) || defined(__clang__)
#define MSAIDX_API __attribute__((visibility("default")))
#else
#define MSAIDX_API
#endif
#endif

typedef enum msaidx_status {
    MSAIDX_SUCCESS = 0,
    MSAIDX_ERROR_INVALID_ARGUMENT = 1, /* a pointer, size, shape or host-side metadata is bad */
    MSAIDX_ERROR_NOT_SUPPORTED = 2,    /* valid, but the chosen backend does not admit it */
    MSAIDX_ERROR_BAD_METADATA = 3,     /* device-side metadata check failed (see plan_check) */
    MSAIDX_ERROR_CUDA = 4,             /* a CUDA runtime call failed */
    MSAIDX_ERROR_OUT_OF_MEMORY = 5,    /* host allocation at create time failed */
    MSAIDX_ERROR_INTERNAL = 6
} msaidx_status;

/* Static name of a status ("MSAIDX_ERROR_INVALID_ARGUMENT", ...). */
MSAIDX_API const char *msaidx_status_string(msaidx_status status);
/* MSAIDX_VERSION_STRING of the library as it was built: a binding that loads it at run time
 * compares it with the version it was written for. */
MSAIDX_API const char *msaidx_version(void);
/* Message of the last failed call on this thread ("" if none). Valid until the next call. */
MSAIDX_API const char *msaidx_last_error(void);

typedef enum msaidx_dtype {
    MSAIDX_DTYPE_E4M3 = 0, /* FP8 E4M3 "fn" (OCP): 1 byte */
    MSAIDX_DTYPE_BF16 = 1  /* bfloat16: 2 bytes */
} msaidx_dtype;

typedef enum msaidx_backend {
    MSAIDX_BACKEND_AUTO = 0,  /* cpu on the host; persistent if admitted, else dense, on a GPU */
    MSAIDX_BACKEND_CPU = 1,   /* host memory, exact reference semantics, threaded + SIMD */
    MSAIDX_BACKEND_DENSE = 2, /* CUDA: one CTA walks a query tile's whole causal range */
    MSAIDX_BACKEND_SPLIT = 3, /* CUDA: page range split over CTAs; bitwise equal to dense */
    MSAIDX_BACKEND_PERSISTENT = 4 /* CUDA sm_90a: persistent TMA + wgmma FP8 scorer */
} msaidx_backend;

#define MSAIDX_DEVICE_HOST (-1)

/* How a backend sums each dot (SPEC.md section 3). */
typedef enum msaidx_precision {
    /* The fastest accumulation the backend has, within a documented bound: `persistent` sums
     * E4M3 x E4M3 with Hopper's FP8 tensor cores (each dot within
     * MSAIDX_FP8_ACCUMULATION_DOT_BOUND * sum_d |q_d * k_d|; top-k differs from the exact
     * selection only among pages that close); every other backend and BF16 are exact. */
    MSAIDX_PRECISION_DEFAULT = 0,
    /* FP32 sums of the exact products on every backend: |S - ref| <= 2e-4 * max(1, |ref|) +
     * 2^-16 * sum_d |q_d * k_d| against an FP64 reference. */
    MSAIDX_PRECISION_EXACT = 1
} msaidx_precision;

/* Fixed per context: the model's indexer shape and the backend choice. */
typedef struct msaidx_config {
    size_t struct_size;     /* sizeof(msaidx_config) */
    int32_t head_dim;       /* D: 128 (cpu: any multiple of 16 in [16, 256]) */
    int32_t page_size;      /* tokens per page = block: 128 (cpu: multiple of 16 in [16, 512]) */
    int32_t num_heads;      /* H index heads per GPU: 1..16 (persistent: 1, 2 or 4) */
    int32_t topk;           /* 1..64 (MiniMax-M3: 16) */
    int32_t init_blocks;    /* always-selected leading blocks (0) */
    int32_t local_blocks;   /* always-selected trailing blocks (1); init + local <= topk */
    msaidx_dtype dtype;     /* of q and the key cache */
    msaidx_backend backend; /* AUTO, or a forced backend */
    int32_t device;         /* CUDA device ordinal, or MSAIDX_DEVICE_HOST for host memory. Calls
                               run on it whatever the thread's current device, which they leave
                               as they found it; a stream passed must belong to it */
    int32_t num_threads;    /* cpu backend worker threads; 0 = all online cores; at most 1024
                               and at most 4 per online core (more is INVALID_ARGUMENT) */
    /* Deprecated spelling of `precision`, accepted for one release: -1 (set by
     * msaidx_config_init) follows `precision`; 1 means MSAIDX_PRECISION_DEFAULT, 0 means
     * MSAIDX_PRECISION_EXACT. 1 together with MSAIDX_PRECISION_EXACT is INVALID_ARGUMENT. */
    int32_t fast_accumulation;
    msaidx_precision precision; /* MSAIDX_PRECISION_DEFAULT (set by msaidx_config_init) or EXACT */
} msaidx_config;

/* With FP8 accumulation each dot is within this times A = sum_d |q_d * k_d| of the exact value.
 * Why: a k32 E4M3 wgmma aligns its 32 products and the running sum to the largest exponent among
 * them and truncates below 2^-13 of it (measured on the H200 by tests/gpu_fp8_accumulation.c),
 * so each of the 128 products and the 3 carried sums of a 128-dim dot loses less than 2^-13 times
 * the largest term, which is at most A: 131 * 2^-13. The worst error measured there, on data built
 * to make every product lose almost a whole unit, is 0.0076 * A (2.1x under the bound). */
#define MSAIDX_FP8_ACCUMULATION_DOT_BOUND (131.0 / 8192.0)
/* Deprecated name of MSAIDX_FP8_ACCUMULATION_DOT_BOUND. */
#define MSAIDX_FAST_ACCUMULATION_DOT_BOUND MSAIDX_FP8_ACCUMULATION_DOT_BOUND

/* Fill with MiniMax-M3 defaults: D 128, page 128, H 4, top-16, init 0, local 1, E4M3, AUTO,
 * host memory, all cores, MSAIDX_PRECISION_DEFAULT. */
MSAIDX_API void msaidx_config_init(msaidx_config *config);

typedef struct msaidx_context msaidx_context;

/* A CUDA context (config.device >= 0) runs each call in the CUDA context current on that device
 * at the call: the device's primary context, as torch and the runtime API use, or one the caller
 * made current (a driver-API context), whichever was current when the msaidx context was created.
 * Every buffer of a call must belong to that CUDA context. tests/gpu_cuda_context.c checks both
 * on every CUDA backend: bitwise the same results. */
MSAIDX_API msaidx_status msaidx_context_create(msaidx_context **context,
                                               const msaidx_config *config);
/* NULL is a no-op. Plans made from the context keep a copy of what they need of it and stay
 * usable after it is destroyed. */
MSAIDX_API msaidx_status msaidx_context_destroy(msaidx_context *context);
/* The backend that AUTO resolved to (or the forced one). */
MSAIDX_API msaidx_status msaidx_context_backend(const msaidx_context *context,
                                                msaidx_backend *backend);
/* Static name: "auto", "cpu", "dense", "split", "persistent". */
MSAIDX_API const char *msaidx_backend_name(msaidx_backend backend);
/* Whether `backend` is admitted for `config` on this build and machine. On NOT_SUPPORTED
 * msaidx_last_error() names the failed rule. */
MSAIDX_API msaidx_status msaidx_backend_supported(msaidx_backend backend,
                                                  const msaidx_config *config);

/* Upper bounds and layouts of a batch: everything the host knows without reading metadata. */
typedef struct msaidx_batch_desc {
    size_t struct_size;  /* sizeof(msaidx_batch_desc) */
    int32_t batch_size;  /* B: requests; cu_seqlens_q has B + 1 entries, seq_lens B */
    int32_t num_tokens;  /* T: rows of q and scores; tokens at or past cu_seqlens_q[B] are
                            padding (nvp = 0, never scored, top-k all -1) */
    int32_t max_q_len;   /* upper bound on any request's q_len (<= num_tokens) */
    int32_t max_seq_len; /* upper bound on any seq_lens[b] */
    int32_t num_pages;   /* physical pages in the key cache */
    int32_t bt_stride;   /* block_table row stride, in int32 entries */
    int64_t page_stride; /* bytes between key-cache pages: >= page_size*head_dim*elem, % 16 == 0 */
    int32_t pitch;       /* score row pitch in floats: >= the largest nvp */
    /* Context parallel (SPEC.md section 12, docs/context_parallel.md): this plan scores only the
     * logical pages rank cp_rank of cp_world owns. cp_world 0 or 1 is off (cp_rank must be 0).
     * Sharded, each block_table row lists only the rank's own pages of the request, in order
     * (entry i = the i-th page the rank owns); cu_seqlens_q, seq_lens and positions stay global;
     * score column i of row t is the i-th owned page and nvp[t] counts the owned pages < the
     * global nvp. bt_stride and pitch need only hold ceil(pages of max_seq_len / cp_world).
     * Every backend shards (CUDA: prefill and decode scorers alike). Callers built before these
     * fields (struct_size of the struct ending at pitch) get cp_world = 0. */
    int32_t cp_world;
    int32_t cp_rank;
    int32_t cp_layout; /* an msaidx_cp_layout */
} msaidx_batch_desc;

/* Which logical pages rank r of W owns; a request has P = ceil(seq_len / page_size) pages. */
typedef enum msaidx_cp_layout {
    MSAIDX_CP_INTERLEAVED = 0, /* page j on rank j mod W */
    MSAIDX_CP_CONTIGUOUS = 1   /* pages [r * C, min((r + 1) * C, P)), C = ceil(P / W) */
} msaidx_cp_layout;

MSAIDX_API void msaidx_batch_desc_init(msaidx_batch_desc *desc);

/*
 * A plan binds a context to a batch shape. Create it once (host allocation, no device work);
 * msaidx_plan_batch then plans each batch on the stream from device-resident metadata, and
 * msaidx_prefill_scores / msaidx_decode_scores run once per layer.
 */
typedef struct msaidx_plan msaidx_plan;

MSAIDX_API msaidx_status msaidx_plan_create(msaidx_plan **plan, msaidx_context *context,
                                            const msaidx_batch_desc *desc);
MSAIDX_API msaidx_status msaidx_plan_destroy(msaidx_plan *plan); /* NULL is a no-op */
/* Bytes of caller-owned workspace the plan needs (in the context's memory space). */
MSAIDX_API msaidx_status msaidx_plan_workspace_size(const msaidx_plan *plan, size_t *bytes);

/*
 * Plan one batch. cu_seqlens_q [B+1], seq_lens [B] and block_table [B, bt_stride] are int32,
 * 4-byte aligned, in the context's memory space; they must stay valid (and may be rewritten in
 * place between graph replays) while the plan is used. The workspace must be 16-byte aligned.
 * cpu: the metadata is validated now and errors name the offending entry; the plan keeps a
 * copy of what it validated (cu_seqlens_q, seq_lens and the visible block-table entries, in
 * the workspace), and the scores calls use that copy: metadata rewritten in place after
 * msaidx_plan_batch takes effect at the next msaidx_plan_batch.
 * CUDA: validation runs on the device; bad requests are skipped and recorded in an error word
 * that msaidx_plan_check reads later.
 */
MSAIDX_API msaidx_status msaidx_plan_batch(msaidx_plan *plan, const int32_t *cu_seqlens_q,
                                           const int32_t *seq_lens, const int32_t *block_table,
                                           void *workspace, size_t workspace_bytes, void *stream);

/* Scores of every visible page: scores[(t*H + h)*pitch + p] for p < nvp[t]; cells with
 * p >= nvp are never written. q is [T, H, D] (16-byte aligned), k_cache [num_pages, page, D]
 * with desc->page_stride bytes between pages (16-byte aligned), scores fp32 (4-byte aligned).
 * With desc.num_tokens = 0 nothing is read or written and the pointers may be NULL (as are the
 * data pointers of empty tensors); likewise for top-k and num_valid_pages with num_tokens = 0. */
MSAIDX_API msaidx_status msaidx_prefill_scores(const msaidx_plan *plan, const void *q,
                                               const void *k_cache, float *scores, void *stream);
/* Same contract, decode-shaped work (short q_lens): a launch grid that depends only on the
 * batch description, split over pages so a few rows at long context use the whole GPU. */
MSAIDX_API msaidx_status msaidx_decode_scores(const msaidx_plan *plan, const void *q,
                                              const void *k_cache, float *scores, void *stream);

/* nvp [T] of the last planned batch, inside the workspace (context's memory space); on a
 * context-parallel plan the pages this rank owns among the visible ones (its score columns). */
MSAIDX_API msaidx_status msaidx_plan_nvp(const msaidx_plan *plan, const int32_t **nvp);

/* Host call, after the plan's work: synchronises the stream and reports device-side metadata
 * errors of the last msaidx_plan_batch (MSAIDX_ERROR_BAD_METADATA, message lists them). */
MSAIDX_API msaidx_status msaidx_plan_check(const msaidx_plan *plan, void *stream);

/* Error bits of the device error word (msaidx_plan_check decodes them). */
enum {
    MSAIDX_BAD_CU_SEQLENS = 1u << 0,  /* cu_seqlens_q[0] != 0 or decreasing */
    MSAIDX_BAD_SEQ_LEN = 1u << 1,     /* seq_len < 0, q_len > seq_len or seq_len > max_seq_len */
    MSAIDX_BAD_TOKEN_COUNT = 1u << 2, /* cu_seqlens_q[B] > num_tokens or q_len > max_q_len */
    MSAIDX_BAD_PAGE_ID = 1u << 3,     /* a visible block_table entry outside [0, num_pages) */
    MSAIDX_BAD_NVP = 1u << 4          /* visible pages exceed pitch or bt_stride */
};

/* nvp[t] for t < num_tokens: pages visible to token t, 0 for padding tokens. */
MSAIDX_API msaidx_status msaidx_num_valid_pages(const msaidx_context *context,
                                                const int32_t *cu_seqlens_q,
                                                const int32_t *seq_lens, int32_t batch_size,
                                                int32_t num_tokens, int32_t *nvp, void *stream);

/* Top-k block selection (SPEC.md section 4) of scores [T, H, pitch] with nvp [T]:
 * out [T, H, topk] int32, ascending logical page ids, -1 tail padding. */
MSAIDX_API msaidx_status msaidx_topk_select(const msaidx_context *context, const float *scores,
                                            int32_t pitch, const int32_t *nvp, int32_t num_tokens,
                                            int32_t *out, void *stream);

/* Host conversions. float -> E4M3 is round-to-nearest-even and saturating (+-448, NaN -> 0x7F);
 * float -> BF16 is round-to-nearest-even, NaN kept quiet. The arrays need no alignment. */
MSAIDX_API void msaidx_e4m3_from_float(const float *src, uint8_t *dst, size_t n);
MSAIDX_API void msaidx_e4m3_to_float(const uint8_t *src, float *dst, size_t n);
MSAIDX_API void msaidx_bf16_from_float(const float *src, uint16_t *dst, size_t n);
MSAIDX_API void msaidx_bf16_to_float(const uint16_t *src, float *dst, size_t n);

/* msaidx_topk_select writing row (t, h) at out + t * out_stride_t + h * out_stride_h (strides in
 * int32 elements; each row's topk entries contiguous), so `out` may be a strided view such as the
 * transpose of an [H, T, topk] buffer. Strides are >= 0 and rows must not overlap: of the two
 * dimensions with extent > 1, the one with the smaller stride has stride >= topk and the other a
 * stride >= the first's stride times its extent. msaidx_topk_select is (H * topk, topk). */
MSAIDX_API msaidx_status msaidx_topk_select_strided(const msaidx_context *context,
                                                    const float *scores, int32_t pitch,
                                                    const int32_t *nvp, int32_t num_tokens,
                                                    int32_t *out, int64_t out_stride_t,
                                                    int64_t out_stride_h, void *stream);

/* msaidx_topk_select_strided for a batch whose rows have at most max_nvp pages (1 <= max_nvp <=
 * pitch; the pages of its longest request, from the max_seq_len it was planned with). Engines
 * size the pitch for their longest context whatever a batch holds (vLLM: 8192 pages); the CUDA
 * top-k picks its kernels by max_nvp (on an H200, a batch at 8K context under the 8192 pitch
 * is then selected as fast as under its own pitch). A row with nvp > max_nvp is all -1 on the
 * device (INVALID_ARGUMENT on the cpu backend), as a row with nvp > pitch.
 * msaidx_topk_select_strided is max_nvp = pitch. */
MSAIDX_API msaidx_status msaidx_topk_select_bounded(const msaidx_context *context,
                                                    const float *scores, int32_t pitch,
                                                    int32_t max_nvp, const int32_t *nvp,
                                                    int32_t num_tokens, int32_t *out,
                                                    int64_t out_stride_t, int64_t out_stride_h,
                                                    void *stream);

/*
 * Scores and top-k of one layer (SPEC.md sections 3 and 4) in one call, with the score buffer
 * optional. The selection is bitwise what msaidx_topk_select (with these topk, init_blocks and
 * local_blocks) gives on the scores msaidx_prefill_scores writes on the same plan; `scores`, when
 * given, receives exactly those scores. With scores = NULL the caller keeps no score buffer: the
 * backends score into the workspace of msaidx_topk_args, sized by
 * msaidx_prefill_topk_workspace_size from the plan's bounds alone (so the call stays graph safe),
 * then select from it; where the plan's max_seq_len leaves no row more than topk pages (every row
 * then takes all its pages), they score nothing. `persistent` fuses the two where rows are long
 * and many (more candidates than a warp holds, more rows than a wave of its top-k's CTAs, at
 * least 2^24 score cells: rows x the plan's pages a row): its scorer also keeps each row's maximum
 * over each of its tasks' page chunks, and the top-k of such a row reads those maxima and then only
 * the chunks that can hold a chosen page.
 */
typedef struct msaidx_topk_args {
    size_t struct_size;   /* sizeof(msaidx_topk_args) */
    int32_t topk;         /* 1..64 entries per row (MiniMax-M3: 16) */
    int32_t init_blocks;  /* always-selected leading blocks (0) */
    int32_t local_blocks; /* always-selected trailing blocks (1); init + local <= topk */
    /* Row (t, h) of the outputs at t * out_stride_t + h * out_stride_h elements, each row's topk
     * entries contiguous; both 0 (set by msaidx_topk_args_init) mean contiguous [T, H, topk].
     * Rows must not overlap (the rule of msaidx_topk_select_strided). */
    int64_t out_stride_t;
    int64_t out_stride_h;
    /* msaidx_prefill_topk_workspace_size bytes in the context's memory space, 16-byte aligned
     * (NULL when that size is 0); nothing else may use it while the call's work runs. */
    void *workspace;
    size_t workspace_bytes;
} msaidx_topk_args;

/* Zeroes the fields, then struct_size, topk = 16, init_blocks = 0, local_blocks = 1. */
MSAIDX_API void msaidx_topk_args_init(msaidx_topk_args *args);

/* Bytes of msaidx_topk_args.workspace that msaidx_prefill_topk and msaidx_prefill_topk_candidates
 * need on `plan`: `with_scores` = 1 for calls given a score buffer, 0 for calls with scores =
 * NULL (then T * H * desc.pitch floats, on `persistent` plus T * H * ceil(desc.pitch / 8) for its
 * chunk maxima). With no score buffer desc.pitch sets only these rows: a plan whose pitch is the
 * pages of its desc.max_seq_len (the least it admits) needs the smallest workspace, as the
 * Python Plan does for such calls. */
MSAIDX_API msaidx_status msaidx_prefill_topk_workspace_size(const msaidx_plan *plan,
                                                            int32_t with_scores, size_t *bytes);

/* The selection [T, H, topk] int32 (SPEC.md section 4, logical page ids) of the planned batch
 * into `out`; q, k_cache and scores (may be NULL) as msaidx_prefill_scores. */
MSAIDX_API msaidx_status msaidx_prefill_topk(const msaidx_plan *plan, const void *q,
                                             const void *k_cache, const msaidx_topk_args *args,
                                             float *scores, int32_t *out, void *stream);

/* Per row, the best args->topk pages with their scores: what a context-parallel merge (SPEC.md
 * section 12) gathers from every rank. Forced pages are NOT applied here (init_blocks and
 * local_blocks are ignored): the merge forces the global init/local pages itself. Row (t, h):
 * min(topk, nvp[t]) distinct logical page ids (of this plan's block table; a rank maps them to
 * global pages) in ascending order, then -1 padding; each page's score in candidate_scores at
 * the same position, NaN written as -inf, and -inf beside every -1. "Best" is SPEC section 4's
 * order: higher score first, NaN as -inf, ties to the lower page, so the pages are
 * msaidx_topk_select's with init_blocks = local_blocks = 0. Both outputs use args->out_stride_t /
 * out_stride_h. On a context-parallel plan (desc.cp_world > 1) the pages are GLOBAL logical page
 * ids (positions in the unsharded request), ascending, among the pages the rank owns: what
 * msaidx_merge_candidates takes. msaidx_prefill_topk refuses such plans (its forced pages are
 * global: merge instead). With scores = NULL, `persistent` selects as msaidx_prefill_topk does
 * (from chunk maxima where rows are long and many; a rank counts its own pages a row). */
MSAIDX_API msaidx_status msaidx_prefill_topk_candidates(const msaidx_plan *plan, const void *q,
                                                        const void *k_cache,
                                                        const msaidx_topk_args *args, float *scores,
                                                        float *candidate_scores,
                                                        int32_t *candidate_pages, void *stream);

/*
 * The context-parallel merge (SPEC.md section 12): from the candidates of world_size ranks,
 * gathered rank after rank (rank r's [T, H, args->topk] rows, contiguous, at r * rank_stride
 * elements of candidate_scores and candidate_pages, as msaidx_prefill_topk_candidates wrote them
 * with global page ids), the selection [T, H, args->topk] that msaidx_prefill_topk makes over
 * the whole cache with args->topk, init_blocks and local_blocks: bitwise the same ids. nvp [T]
 * are the GLOBAL visible pages (msaidx_num_valid_pages of the batch's metadata). Forced pages
 * come from nvp alone; candidates with pages outside [init_blocks, nvp - local_blocks) or -1 are
 * ignored, and a page sent more than once counts once, at its highest score (so the ids do not
 * depend on where a candidate sits in the gather). H is the context's num_heads; every rank's
 * candidates must have been made with this args->topk. out uses args->out_stride_t / out_stride_h;
 * args->workspace is unused. Every backend merges: on a CUDA context all pointers are device memory
 * and the merge is one kernel on `stream` (no allocation, graph safe), bitwise the cpu merge on any
 * input. rank_stride >= T * H * args->topk. out shares no memory with the inputs, except that it
 * may be candidate_pages itself with the contiguous layout (the merge in place over rank 0's rows).
 */
MSAIDX_API msaidx_status msaidx_merge_candidates(const msaidx_context *context,
                                                 const msaidx_topk_args *args, int32_t world_size,
                                                 int32_t num_tokens, const int32_t *nvp,
                                                 const float *candidate_scores,
                                                 const int32_t *candidate_pages,
                                                 int64_t rank_stride, int32_t *out, void *stream);

/*
 * Index Q/K preparation (SPEC.md section 11): per token, each of the H index-query heads and the
 * one index key (128 BF16 values each) is Gemma-RMSNormed (x * rsqrt(mean(x^2) + eps) * (1 + w)),
 * rotated by partial NeoX RoPE on dims [0, 64) by its position's angles (a row of a cos/sin
 * table, or computed from the RoPE theta in the call), and cast
 * straight from FP32 to the cache dtype (E4M3 saturating or BF16, round-to-nearest-even). The
 * queries go to q_out; the key is written into the paged key cache at its slot. One pass over
 * memory; the CUDA kernel runs on the caller's stream, allocates nothing and is graph-safe.
 *
 * Accuracy: evaluated in FP32, so that every backend writes the same bytes; each output is the
 * FP64 value's rounding or one step from it, except where RoPE cancels far below its terms (the
 * output is then within 2^-20 of the terms, not of itself) and for vectors outside FP32's range
 * for their sum of squares: an RMS above about 1.6e18 (the vector comes out 0), or squares below
 * FP32's normal range with eps < 2^-100 (docs/index_prepare.md). Projections stay far inside.
 *
 * Bad input found in the data (all backends): a token whose position lies outside
 * [0, max_position) is skipped whole (its q_out rows and its key are not written); a key whose
 * slot is neither -1 (skip, not an error) nor inside [0, num_pages * page_size) is not written.
 * Both are recorded as MSAIDX_BAD_PREPARE_* bits OR-ed into *error_word when it is given. The
 * cpu backend also returns MSAIDX_ERROR_INVALID_ARGUMENT naming the first bad token, after
 * writing every good one; the CUDA kernel cannot return it, so pass an error_word (a 4-byte
 * device word the caller zeroes and reads later) to learn of them.
 */
typedef enum msaidx_cos_sin_format {
    MSAIDX_COS_SIN_FP32 = 0, /* float [max_position, 64] */
    MSAIDX_COS_SIN_BF16 = 1, /* bfloat16 [max_position, 64] */
    /* No table (cos_sin_cache NULL): the call computes the cos and sin of
     * positions[t] * rope_theta^(-2i/64) itself, each within 1.5 FP32 ulps (a table stored in FP32
     * is within half an ulp), for positions below MSAIDX_ROPE_THETA_MAX_POSITION. It reads
     * 256 bytes a token less than an FP32 table. */
    MSAIDX_COS_SIN_THETA = 2
} msaidx_cos_sin_format;

/* The largest max_position of MSAIDX_COS_SIN_THETA (2^24): the angle of position p carries the
 * FP64 inverse frequency's rounding, p * 2^-53 relative, under 2^-29 radians below it. */
#define MSAIDX_ROPE_THETA_MAX_POSITION (1 << 24)

/* Bits of msaidx_index_prepare_args.error_word. */
enum {
    MSAIDX_BAD_PREPARE_POSITION = 1u << 8, /* positions[t] outside [0, max_position) */
    MSAIDX_BAD_PREPARE_SLOT = 1u << 9      /* slot_mapping[t] outside the cache and not -1 */
};

typedef struct msaidx_index_prepare_args {
    size_t struct_size; /* sizeof(msaidx_index_prepare_args) */
    int32_t num_tokens; /* T (0: nothing is read or written, pointers may be NULL) */
    /* BF16 [T, H, 128], heads contiguous within a token; q_in_token_stride elements between
     * tokens (>= H * 128, a multiple of 8: the inputs are slices of one fused projection). */
    const void *q_in;
    int64_t q_in_token_stride;
    const void *k_in; /* BF16 [T, 128], k_in_token_stride (>= 128, % 8 == 0) */
    int64_t k_in_token_stride;
    const int64_t *positions;  /* [T], rows of cos_sin_cache (or RoPE positions, theta) */
    const void *q_norm_weight; /* BF16 [128] */
    const void *k_norm_weight; /* BF16 [128] */
    /* [max_position, 64] contiguous, per row [cos(32) | sin(32)] of the rotary angles; NULL with
     * MSAIDX_COS_SIN_THETA. */
    const void *cos_sin_cache;
    msaidx_cos_sin_format cos_sin_format;
    int64_t max_position;        /* positions must lie in [0, max_position) */
    const int64_t *slot_mapping; /* [T]: slot = page * page_size + offset; -1 skips the key */
    /* The context's dtype, [num_pages, page_size, 128] with page_stride bytes between pages
     * (>= page_size * 128 * element size, % 16 == 0). */
    void *k_cache;
    int64_t page_stride;
    int32_t num_pages;
    void *q_out;          /* the context's dtype, [T, H, 128] contiguous */
    float eps;            /* RMSNorm epsilon, finite and >= 0 (MiniMax-M3: 1e-6) */
    uint32_t *error_word; /* NULL, or a 4-byte word (context's memory space) */
    /* MSAIDX_COS_SIN_THETA: the RoPE base, finite and >= 1 (MiniMax-M3: 5e6); pair i of position
     * p rotates by p * rope_theta^(-2i/64) radians. Ignored with a table. */
    double rope_theta;
} msaidx_index_prepare_args;

/* Zeroes the fields and sets struct_size, eps = 1e-6 and cos_sin_format = FP32. */
MSAIDX_API void msaidx_index_prepare_args_init(msaidx_index_prepare_args *args);

/* Pointers live in the context's memory space (host for cpu, the context's device for CUDA) and
 * are 16-byte aligned (positions, slot_mapping: 8; error_word: 4). H = config.num_heads; the
 * context's head_dim must be 128. */
MSAIDX_API msaidx_status msaidx_index_prepare(const msaidx_context *context,
                                              const msaidx_index_prepare_args *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MSAIDX_H */
