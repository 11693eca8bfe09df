/* Every validation error path of the public API: the right status, a message naming the
 * argument, nothing written on failure (poisoned outputs stay poisoned), no abort. */
#include "backend_cases.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static void expect_fail(msaidx_status got, msaidx_status want, const char *needle, const char *call,
                        int line) {
    CHECK(got == want, "line %d: %s returned %s, want %s (%s)", line, call,
          msaidx_status_string(got), msaidx_status_string(want), msaidx_last_error());
    CHECK(strstr(msaidx_last_error(), needle) != NULL,
          "line %d: %s: message \"%s\" does not name \"%s\"", line, call, msaidx_last_error(),
          needle);
}
#define EXPECT_FAIL(call, status, needle) expect_fail((call), (status), (needle), #call, __LINE__)
#define EXPECT_INVALID(call, needle) EXPECT_FAIL(call, MSAIDX_ERROR_INVALID_ARGUMENT, needle)

static void *zeroed(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) exit(2);
    memset(p, 0, (bytes + 63) / 64 * 64 + 64);
    return p;
}

static long unpoisoned(const float *scores, size_t count) {
    long written = 0;
    for (size_t i = 0; i < count; ++i) written += !bc_is_poison(scores[i]);
    return written;
}

static void status_strings(void) {
    static const struct {
        msaidx_status status;
        const char *name;
    } names[] = {
        {MSAIDX_SUCCESS, "MSAIDX_SUCCESS"},
        {MSAIDX_ERROR_INVALID_ARGUMENT, "MSAIDX_ERROR_INVALID_ARGUMENT"},
        {MSAIDX_ERROR_NOT_SUPPORTED, "MSAIDX_ERROR_NOT_SUPPORTED"},
        {MSAIDX_ERROR_BAD_METADATA, "MSAIDX_ERROR_BAD_METADATA"},
        {MSAIDX_ERROR_CUDA, "MSAIDX_ERROR_CUDA"},
        {MSAIDX_ERROR_OUT_OF_MEMORY, "MSAIDX_ERROR_OUT_OF_MEMORY"},
        {MSAIDX_ERROR_INTERNAL, "MSAIDX_ERROR_INTERNAL"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i) {
        const char *got = msaidx_status_string(names[i].status);
        CHECK(got && strcmp(got, names[i].name) == 0, "status %d named \"%s\"",
              (int)names[i].status, got ? got : "(null)");
    }
    const char *unknown = msaidx_status_string((msaidx_status)99);
    CHECK(unknown != NULL && strstr(unknown, "MSAIDX_SUCCESS") == NULL, "unknown status named %s",
          unknown ? unknown : "(null)");
    static const char *backends[] = {"auto", "cpu", "dense", "split", "persistent"};
    for (int b = 0; b < 5; ++b)
        CHECK(strcmp(msaidx_backend_name((msaidx_backend)b), backends[b]) == 0, "backend %d: %s", b,
              msaidx_backend_name((msaidx_backend)b));
    CHECK(msaidx_backend_name((msaidx_backend)42) != NULL, "unknown backend name is NULL");
    CHECK(strcmp(msaidx_version(), MSAIDX_VERSION_STRING) == 0, "msaidx_version() = %s, header %s",
          msaidx_version(), MSAIDX_VERSION_STRING);
}

static void config_errors(void) {
    msaidx_config good;
    msaidx_config_init(&good);
    msaidx_context *context = (msaidx_context *)&good; /* must come back NULL */
    EXPECT_INVALID(msaidx_context_create(NULL, &good), "context: NULL");
    EXPECT_INVALID(msaidx_context_create(&context, NULL), "config: NULL");
    CHECK(context == NULL, "context not NULLed on failure");
    EXPECT_INVALID(msaidx_backend_supported(MSAIDX_BACKEND_CPU, NULL), "config: NULL");

    msaidx_config c;
#define BAD_CONFIG(field_assignment, needle)                                                       \
    do {                                                                                           \
        c = good;                                                                                  \
        field_assignment;                                                                          \
        context = (msaidx_context *)&good;                                                         \
        EXPECT_INVALID(msaidx_context_create(&context, &c), needle);                               \
        CHECK(context == NULL, "context not NULLed on failure (%s)", needle);                      \
        EXPECT_INVALID(msaidx_backend_supported(MSAIDX_BACKEND_CPU, &c), needle);                  \
    } while (0)
    BAD_CONFIG(c.struct_size = sizeof c - 4, "config.struct_size");
    BAD_CONFIG(c.struct_size = 0, "config.struct_size");
    BAD_CONFIG(c.head_dim = 0, "config.head_dim");
    BAD_CONFIG(c.head_dim = 8, "config.head_dim");
    BAD_CONFIG(c.head_dim = 24, "config.head_dim");
    BAD_CONFIG(c.head_dim = 272, "config.head_dim");
    BAD_CONFIG(c.head_dim = -128, "config.head_dim");
    BAD_CONFIG(c.page_size = 0, "config.page_size");
    BAD_CONFIG(c.page_size = 100, "config.page_size");
    BAD_CONFIG(c.page_size = 528, "config.page_size");
    BAD_CONFIG(c.num_heads = 0, "config.num_heads");
    BAD_CONFIG(c.num_heads = 17, "config.num_heads");
    BAD_CONFIG(c.num_heads = -4, "config.num_heads");
    BAD_CONFIG(c.topk = 0, "config.topk");
    BAD_CONFIG(c.topk = 65, "config.topk");
    BAD_CONFIG(c.init_blocks = -1, "config.init_blocks");
    BAD_CONFIG(c.local_blocks = -1, "config.local_blocks");
    BAD_CONFIG((c.topk = 2, c.init_blocks = 2, c.local_blocks = 1),
               "config.init_blocks + config.local_blocks");
    BAD_CONFIG(c.dtype = (msaidx_dtype)7, "config.dtype");
    BAD_CONFIG(c.dtype = (msaidx_dtype)-1, "config.dtype");
    BAD_CONFIG(c.backend = (msaidx_backend)9, "config.backend");
    BAD_CONFIG(c.backend = (msaidx_backend)-1, "config.backend");
    BAD_CONFIG(c.device = -2, "config.device");
    BAD_CONFIG(c.num_threads = -1, "config.num_threads");
    BAD_CONFIG(c.precision = (msaidx_precision)2, "config.precision");
    BAD_CONFIG(c.precision = (msaidx_precision)-1, "config.precision");
    BAD_CONFIG(c.fast_accumulation = 2, "config.fast_accumulation");
    BAD_CONFIG(c.fast_accumulation = -2, "config.fast_accumulation");
    BAD_CONFIG((c.fast_accumulation = 1, c.precision = MSAIDX_PRECISION_EXACT),
               "config.fast_accumulation");
#undef BAD_CONFIG

    /* Edges that are valid on the cpu backend. */
    static const int32_t valid[][3] = {{16, 16, 1}, {256, 512, 16}, {48, 272, 3}};
    for (int i = 0; i < 3; ++i) {
        c = good;
        c.head_dim = valid[i][0];
        c.page_size = valid[i][1];
        c.num_heads = valid[i][2];
        c.topk = i == 1 ? 64 : 1;
        c.init_blocks = i == 1 ? 32 : 0;
        c.local_blocks = i == 1 ? 32 : (i == 0 ? 1 : 0);
        c.dtype = i == 2 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
        context = NULL;
        CHECK_OK(msaidx_context_create(&context, &c));
        msaidx_context_destroy(context);
    }

    /* Forcing a backend that is not compiled in or not admitted names the rule. */
    c = good;
    msaidx_backend device_backends[] = {MSAIDX_BACKEND_DENSE, MSAIDX_BACKEND_SPLIT,
                                        MSAIDX_BACKEND_PERSISTENT};
    for (int i = 0; i < 3; ++i) {
        c.backend = device_backends[i];
        bool compiled = false;
#ifdef MSAIDX_WITH_CUDA
        compiled = device_backends[i] != MSAIDX_BACKEND_PERSISTENT;
#endif
#ifdef MSAIDX_WITH_PERSISTENT
        compiled = true;
#endif
        const char *rule = compiled ? "needs a CUDA device" : "not compiled";
        context = (msaidx_context *)&good;
        EXPECT_FAIL(msaidx_context_create(&context, &c), MSAIDX_ERROR_NOT_SUPPORTED, rule);
        CHECK(context == NULL, "context not NULLed on NOT_SUPPORTED");
        EXPECT_FAIL(msaidx_context_create(&context, &c), MSAIDX_ERROR_NOT_SUPPORTED,
                    msaidx_backend_name(device_backends[i]));
        EXPECT_FAIL(msaidx_backend_supported(device_backends[i], &good), MSAIDX_ERROR_NOT_SUPPORTED,
                    rule);
    }
    c = good;
    c.backend = MSAIDX_BACKEND_CPU;
    c.device = 0;
    EXPECT_FAIL(msaidx_context_create(&context, &c), MSAIDX_ERROR_NOT_SUPPORTED,
                "config.device = 0");
    EXPECT_INVALID(msaidx_backend_supported((msaidx_backend)99, &good), "backend = 99");
    CHECK_OK(msaidx_backend_supported(MSAIDX_BACKEND_CPU, &good));
    CHECK_OK(msaidx_backend_supported(MSAIDX_BACKEND_AUTO, &good));

    CHECK_OK(msaidx_context_create(&context, &good));
    msaidx_backend resolved = MSAIDX_BACKEND_AUTO;
    EXPECT_INVALID(msaidx_context_backend(NULL, &resolved), "context: NULL");
    EXPECT_INVALID(msaidx_context_backend(context, NULL), "backend: NULL");
    CHECK_OK(msaidx_context_backend(context, &resolved));
    CHECK(resolved == MSAIDX_BACKEND_CPU, "AUTO on the host resolved to %s",
          msaidx_backend_name(resolved));
    CHECK_OK(msaidx_context_destroy(context));
    CHECK_OK(msaidx_context_destroy(NULL));
    CHECK_OK(msaidx_plan_destroy(NULL));
    msaidx_config_init(NULL);
    msaidx_batch_desc_init(NULL);
}

/* A valid batch with room to break: B = 3, H = 2, request 1 has >= 4 pages. */
static const int32_t q_lens[3] = {5, 3, 2}, prefixes[3] = {300, 600, 10};

static bc_batch *valid_batch(harness_rng *rng) {
    bc_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.name = "validation";
    spec.dtype = MSAIDX_DTYPE_E4M3;
    spec.num_heads = 2;
    spec.head_dim = 128;
    spec.page_size = 128;
    spec.topk = 16;
    spec.local_blocks = 1;
    spec.batch_size = 3;
    for (int b = 0; b < 3; ++b) {
        spec.q_lens[b] = q_lens[b];
        spec.prefixes[b] = prefixes[b];
    }
    spec.pad_tokens = 2;
    spec.extra_pages = 2;
    bc_batch *batch = bc_build(&spec, rng);
    /* Tight bounds so each one can be exceeded by one. */
    batch->desc.max_q_len = 5;
    batch->desc.max_seq_len = 603;
    return batch;
}

static void desc_errors(bc_batch *batch) {
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &batch->config));
    msaidx_plan *plan = (msaidx_plan *)batch;
    const msaidx_batch_desc good = batch->desc;
    EXPECT_INVALID(msaidx_plan_create(NULL, context, &good), "plan: NULL");
    EXPECT_INVALID(msaidx_plan_create(&plan, NULL, &good), "context: NULL");
    CHECK(plan == NULL, "plan not NULLed on failure");
    EXPECT_INVALID(msaidx_plan_create(&plan, context, NULL), "desc: NULL");
    msaidx_batch_desc d;
