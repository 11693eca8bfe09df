/* The cpu scalar reference and the public cpu backend against a brute force written here
 * (FP64, its own decoders), on random ragged batches and every SPEC.md section 9 case; top-k
 * against a full-sort oracle; nvp against the test's own computation. */
#include "backend_cases.h"
#include "cpu/cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifdef MSAIDX_TEST_SANITIZE
enum { RANDOM_CASES = 10, TOPK_ROUNDS = 30 };
static const double full_check_macs = 1e7;
#else
enum { RANDOM_CASES = 40, TOPK_ROUNDS = 200 };
static const double full_check_macs = 3e8;
#endif

static void *checked_malloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) exit(2);
    return p;
}

/* The public cpu backend on `batch`; scores poisoned by the caller. */
static msaidx_status run_public(const bc_batch *batch, bool decode, float *scores,
                                int32_t *nvp_out) {
    msaidx_config config = batch->config;
    config.backend = MSAIDX_BACKEND_CPU;
    config.num_threads = decode ? 1 : 0;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    void *workspace = NULL;
    msaidx_status status = msaidx_context_create(&context, &config);
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_create(&plan, context, &batch->desc);
    size_t bytes = 0;
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_workspace_size(plan, &bytes);
    if (status == MSAIDX_SUCCESS) {
        workspace = checked_malloc(bytes);
        status = msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                                   workspace, bytes, NULL);
    }
    if (status == MSAIDX_SUCCESS)
        status = decode ? msaidx_decode_scores(plan, batch->q, batch->k_cache, scores, NULL)
                        : msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL);
    const int32_t *nvp = NULL;
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_nvp(plan, &nvp);
    if (status == MSAIDX_SUCCESS)
        memcpy(nvp_out, nvp, sizeof(int32_t) * (size_t)batch->desc.num_tokens);
    free(workspace);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    return status;
}

static long count_inexact(const bc_batch *batch, const float *got, const float *want) {
    const int32_t H = batch->config.num_heads, pitch = batch->desc.pitch;
    long differ = 0;
    for (int32_t t = 0; t < batch->desc.num_tokens; ++t)
        for (int32_t h = 0; h < H; ++h)
            for (int32_t p = 0; p < batch->nvp[t]; ++p) {
                const size_t i = ((size_t)t * H + h) * pitch + p;
                differ += got[i] != want[i];
            }
    return differ;
}

/* Brute force vs the scalar reference, public prefill and public decode; nvp both ways. A sampled
 * batch (`whole` false: single-token requests) no longer has the NaN rows of its spec. */
static void check_batch(const bc_batch *batch, const char *name, bool whole) {
    const size_t cells = bc_score_count(batch) + 1;
    const int32_t T = batch->desc.num_tokens;
    float *brute = checked_malloc(sizeof(float) * cells);
    float *got = checked_malloc(sizeof(float) * cells);
    int32_t *nvp = checked_malloc(sizeof(int32_t) * ((size_t)T + 1));
    bc_poison(brute, cells);
    bc_brute_scores(batch, brute);

    char label[128];
    snprintf(label, sizeof label, "%s reference", name);
    bc_poison(got, cells);
    bc_reference_scores(batch, got);
    bc_compare_scores(batch, got, brute, label);
    if (whole && batch->spec.nan_inputs) bc_check_nan_semantics(batch, got, label);
    if (batch->spec.distinct)
        CHECK(count_inexact(batch, got, brute) == 0, "%s: distinct scores not exact", label);

    for (int decode = 0; decode < 2; ++decode) {
        snprintf(label, sizeof label, "%s public %s", name, decode ? "decode" : "prefill");
        bc_poison(got, cells);
        for (int32_t t = 0; t < T; ++t) nvp[t] = -7;
        const msaidx_status status = run_public(batch, decode, got, nvp);
        CHECK(status == MSAIDX_SUCCESS, "%s: %s", label, msaidx_last_error());
        if (status != MSAIDX_SUCCESS) continue;
        bc_compare_scores(batch, got, brute, label);
        if (whole && batch->spec.nan_inputs) bc_check_nan_semantics(batch, got, label);
        if (batch->spec.distinct)
            CHECK(count_inexact(batch, got, brute) == 0, "%s: distinct scores not exact", label);
        long bad = 0;
        for (int32_t t = 0; t < T; ++t) bad += nvp[t] != batch->nvp[t];
        CHECK(bad == 0, "%s: msaidx_plan_nvp differs from the test in %ld tokens", label, bad);
    }

    /* The distinct cases have exact, strictly ordered scores: the top-k is unambiguous. */
    if (batch->spec.distinct) {
        const size_t picks = (size_t)T * batch->config.num_heads * batch->config.topk;
        int32_t *want = checked_malloc(sizeof(int32_t) * picks);
        int32_t *have = checked_malloc(sizeof(int32_t) * picks);
        bc_topk_oracle(&batch->config, brute, batch->desc.pitch, batch->nvp, T, want);
        msaidx_cpu_topk_fast(&batch->config, brute, batch->desc.pitch, batch->nvp, T, have);
        CHECK(memcmp(want, have, sizeof(int32_t) * picks) == 0, "%s: top-k of exact scores", name);
        free(want);
        free(have);
    }

    /* msaidx_num_valid_pages against the test's nvp. */
    msaidx_config config = batch->config;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    for (int32_t t = 0; t < T; ++t) nvp[t] = -7;
    CHECK_OK(msaidx_num_valid_pages(context, batch->cu_seqlens_q, batch->seq_lens,
                                    batch->desc.batch_size, T, nvp, NULL));
    long bad = 0;
    for (int32_t t = 0; t < T; ++t) bad += nvp[t] != batch->nvp[t];
    CHECK(bad == 0, "%s: msaidx_num_valid_pages differs from the test in %ld tokens", name, bad);
    msaidx_context_destroy(context);
    free(brute);
    free(got);
    free(nvp);
}

