/*
 * Context parallel on the cpu backend (SPEC.md section 12): every rank of W scores its shard of
 * the pages (desc.cp_*), returns its candidates with global page ids, and
 * msaidx_merge_candidates of the gathered candidates must give bitwise msaidx_prefill_topk's
 * selection of the unsharded batch. Random ragged batches (prefill and decode rows, H 1/2/4,
 * rows with nvp <= topk, padding rows, NaN inputs, forced init/local pages), both layouts,
 * W = 1..4; then the merge alone on score rows full of ties and NaN; then the refusals.
 */
#include "backend_cases.h"
#include "cp_oracle.h"

#include <msaidx.h>

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static void *zalloc(size_t bytes) {
    void *pointer = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!pointer) exit(2);
    memset(pointer, 0, bytes);
    return pointer;
}

static long int_differences(const int32_t *a, const int32_t *b, size_t count) {
    long differ = 0;
    for (size_t i = 0; i < count; ++i) differ += a[i] != b[i];
    return differ;
}

static void expect_status(msaidx_status status, msaidx_status expected, const char *name,
                          const char *what) {
    CHECK(status == expected && strstr(msaidx_last_error(), name),
          "%s: status %d, \"%s\" (expected %d naming %s)", what, status, msaidx_last_error(),
          expected, name);
}

typedef struct unsharded {
    msaidx_topk_args args; /* the batch's topk, init_blocks, local_blocks */
    int32_t *selection;    /* [T, H, topk] of msaidx_prefill_topk */
    float *scores;         /* [T, H, pitch] */
    int32_t *nvp;          /* [T], global */
} unsharded;

static void run_unsharded(const bc_batch *batch, msaidx_context *context, unsharded *u) {
    const int32_t T = batch->desc.num_tokens, H = batch->config.num_heads;
    msaidx_topk_args_init(&u->args);
    u->args.topk = batch->config.topk;
    u->args.init_blocks = batch->config.init_blocks;
    u->args.local_blocks = batch->config.local_blocks;
    u->selection = zalloc(sizeof(int32_t) * ((size_t)T * H * u->args.topk + 1));
    u->scores = zalloc(sizeof(float) * (bc_score_count(batch) + 1));
    u->nvp = zalloc(sizeof(int32_t) * ((size_t)T + 1));
    msaidx_plan *plan = NULL;
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = zalloc(bytes);
    CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                               workspace, bytes, NULL));
    CHECK_OK(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &u->args, u->scores, u->selection,
                                 NULL));
    CHECK_OK(msaidx_num_valid_pages(context, batch->cu_seqlens_q, batch->seq_lens,
                                    batch->desc.batch_size, T, u->nvp, NULL));
    msaidx_plan_destroy(plan);
    free(workspace);
}

/* Rank r's candidates into scores/pages (its [T, H, topk] rows); checks its scores against the
 * unsharded ones, column by column. */