#define BAD_DESC(assignment, needle)                                                               \
    do {                                                                                           \
        d = good;                                                                                  \
        assignment;                                                                                \
        plan = (msaidx_plan *)batch;                                                               \
        EXPECT_INVALID(msaidx_plan_create(&plan, context, &d), needle);                            \
        CHECK(plan == NULL, "plan not NULLed on failure (%s)", needle);                            \
    } while (0)
    BAD_DESC(d.struct_size = 8, "desc.struct_size");
    BAD_DESC(d.batch_size = -1, "desc.batch_size");
    BAD_DESC(d.num_tokens = -1, "desc.num_tokens");
    BAD_DESC(d.max_q_len = -1, "desc.max_q_len");
    BAD_DESC(d.max_q_len = d.num_tokens + 1, "desc.max_q_len");
    BAD_DESC(d.max_seq_len = -1, "desc.max_seq_len");
    BAD_DESC(d.num_pages = 0, "desc.num_pages");
    BAD_DESC(d.bt_stride = 4, "desc.bt_stride");
    BAD_DESC(d.bt_stride = 0, "desc.bt_stride");
    BAD_DESC(d.pitch = 4, "desc.pitch");
    BAD_DESC(d.pitch = 0, "desc.pitch");
    BAD_DESC((d.max_seq_len = INT32_MAX, d.bt_stride = INT32_MAX), "desc.pitch");
    BAD_DESC(d.page_stride = 128 * 128 - 16, "desc.page_stride");
    BAD_DESC(d.page_stride = 128 * 128 + 8, "desc.page_stride");
    BAD_DESC(d.page_stride = -16, "desc.page_stride");