/* Small cases in full; big ones through one single-token request per sampled token. */
static void check_spec(bc_spec *spec, harness_rng *rng) {
    const bool sample = spec->large || bc_spec_macs(spec) > full_check_macs;
    if (sample && spec->sample_tokens <= 0) spec->sample_tokens = 48;
    bc_batch *batch = bc_build(spec, rng);
    if (sample) {
        bc_batch *sub = bc_sample(batch);
        check_batch(sub, spec->name, false);
        bc_free(sub);
    } else {
        check_batch(batch, spec->name, true);
    }
    bc_free(batch);
}

/* Several host threads scoring at once, each on its own context (the library's state is
 * per context and per thread); every run writes its own poisoned buffers, all checked. */
enum { CONCURRENT_THREADS = 3, CONCURRENT_RUNS = 3 };

typedef struct concurrent_run {
    const bc_batch *batch;
    float *scores[CONCURRENT_RUNS];
    int32_t *nvp[CONCURRENT_RUNS];
    msaidx_status status;
} concurrent_run;

static void *concurrent_worker(void *arg) {
    concurrent_run *run = arg;
    for (int repeat = 0; repeat < CONCURRENT_RUNS && run->status == MSAIDX_SUCCESS; ++repeat)
        run->status = run_public(run->batch, repeat == 1, run->scores[repeat], run->nvp[repeat]);
    return NULL;
}

static void concurrent_threads(harness_rng *rng) {
    bc_batch *batches[CONCURRENT_THREADS];
    concurrent_run runs[CONCURRENT_THREADS];
    pthread_t threads[CONCURRENT_THREADS];
    for (int i = 0; i < CONCURRENT_THREADS; ++i) {
        bc_spec spec;
        bc_random_spec(&spec, rng, false);
        spec.name = "concurrent";
        batches[i] = bc_build(&spec, rng);
        const size_t cells = bc_score_count(batches[i]) + 1;
        const int32_t T = batches[i]->desc.num_tokens;
        runs[i] = (concurrent_run){.batch = batches[i], .status = MSAIDX_SUCCESS};
        for (int r = 0; r < CONCURRENT_RUNS; ++r) {
            runs[i].scores[r] = checked_malloc(sizeof(float) * cells);
            runs[i].nvp[r] = checked_malloc(sizeof(int32_t) * ((size_t)T + 1));
            bc_poison(runs[i].scores[r], cells);
            for (int32_t t = 0; t < T; ++t) runs[i].nvp[r][t] = -7;
        }
    }
    for (int i = 0; i < CONCURRENT_THREADS; ++i)
        CHECK(pthread_create(&threads[i], NULL, concurrent_worker, &runs[i]) == 0,
              "pthread_create");
    for (int i = 0; i < CONCURRENT_THREADS; ++i) pthread_join(threads[i], NULL);
    for (int i = 0; i < CONCURRENT_THREADS; ++i) {
        CHECK(runs[i].status == MSAIDX_SUCCESS, "concurrent run %d: %s", i,
              msaidx_status_string(runs[i].status));
        const size_t cells = bc_score_count(batches[i]) + 1;
        float *brute = checked_malloc(sizeof(float) * cells);
        bc_poison(brute, cells);
        bc_brute_scores(batches[i], brute);
        for (int r = 0; r < CONCURRENT_RUNS; ++r) {
            bc_compare_scores(batches[i], runs[i].scores[r], brute, "concurrent");
            long bad = 0;
            for (int32_t t = 0; t < batches[i]->desc.num_tokens; ++t)
                bad += runs[i].nvp[r][t] != batches[i]->nvp[t];
            CHECK(bad == 0, "concurrent run %d.%d: nvp differs in %ld tokens", i, r, bad);
            free(runs[i].scores[r]);
            free(runs[i].nvp[r]);
        }
        free(brute);
        bc_free(batches[i]);
    }
}

/* --- top-k --------------------------------------------------------------------------- */