static void run_rank(const bc_batch *batch, msaidx_context *context, const unsharded *u, int32_t W,
                     int32_t r, int32_t layout, harness_rng *rng, float *cand_scores,
                     int32_t *cand_pages, const char *label) {
    const msaidx_batch_desc *full = &batch->desc;
    const int32_t T = full->num_tokens, H = batch->config.num_heads, K = u->args.topk;
    const int32_t P = batch->config.page_size;
    const int32_t local_max = ceil_div(ceil_div(full->max_seq_len, P), W);
    msaidx_batch_desc desc = *full;
    desc.cp_world = W;
    desc.cp_rank = r;
    desc.cp_layout = layout;
    desc.bt_stride = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    desc.pitch = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    /* The engine convention: each row lists only the rank's pages, in order. */
    const int32_t B = full->batch_size;
    int32_t *table = zalloc(sizeof(int32_t) * (size_t)(B > 0 ? B : 1) * desc.bt_stride);
    for (int32_t b = 0; b < B; ++b) {
        const int32_t pages = ceil_div(batch->seq_lens[b], P);
        for (int32_t i = 0; i < desc.bt_stride; ++i) {
            const int32_t g = global_page(layout, W, r, pages, i);
            table[(size_t)b * desc.bt_stride + i] =
                g >= 0 ? batch->block_table[(size_t)b * full->bt_stride + g] : -7;
        }
    }
    msaidx_plan *plan = NULL;
    size_t bytes = 0, area_bytes = 0;
    CHECK_OK(msaidx_plan_create(&plan, context, &desc));
    if (!plan) {
        free(table);
        return;
    }
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes));
    void *workspace = zalloc(bytes), *area = zalloc(area_bytes);
    CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, table, workspace, bytes,
                               NULL));
    const size_t cells = (size_t)T * H * desc.pitch;
    float *scores = zalloc(sizeof(float) * (cells + 1));
    bc_poison(scores, cells);
    const bool keep_scores = harness_int(rng, 0, 2) != 0;
    msaidx_topk_args args = u->args;
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    CHECK_OK(msaidx_prefill_topk_candidates(plan, batch->q, batch->k_cache, &args,
                                            keep_scores ? scores : NULL, cand_scores, cand_pages,
                                            NULL));
    const int32_t *nvp = NULL;
    CHECK_OK(msaidx_plan_nvp(plan, &nvp));
    long bad_nvp = 0, bad_cells = 0, bad_pages = 0;
    for (int32_t b = 0; b < B && nvp; ++b) {
        const int32_t pages = ceil_div(batch->seq_lens[b], P);
        for (int32_t t = batch->cu_seqlens_q[b]; t < batch->cu_seqlens_q[b + 1]; ++t) {
            const int32_t local = owned_below(layout, W, r, pages, u->nvp[t]);
            bad_nvp += nvp[t] != local;
            for (int32_t h = 0; h < H; ++h) {
                const size_t row = (size_t)t * H + h;
                for (int32_t i = 0; keep_scores && i < desc.pitch; ++i) {
                    const float *got = scores + row * desc.pitch + i;
                    if (i >= local) {
                        bad_cells += !bc_is_poison(*got);
                        continue;
                    }
                    const float *want =
                        u->scores + row * full->pitch + global_page(layout, W, r, pages, i);
                    bad_cells += memcmp(got, want, sizeof(float)) != 0;
                }
                /* Ascending global pages the rank owns, then -1. */
                const int32_t *row_pages = cand_pages + row * K;
                for (int32_t k = 0; k < K; ++k) {
                    const int32_t p = row_pages[k];
                    const bool padding = k >= (local < K ? local : K);
                    if (padding)
                        bad_pages += p != -1;
                    else
                        bad_pages += p < 0 || p >= u->nvp[t] || !owns(layout, W, r, pages, p) ||
                                     (k > 0 && p <= row_pages[k - 1]);
                }
            }
        }
    }
    for (int32_t t = B > 0 ? batch->cu_seqlens_q[B] : 0; t < T && nvp; ++t) {
        bad_nvp += nvp[t] != 0;
        for (int32_t k = 0; k < H * K; ++k) bad_pages += cand_pages[(size_t)t * H * K + k] != -1;
    }
    CHECK(bad_nvp == 0, "%s rank %d: %ld nvp entries are not the owned visible pages", label, r,
          bad_nvp);
    CHECK(bad_cells == 0, "%s rank %d: %ld score cells differ from the unsharded ones", label, r,
          bad_cells);
    CHECK(bad_pages == 0, "%s rank %d: %ld candidate pages are not ascending owned global pages",
          label, r, bad_pages);
    msaidx_plan_destroy(plan);
    free(workspace);
    free(area);
    free(scores);
    free(table);
}

