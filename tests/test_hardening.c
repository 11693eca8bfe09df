/* Regression tests for the memory-safety findings of issue 13, run under ASan + UBSan by
 * `make test-sanitize`: every buffer is allocated to exactly the bytes a call may touch.
 *  - config.init_blocks + config.local_blocks overflowing int (cpu top-k wrote past `out`);
 *  - config.num_threads without an upper bound (the OpenMP runtime crashed or exited);
 *  - metadata rewritten after msaidx_plan_batch (the cpu scorer read it again, out of bounds);
 * and of a later review (the API probed under ASan + UBSan):
 *  - output strides whose last row lies past a 64-bit offset (signed overflow in the cpu top-k
 *    and merge);
 *  - a context destroyed while its plans live (use after free in every plan call);
 *  - an empty batch's msaidx_prefill_topk_candidates with NULL tensors (refused);
 *  - args.max_position past a 64-bit byte offset of cos_sin_cache rows (wrapped to row 1);
 *  - config.num_threads = 0 under OMP_NUM_THREADS=100000 (the OpenMP runtime overflowed its
 *    stack): ctest runs this binary a second time in that environment;
 * and of a third review:
 *  - outputs sharing memory with what the call reads back (candidate scores over candidate pages,
 *    scores or metadata inside the plan's workspace): the cpu backend read out of bounds;
 * and of a fourth review:
 *  - desc.page_stride x desc.num_pages past a 64-bit offset (the scorer's key offset wrapped and
 *    read before k_cache);
 *  - T x H x pitch score rows past the address space (the cpu top-k's row pointer wrapped);
 *  - num_valid_pages writing nvp over the cu_seqlens_q it reads again (heap overflow);
 *  - scores or a selection over the metadata the plan was given, and index_prepare's outputs
 *    over each other or over the positions and slots (no check: silent corruption);
 *  - the in-place merge over a packed gather (each rank's scores then its pages, as the docs
 *    gather them) was refused: the check took the ranks' score rows as one block. */
#include "backend_cases.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void expect_invalid(msaidx_status got, const char *needle, const char *what) {
    CHECK(got == MSAIDX_ERROR_INVALID_ARGUMENT, "%s: returned %s (%s)", what,
          msaidx_status_string(got), msaidx_last_error());
    CHECK(strstr(msaidx_last_error(), needle) != NULL, "%s: message \"%s\" does not name \"%s\"",
          what, msaidx_last_error(), needle);
}

static void *exact(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) exit(2);
    return p;
}

static void config_rejected(const msaidx_config *c, const char *needle, const char *what) {
    msaidx_context *context = NULL;
    expect_invalid(msaidx_context_create(&context, c), needle, what);
    CHECK(context == NULL, "%s: context created", what);
    msaidx_context_destroy(context);
    expect_invalid(msaidx_backend_supported(MSAIDX_BACKEND_CPU, c), needle, what);
}

static void forced_block_overflow(void) {
    static const int32_t pairs[][2] = {
        {INT32_MAX, 1}, {1, INT32_MAX}, {INT32_MAX, INT32_MAX}, {INT32_MAX - 15, 16}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; ++i) {
        msaidx_config c;
        msaidx_config_init(&c);
        c.init_blocks = pairs[i][0];
        c.local_blocks = pairs[i][1];
        char what[96];
        snprintf(what, sizeof what, "init_blocks %d + local_blocks %d", c.init_blocks,
                 c.local_blocks);
        config_rejected(&c, "config.init_blocks + config.local_blocks", what);
    }
    /* The largest valid split still selects correctly into an exactly sized output. */
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_heads = 1;
    c.topk = 4;
    c.init_blocks = 2;
    c.local_blocks = 2;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    if (!context) return;
    enum { PITCH = 9 };
    float *scores = exact(sizeof(float) * PITCH);
    for (int p = 0; p < PITCH; ++p) scores[p] = (float)p;
    const int32_t nvp[1] = {PITCH};
    int32_t *out = exact(sizeof(int32_t) * 4);
    CHECK_OK(msaidx_topk_select(context, scores, PITCH, nvp, 1, out, NULL));
    CHECK(out[0] == 0 && out[1] == 1 && out[2] == 7 && out[3] == 8, "forced blocks: %d %d %d %d",
          out[0], out[1], out[2], out[3]);
    free(out);
    free(scores);
    msaidx_context_destroy(context);
}

