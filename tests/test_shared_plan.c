/* One cpu plan shared by host threads (tests/backend_cases.c, bc_check_shared_plan): layers scored
 * and selected from four threads at once on one context and one plan, each bitwise the same layer
 * run alone. tests/gpu_shared_plan.c runs the same check on the CUDA backends, with streams. */
#include "backend_cases.h"

#include <stdlib.h>

enum { WORKERS = 4, ROUNDS = 6, LAYERS = 5, CASES = 16 };

typedef struct shared_cpu {
    const bc_batch *batch;
    msaidx_context *context;
    msaidx_plan *plan;
    void *workspace, *fused_workspace[WORKERS];
    size_t fused_bytes;
    void *q[LAYERS];
} shared_cpu;

static void *aligned_or_exit(size_t bytes) {
    void *p = aligned_alloc(16, (bytes + 15) / 16 * 16 + 16);
    if (!p) exit(2);
    return p;
}

/* Writes straight into the checked buffers. */
static msaidx_status run_layer(void *user, int worker, int layer, float *scores, int32_t *topk,
                               int32_t *fused, long *guard_hits) {
    (void)guard_hits;
    const shared_cpu *s = user;
    return bc_layer_calls(s->context, s->plan, s->batch, s->q[layer], s->batch->k_cache, scores,
                          topk, fused, s->fused_workspace[worker], s->fused_bytes, NULL);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    for (int c = 0; c < CASES; ++c) {
        bc_spec spec;
        bc_random_spec(&spec, &rng, c % 2 == 0);
        spec.name = "shared plan";
        spec.decode = c % 4 == 3;
        bc_batch *batch = bc_build(&spec, &rng);
        shared_cpu s = {.batch = batch};
        msaidx_config config = batch->config;
        config.backend = MSAIDX_BACKEND_CPU;
        size_t bytes = 0;
        CHECK_OK(msaidx_context_create(&s.context, &config));
        CHECK_OK(msaidx_plan_create(&s.plan, s.context, &batch->desc));
        CHECK_OK(msaidx_plan_workspace_size(s.plan, &bytes));
        CHECK_OK(msaidx_prefill_topk_workspace_size(s.plan, 0, &s.fused_bytes));
        s.workspace = aligned_or_exit(bytes);
        for (int w = 0; w < WORKERS; ++w) s.fused_workspace[w] = aligned_or_exit(s.fused_bytes);
        for (int l = 0; l < LAYERS; ++l) {
            s.q[l] = aligned_or_exit(batch->q_bytes);
            bc_layer_q(batch, l, s.q[l]);
        }
        CHECK_OK(msaidx_plan_batch(s.plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                                   s.workspace, bytes, NULL));
        bc_check_shared_plan("cpu", batch, run_layer, &s, WORKERS, ROUNDS, LAYERS);
        for (int l = 0; l < LAYERS; ++l) free(s.q[l]);
        for (int w = 0; w < WORKERS; ++w) free(s.fused_workspace[w]);
        free(s.workspace);
        msaidx_plan_destroy(s.plan);
        msaidx_context_destroy(s.context);
        bc_free(batch);
    }
    return harness_finish("test_shared_plan");
}