#undef BAD_DESC
    /* BF16 pages need twice the bytes. */
    msaidx_config bf16 = batch->config;
    bf16.dtype = MSAIDX_DTYPE_BF16;
    msaidx_context *bf16_context = NULL;
    CHECK_OK(msaidx_context_create(&bf16_context, &bf16));
    EXPECT_INVALID(msaidx_plan_create(&plan, bf16_context, &good), "desc.page_stride");
    msaidx_context_destroy(bf16_context);
    msaidx_context_destroy(context);
}

/* Restores the batch's metadata after a test broke it. */
typedef struct saved_meta {
    int32_t cu[4], seq[3], bt[64];
} saved_meta;

static void save(const bc_batch *b, saved_meta *s) {
    memcpy(s->cu, b->cu_seqlens_q, sizeof s->cu);
    memcpy(s->seq, b->seq_lens, sizeof s->seq);
    memcpy(s->bt, b->block_table, sizeof(int32_t) * 3 * (size_t)b->desc.bt_stride);
}
static void restore(bc_batch *b, const saved_meta *s) {
    memcpy(b->cu_seqlens_q, s->cu, sizeof s->cu);
    memcpy(b->seq_lens, s->seq, sizeof s->seq);
    memcpy(b->block_table, s->bt, sizeof(int32_t) * 3 * (size_t)b->desc.bt_stride);
}

