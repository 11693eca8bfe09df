/*
 * The check of msaidx_prefill_topk and msaidx_prefill_topk_candidates shared by
 * tests/test_prefill_topk.c (cpu backend, host memory) and tests/gpu_prefill_topk.c (the CUDA
 * backends): on one batch, the selection is bitwise msaidx_topk_select of the same backend's
 * msaidx_prefill_scores (with a score buffer, without one, into a transposed [H, T, k] output),
 * the scores it writes are bitwise prefill_scores', and the candidates are the top-k without
 * forced pages with their scores (NaN as -inf, -inf beside -1). The workspace of a call without
 * a score buffer is poisoned (NaN) before each call, so that a selection that reads a cell or a
 * chunk maximum its call did not write (a fused path) shows.
 */
#ifndef MSAIDX_TEST_PREFILL_TOPK_CASES_H
#define MSAIDX_TEST_PREFILL_TOPK_CASES_H

#include "backend_cases.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Where the buffers of a run live: host memory, or a CUDA device. */
typedef struct ptk_memory {
    int32_t device; /* config.device */
    bool sm90a;     /* build and device carry sm_90a (bc_must_admit) */
    void *stream;
    void *(*alloc)(size_t bytes); /* 256-byte aligned */
    void (*release)(void *pointer);
    void (*upload)(void *dst, const void *src, size_t bytes);
    void (*download)(void *dst, const void *src, size_t bytes);
    void (*sync)(void *stream);
    /* CUDA graphs (NULL on the host): capture returns an executable graph of what enqueue(state,
     * stream) enqueues (NULL when the capture failed, reported), launch replays it on the stream,
     * destroy frees it. */
    void *(*capture)(void *stream, msaidx_status (*enqueue)(void *state, void *stream),
                     void *state);
    void (*launch)(void *graph, void *stream);
    void (*destroy)(void *graph);
} ptk_memory;

static inline void *ptk_upload_copy(const ptk_memory *m, const void *src, size_t bytes) {
    void *dst = m->alloc(bytes ? bytes : 16);
    if (bytes) m->upload(dst, src, bytes);
    return dst;
}

/* The bits of a float, so that NaN payloads compare too. */
static inline long ptk_float_differences(const float *a, const float *b, size_t count) {
    long differ = 0;
    for (size_t i = 0; i < count; ++i) differ += memcmp(a + i, b + i, sizeof(float)) != 0;
    return differ;
}

static inline long ptk_int_differences(const int32_t *a, const int32_t *b, size_t count) {
    long differ = 0;
    for (size_t i = 0; i < count; ++i) differ += a[i] != b[i];
    return differ;
}

/* What a graph of ptk_check_graph captures: plan_batch, then prefill_topk without a score buffer
 * into `out`. */
typedef struct ptk_graph_call {
    msaidx_plan *plan;
    const void *cu, *lens, *table, *q, *k;
    void *workspace;
    size_t workspace_bytes;
    const msaidx_topk_args *args;
    int32_t *out;
} ptk_graph_call;

static inline msaidx_status ptk_enqueue_graph_call(void *state, void *stream) {
    const ptk_graph_call *c = state;
    const msaidx_status status = msaidx_plan_batch(c->plan, c->cu, c->lens, c->table, c->workspace,
                                                   c->workspace_bytes, stream);
    if (status != MSAIDX_SUCCESS) return status;
    return msaidx_prefill_topk(c->plan, c->q, c->k, c->args, NULL, c->out, stream);
}

/* SPEC.md section 6 for the fused call: plan_batch + prefill_topk without scores (args carrying
 * the workspace) captured in a graph and replayed after the request lengths are rewritten in
 * place, each one's prefix cut by an eighth (another batch within the plan's bounds: a new deal,
 * so new chunks for the maxima), then with the first lengths again. Each replay must pick what
 * plan_batch + prefill_scores + topk_select pick on that batch, run eagerly; `want` holds them for
 * the first lengths. */