static void thread_bound(void) {
    static const int32_t too_many[] = {100000, INT32_MAX, 1025};
    for (size_t i = 0; i < sizeof too_many / sizeof too_many[0]; ++i) {
        msaidx_config c;
        msaidx_config_init(&c);
        c.num_threads = too_many[i];
        char what[64];
        snprintf(what, sizeof what, "num_threads %d", c.num_threads);
        config_rejected(&c, "config.num_threads", what);
    }
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int32_t bound = cores > 0 && cores * 4 < 1024 ? (int32_t)(cores * 4) : 1024;
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_threads = bound;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    msaidx_context_destroy(context);
    c.num_threads = bound + 1;
    config_rejected(&c, "config.num_threads", "num_threads one above the bound");
}

/* Hostile values for the rewrite: those that crashed the cpu scorer, and their kin. */
static void rewrite_hostile(bc_batch *batch, int variant) {
    const int32_t B = batch->desc.batch_size;
    int32_t *cu = batch->cu_seqlens_q, *seq = batch->seq_lens, *bt = batch->block_table;
    const size_t entries = (size_t)B * batch->desc.bt_stride;
    switch (variant) {
    case 0: /* physical pages far outside the cache */
        for (size_t i = 0; i < entries; ++i) bt[i] = i % 2 ? 1 << 28 : -5;
        break;
    case 1: /* contexts far beyond desc.max_seq_len and the block table */
        for (int32_t b = 0; b < B; ++b) seq[b] = 1 << 30;
        break;
    case 2: /* more tokens than the batch holds */ cu[B] = 1 << 29; break;
    case 3: /* decreasing and negative offsets */
        for (int32_t b = 1; b <= B; ++b) cu[b] = -(b << 20);
        break;
    default: /* all at once */
        for (int32_t b = 0; b < B; ++b) seq[b] = INT32_MAX;
        cu[B] = INT32_MAX;
        for (size_t i = 0; i < entries; ++i) bt[i] = INT32_MIN;
        break;
    }
}

/* An E4M3 batch of H = 2, D = page = 128, top-4 with one local block; the caller sets the
 * requests. */
static bc_spec small_spec(const char *name) {
    bc_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.name = name;
    spec.dtype = MSAIDX_DTYPE_E4M3;
    spec.num_heads = 2;
    spec.head_dim = 128;
    spec.page_size = 128;
    spec.topk = 4;
    spec.local_blocks = 1;
    return spec;
}