static void run_errors(bc_batch *batch) {
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_context_create(&context, &batch->config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    size_t bytes = 0;
    EXPECT_INVALID(msaidx_plan_workspace_size(NULL, &bytes), "plan: NULL");
    EXPECT_INVALID(msaidx_plan_workspace_size(plan, NULL), "bytes: NULL");
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK(bytes >= 16 + sizeof(int32_t) * (size_t)batch->desc.num_tokens, "workspace %zu bytes",
          bytes);
    char *workspace = zeroed(bytes + 64);
    const size_t cells = bc_score_count(batch);
    float *scores = zeroed(sizeof(float) * (cells + 64));
    bc_poison(scores, cells + 64);
    const int32_t *cu = batch->cu_seqlens_q, *seq = batch->seq_lens, *bt = batch->block_table;
    const int32_t T = batch->desc.num_tokens, H = batch->config.num_heads;

    /* Nothing planned yet: every run refuses. */
    EXPECT_INVALID(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL),
                   "no batch planned");
    EXPECT_INVALID(msaidx_decode_scores(plan, batch->q, batch->k_cache, scores, NULL),
                   "no batch planned");
    const int32_t *nvp = NULL;
    EXPECT_INVALID(msaidx_plan_nvp(plan, &nvp), "no batch planned");
    EXPECT_INVALID(msaidx_plan_check(plan, NULL), "no batch planned");
    EXPECT_INVALID(msaidx_plan_nvp(NULL, &nvp), "plan: NULL");
    EXPECT_INVALID(msaidx_plan_nvp(plan, NULL), "nvp: NULL");
    EXPECT_INVALID(msaidx_plan_check(NULL, NULL), "plan: NULL");

    /* Pointer arguments of plan_batch. */
    const char *c_cu = (const char *)cu, *c_seq = (const char *)seq, *c_bt = (const char *)bt;
    EXPECT_INVALID(msaidx_plan_batch(NULL, cu, seq, bt, workspace, bytes, NULL), "plan: NULL");
    EXPECT_INVALID(msaidx_plan_batch(plan, NULL, seq, bt, workspace, bytes, NULL),
                   "cu_seqlens_q: NULL");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, NULL, bt, workspace, bytes, NULL), "seq_lens: NULL");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, NULL, workspace, bytes, NULL),
                   "block_table: NULL");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, NULL, bytes, NULL), "workspace: NULL");
    EXPECT_INVALID(
        msaidx_plan_batch(plan, (const int32_t *)(c_cu + 2), seq, bt, workspace, bytes, NULL),
        "not 4-byte aligned");
    EXPECT_INVALID(
        msaidx_plan_batch(plan, cu, (const int32_t *)(c_seq + 1), bt, workspace, bytes, NULL),
        "seq_lens = ");
    EXPECT_INVALID(
        msaidx_plan_batch(plan, cu, seq, (const int32_t *)(c_bt + 3), workspace, bytes, NULL),
        "block_table = ");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, workspace + 4, bytes, NULL),
                   "not 16-byte aligned");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, workspace + 8, bytes, NULL),
                   "workspace = ");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, workspace, bytes - 1, NULL),
                   "workspace_bytes");
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, workspace, 0, NULL), "workspace_bytes");
    EXPECT_INVALID(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL),
                   "no batch planned");

    /* Metadata errors name the entry; a failed plan leaves nothing planned. */
    saved_meta saved;
    save(batch, &saved);
    int32_t *mcu = batch->cu_seqlens_q, *mseq = batch->seq_lens, *mbt = batch->block_table;
    const int32_t stride = batch->desc.bt_stride;