static void check_batch(const bc_batch *batch, harness_rng *rng, const char *label) {
    msaidx_config config = batch->config;
    config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    if (!context) return;
    unsharded u;
    run_unsharded(batch, context, &u);
    const int32_t T = batch->desc.num_tokens, H = config.num_heads, K = u.args.topk;
    const size_t per_rank = (size_t)T * H * K;
    int32_t *merged = zalloc(sizeof(int32_t) * (per_rank + 1));
    for (int32_t W = 1; W <= 4; ++W)
        for (int32_t layout = 0; layout < 2; ++layout) {
            /* Now and then ranks spaced wider than their rows, as a padded gather lays them. */
            const int64_t rank_stride = (int64_t)per_rank + (harness_int(rng, 0, 3) ? 0 : 5);
            float *cand_scores = zalloc(sizeof(float) * ((size_t)rank_stride * W + 1));
            int32_t *cand_pages = zalloc(sizeof(int32_t) * ((size_t)rank_stride * W + 1));
            char what[160];
            snprintf(what, sizeof what, "%s W=%d %s", label, W,
                     layout ? "contiguous" : "interleaved");
            for (int32_t r = 0; r < W; ++r)
                run_rank(batch, context, &u, W, r, layout, rng, cand_scores + r * rank_stride,
                         cand_pages + r * rank_stride, what);
            for (size_t i = 0; i < per_rank; ++i) merged[i] = -99;
            CHECK_OK(msaidx_merge_candidates(context, &u.args, W, T, u.nvp, cand_scores, cand_pages,
                                             rank_stride, merged, NULL));
            const long differ = int_differences(merged, u.selection, per_rank);
            CHECK(differ == 0, "%s: %ld of %zu merged ids differ from msaidx_prefill_topk's", what,
                  differ, per_rank);
            free(cand_scores);
            free(cand_pages);
        }
    free(merged);
    free(u.selection);
    free(u.scores);
    free(u.nvp);
    msaidx_context_destroy(context);
}

/* The merge alone: rows of one request with P pages whose scores take a few values (many ties)
 * and NaN; each rank's candidates are msaidx_topk_select of its columns with no forced page. */
static void check_merge_ties(harness_rng *rng, int round) {
    static const int32_t heads[] = {1, 2, 4}, topks[] = {1, 4, 16};
    const int32_t H = heads[harness_int(rng, 0, 2)], K = topks[harness_int(rng, 0, 2)];
    int32_t init = 0, local = 0;
    do {
        init = (int32_t)harness_int(rng, 0, 2);
        local = (int32_t)harness_int(rng, 0, 2);
    } while (init + local > K);
    const int32_t T = (int32_t)harness_int(rng, 1, 12), P = (int32_t)harness_int(rng, 1, 80);
    const int32_t W = (int32_t)harness_int(rng, 1, 4), layout = (int32_t)harness_int(rng, 0, 1);
    msaidx_config config;
    msaidx_config_init(&config);
    config.backend = MSAIDX_BACKEND_CPU;
    config.num_heads = H;
    config.topk = K;
    config.init_blocks = init;
    config.local_blocks = local;
    msaidx_config free_config = config;
    free_config.init_blocks = free_config.local_blocks = 0;
    msaidx_context *context = NULL, *free_context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    CHECK_OK(msaidx_context_create(&free_context, &free_config));
    if (!context || !free_context) return;
    const size_t rows = (size_t)T * H, per_rank = rows * K;
    float *scores = zalloc(sizeof(float) * rows * P);
    int32_t *nvp = zalloc(sizeof(int32_t) * T), *want = zalloc(sizeof(int32_t) * per_rank);
    static const float values[] = {0.0f, 1.0f, 1.0f, 2.0f, -INFINITY, INFINITY};
    for (size_t i = 0; i < rows * P; ++i)
        scores[i] = harness_int(rng, 0, 9) ? values[harness_int(rng, 0, 5)] : NAN;
    for (int32_t t = 0; t < T; ++t) nvp[t] = (int32_t)harness_int(rng, -1, P);
    CHECK_OK(msaidx_topk_select(context, scores, P, nvp, T, want, NULL));

    const int32_t pitch = ceil_div(P, W);
    float *local_scores = zalloc(sizeof(float) * rows * pitch);
    int32_t *local_nvp = zalloc(sizeof(int32_t) * T);
    float *cand_scores = zalloc(sizeof(float) * per_rank * W);
    int32_t *cand_pages = zalloc(sizeof(int32_t) * per_rank * W);
    for (int32_t r = 0; r < W; ++r) {
        for (size_t row = 0; row < rows; ++row)
            for (int32_t i = 0; i < pitch; ++i) {
                const int32_t g = global_page(layout, W, r, P, i);
                local_scores[row * pitch + i] = g >= 0 ? scores[row * P + g] : -INFINITY;
            }
        for (int32_t t = 0; t < T; ++t) local_nvp[t] = owned_below(layout, W, r, P, nvp[t]);
        int32_t *pages = cand_pages + r * per_rank;
        float *best = cand_scores + r * per_rank;
        CHECK_OK(msaidx_topk_select(free_context, local_scores, pitch, local_nvp, T, pages, NULL));
        for (size_t row = 0; row < rows; ++row)
            for (int32_t k = 0; k < K; ++k) {
                const int32_t i = pages[row * K + k];
                const float s = i >= 0 ? local_scores[row * pitch + i] : -INFINITY;
                best[row * K + k] = isnan(s) ? -INFINITY : s;
                pages[row * K + k] = i >= 0 ? global_page(layout, W, r, P, i) : -1;
            }
    }
    int32_t *merged = zalloc(sizeof(int32_t) * per_rank);
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    args.init_blocks = init;
    args.local_blocks = local;
    CHECK_OK(msaidx_merge_candidates(context, &args, W, T, nvp, cand_scores, cand_pages,
                                     (int64_t)per_rank, merged, NULL));
    const long differ = int_differences(merged, want, per_rank);
    CHECK(differ == 0,
          "ties round %d (H %d, topk %d, init %d, local %d, P %d, W %d, layout %d): %ld ids differ",
          round, H, K, init, local, P, W, layout, differ);
    free(scores);
    free(nvp);
    free(want);
    free(local_scores);
    free(local_nvp);
    free(cand_scores);
    free(cand_pages);
    free(merged);
    msaidx_context_destroy(context);
    msaidx_context_destroy(free_context);
}