static void rewrite_after_plan(harness_rng *rng) {
    bc_spec spec = small_spec("rewrite after plan");
    spec.batch_size = 3;
    const int32_t q_lens[3] = {1, 70, 5}, prefixes[3] = {900, 200, 0};
    for (int b = 0; b < 3; ++b) {
        spec.q_lens[b] = q_lens[b];
        spec.prefixes[b] = prefixes[b];
    }
    spec.pad_tokens = 3;
    spec.extra_pages = 1;
    bc_batch *batch = bc_build(&spec, rng);
    batch->config.backend = MSAIDX_BACKEND_CPU;
    const int32_t B = batch->desc.batch_size, T = batch->desc.num_tokens;
    const size_t cells = bc_score_count(batch);
    const size_t meta_bytes =
        sizeof(int32_t) * ((size_t)B + 1 + (size_t)B + (size_t)B * batch->desc.bt_stride);
    int32_t *original = exact(meta_bytes);
    memcpy(original, batch->cu_seqlens_q, sizeof(int32_t) * ((size_t)B + 1));
    memcpy(original + B + 1, batch->seq_lens, sizeof(int32_t) * (size_t)B);
    memcpy(original + 2 * B + 1, batch->block_table,
           sizeof(int32_t) * (size_t)B * batch->desc.bt_stride);

    float *want = exact(sizeof(float) * cells);
    bc_poison(want, cells);
    bc_brute_scores(batch, want);

    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    size_t bytes = 0;
    CHECK_OK(msaidx_context_create(&context, &batch->config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    if (!plan) return;
    void *workspace = exact(bytes);
    float *scores = exact(sizeof(float) * cells);
    int32_t *topk = exact(sizeof(int32_t) * (size_t)T * batch->config.num_heads * spec.topk);
    for (int variant = 0; variant < 5; ++variant) {
        memcpy(batch->cu_seqlens_q, original, sizeof(int32_t) * ((size_t)B + 1));
        memcpy(batch->seq_lens, original + B + 1, sizeof(int32_t) * (size_t)B);
        memcpy(batch->block_table, original + 2 * B + 1,
               sizeof(int32_t) * (size_t)B * batch->desc.bt_stride);
        CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                                   workspace, bytes, NULL));
        rewrite_hostile(batch, variant);
        for (int decode = 0; decode < 2; ++decode) {
            char label[64];
            snprintf(label, sizeof label, "rewrite %d, %s", variant, decode ? "decode" : "prefill");
            bc_poison(scores, cells);
            const msaidx_status status =
                decode ? msaidx_decode_scores(plan, batch->q, batch->k_cache, scores, NULL)
                       : msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL);
            CHECK(status == MSAIDX_SUCCESS, "%s: %s", label, msaidx_last_error());
            /* The plan's snapshot is used: the scores of the metadata as planned. */
            bc_compare_scores(batch, scores, want, label);
        }
        const int32_t *nvp = NULL;
        CHECK_OK(msaidx_plan_nvp(plan, &nvp));
        if (nvp) {
            CHECK(memcmp(nvp, batch->nvp, sizeof(int32_t) * (size_t)T) == 0,
                  "rewrite %d: the plan's nvp changed", variant);
            CHECK_OK(msaidx_topk_select(context, scores, batch->desc.pitch, nvp, T, topk, NULL));
            bc_check_topk_shape(&batch->config, nvp, T, topk, "rewrite after plan");
        }
        CHECK_OK(msaidx_plan_check(plan, NULL));
        /* Planning the rewritten metadata is refused, naming it. */
        const msaidx_status replan = msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens,
                                                       batch->block_table, workspace, bytes, NULL);
        CHECK(replan == MSAIDX_ERROR_INVALID_ARGUMENT, "rewrite %d: re-plan returned %s", variant,
              msaidx_status_string(replan));
        const char *message = msaidx_last_error();
        CHECK(strstr(message, "cu_seqlens_q") || strstr(message, "seq_lens") ||
                  strstr(message, "block_table"),
              "rewrite %d: message \"%s\" names no metadata", variant, message);
        CHECK(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL) ==
                  MSAIDX_ERROR_INVALID_ARGUMENT,
              "rewrite %d: a failed re-plan left a batch planned", variant);
    }
    memcpy(batch->cu_seqlens_q, original, sizeof(int32_t) * ((size_t)B + 1));
    memcpy(batch->seq_lens, original + B + 1, sizeof(int32_t) * (size_t)B);
    memcpy(batch->block_table, original + 2 * B + 1,
           sizeof(int32_t) * (size_t)B * batch->desc.bt_stride);
    free(topk);
    free(scores);
    free(workspace);
    free(want);
    free(original);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    bc_free(batch);
}