static inline void ptk_check_graph(const bc_batch *batch, const ptk_memory *m,
                                   const ptk_graph_call *call, const msaidx_context *context,
                                   float *scores, const int32_t *want, int32_t *got,
                                   const float *area_poison, size_t area_bytes,
                                   const int32_t *pick_poison, const char *label) {
    const int32_t B = batch->desc.batch_size, T = batch->desc.num_tokens;
    const size_t picks = (size_t)T * batch->config.num_heads * batch->config.topk;
    int32_t *cut_lens = malloc(sizeof(int32_t) * (size_t)(B ? B : 1));
    int32_t *cut_want = malloc(sizeof(int32_t) * (picks + 1));
    if (!cut_lens || !cut_want) exit(2);
    for (int32_t b = 0; b < B; ++b) {
        const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
        cut_lens[b] = batch->seq_lens[b] - (batch->seq_lens[b] - q_len) / 8;
    }
    void *graph = m->capture(m->stream, ptk_enqueue_graph_call, (void *)call);
    for (int round = 0; graph && round < 2; ++round) {
        const int32_t *lens = round == 0 ? cut_lens : batch->seq_lens;
        const int32_t *expected = want;
        if (round == 0) { /* the eager answer on the cut lengths */
            const int32_t *nvp = NULL;
            m->upload((void *)call->lens, lens, sizeof(int32_t) * (size_t)B);
            CHECK_OK(msaidx_plan_batch(call->plan, call->cu, call->lens, call->table,
                                       call->workspace, call->workspace_bytes, m->stream));
            CHECK_OK(msaidx_plan_nvp(call->plan, &nvp));
            CHECK_OK(msaidx_prefill_scores(call->plan, call->q, call->k, scores, m->stream));
            CHECK_OK(msaidx_topk_select(context, scores, batch->desc.pitch, nvp, T, call->out,
                                        m->stream));
            m->sync(m->stream);
            m->download(cut_want, call->out, sizeof(int32_t) * picks);
            expected = cut_want;
        }
        m->upload((void *)call->lens, lens, sizeof(int32_t) * (size_t)B);
        m->upload(call->out, pick_poison, sizeof(int32_t) * picks);
        m->upload(call->args->workspace, area_poison, area_bytes);
        m->launch(graph, m->stream);
        m->sync(m->stream);
        m->download(got, call->out, sizeof(int32_t) * picks);
        CHECK(ptk_int_differences(got, expected, picks) == 0,
              "%s: prefill_topk without scores, graph replay on the %s lengths, differs from "
              "topk_select in %ld entries",
              label, round == 0 ? "cut" : "first", ptk_int_differences(got, expected, picks));
    }
    if (graph) m->destroy(graph);
    free(cut_lens);
    free(cut_want);
}

/* Runs the check of `batch` on `backend`; returns NOT_SUPPORTED when the backend does not admit
 * the batch's config (nothing checked), a failure where bc_must_admit says it does. */
