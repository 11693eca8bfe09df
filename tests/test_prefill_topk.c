/* msaidx_prefill_topk and msaidx_prefill_topk_candidates on the cpu backend
 * (tests/prefill_topk_cases.h: bitwise msaidx_topk_select of msaidx_prefill_scores' scores, with
 * and without a score buffer, and after a metadata rewrite), then the refusals, each naming its
 * argument. */
#include "prefill_topk_cases.h"

#include <msaidx.h>

static void *host_alloc(size_t bytes) {
    void *pointer = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    if (!pointer) exit(2);
    return pointer;
}
static void host_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void host_sync(void *stream) { (void)stream; }
/* The host has no graphs: a "replay" enqueues the captured calls again, so the rewrite-and-replay
 * checks (ptk_check_graph) run on the cpu backend too. */
typedef struct host_graph {
    msaidx_status (*enqueue)(void *state, void *stream);
    void *state;
} host_graph;
static void *host_capture(void *stream, msaidx_status (*enqueue)(void *state, void *stream),
                          void *state) {
    (void)stream;
    host_graph *graph = malloc(sizeof *graph);
    if (!graph) exit(2);
    graph->enqueue = enqueue;
    graph->state = state;
    return graph;
}
static void host_launch(void *graph, void *stream) {
    const host_graph *g = graph;
    CHECK_OK(g->enqueue(g->state, stream));
}

static void expect_refusal(msaidx_status status, const char *name, const char *what) {
    CHECK(status == MSAIDX_ERROR_INVALID_ARGUMENT && strstr(msaidx_last_error(), name),
          "%s: status %d, \"%s\" (expected INVALID_ARGUMENT naming %s)", what, status,
          msaidx_last_error(), name);
}

static void check_refusals(const ptk_memory *m, harness_rng *rng) {
    bc_spec spec;
    bc_random_spec(&spec, rng, true);
    spec.q_lens[0] = 5; /* a batch with tokens */
    bc_batch *batch = bc_build(&spec, rng);
    msaidx_config config = batch->config;
    config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    size_t plan_bytes = 0, area_bytes = 0;
    CHECK_OK(msaidx_context_create(&context, &config));
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    CHECK_OK(msaidx_plan_workspace_size(plan, &plan_bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes));
    void *workspace = m->alloc(plan_bytes), *area = m->alloc(area_bytes);
    const size_t picks = (size_t)batch->desc.num_tokens * config.num_heads * 64;
    int32_t *out = m->alloc(sizeof(int32_t) * picks);
    float *candidates = m->alloc(sizeof(float) * picks);
    float *scores = m->alloc(sizeof(float) * bc_score_count(batch));
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    CHECK(args.struct_size == sizeof args && args.topk == 16 && args.init_blocks == 0 &&
              args.local_blocks == 1 && !args.workspace && !args.out_stride_t,
          "msaidx_topk_args_init: unexpected defaults");
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    size_t bytes = 0;

    expect_refusal(msaidx_prefill_topk_workspace_size(NULL, 0, &bytes), "plan", "size NULL plan");
    expect_refusal(msaidx_prefill_topk_workspace_size(plan, 2, &bytes), "with_scores",
                   "size with_scores 2");
    expect_refusal(msaidx_prefill_topk_workspace_size(plan, 0, NULL), "bytes", "size NULL bytes");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args, NULL, out, NULL),
                   "plan: no batch planned", "unplanned");
    CHECK_OK(msaidx_plan_batch(plan, batch->cu_seqlens_q, batch->seq_lens, batch->block_table,
                               workspace, plan_bytes, NULL));
    CHECK_OK(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args, NULL, out, NULL));

    expect_refusal(msaidx_prefill_topk(NULL, batch->q, batch->k_cache, &args, NULL, out, NULL),
                   "plan", "NULL plan");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, NULL, NULL, out, NULL),
                   "args", "NULL args");
    expect_refusal(msaidx_prefill_topk(plan, NULL, batch->k_cache, &args, NULL, out, NULL), "q",
                   "NULL q");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, NULL, &args, NULL, out, NULL), "k_cache",
                   "NULL k_cache");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args, NULL, NULL, NULL),
                   "out", "NULL out");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args, NULL,
                                       (int32_t *)((char *)out + 2), NULL),
                   "out", "misaligned out");
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &args,
                                       (float *)((char *)scores + 1), out, NULL),
                   "scores", "misaligned scores");
    msaidx_topk_args bad = args;
    bad.struct_size = 8;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.struct_size", "struct_size");
    bad = args;
    bad.topk = 0;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.topk", "topk 0");
    bad.topk = 65;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.topk", "topk 65");
    bad = args;
    bad.init_blocks = -1;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.init_blocks", "init -1");
    bad = args;
    bad.local_blocks = -1;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.local_blocks", "local -1");
    bad = args;
    bad.init_blocks = 10;
    bad.local_blocks = 7;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.init_blocks + args.local_blocks", "init + local > topk");
    /* The candidates apply no forced page, so they take any init/local. */
    CHECK_OK(msaidx_prefill_topk_candidates(plan, batch->q, batch->k_cache, &bad, NULL, candidates,
                                            out, NULL));
    bad = args;
    bad.out_stride_t = 16;
    bad.out_stride_h = 16;
    if (batch->desc.num_tokens > 1 && config.num_heads > 1)
        expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                       "out_stride", "overlapping strides");
    bad = args;
    bad.workspace = NULL;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.workspace", "NULL workspace");
    bad.workspace = (char *)area + 8;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.workspace", "misaligned workspace");
    bad.workspace = area;
    bad.workspace_bytes = area_bytes - 1;
    expect_refusal(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, NULL, out, NULL),
                   "args.workspace_bytes", "short workspace");
    /* With a score buffer no workspace is needed. */
    bad.workspace = NULL;
    bad.workspace_bytes = 0;
    CHECK_OK(msaidx_prefill_topk(plan, batch->q, batch->k_cache, &bad, scores, out, NULL));
    expect_refusal(msaidx_prefill_topk_candidates(plan, batch->q, batch->k_cache, &args, NULL, NULL,
                                                  out, NULL),
                   "candidate_scores", "NULL candidate_scores");
    expect_refusal(msaidx_prefill_topk_candidates(plan, batch->q, batch->k_cache, &args, NULL,
                                                  candidates, NULL, NULL),
                   "candidate_pages", "NULL candidate_pages");

    m->release(workspace);
    m->release(area);
    m->release(out);
    m->release(candidates);
    m->release(scores);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    bc_free(batch);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    const ptk_memory host = {
        MSAIDX_DEVICE_HOST, false,     NULL,         host_alloc,  free, host_copy,
        host_copy,          host_sync, host_capture, host_launch, free};
#ifdef MSAIDX_TEST_SANITIZE
    /* Sanitized runs are several times slower: random batches only. */
    ptk_run(MSAIDX_BACKEND_CPU, &host, false, false, 12, &rng);
#else
    ptk_run(MSAIDX_BACKEND_CPU, &host, false, true, 24, &rng);
#endif
    check_refusals(&host, &rng);
    return harness_finish("test_prefill_topk");
}
