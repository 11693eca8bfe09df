/* The cross-backend check (tests/backend_cases.c) on every host backend: the public cpu
 * backend (its fast path) against the scalar reference, on every SPEC.md section 9 case and
 * random ragged batches. tests/gpu_backends.c runs the same cases on the CUDA backends. */
#include "backend_cases.h"
#include "cpu/cpu.h"

#include <stdlib.h>
#include <string.h>

#define TRY(call)                                                                                  \
    do {                                                                                           \
        msaidx_status try_status_ = (call);                                                        \
        if (try_status_ != MSAIDX_SUCCESS) {                                                       \
            status = try_status_;                                                                  \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

static msaidx_status run_cpu(void *user, const bc_batch *batch, float *scores, int32_t *nvp,
                             int32_t *topk) {
    (void)user;
    msaidx_config config = batch->config;
    config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    void *workspace = NULL;
    msaidx_status status = MSAIDX_SUCCESS;
    TRY(msaidx_context_create(&context, &config));
    TRY(msaidx_plan_create(&plan, context, &batch->desc));
    size_t bytes = 0;
    TRY(msaidx_plan_workspace_size(plan, &bytes));
    workspace = aligned_alloc(16, (bytes + 15) / 16 * 16 + 16);
    if (!workspace) exit(2);
    TRY(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table, workspace,
                          bytes, NULL));
    if (batch->spec.decode)
        TRY(msaidx_decode_scores(plan, batch->q, batch->k_cache, scores, NULL));
    else
        TRY(msaidx_prefill_scores(plan, batch->q, batch->k_cache, scores, NULL));
    TRY(msaidx_plan_check(plan, NULL));
    const int32_t *planned = NULL;
    TRY(msaidx_plan_nvp(plan, &planned));
    memcpy(nvp, planned, sizeof(int32_t) * (size_t)batch->desc.num_tokens);
    TRY(msaidx_topk_select(context, scores, batch->desc.pitch, planned, batch->desc.num_tokens,
                           topk, NULL));
done:
    free(workspace);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    return status;
}

int main(void) {
    harness_rng rng = {harness_seed()};
    /* The large cases run every row through the fast path: minutes if it is the scalar one. */
    const bool fast = strcmp(msaidx_cpu_simd_name(), "scalar") != 0;
    printf("cpu fast path: %s\n", msaidx_cpu_simd_name());
    const char *forced = getenv("MSAIDX_CPU_SIMD");
    if (forced && strcmp(forced, "scalar") == 0)
        CHECK(!fast, "MSAIDX_CPU_SIMD=scalar ran %s", msaidx_cpu_simd_name());
    if (forced && strcmp(forced, "avx2") == 0)
        CHECK(strcmp(msaidx_cpu_simd_name(), "avx512") != 0, "MSAIDX_CPU_SIMD=avx2 ran avx512");
    bc_options options = {.backend = MSAIDX_BACKEND_CPU,
                          .device_shapes = false,
                          .run_large = fast,
                          .random_cases = 24};
#ifdef MSAIDX_TEST_SANITIZE
    options.run_large = false;
    options.random_cases = 8;
    options.sample_above_macs = 3e7;
#endif
    bc_run_backend("cpu", run_cpu, NULL, &options, &rng);
    return harness_finish("test_backends");
}