/* Strides whose last row ends past a 64-bit offset are refused by name, before any arithmetic. */
static void row_offset_overflow(void) {
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_heads = 1;
    c.topk = 4;
    c.local_blocks = 0;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    if (!context) return;
    enum { PITCH = 8, T = 3 };
    float *scores = exact(sizeof(float) * PITCH * T);
    for (int i = 0; i < PITCH * T; ++i) scores[i] = (float)i;
    const int32_t nvp[T] = {PITCH, PITCH, PITCH};
    int32_t *out = exact(sizeof(int32_t) * 4 * T);
    const int64_t huge = INT64_MAX / 2 + 1;
    expect_invalid(msaidx_topk_select_strided(context, scores, PITCH, nvp, T, out, huge, 0, NULL),
                   "out_stride_t", "top-k, stride_t INT64_MAX / 2 + 1");
    expect_invalid(
        msaidx_topk_select_strided(context, scores, PITCH, nvp, T, out, INT64_MAX / 8, 1, NULL),
        "64-bit", "top-k, last row past INT64_MAX / 4 entries");
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = 4;
    args.init_blocks = 0;
    args.local_blocks = 0;
    args.out_stride_t = huge;
    float *candidate_scores = exact(sizeof(float) * 4 * T);
    int32_t *candidate_pages = exact(sizeof(int32_t) * 4 * T);
    for (int i = 0; i < 4 * T; ++i) {
        candidate_scores[i] = (float)i;
        candidate_pages[i] = i % 4;
    }
    expect_invalid(msaidx_merge_candidates(context, &args, 1, T, nvp, candidate_scores,
                                           candidate_pages, 4 * T, out, NULL),
                   "out_stride_t", "merge, stride_t INT64_MAX / 2 + 1");
    /* The largest stride that fits still selects: row t at t * stride_t of a 1-row buffer is
     * only touched for t = 0, so one token. */
    CHECK_OK(msaidx_topk_select_strided(context, scores, PITCH, nvp, 1, out, huge, 0, NULL));
    CHECK(out[0] == 4 && out[3] == 7, "one row under a huge stride: picked %d..%d", out[0], out[3]);
    free(candidate_scores);
    free(candidate_pages);
    free(out);
    free(scores);
    msaidx_context_destroy(context);
}

/* A plan keeps what it needs of its context: destroying the context first leaves it working. */
static void plan_outlives_context(harness_rng *rng) {
    bc_spec spec = small_spec("plan outlives context");
    spec.batch_size = 2;
    spec.q_lens[0] = 3;
    spec.q_lens[1] = 40;
    spec.prefixes[0] = 300;
    spec.prefixes[1] = 0;
    bc_batch *batch = bc_build(&spec, rng);
    batch->config.backend = MSAIDX_BACKEND_CPU;
    const size_t cells = bc_score_count(batch);
    float *want = exact(sizeof(float) * cells), *scores = exact(sizeof(float) * cells);
    bc_poison(want, cells);
    bc_brute_scores(batch, want);
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_context_create(&context, &batch->config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    CHECK_OK(msaidx_context_destroy(context));
    size_t bytes = 0, topk_bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &topk_bytes));
    CHECK(topk_bytes >= sizeof(float) * cells, "prefill_topk workspace %zu bytes", topk_bytes);
    void *workspace = exact(bytes);
    if (plan) {
        CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                                   workspace, bytes, NULL));
        bc_poison(scores, cells);
        CHECK_OK(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL));
        bc_compare_scores(batch, scores, want, "after msaidx_context_destroy");
    }
    free(workspace);
    free(scores);
    free(want);
    msaidx_plan_destroy(plan);
    bc_free(batch);
}

/* A context of the default config with num_heads heads on the cpu backend (NULL after a failed
 * check). */
static msaidx_context *cpu_context(int32_t num_heads) {
    msaidx_config c;
    msaidx_config_init(&c);
    c.backend = MSAIDX_BACKEND_CPU;
    c.num_heads = num_heads;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    return context;
}