#define BAD_META(assignment, needle)                                                               \
    do {                                                                                           \
        restore(batch, &saved);                                                                    \
        assignment;                                                                                \
        EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, bt, workspace, bytes, NULL), needle);      \
        EXPECT_INVALID(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL),        \
                       "no batch planned");                                                        \
    } while (0)
    BAD_META(mcu[0] = 1, "cu_seqlens_q[0]");
    BAD_META(mcu[0] = -1, "cu_seqlens_q[0]");
    BAD_META(mcu[2] = mcu[1] - 1, "cu_seqlens_q[2]");
    BAD_META(mcu[3] = T + 1, "num_tokens");
    BAD_META((mcu[3] = T + 1, mseq[2] = 100), "cu_seqlens_q[3]");
    BAD_META(mseq[1] = -1, "seq_lens[1]");
    BAD_META(mseq[2] = 1, "seq_lens[2]");
    BAD_META(mseq[0] = q_lens[0] - 1, "q_len");
    BAD_META(mseq[1] = 604, "desc.max_seq_len");
    BAD_META((mcu[1] = 6, mcu[2] = 8, mseq[0] = 400), "desc.max_q_len");
    BAD_META(mbt[1 * stride + 3] = batch->desc.num_pages, "block_table[1][3]");
    BAD_META(mbt[1 * stride + 3] = -1, "block_table[1][3]");
    BAD_META(mbt[2 * stride + 0] = INT32_MIN, "block_table[2][0]");
    BAD_META(mbt[0 * stride + 2] = INT32_MAX, "block_table[0][2]");
#undef BAD_META
    restore(batch, &saved);
    /* Entries past a request's pages are never read: garbage there is fine. */
    mbt[2 * stride + 1] = -99;
    mbt[0 * stride + 3] = INT32_MAX;
    CHECK_OK(msaidx_plan_batch(plan, cu, seq, bt, workspace, bytes, NULL));
    CHECK(unpoisoned(scores, cells + 64) == 0, "failed calls wrote %ld score cells",
          unpoisoned(scores, cells + 64));

    /* Pointer arguments of the runs, now that a batch is planned. */
    const char *q = batch->q, *k = batch->k_cache;
    char *s = (char *)scores;
    for (int decode = 0; decode < 2; ++decode) {
        msaidx_status (*run)(const msaidx_plan *, const void *, const void *, float *, void *) =
            decode ? msaidx_decode_scores : msaidx_prefill_scores;
        EXPECT_INVALID(run(NULL, q, k, scores, NULL), "plan: NULL");
        EXPECT_INVALID(run(plan, NULL, k, scores, NULL), "q: NULL");
        EXPECT_INVALID(run(plan, q, NULL, scores, NULL), "k_cache: NULL");
        EXPECT_INVALID(run(plan, q, k, NULL, NULL), "scores: NULL");
        EXPECT_INVALID(run(plan, q + 1, k, scores, NULL), "q = ");
        EXPECT_INVALID(run(plan, q + 8, k, scores, NULL), "not 16-byte aligned");
        EXPECT_INVALID(run(plan, q, k + 4, scores, NULL), "k_cache = ");
        EXPECT_INVALID(run(plan, q, k + 4, scores, NULL), "not 16-byte aligned");
        EXPECT_INVALID(run(plan, q, k, (float *)(s + 2), NULL), "scores = ");
        EXPECT_INVALID(run(plan, q, k, (float *)(s + 2), NULL), "not 4-byte aligned");
    }
    CHECK(unpoisoned(scores, cells + 64) == 0, "failed runs wrote %ld score cells",
          unpoisoned(scores, cells + 64));
    /* A 4-byte (not 16) aligned score buffer is fine. */
    float *shifted = scores + 1;
    CHECK_OK(msaidx_prefill_scores(plan, q, k, shifted, NULL));
    CHECK_OK(msaidx_plan_check(plan, NULL));
    CHECK(bc_is_poison(scores[0]), "scores + 1 run wrote before its buffer");
    long written = 0;
    for (int32_t t = 0; t < T; ++t) written += (long)batch->nvp[t] * H;
    CHECK(unpoisoned(scores, cells + 64) == written, "scores: %ld cells written, want %ld",
          unpoisoned(scores, cells + 64), written);
    CHECK_OK(msaidx_plan_nvp(plan, &nvp));

    /* num_valid_pages: same metadata rules, output untouched on failure. */
    int32_t *out_nvp = zeroed(sizeof(int32_t) * ((size_t)T + 8));
    char *c_out = (char *)out_nvp;
    for (int32_t t = 0; t < T + 8; ++t) out_nvp[t] = -777;
    EXPECT_INVALID(msaidx_num_valid_pages(NULL, cu, seq, 3, T, out_nvp, NULL), "context: NULL");
    EXPECT_INVALID(msaidx_num_valid_pages(context, NULL, seq, 3, T, out_nvp, NULL),
                   "cu_seqlens_q: NULL");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, NULL, 3, T, out_nvp, NULL),
                   "seq_lens: NULL");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, 3, T, NULL, NULL), "nvp: NULL");
    EXPECT_INVALID(
        msaidx_num_valid_pages(context, (const int32_t *)(c_cu + 1), seq, 3, T, out_nvp, NULL),
        "cu_seqlens_q = ");
    EXPECT_INVALID(
        msaidx_num_valid_pages(context, cu, (const int32_t *)(c_seq + 2), 3, T, out_nvp, NULL),
        "seq_lens = ");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, 3, T, (int32_t *)(c_out + 2), NULL),
                   "nvp = ");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, -1, T, out_nvp, NULL), "batch_size");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, 3, -1, out_nvp, NULL), "num_tokens");
    EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, 3, cu[3] - 1, out_nvp, NULL),
                   "num_tokens");
    save(batch, &saved);