static inline msaidx_status ptk_check_batch(const bc_batch *batch, msaidx_backend backend,
                                            const ptk_memory *m, const char *label) {
    msaidx_config config = batch->config;
    config.backend = backend;
    config.device = m->device;
    if (msaidx_backend_supported(backend, &config) != MSAIDX_SUCCESS) {
        CHECK(!bc_must_admit(backend, m->sm90a, &config),
              "%s: refused, though documented as admitted: %s", label, msaidx_last_error());
        return MSAIDX_ERROR_NOT_SUPPORTED;
    }
    msaidx_config free_config = config; /* the candidates' order: no forced page */
    free_config.init_blocks = 0;
    free_config.local_blocks = 0;
    msaidx_context *context = NULL, *free_context = NULL;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    CHECK_OK(msaidx_context_create(&free_context, &free_config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    if (!plan) return MSAIDX_ERROR_INTERNAL;

    const int32_t T = batch->desc.num_tokens, H = config.num_heads, K = config.topk;
    const size_t cells = bc_score_count(batch), picks = (size_t)T * H * K;
    const size_t meta = (size_t)batch->desc.batch_size;
    size_t plan_bytes = 0, area_bytes = 0, with_scores_bytes = 1;
    CHECK_OK(msaidx_plan_workspace_size(plan, &plan_bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 1, &with_scores_bytes));
    CHECK(area_bytes >= cells * sizeof(float), "%s: workspace %zu bytes for %zu scores", label,
          area_bytes, cells);
    CHECK(with_scores_bytes == 0, "%s: %zu workspace bytes with a score buffer", label,
          with_scores_bytes);

    void *cu = ptk_upload_copy(m, batch->cu_seqlens_q, sizeof(int32_t) * (meta + 1));
    void *lens = ptk_upload_copy(m, batch->seq_lens, sizeof(int32_t) * meta);
    void *table = ptk_upload_copy(m, batch->block_table,
                                  sizeof(int32_t) * (meta ? meta : 1) * batch->desc.bt_stride);
    void *q = ptk_upload_copy(m, batch->q, batch->q_bytes);
    void *k = ptk_upload_copy(m, batch->k_cache, batch->k_bytes);
    void *workspace = m->alloc(plan_bytes);
    void *area = m->alloc(area_bytes);

    /* Host images and their device twins, all poisoned alike. */
    const size_t poison_count = (cells > picks ? cells : picks) + 1;
    float *poison = malloc(sizeof(float) * poison_count);
    int32_t *pick_poison = malloc(sizeof(int32_t) * (picks + 1));
    float *want_scores = malloc(sizeof(float) * (cells + 1));
    float *got_scores = malloc(sizeof(float) * (cells + 1));
    int32_t *want = malloc(sizeof(int32_t) * (picks + 1)),
            *got = malloc(sizeof(int32_t) * (picks + 1));
    int32_t *want_pages = malloc(sizeof(int32_t) * (picks + 1));
    float *want_candidates = malloc(sizeof(float) * (picks + 1));
    float *got_candidates = malloc(sizeof(float) * (picks + 1));
    float *area_poison = malloc(area_bytes + sizeof(float));
    if (!poison || !pick_poison || !want_scores || !got_scores || !want || !got || !want_pages ||
        !want_candidates || !got_candidates || !area_poison)
        exit(2);
    bc_poison(poison, poison_count);
    bc_poison(area_poison, area_bytes / sizeof(float));
    for (size_t i = 0; i <= picks; ++i) pick_poison[i] = 0x5A5A5A5A;
    float *scores_a = ptk_upload_copy(m, poison, sizeof(float) * cells);
    float *scores_b = ptk_upload_copy(m, poison, sizeof(float) * cells);
    int32_t *out = ptk_upload_copy(m, pick_poison, sizeof(int32_t) * picks);
    float *candidates = ptk_upload_copy(m, poison, sizeof(float) * picks);

    const int32_t *nvp = NULL;
    CHECK_OK(msaidx_plan_batch(plan, cu, lens, table, workspace, plan_bytes, m->stream));
    CHECK_OK(msaidx_plan_nvp(plan, &nvp));
    /* The two-call answer. */
    CHECK_OK(msaidx_prefill_scores(plan, q, k, scores_a, m->stream));
    CHECK_OK(msaidx_topk_select(context, scores_a, batch->desc.pitch, nvp, T, out, m->stream));
    m->sync(m->stream);
    m->download(want_scores, scores_a, sizeof(float) * cells);
    m->download(want, out, sizeof(int32_t) * picks);
    CHECK_OK(msaidx_topk_select(free_context, scores_a, batch->desc.pitch, nvp, T, out, m->stream));
    m->sync(m->stream);
    m->download(want_pages, out, sizeof(int32_t) * picks);
    for (size_t i = 0; i < picks; ++i) {
        const int64_t row = (int64_t)(i / (size_t)K);
        const float s =
            want_pages[i] >= 0 ? want_scores[row * batch->desc.pitch + want_pages[i]] : -INFINITY;
        want_candidates[i] = isnan(s) ? -INFINITY : s;
    }
    bc_check_topk_shape(&config, batch->nvp, T, want, label);

    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    args.init_blocks = config.init_blocks;
    args.local_blocks = config.local_blocks;

    /* With a score buffer: the same scores, the same selection. */
    m->upload(out, pick_poison, sizeof(int32_t) * picks);
    CHECK_OK(msaidx_prefill_topk(plan, q, k, &args, scores_b, out, m->stream));
    m->sync(m->stream);
    m->download(got_scores, scores_b, sizeof(float) * cells);
    m->download(got, out, sizeof(int32_t) * picks);
    CHECK(ptk_float_differences(got_scores, want_scores, cells) == 0,
          "%s: prefill_topk wrote %ld score cells unlike prefill_scores", label,
          ptk_float_differences(got_scores, want_scores, cells));
    CHECK(ptk_int_differences(got, want, picks) == 0,
          "%s: prefill_topk (with scores) differs from topk_select in %ld entries", label,
          ptk_int_differences(got, want, picks));

    /* Without: the workspace holds the scores. */
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    m->upload(out, pick_poison, sizeof(int32_t) * picks);
    m->upload(area, area_poison, area_bytes);
    CHECK_OK(msaidx_prefill_topk(plan, q, k, &args, NULL, out, m->stream));
    m->sync(m->stream);
    m->download(got, out, sizeof(int32_t) * picks);
    CHECK(ptk_int_differences(got, want, picks) == 0,
          "%s: prefill_topk (without scores) differs from topk_select in %ld entries", label,
          ptk_int_differences(got, want, picks));
    if (m->capture) {
        const ptk_graph_call call = {plan, cu,        lens,       table, q,
                                     k,    workspace, plan_bytes, &args, out};
        ptk_check_graph(batch, m, &call, context, scores_a, want, got, area_poison, area_bytes,
                        pick_poison, label);
        /* The lengths are the first ones again, their plan the last replay's. */
    }

    /* Into the transpose of an [H, T, K] buffer. */
    args.out_stride_t = K;
    args.out_stride_h = (int64_t)T * K;
    m->upload(out, pick_poison, sizeof(int32_t) * picks);
    m->upload(area, area_poison, area_bytes);
    CHECK_OK(msaidx_prefill_topk(plan, q, k, &args, NULL, out, m->stream));
    m->sync(m->stream);
    m->download(got, out, sizeof(int32_t) * picks);
    long transposed_wrong = 0;
    for (int32_t t = 0; t < T; ++t)
        for (int32_t h = 0; h < H; ++h)
            transposed_wrong += memcmp(got + ((size_t)h * T + t) * K,
                                       want + ((size_t)t * H + h) * K, sizeof(int32_t) * K) != 0;
    CHECK(transposed_wrong == 0, "%s: prefill_topk into [H, T, k]: %ld rows differ", label,
          transposed_wrong);
    args.out_stride_t = 0;
    args.out_stride_h = 0;

    /* Candidates, without scores and with them. */
    for (int with = 0; with < 2; ++with) {
        m->upload(out, pick_poison, sizeof(int32_t) * picks);
        m->upload(candidates, poison, sizeof(float) * picks);
        m->upload(scores_b, poison, sizeof(float) * cells);
        m->upload(area, area_poison, area_bytes);
        CHECK_OK(msaidx_prefill_topk_candidates(plan, q, k, &args, with ? scores_b : NULL,
                                                candidates, out, m->stream));
        m->sync(m->stream);
        m->download(got, out, sizeof(int32_t) * picks);
        m->download(got_candidates, candidates, sizeof(float) * picks);
        CHECK(ptk_int_differences(got, want_pages, picks) == 0,
              "%s: candidate pages (scores %s) differ from topk_select without forced pages in "
              "%ld entries",
              label, with ? "given" : "NULL", ptk_int_differences(got, want_pages, picks));
        CHECK(ptk_float_differences(got_candidates, want_candidates, picks) == 0,
              "%s: candidate scores (scores %s) differ in %ld entries", label,
              with ? "given" : "NULL",
              ptk_float_differences(got_candidates, want_candidates, picks));
        if (with) {
            m->download(got_scores, scores_b, sizeof(float) * cells);
            CHECK(ptk_float_differences(got_scores, want_scores, cells) == 0,
                  "%s: prefill_topk_candidates wrote scores unlike prefill_scores", label);
        }
    }

    /* A workspace one byte short is refused by name, before any work. */
    if (T > 0) {
        args.workspace_bytes = area_bytes - 1;
        CHECK(msaidx_prefill_topk(plan, q, k, &args, NULL, out, m->stream) ==
                      MSAIDX_ERROR_INVALID_ARGUMENT &&
                  strstr(msaidx_last_error(), "args.workspace_bytes"),
              "%s: short workspace not refused by name: %s", label, msaidx_last_error());
    }
    CHECK_OK(msaidx_plan_check(plan, m->stream));

    m->release(cu);
    m->release(lens);
    m->release(table);
    m->release(q);
    m->release(k);
    m->release(workspace);
    m->release(area);
    m->release(scores_a);
    m->release(scores_b);
    m->release(out);
    m->release(candidates);
    free(poison);
    free(area_poison);
    free(pick_poison);
    free(want_scores);
    free(got_scores);
    free(want);
    free(got);
    free(want_pages);
    free(want_candidates);
    free(got_candidates);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    msaidx_context_destroy(free_context);
    return MSAIDX_SUCCESS;
}

/* Batches of long rows, which the persistent plan deals in chunks of at least 8 pages, with more
 * rows than a wave of the top-k's CTAs:
 * - even rounds with `many_cells`: one request at 1M tokens of context, 2200-3200 rows of
 *   7800-8200 pages, past the 2^24 score cells from which the persistent fused call selects long
 *   rows from their chunk maxima (5 s of the host's time to build each);
 * - the other rounds: two requests at 128K-300K tokens, 560-1200 rows of 1000-2400 pages (fewer
 *   cells: the plain kernels), every fourth round at most 300 tokens (the CTA-a-row top-k).
 * Every third round with all keys zero: every score ties, the maxima too, and a fused path must
 * fall back. */
static inline void ptk_long_spec(bc_spec *spec, harness_rng *rng, int round, bool many_cells) {
    bc_random_spec(spec, rng, true);
    spec->name = round % 3 == 2 ? "long rows, zero keys" : "long rows";
    many_cells = many_cells && round % 2 == 0;
    spec->batch_size = many_cells ? 1 : 2;
    const int32_t rows = many_cells       ? (int32_t)harness_int(rng, 2600, 3200)
                         : round % 4 == 3 ? 300
                                          : (int32_t)harness_int(rng, 640, 1200);
    for (int32_t b = 0; b < spec->batch_size; ++b) {
        const int32_t tokens = rows / (spec->num_heads * spec->batch_size);
        spec->q_lens[b] = (int32_t)harness_int(rng, tokens - tokens / 8, tokens);
        spec->prefixes[b] = many_cells ? (int32_t)harness_int(rng, 1000 * 1000, 1024 * 1024)
                                       : (int32_t)harness_int(rng, 128 * 1024, 300 * 1000);
    }
    spec->nan_inputs = false;
    spec->pad_tokens = (int32_t)harness_int(rng, 0, 3);
    spec->pitch_extra = (int32_t)harness_int(rng, 0, 64);
}

/* Random ragged batches (rows with nvp <= topk, padding rows, NaN inputs now and then) and, with
 * fixed_cases, the SPEC.md section 9 cases that are not large, at both precisions, through
 * ptk_check_batch; on a device, long rows (ptk_long_spec) too. */
static inline void ptk_run(msaidx_backend backend, const ptk_memory *m, bool device_shapes,
                           bool fixed_cases, int random_cases, harness_rng *rng) {
    for (int precision = 0; precision < 2; ++precision) {
        int checked = 0;
        /* None under MSAIDX_TEST_SMALL=1 (racecheck): with one, dense's exact section took
         * 93 s on an H100. gpu_topk's racecheck covers the top-k of rows past 1024 pages. */
        const bool small = getenv("MSAIDX_TEST_SMALL") != NULL;
        const int long_cases = device_shapes && !small ? (random_cases + 3) / 4 : 0;
        for (int i = 0; i < bc_num_fixed_specs() + random_cases + long_cases; ++i) {
            bc_spec spec;
            const int long_round = i - bc_num_fixed_specs() - random_cases;
            if (long_round >= 0) {
                /* Past 2^24 cells only where that changes the kernels. */
                ptk_long_spec(&spec, rng, long_round, backend == MSAIDX_BACKEND_PERSISTENT);
            } else if (i < bc_num_fixed_specs()) {
                if (!fixed_cases) continue;
                bc_fixed_spec(i, &spec, rng);
                if (spec.large) continue;
                if (device_shapes && (spec.head_dim != 128 || spec.page_size != 128)) continue;
            } else {
                bc_random_spec(&spec, rng, device_shapes);
                spec.nan_inputs = harness_int(rng, 0, 2) == 0;
                spec.pad_tokens = (int32_t)harness_int(rng, 0, 3);
                /* Every third batch in score rows far wider than its contexts, as engines size
                 * them for their longest: past a warp's 1024 pages, so that the CUDA
                 * topk_select picks its kernels for long rows and prefill_topk, bounded by the
                 * plan's max_seq_len, those for short ones. */
                if (i % 3 == 0) spec.pitch_extra = 1100 + (int32_t)harness_int(rng, 0, 3);
            }
            spec.decode = false;
            spec.fp8_accumulation = precision == 1;
            bc_batch *batch = bc_build(&spec, rng);
            if (long_round >= 0 && long_round % 3 == 2) memset(batch->k_cache, 0, batch->k_bytes);
            char label[160];
            snprintf(label, sizeof label, "%s %s %s %s H%d topk %d init %d local %d",
                     msaidx_backend_name(backend), precision ? "default" : "exact", spec.name,
                     spec.dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", spec.num_heads, spec.topk,
                     spec.init_blocks, spec.local_blocks);
            checked += ptk_check_batch(batch, backend, m, label) == MSAIDX_SUCCESS;
            bc_free(batch);
        }
        printf("  %s %s: %d batches\n", msaidx_backend_name(backend),
               precision ? "default precision" : "exact", checked);
        CHECK(checked > random_cases / 2, "%s: only %d batches admitted",
              msaidx_backend_name(backend), checked);
    }
}

#endif