/* An empty batch: every tensor of msaidx_prefill_topk_candidates may be NULL, as elsewhere. */
static void empty_candidates(void) {
    msaidx_context *context = cpu_context(4);
    msaidx_batch_desc d;
    msaidx_batch_desc_init(&d);
    d.batch_size = 1;
    d.num_tokens = 0;
    d.max_q_len = 0;
    d.max_seq_len = 128;
    d.num_pages = 1;
    d.bt_stride = 1;
    d.page_stride = 128 * 128;
    d.pitch = 1;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_plan_create(&plan, context, &d));
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = exact(bytes);
    const int32_t cu[2] = {0, 0}, seq[1] = {5}, table[1] = {0};
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    if (plan) {
        CHECK_OK(msaidx_plan_batch(plan, cu, seq, table, workspace, bytes, NULL));
        CHECK_OK(msaidx_prefill_topk_candidates(plan, NULL, NULL, &args, NULL, NULL, NULL, NULL));
        CHECK_OK(msaidx_prefill_topk(plan, NULL, NULL, &args, NULL, NULL, NULL));
    }
    free(workspace);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* A cos/sin table too long for 64-bit byte offsets is refused before a position is read. */
static void position_bound(void) {
    msaidx_context *context = cpu_context(4);
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    a.num_tokens = 0;
    a.num_pages = 1;
    a.page_stride = 128 * 128;
    a.max_position = INT64_MAX;
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.max_position",
                   "max_position INT64_MAX");
    a.max_position = INT64_MAX / 256 + 1;
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.max_position",
                   "max_position one row past the bound");
    a.max_position = INT64_MAX / 256;
    CHECK_OK(msaidx_index_prepare(context, &a, NULL));
    msaidx_context_destroy(context);
}

/* A plan of one request of `tokens` new tokens seeing all of `pages` E4M3 pages of 128 keys. */
static msaidx_plan *one_request_plan(msaidx_context *context, int32_t tokens, int32_t pages) {
    msaidx_batch_desc d;
    msaidx_batch_desc_init(&d);
    d.batch_size = 1;
    d.num_tokens = tokens;
    d.max_q_len = tokens;
    d.max_seq_len = pages * 128;
    d.num_pages = pages;
    d.bt_stride = pages;
    d.page_stride = 128 * 128;
    d.pitch = pages;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_plan_create(&plan, context, &d));
    return plan;
}

/* Buffers that share memory with what the call reads back are refused, naming them: outputs over
 * each other (the candidates' pages are read back as indices), outputs or metadata inside the
 * plan's workspace (it holds the metadata the scorer indexes with), a top-k over its scores. */