/* Candidates that no rank would send (pages anywhere, repeated, NaN and infinite scores) and
 * any nvp: the merge reads and writes only its buffers, each row stays a selection (strictly
 * ascending ids in [0, nvp), the forced ones present, -1 only as tail padding), and it is the
 * sorting oracle's merge: a repeated page at its best copy, wherever the copies sit. */
static void check_hostile_merge(harness_rng *rng) {
    const int32_t H = (int32_t)harness_int(rng, 1, 4), K = (int32_t)harness_int(rng, 1, 64);
    const int32_t T = (int32_t)harness_int(rng, 1, 8), W = (int32_t)harness_int(rng, 1, 5);
    const int32_t init = (int32_t)harness_int(rng, 0, K),
                  local = (int32_t)harness_int(rng, 0, K - init);
    msaidx_config config;
    msaidx_config_init(&config);
    config.backend = MSAIDX_BACKEND_CPU;
    config.num_heads = H;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    if (!context) return;
    const size_t per_rank = (size_t)T * H * K;
    float *scores = zalloc(sizeof(float) * per_rank * W);
    int32_t *pages = zalloc(sizeof(int32_t) * per_rank * W);
    int32_t *nvp = zalloc(sizeof(int32_t) * T), *out = zalloc(sizeof(int32_t) * per_rank);
    hostile_candidates(rng, scores, pages, per_rank * W, nvp, T, harness_int(rng, 0, 2) == 0);
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    args.init_blocks = init;
    args.local_blocks = local;
    CHECK_OK(msaidx_merge_candidates(context, &args, W, T, nvp, scores, pages, (int64_t)per_rank,
                                     out, NULL));
    long bad_rows = 0, unlike_oracle = 0;
    float *pool = zalloc(sizeof(float) * 2 * (size_t)W * K);
    int32_t *want = zalloc(sizeof(int32_t) * K);
    for (size_t row = 0; row < (size_t)T * H; ++row) {
        const int32_t n = nvp[row / H], *o = out + row * K;
        oracle_merge_row(W, K, init, local, n, scores + row * K, pages + row * K, (int64_t)per_rank,
                         pool, want);
        unlike_oracle += memcmp(want, o, sizeof(int32_t) * K) != 0;
        int32_t k = 0;
        bool bad = false;
        for (; k < K && o[k] >= 0; ++k) bad |= o[k] >= n || (k > 0 && o[k] <= o[k - 1]);
        for (int32_t j = k; j < K; ++j) bad |= o[j] != -1;
        if (n > K) {
            for (int32_t p = 0; p < init; ++p) bad |= o[p] != p;
            for (int32_t p = 0; p < local; ++p)
                bad |= k < local || o[k - local + p] != n - local + p;
        } else {
            bad |= k != (n > 0 ? n : 0);
        }
        bad_rows += bad;
    }
    CHECK(bad_rows == 0, "hostile merge (H %d, topk %d, init %d, local %d, W %d): %ld bad rows", H,
          K, init, local, W, bad_rows);
    CHECK(unlike_oracle == 0,
          "hostile merge (H %d, topk %d, init %d, local %d, W %d): %ld rows unlike the oracle's", H,
          K, init, local, W, unlike_oracle);
    free(pool);
    free(want);
    free(scores);
    free(pages);
    free(nvp);
    free(out);
    msaidx_context_destroy(context);
}