#define BAD_NVP(assignment, needle)                                                                \
    do {                                                                                           \
        restore(batch, &saved);                                                                    \
        assignment;                                                                                \
        EXPECT_INVALID(msaidx_num_valid_pages(context, cu, seq, 3, T, out_nvp, NULL), needle);     \
    } while (0)
    BAD_NVP(mcu[0] = 2, "cu_seqlens_q[0]");
    BAD_NVP(mcu[1] = mcu[2] + 1, "cu_seqlens_q[2]");
    BAD_NVP(mseq[2] = -5, "seq_lens[2]");
    BAD_NVP(mseq[1] = 2, "seq_lens[1]");
#undef BAD_NVP
    restore(batch, &saved);
    long touched = 0;
    for (int32_t t = 0; t < T + 8; ++t) touched += out_nvp[t] != -777;
    CHECK(touched == 0, "failed num_valid_pages wrote %ld entries", touched);
    CHECK_OK(msaidx_num_valid_pages(context, cu, seq, 3, T, out_nvp, NULL));
    for (int32_t t = 0; t < T; ++t)
        CHECK(out_nvp[t] == batch->nvp[t] && nvp[t] == batch->nvp[t], "nvp[%d] = %d / %d, want %d",
              t, out_nvp[t], nvp[t], batch->nvp[t]);
    CHECK(out_nvp[T] == -777, "num_valid_pages wrote past num_tokens");

    /* topk_select. */
    const int32_t K = batch->config.topk, pitch = batch->desc.pitch;
    const size_t picks = (size_t)T * H * K;
    int32_t *out = zeroed(sizeof(int32_t) * (picks + 8));
    char *c_out_k = (char *)out, *c_scores = (char *)shifted;
    for (size_t i = 0; i < picks + 8; ++i) out[i] = -777;
    EXPECT_INVALID(msaidx_topk_select(NULL, shifted, pitch, nvp, T, out, NULL), "context: NULL");
    EXPECT_INVALID(msaidx_topk_select(context, NULL, pitch, nvp, T, out, NULL), "scores: NULL");
    EXPECT_INVALID(msaidx_topk_select(context, shifted, pitch, NULL, T, out, NULL), "nvp: NULL");
    EXPECT_INVALID(msaidx_topk_select(context, shifted, pitch, nvp, T, NULL, NULL), "out: NULL");
    EXPECT_INVALID(
        msaidx_topk_select(context, (const float *)(c_scores + 1), pitch, nvp, T, out, NULL),
        "scores = ");
    EXPECT_INVALID(
        msaidx_topk_select(context, shifted, pitch, (const int32_t *)(c_cu + 2), T, out, NULL),
        "nvp = ");
    EXPECT_INVALID(
        msaidx_topk_select(context, shifted, pitch, nvp, T, (int32_t *)(c_out_k + 2), NULL),
        "out = ");
    EXPECT_INVALID(msaidx_topk_select(context, shifted, 0, nvp, T, out, NULL), "pitch");
    EXPECT_INVALID(msaidx_topk_select(context, shifted, -3, nvp, T, out, NULL), "pitch");
    EXPECT_INVALID(msaidx_topk_select(context, shifted, pitch, nvp, -1, out, NULL), "num_tokens");
    int32_t *big_nvp = zeroed(sizeof(int32_t) * (size_t)T);
    memcpy(big_nvp, nvp, sizeof(int32_t) * (size_t)T);
    big_nvp[1] = pitch + 1;
    EXPECT_INVALID(msaidx_topk_select(context, shifted, pitch, big_nvp, T, out, NULL), "nvp[1]");
    touched = 0;
    for (size_t i = 0; i < picks + 8; ++i) touched += out[i] != -777;
    CHECK(touched == 0, "failed topk_select wrote %ld entries", touched);
    CHECK_OK(msaidx_topk_select(context, shifted, pitch, nvp, T, out, NULL));
    CHECK(out[picks] == -777, "topk_select wrote past T*H*topk");
    bc_check_topk_shape(&batch->config, nvp, T, out, "validation batch");

    /* An empty batch: nothing scored, nothing written, padding rows all -1. */
    msaidx_batch_desc empty = batch->desc;
    empty.batch_size = 0;
    msaidx_plan *empty_plan = NULL;
    CHECK_OK(msaidx_plan_create(&empty_plan, context, &empty));
    const int32_t zero = 0;
    bc_poison(scores, cells + 64);
    CHECK_OK(msaidx_plan_batch(empty_plan, &zero, seq, bt, workspace, bytes, NULL));
    CHECK_OK(msaidx_prefill_scores(empty_plan, q, k, scores, NULL));
    CHECK_OK(msaidx_decode_scores(empty_plan, q, k, scores, NULL));
    CHECK(unpoisoned(scores, cells + 64) == 0, "empty batch wrote scores");
    CHECK_OK(msaidx_plan_nvp(empty_plan, &nvp));
    long nonzero = 0;
    for (int32_t t = 0; t < T; ++t) nonzero += nvp[t] != 0;
    CHECK(nonzero == 0, "empty batch: %ld tokens with nvp != 0", nonzero);
    CHECK_OK(msaidx_topk_select(context, scores, pitch, nvp, T, out, NULL));
    long not_padding = 0;
    for (size_t i = 0; i < picks; ++i) not_padding += out[i] != -1;
    CHECK(not_padding == 0, "empty batch: %ld top-k slots not -1", not_padding);
    msaidx_plan_destroy(empty_plan);

    /* No tokens at all: empty tensors may carry NULL data pointers (torch does). */
    msaidx_batch_desc no_tokens = empty;
    no_tokens.num_tokens = 0;
    no_tokens.max_q_len = 0;
    msaidx_plan *no_token_plan = NULL;
    CHECK_OK(msaidx_plan_create(&no_token_plan, context, &no_tokens));
    CHECK_OK(msaidx_plan_batch(no_token_plan, &zero, seq, bt, workspace, bytes, NULL));
    CHECK_OK(msaidx_prefill_scores(no_token_plan, NULL, k, NULL, NULL));
    CHECK_OK(msaidx_decode_scores(no_token_plan, NULL, NULL, NULL, NULL));
    CHECK_OK(msaidx_topk_select(context, NULL, pitch, NULL, 0, NULL, NULL));
    CHECK_OK(msaidx_num_valid_pages(context, &zero, seq, 0, 0, NULL, NULL));
    EXPECT_INVALID(msaidx_num_valid_pages(context, &zero, seq, 0, 1, NULL, NULL), "nvp: NULL");
    msaidx_plan_destroy(no_token_plan);

    free(big_nvp);
    free(out);
    free(out_nvp);
    free(scores);
    free(workspace);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* Lengths at the edge of int32: no overflow on the way to the checks (UBSan guards this). */