static void aliased_buffers(void) {
    msaidx_context *context = cpu_context(1);
    enum { T = 4, P = 40 };
    msaidx_plan *plan = one_request_plan(context, T, P);
    size_t bytes = 0, topk_bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &topk_bytes));
    uint8_t *workspace = calloc(1, bytes + sizeof(int32_t) * 2);
    uint8_t *q = calloc(T, 128), *k = calloc(P, 128 * 128);
    float *scores = calloc(T * P, sizeof(float)), *topk_workspace = calloc(1, topk_bytes + 4);
    int32_t *pages = calloc(T * 16 + 1, sizeof(int32_t)), table[P], seq[1] = {P * 128};
    int32_t cu[2] = {0, T};
    for (int p = 0; p < P; ++p) table[p] = p;
    if (!plan || !workspace || !q || !k || !scores || !topk_workspace || !pages) exit(2);
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);

    int32_t *cu_inside = (int32_t *)(workspace + bytes - sizeof(int32_t));
    memcpy(cu_inside, cu, sizeof cu);
    expect_invalid(msaidx_plan_batch(plan, cu_inside, seq, table, workspace, bytes, NULL),
                   "cu_seqlens_q", "metadata inside the workspace");
    /* A caller's arena larger than the plan needs may hold the metadata past the plan's bytes. */
    int32_t *cu_past = (int32_t *)(workspace + bytes);
    memcpy(cu_past, cu, sizeof cu);
    CHECK_OK(msaidx_plan_batch(plan, cu_past, seq, table, workspace, bytes + sizeof cu, NULL));
    CHECK_OK(msaidx_plan_batch(plan, cu, seq, table, workspace, bytes, NULL));
    expect_invalid(msaidx_prefill_scores(plan, q, k, (float *)workspace, NULL), "scores",
                   "scores over the workspace");
    args.workspace = workspace;
    args.workspace_bytes = topk_bytes;
    expect_invalid(msaidx_prefill_topk(plan, q, k, &args, NULL, pages, NULL), "args.workspace",
                   "score workspace over the plan's workspace");
    args.workspace = topk_workspace;
    expect_invalid(msaidx_prefill_topk(plan, q, k, &args, scores, (int32_t *)scores + 3, NULL),
                   "out", "selection over the scores");
    expect_invalid(msaidx_prefill_topk_candidates(plan, q, k, &args, scores, (float *)(pages + 1),
                                                  pages, NULL),
                   "candidate_scores", "candidate scores over the candidate pages");
    int32_t nvp[T];
    for (int t = 0; t < T; ++t) nvp[t] = P;
    expect_invalid(msaidx_topk_select(context, scores, P, nvp, T, (int32_t *)scores + 5, NULL),
                   "out", "top-k over its scores");
    /* The same calls on separate buffers run. */
    CHECK_OK(msaidx_prefill_scores(plan, q, k, scores, NULL));
    CHECK_OK(msaidx_prefill_topk(plan, q, k, &args, NULL, pages, NULL));
    float candidate_scores[T * 16];
    CHECK_OK(
        msaidx_prefill_topk_candidates(plan, q, k, &args, scores, candidate_scores, pages, NULL));
    CHECK_OK(msaidx_topk_select(context, scores, P, nvp, T, pages, NULL));
    CHECK_OK(
        msaidx_prefill_topk_candidates(plan, q, k, &args, scores, candidate_scores, pages, NULL));
    expect_invalid(msaidx_merge_candidates(context, &args, 1, T, nvp, candidate_scores, pages,
                                           T * 16, pages + 3, NULL),
                   "out", "a merge over its candidates, rows shifted");
    expect_invalid(msaidx_merge_candidates(context, &args, 1, T, nvp, candidate_scores, pages,
                                           T * 16, (int32_t *)candidate_scores, NULL),
                   "out", "a merge over its candidate scores");
    int32_t merged[T * 16];
    CHECK_OK(msaidx_merge_candidates(context, &args, 1, T, nvp, candidate_scores, pages, T * 16,
                                     merged, NULL));
    /* No request, no seq_lens to read: a NULL pointer, as an empty tensor has. */
    CHECK_OK(msaidx_num_valid_pages(context, cu, NULL, 0, 0, NULL, NULL));
    free(workspace);
    free(q);
    free(k);
    free(scores);
    free(topk_workspace);
    free(pages);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* A plan whose key offsets or score rows cannot be addressed is refused when it is created, and
 * a top-k over such rows before any pointer is used. */
static void address_bounds(void) {
    msaidx_context *context = cpu_context(16);
    msaidx_batch_desc d;
    msaidx_batch_desc_init(&d);
    d.batch_size = 1;
    d.num_tokens = 4;
    d.max_q_len = 4;
    d.max_seq_len = 384;
    d.num_pages = 3;
    d.bt_stride = 3;
    d.pitch = 3;
    d.page_stride = INT64_MAX - 15; /* 2 x it wraps past 2^64 */
    msaidx_plan *plan = NULL;
    expect_invalid(msaidx_plan_create(&plan, context, &d), "desc.page_stride",
                   "page_stride x num_pages past 64 bits");
    d.page_stride = INT64_MAX / 3 / 16 * 16;
    CHECK_OK(msaidx_plan_create(&plan, context, &d));
    msaidx_plan_destroy(plan);
    d.page_stride = 128 * 128;
    d.num_tokens = d.max_q_len = (1 << 28) + 1;
    d.pitch = INT32_MAX;
    plan = NULL;
    expect_invalid(msaidx_plan_create(&plan, context, &d), "desc.pitch",
                   "T x H x pitch scores past the address space");
    CHECK(plan == NULL, "plan created");
    float scores[4];
    int32_t nvp[1] = {0}, out[16];
    expect_invalid(msaidx_topk_select(context, scores, INT32_MAX, nvp, (1 << 28) + 1, out, NULL),
                   "pitch", "top-k rows past the address space");
    msaidx_context_destroy(context);
}