static void topk_round(harness_rng *rng, int round) {
    bc_topk_case tc;
    bc_topk_case_make(&tc, rng, round, 1, round % 7 == 0 ? 700 : 90, 1, 40);
    const msaidx_config *config = &tc.config;
    const int32_t T = tc.num_tokens, pitch = tc.pitch;
    const size_t picks = (size_t)T * config->num_heads * config->topk;
    int32_t *want = checked_malloc(sizeof(int32_t) * picks);
    int32_t *out = checked_malloc(sizeof(int32_t) * (picks + 8));
    int32_t *first = checked_malloc(sizeof(int32_t) * picks);
    bc_topk_oracle(config, tc.scores, pitch, tc.nvp, T, want);

    char label[96];
    snprintf(label, sizeof label, "topk round %d (H=%d T=%d pitch=%d topk=%d/%d/%d)", round,
             config->num_heads, T, pitch, config->topk, config->init_blocks, config->local_blocks);
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, config));
    for (int run = 0; run < 2; ++run) {
        for (size_t i = 0; i < picks + 8; ++i) out[i] = -999;
        CHECK_OK(msaidx_topk_select(context, tc.scores, pitch, tc.nvp, T, out, NULL));
        long differ = 0;
        for (size_t i = 0; i < picks; ++i) differ += out[i] != want[i];
        CHECK(differ == 0, "%s: public top-k differs from the oracle in %ld slots", label, differ);
        for (size_t i = picks; i < picks + 8; ++i)
            CHECK(out[i] == -999, "%s: wrote past T*H*topk", label);
        if (run == 0)
            memcpy(first, out, sizeof(int32_t) * picks);
        else
            CHECK(memcmp(first, out, sizeof(int32_t) * picks) == 0, "%s: not deterministic", label);
    }
    bc_check_topk_shape(config, tc.nvp, T, out, label);
    for (size_t i = 0; i < picks; ++i) out[i] = -999;
    msaidx_cpu_topk_reference(config, tc.scores, pitch, tc.nvp, T, out);
    CHECK(memcmp(out, want, sizeof(int32_t) * picks) == 0, "%s: msaidx_cpu_topk_reference", label);
    for (size_t i = 0; i < picks; ++i) out[i] = -999;
    msaidx_cpu_topk_fast(config, tc.scores, pitch, tc.nvp, T, out);
    CHECK(memcmp(out, want, sizeof(int32_t) * picks) == 0, "%s: msaidx_cpu_topk_fast", label);
    msaidx_context_destroy(context);
    bc_topk_case_free(&tc);
    free(want);
    free(out);
    free(first);
}

/* Hand-checked rows: the rules of SPEC.md section 4 spelled out. */
static void topk_examples(void) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = 1;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    float scores[4][20];
    for (int p = 0; p < 20; ++p) {
        scores[0][p] = (float)p;                 /* nvp 17: best are the highest pages */
        scores[1][p] = (float)(20 - p);          /* nvp 17: best are the lowest pages */
        scores[2][p] = 1.0f;                     /* all tied: lowest pages win */
        scores[3][p] = p == 3 ? NAN : -INFINITY; /* NaN ranks as -inf: ties, lower pages */
    }
    const int32_t nvp[4] = {17, 17, 17, 16};
    int32_t out[4][16];
    CHECK_OK(msaidx_topk_select(context, &scores[0][0], 20, nvp, 4, &out[0][0], NULL));
    /* local = 1 forces page 16; 15 slots from pages 0..15. */
    for (int k = 0; k < 16; ++k) {
        CHECK(out[0][k] == k + 1, "ascending scores: slot %d = %d", k, out[0][k]);
        CHECK(out[1][k] == (k < 15 ? k : 16), "descending scores: slot %d = %d", k, out[1][k]);
        CHECK(out[2][k] == (k < 15 ? k : 16), "tied scores: slot %d = %d", k, out[2][k]);
        CHECK(out[3][k] == k, "nvp == topk: slot %d = %d", k, out[3][k]);
    }
    const int32_t padding[2] = {0, -3};
    CHECK_OK(msaidx_topk_select(context, &scores[0][0], 20, padding, 2, &out[0][0], NULL));
    for (int k = 0; k < 16; ++k)
        CHECK(out[0][k] == -1 && out[1][k] == -1, "padding rows: slot %d = %d, %d", k, out[0][k],
              out[1][k]);
    msaidx_context_destroy(context);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    for (int i = 0; i < bc_num_fixed_specs(); ++i) {
        bc_spec spec;
        bc_fixed_spec(i, &spec, &rng);
#ifdef MSAIDX_TEST_SANITIZE
        if (spec.large) continue; /* minutes under the sanitizers; the Release run covers them */
#endif
        check_spec(&spec, &rng);
    }
    for (int i = 0; i < RANDOM_CASES; ++i) {
        bc_spec spec;
        bc_random_spec(&spec, &rng, false);
        check_spec(&spec, &rng);
    }
    concurrent_threads(&rng);
    topk_examples();
    for (int round = 0; round < TOPK_ROUNDS; ++round) topk_round(&rng, round);
    return harness_finish("test_reference");
}