static void extreme_lengths(void) {
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_heads = 1;
    c.page_size = 512;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    if (!context) return;

    msaidx_batch_desc d;
    msaidx_batch_desc_init(&d);
    d.batch_size = 1;
    d.num_tokens = 1;
    d.max_q_len = 1;
    d.max_seq_len = INT32_MAX;
    d.num_pages = 1;
    d.bt_stride = INT32_MAX / 512 + 1;
    d.pitch = d.bt_stride;
    d.page_stride = 512 * 128;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_plan_create(&plan, context, &d));
    int32_t *block_table = zeroed((size_t)d.bt_stride * sizeof(int32_t));
    block_table[d.bt_stride - 1] = 7; /* the last visible page is out of range */
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = zeroed(bytes);
    const int32_t cu[2] = {0, 1}, seq[1] = {INT32_MAX};
    EXPECT_INVALID(msaidx_plan_batch(plan, cu, seq, block_table, workspace, bytes, NULL),
                   "block_table[0][4194303] = 7");

    const int32_t jumping_cu[3] = {0, 5, INT32_MIN}, seq2[2] = {10, 10};
    int32_t nvp[8];
    EXPECT_INVALID(msaidx_num_valid_pages(context, jumping_cu, seq2, 2, 8, nvp, NULL),
                   "cu_seqlens_q[2]");
    free(workspace);
    free(block_table);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* A failed msaidx_plan_batch, whatever check failed, leaves no batch planned. */