/* Outputs over the metadata a call reads (again) are refused, naming the output. */
static void outputs_over_metadata(void) {
    msaidx_context *context = cpu_context(4);
    enum { T = 4, P = 4 };
    msaidx_plan *plan = one_request_plan(context, T, P);
    const int32_t H = 4; /* msaidx_config_init's */
    size_t bytes = 0, topk_bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &topk_bytes));
    /* One arena holding the metadata first, then room for outputs laid over it. */
    const size_t arena_bytes = topk_bytes + sizeof(float) * T * H * P + 4096;
    int32_t *arena = calloc(1, arena_bytes);
    uint8_t *workspace = calloc(1, bytes), *q = calloc((size_t)T * H, 128),
            *k = calloc(P, 128 * 128);
    int32_t *pages = calloc((size_t)T * H * 16, sizeof(int32_t));
    if (!plan || !arena || !workspace || !q || !k || !pages) exit(2);
    int32_t *cu = arena, *seq = arena + 4, *table = arena + 8; /* 16-byte aligned each */
    cu[1] = T;
    seq[0] = P * 128;
    for (int p = 0; p < P; ++p) table[p] = p;
    CHECK_OK(msaidx_plan_batch(plan, cu, seq, table, workspace, bytes, NULL));
    expect_invalid(msaidx_prefill_scores(plan, q, k, (float *)(table + 2), NULL),
                   "the plan's block_table", "scores over the block table");
    expect_invalid(msaidx_decode_scores(plan, q, k, (float *)arena, NULL),
                   "the plan's cu_seqlens_q", "scores over cu_seqlens_q");
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.workspace = seq;
    args.workspace_bytes = topk_bytes;
    expect_invalid(msaidx_prefill_topk(plan, q, k, &args, NULL, pages, NULL), "args.workspace",
                   "score workspace over seq_lens");
    float *scores = (float *)(arena + 1024);
    expect_invalid(msaidx_prefill_topk(plan, q, k, &args, scores, seq, NULL), "out",
                   "selection over seq_lens");
    float candidate_scores[T * 4 * 16];
    args.workspace = NULL;
    args.workspace_bytes = 0;
    expect_invalid(
        msaidx_prefill_topk_candidates(plan, q, k, &args, scores, (float *)table, pages, NULL),
        "candidate_scores", "candidate scores over the block table");
    CHECK_OK(
        msaidx_prefill_topk_candidates(plan, q, k, &args, scores, candidate_scores, pages, NULL));
    CHECK(cu[0] == 0 && cu[1] == T && seq[0] == P * 128 && table[P - 1] == P - 1,
          "metadata changed by refused calls");
    /* num_valid_pages writing over the cu_seqlens_q and seq_lens it reads. */
    int32_t metadata[5] = {0, 1, 3, 128000, 128000};
    expect_invalid(
        msaidx_num_valid_pages(context, metadata, metadata + 3, 2, 3, metadata + 2, NULL), "nvp",
        "nvp over cu_seqlens_q");
    expect_invalid(
        msaidx_num_valid_pages(context, metadata, metadata + 3, 2, 3, metadata + 3, NULL), "nvp",
        "nvp over seq_lens");
    CHECK(metadata[2] == 3 && metadata[3] == 128000, "refused num_valid_pages wrote");
    free(arena);
    free(workspace);
    free(q);
    free(k);
    free(pages);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

/* index_prepare's outputs (q_out, the key cache, the error word) apart from each other and from
 * the positions and slots that index memory. */