static void check_refusals(harness_rng *rng) {
    bc_spec spec;
    bc_random_spec(&spec, rng, true);
    spec.q_lens[0] = 5;
    spec.prefixes[0] = 700;
    bc_batch *batch = bc_build(&spec, rng);
    msaidx_config config = batch->config;
    config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    msaidx_batch_desc d = batch->desc;
    CHECK(d.cp_world == 0 && d.cp_rank == 0 && d.cp_layout == MSAIDX_CP_INTERLEAVED,
          "msaidx_batch_desc_init: context parallel is not off");
#define BAD_DESC(mutation, name, expected)                                                         \
    do {                                                                                           \
        d = batch->desc;                                                                           \
        mutation;                                                                                  \
        expect_status(msaidx_plan_create(&plan, context, &d), expected, name, #mutation);          \
        CHECK(plan == NULL, "%s: a plan despite the refusal", #mutation);                          \
    } while (0)
    BAD_DESC(d.cp_world = -1, "desc.cp_world", MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC((d.cp_world = 2, d.cp_rank = 2), "desc.cp_rank", MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC((d.cp_world = 2, d.cp_rank = -1), "desc.cp_rank", MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC(d.cp_rank = 1, "desc.cp_rank", MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC((d.cp_world = 2, d.cp_layout = 2), "desc.cp_layout", MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC(d.cp_layout = -1, "desc.cp_layout", MSAIDX_ERROR_INVALID_ARGUMENT);
    const int32_t max_pages = ceil_div(batch->desc.max_seq_len, config.page_size);
    BAD_DESC((d.cp_world = 2, d.bt_stride = ceil_div(max_pages, 2) - 1), "desc.bt_stride",
             MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC((d.cp_world = 3, d.pitch = ceil_div(max_pages, 3) - 1), "desc.pitch",
             MSAIDX_ERROR_INVALID_ARGUMENT);
    BAD_DESC(d.struct_size = offsetof(msaidx_batch_desc, cp_world), "desc.struct_size",
             MSAIDX_ERROR_INVALID_ARGUMENT);
#undef BAD_DESC
    /* A caller built before the cp_* fields: its struct ends at pitch, and whatever lies past
     * it (here 1s, as stack garbage would) is not read. */
    msaidx_batch_desc old = batch->desc;
    old.cp_world = old.cp_rank = old.cp_layout = 1;
    old.struct_size = (offsetof(msaidx_batch_desc, pitch) + sizeof(int32_t) + 7) / 8 * 8;
    CHECK_OK(msaidx_plan_create(&plan, context, &old));
    msaidx_plan_destroy(plan);
    plan = NULL;

    /* A sharded plan forces global pages only through the merge. */
    d = batch->desc;
    d.cp_world = 2;
    d.cp_rank = 1;
    CHECK_OK(msaidx_plan_create(&plan, context, &d));
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = zalloc(bytes);
    CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                               workspace, bytes, NULL));
    const int32_t T = d.num_tokens, H = config.num_heads;
    float *scores = zalloc(sizeof(float) * ((size_t)T * H * d.pitch + 1));
    int32_t *out = zalloc(sizeof(int32_t) * ((size_t)T * H * 64 + 1));
    float *cand = zalloc(sizeof(float) * ((size_t)T * H * 64 + 1));
    int32_t *nvp = zalloc(sizeof(int32_t) * ((size_t)T + 1));
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    expect_status(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args, scores, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "msaidx_merge_candidates", "sharded prefill_topk");
    CHECK_OK(msaidx_prefill_topk_candidates(plan, batch->q, batch->k_cache, &args, scores, cand,
                                            out, NULL));

    const int64_t stride = (int64_t)T * H * args.topk;
    CHECK_OK(msaidx_merge_candidates(context, &args, 1, T, nvp, cand, out, stride, out, NULL));
    expect_status(msaidx_merge_candidates(NULL, &args, 1, T, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "context", "merge NULL context");
    expect_status(msaidx_merge_candidates(context, NULL, 1, T, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "args", "merge NULL args");
    expect_status(msaidx_merge_candidates(context, &args, 0, T, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "world_size", "merge world 0");
    expect_status(msaidx_merge_candidates(context, &args, 1, -1, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "num_tokens", "merge T -1");
    if (T > 0) {
        expect_status(
            msaidx_merge_candidates(context, &args, 2, T, nvp, cand, out, stride - 1, out, NULL),
            MSAIDX_ERROR_INVALID_ARGUMENT, "rank_stride", "merge short rank_stride");
        expect_status(
            msaidx_merge_candidates(context, &args, 1, T, NULL, cand, out, stride, out, NULL),
            MSAIDX_ERROR_INVALID_ARGUMENT, "nvp", "merge NULL nvp");
        expect_status(
            msaidx_merge_candidates(context, &args, 1, T, nvp, NULL, out, stride, out, NULL),
            MSAIDX_ERROR_INVALID_ARGUMENT, "candidate_scores", "merge NULL scores");
        expect_status(
            msaidx_merge_candidates(context, &args, 1, T, nvp, cand, NULL, stride, out, NULL),
            MSAIDX_ERROR_INVALID_ARGUMENT, "candidate_pages", "merge NULL pages");
        expect_status(msaidx_merge_candidates(context, &args, 1, T, nvp, cand, out, stride,
                                              (int32_t *)((char *)out + 2), NULL),
                      MSAIDX_ERROR_INVALID_ARGUMENT, "out", "merge misaligned out");
    }
    expect_status(msaidx_merge_candidates(context, &args, 1 << 30, T, nvp, cand, out, INT64_MAX / 2,
                                          out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "rank_stride", "merge huge candidates");
    msaidx_topk_args bad = args;
    bad.init_blocks = 10;
    bad.local_blocks = 7;
    expect_status(msaidx_merge_candidates(context, &bad, 1, T, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "args.init_blocks + args.local_blocks",
                  "merge init + local > topk");
    bad = args;
    bad.struct_size = 8;
    expect_status(msaidx_merge_candidates(context, &bad, 1, T, nvp, cand, out, stride, out, NULL),
                  MSAIDX_ERROR_INVALID_ARGUMENT, "args.struct_size", "merge struct_size");

    free(workspace);
    free(scores);
    free(out);
    free(cand);
    free(nvp);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    bc_free(batch);
}

int main(void) {
    harness_rng rng = {harness_seed()};
#ifdef MSAIDX_TEST_SANITIZE
    const int batches = 16, tie_rounds = 400; /* sanitized runs are several times slower */
#else
    const int batches = 24, tie_rounds = 600;
#endif
    for (int i = 0; i < batches; ++i) {
        bc_spec spec;
        bc_random_spec(&spec, &rng, false);
        spec.nan_inputs = harness_int(&rng, 0, 2) == 0;
        bc_batch *batch = bc_build(&spec, &rng);
        char label[64];
        snprintf(label, sizeof label, "batch %d (H %d, topk %d, init %d, local %d)", i,
                 spec.num_heads, spec.topk, spec.init_blocks, spec.local_blocks);
        check_batch(batch, &rng, label);
        bc_free(batch);
    }
    for (int round = 0; round < tie_rounds; ++round) check_merge_ties(&rng, round);
    for (int round = 0; round < tie_rounds / 4; ++round) check_hostile_merge(&rng);
    check_refusals(&rng);
    return harness_finish("test_context_parallel");
}