static void failed_plan_unbinds(bc_batch *batch) {
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_context_create(&context, &batch->config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = zeroed(bytes);
    float *scores = zeroed(sizeof(float) * bc_score_count(batch));
    CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                               workspace, bytes, NULL));
    EXPECT_INVALID(
        msaidx_plan_batch(plan, NULL, batch->seq_lens, batch->block_table, workspace, bytes, NULL),
        "cu_seqlens_q: NULL");
    EXPECT_INVALID(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL),
                   "no batch planned");
    free(scores);
    free(workspace);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* Both precisions are valid everywhere; the cpu backend has no faster accumulation, so its scores
 * at the default precision stay exact: bitwise those of MSAIDX_PRECISION_EXACT. */
static void precision_on_cpu(const bc_batch *batch) {
    const size_t cells = bc_score_count(batch);
    float *scores[2], *brute = zeroed(sizeof(float) * cells);
    bc_poison(brute, cells);
    bc_brute_scores(batch, brute);
    for (int fast = 0; fast < 2; ++fast) {
        msaidx_config config = batch->config;
        config.backend = MSAIDX_BACKEND_CPU;
        config.precision = fast ? MSAIDX_PRECISION_DEFAULT : MSAIDX_PRECISION_EXACT;
        msaidx_context *context = NULL;
        msaidx_plan *plan = NULL;
        size_t bytes = 0;
        CHECK_OK(msaidx_backend_supported(MSAIDX_BACKEND_CPU, &config));
        CHECK_OK(msaidx_context_create(&context, &config));
        CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
        CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
        void *workspace = zeroed(bytes);
        scores[fast] = zeroed(sizeof(float) * cells);
        bc_poison(scores[fast], cells);
        CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                                   workspace, bytes, NULL));
        CHECK_OK(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores[fast], NULL));
        free(workspace);
        msaidx_plan_destroy(plan);
        msaidx_context_destroy(context);
    }
    /* batch->config is MSAIDX_PRECISION_EXACT: compared within the exact tolerance. */
    bc_compare_scores(batch, scores[1], brute, "cpu at the default precision");
    CHECK(memcmp(scores[0], scores[1], sizeof(float) * cells) == 0,
          "cpu scores at the default precision differ from the exact ones");
    free(scores[0]);
    free(scores[1]);
    free(brute);
}

/* msaidx_last_error is per thread. */
static void *other_thread(void *arg) {
    char *seen = arg;
    snprintf(seen, 256, "%s", msaidx_last_error());
    msaidx_context *context = NULL;
    (void)msaidx_context_create(&context, NULL); /* sets this thread's message */
    snprintf(seen + 256, 256, "%s", msaidx_last_error());
    return NULL;
}

static void thread_local_error(void) {
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_heads = 99;
    msaidx_context *context = NULL;
    EXPECT_INVALID(msaidx_context_create(&context, &c), "config.num_heads");
    char seen[512] = "";
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, other_thread, seen) == 0, "pthread_create");
    pthread_join(thread, NULL);
    CHECK(strstr(seen, "num_heads") == NULL, "other thread saw this thread's error: \"%s\"", seen);
    CHECK(strstr(seen + 256, "config: NULL") != NULL, "other thread's own error: \"%s\"",
          seen + 256);
    CHECK(strstr(msaidx_last_error(), "config.num_heads") != NULL,
          "this thread's error changed by another thread: \"%s\"", msaidx_last_error());
}

int main(void) {
    harness_rng rng = {harness_seed()};
    status_strings();
    config_errors();
    bc_batch *batch = valid_batch(&rng);
    desc_errors(batch);
    run_errors(batch);
    failed_plan_unbinds(batch);
    precision_on_cpu(batch);
    bc_free(batch);
    extreme_lengths();
    thread_local_error();
    return harness_finish("test_validation");
}