static void prepare_outputs_apart(void) {
    msaidx_context *context = cpu_context(4);
    const int32_t H = 4; /* msaidx_config_init's */
    enum { T = 2, PAGES = 2 };
    uint16_t *q_in = calloc((size_t)T * H * 128, 2), *k_in = calloc(T * 128, 2);
    uint16_t *weights = calloc(128, 2);
    float *table = calloc(8 * 64, sizeof(float));
    uint8_t *cache = calloc(PAGES, 128 * 128), *q_out = calloc((size_t)T * H, 128);
    int64_t *indices = calloc(2 * T + 2, sizeof(int64_t)); /* positions, then slots */
    if (!q_in || !k_in || !weights || !table || !cache || !q_out || !indices) exit(2);
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    a.num_tokens = T;
    a.q_in = q_in;
    a.q_in_token_stride = (int64_t)H * 128;
    a.k_in = k_in;
    a.k_in_token_stride = 128;
    a.positions = indices;
    a.q_norm_weight = a.k_norm_weight = weights;
    a.cos_sin_cache = table;
    a.max_position = 8;
    a.slot_mapping = indices + T;
    a.k_cache = cache;
    a.page_stride = 128 * 128;
    a.num_pages = PAGES;
    a.q_out = q_out;
    indices[T] = 0;
    indices[T + 1] = 1;
    const msaidx_index_prepare_args good = a;
    a.q_out = cache;
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.q_out", "q_out over the cache");
    a = good;
    a.error_word = (uint32_t *)(q_out + 16);
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.error_word",
                   "error word inside q_out");
    a = good;
    a.positions = (const int64_t *)(cache + 128 * 128); /* the second page's first slots */
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.positions",
                   "key cache over the positions");
    a = good;
    a.q_out = (uint8_t *)(indices + T);
    expect_invalid(msaidx_index_prepare(context, &a, NULL), "args.slot_mapping",
                   "q_out over the slots");
    CHECK(indices[T] == 0 && indices[T + 1] == 1, "refused index_prepare wrote the slots");
    CHECK_OK(msaidx_index_prepare(context, &good, NULL));
    free(q_in);
    free(k_in);
    free(weights);
    free(table);
    free(cache);
    free(q_out);
    free(indices);
    msaidx_context_destroy(context);
}

/* A packed gather of W = 2 ranks, [scores | pages] per rank: the merge in place over rank 0's
 * pages runs and equals the merge into a separate out; out over any rank's scores or (not in
 * place) pages is refused. */
static void packed_gather_merge(void) {
    msaidx_context *context = cpu_context(1);
    enum { T = 2, K = 4, ROWS = T * K, W = 2 };
    int32_t *gather = calloc(W * 2 * ROWS, sizeof(int32_t)); /* rank r: scores, then pages */
    if (!gather) exit(2);
    const int32_t nvp[T] = {10, 12};
    for (int r = 0; r < W; ++r)
        for (int i = 0; i < ROWS; ++i) {
            float score = (float)((i * 7 + r * 3) % 11);
            memcpy(gather + r * 2 * ROWS + i, &score, sizeof score);
            gather[r * 2 * ROWS + ROWS + i] = 1 + (i % K) * 2 + r; /* pages 1..8, per rank */
        }
    const float *scores = (const float *)gather;
    int32_t *pages = gather + ROWS;
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    int32_t separate[ROWS];
    CHECK_OK(msaidx_merge_candidates(context, &args, W, T, nvp, scores, pages, 2 * ROWS, separate,
                                     NULL));
    CHECK_OK(
        msaidx_merge_candidates(context, &args, W, T, nvp, scores, pages, 2 * ROWS, pages, NULL));
    CHECK(memcmp(separate, pages, sizeof separate) == 0, "in-place merge differs from out");
    expect_invalid(msaidx_merge_candidates(context, &args, W, T, nvp, scores, pages, 2 * ROWS,
                                           gather + 2 * ROWS, NULL),
                   "candidate_scores", "out over rank 1's scores");
    expect_invalid(msaidx_merge_candidates(context, &args, W, T, nvp, scores, pages, 2 * ROWS,
                                           gather + 3 * ROWS, NULL),
                   "candidate_pages", "out over rank 1's pages");
    free(gather);
    msaidx_context_destroy(context);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    forced_block_overflow();
    thread_bound();
    rewrite_after_plan(&rng);
    row_offset_overflow();
    plan_outlives_context(&rng);
    empty_candidates();
    position_bound();
    aliased_buffers();
    address_bounds();
    outputs_over_metadata();
    prepare_outputs_apart();
    packed_gather_merge();
    return harness_finish("test_hardening");
}
