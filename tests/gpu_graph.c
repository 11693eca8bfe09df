/* SPEC.md section 6: plan_batch + scores + topk_select captured into a CUDA graph on a
 * non-default stream, then replayed after the metadata buffers are rewritten in place with a
 * different batch of the same bounds; each replay checked against the cpu, and two replays of the
 * same batch must leave the same workspace. The fused mode captures plan_batch +
 * msaidx_prefill_topk with a score buffer + msaidx_prefill_topk without one (its scores in a
 * workspace): the first is checked as above, the second must pick the same pages. */
#include "backend_cases.h"
#include "cpu/cpu.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

/* Another batch within first's desc: request b reads first's block-table row B-1-b, with a
 * shorter context and new q_lens. Shares q, the key cache and the desc with `first`. */
typedef struct second_batch {
    bc_batch batch;
    int32_t *arrays;
} second_batch;

static void make_second(second_batch *s, const bc_batch *first, harness_rng *rng) {
    const msaidx_batch_desc *d = &first->desc;
    const int32_t B = d->batch_size, T = d->num_tokens, P = first->config.page_size;
    s->arrays =
        calloc((size_t)(B + 1) + B + (size_t)B * d->bt_stride + 2 * (size_t)T + 4, sizeof(int32_t));
    if (!s->arrays) exit(2);
    s->batch = *first;
    memset(s->batch.allocations, 0, sizeof s->batch.allocations);
    s->batch.spec.name = "graph-second-batch";
    s->batch.cu_seqlens_q = s->arrays;
    s->batch.seq_lens = s->batch.cu_seqlens_q + B + 1;
    s->batch.block_table = s->batch.seq_lens + B;
    s->batch.nvp = s->batch.block_table + (size_t)B * d->bt_stride;
    s->batch.checked = (bool *)(s->batch.nvp + T);
    int32_t used = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t from = B - 1 - b;
        memcpy(s->batch.block_table + (size_t)b * d->bt_stride,
               first->block_table + (size_t)from * d->bt_stride, sizeof(int32_t) * d->bt_stride);
        const int32_t seq = (int32_t)harness_int(rng, 1, first->seq_lens[from]);
        int32_t room = T - used;
        if (room > d->max_q_len) room = d->max_q_len;
        if (room > seq) room = seq;
        const int32_t q_len = (int32_t)harness_int(rng, 0, room);
        s->batch.seq_lens[b] = seq;
        s->batch.cu_seqlens_q[b + 1] = used + q_len;
        for (int32_t i = 0; i < q_len; ++i) {
            s->batch.nvp[used + i] = (seq - q_len + i) / P + 1;
            s->batch.checked[used + i] = true;
        }
        used += q_len;
    }
}

static void check_replay(const bc_batch *batch, const gpu_session *session,
                         const gpu_outputs *outputs, const char *label) {
    const size_t cells = bc_score_count(batch);
    const int32_t T = batch->desc.num_tokens;
    float *got = malloc(sizeof(float) * cells), *ref = malloc(sizeof(float) * cells);
    int32_t *topk = malloc(sizeof(int32_t) * outputs->picks);
    int32_t *want = malloc(sizeof(int32_t) * outputs->picks);
    int32_t *nvp = malloc(sizeof(int32_t) * (size_t)T);
    if (!got || !ref || !topk || !want || !nvp) exit(2);
    const long guard = gpu_outputs_fetch(outputs, got, topk);
    CHECK(guard == 0, "%s: writes past the buffers", label);
    gpu_fetch_nvp(session, batch, nvp);
    long bad_nvp = 0;
    for (int32_t t = 0; t < T; ++t) bad_nvp += nvp[t] != batch->nvp[t];
    CHECK(bad_nvp == 0, "%s: %ld nvp entries wrong after replay", label, bad_nvp);
    bc_poison(ref, cells);
    bc_reference_scores(batch, ref);
    bc_compare_scores(batch, got, ref, label);
    msaidx_cpu_topk_reference(&batch->config, got, batch->desc.pitch, batch->nvp, T, want);
    CHECK(memcmp(topk, want, sizeof(int32_t) * outputs->picks) == 0,
          "%s: replayed top-k differs from the cpu top-k of the replayed scores", label);
    free(got);
    free(ref);
    free(topk);
    free(want);
    free(nvp);
}

/* Two replays of the same batch leave byte-identical workspaces: the plan is deterministic (the
 * persistent deal among others), so the work, and its timing, repeat exactly. */
static void check_plan_repeats(const gpu_session *session, cudaGraphExec_t exec,
                               cudaStream_t stream, const char *label) {
    unsigned char *before = malloc(session->workspace_bytes),
                  *after = malloc(session->workspace_bytes);
    if (!before || !after) exit(2);
    CUDA_CHECK(cudaMemcpyAsync(before, session->workspace, session->workspace_bytes,
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaMemcpyAsync(after, session->workspace, session->workspace_bytes,
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    size_t first_difference = session->workspace_bytes;
    for (size_t i = 0; i < session->workspace_bytes && first_difference == session->workspace_bytes;
         ++i)
        if (before[i] != after[i]) first_difference = i;
    CHECK(first_difference == session->workspace_bytes,
          "%s: the same batch planned twice differs at workspace byte %zu of %zu", label,
          first_difference, session->workspace_bytes);
    free(before);
    free(after);
}

/* decode_only: requests of 1..8 tokens and desc.max_q_len = 8, the batches that every backend
 * scores with the decode scorer and whose plan skips the persistent deal. */
/* plan_batch, then msaidx_prefill_topk into o->scores and o->topk, then again without scores
 * (into `area`) and into `unscored_topk`. */
static msaidx_status enqueue_fused(const gpu_session *s, const gpu_batch *g, const bc_batch *b,
                                   const gpu_outputs *o, void *area, size_t area_bytes,
                                   int32_t *unscored_topk, cudaStream_t stream) {
    msaidx_status status = msaidx_plan_batch(s->plan, g->cu_seqlens_q, g->seq_lens, g->block_table,
                                             s->workspace, s->workspace_bytes, stream);
    if (status != MSAIDX_SUCCESS) return status;
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = b->config.topk;
    args.init_blocks = b->config.init_blocks;
    args.local_blocks = b->config.local_blocks;
    status = msaidx_prefill_topk(s->plan, g->q, g->k_cache, &args, o->scores, o->topk, stream);
    if (status != MSAIDX_SUCCESS) return status;
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    return msaidx_prefill_topk(s->plan, g->q, g->k_cache, &args, NULL, unscored_topk, stream);
}

static void graph_test(msaidx_backend backend, msaidx_dtype dtype, bool decode, bool decode_only,
                       bool fused, cudaStream_t stream, harness_rng *rng) {
    static const int32_t mixed_q_lens[4] = {40, 1, 130, 7}, mixed_prefixes[4] = {300, 2000, 0, 900};
    static const int32_t decode_q_lens[4] = {1, 8, 3, 1}, decode_prefixes[4] = {300, 20000, 0, 900};
    const int32_t *q_lens = decode_only ? decode_q_lens : mixed_q_lens;
    const int32_t *prefixes = decode_only ? decode_prefixes : mixed_prefixes;
    bc_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.name = "graph-first-batch";
    spec.dtype = dtype;
    spec.num_heads = backend == MSAIDX_BACKEND_PERSISTENT ? 4 : 2;
    spec.head_dim = 128;
    spec.page_size = 128;
    spec.topk = 16;
    spec.local_blocks = 1;
    spec.batch_size = 4;
    for (int b = 0; b < 4; ++b) {
        spec.q_lens[b] = q_lens[b];
        spec.prefixes[b] = prefixes[b];
    }
    spec.pad_tokens = 6;
    spec.page_pad_bytes = 32;
    bc_batch *first = bc_build(&spec, rng);
    if (decode_only) first->desc.max_q_len = 8;
    second_batch second;
    make_second(&second, first, rng);

    char label[128];
    snprintf(label, sizeof label, "%s %s %s%s graph", msaidx_backend_name(backend),
             dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3",
             fused    ? "prefill_topk"
             : decode ? "decode"
                      : "prefill",
             decode_only ? " decode-only batch" : "");
    gpu_session session;
    msaidx_status status = gpu_session_create(&session, first, backend);
    if (status == MSAIDX_ERROR_NOT_SUPPORTED) {
        CHECK(!bc_must_admit(backend, gpu_runs_sm90a(), &first->config),
              "%s: refused, though documented as admitted: %s", label, msaidx_last_error());
        printf("skip %s: %s\n", label, msaidx_last_error());
    } else {
        CHECK(status == MSAIDX_SUCCESS, "%s: %s", label, msaidx_last_error());
        gpu_batch device;
        gpu_upload(&device, first);
        gpu_outputs outputs;
        gpu_outputs_create(&outputs, first);
        size_t area_bytes = 0;
        CHECK_OK(msaidx_prefill_topk_workspace_size(session.plan, 0, &area_bytes));
        void *area = NULL;
        int32_t *unscored_topk = NULL;
        int32_t *unscored_host = malloc(sizeof(int32_t) * outputs.picks + 1);
        int32_t *scored_host = malloc(sizeof(int32_t) * outputs.picks + 1);
        if (!unscored_host || !scored_host) exit(2);
        CUDA_CHECK(cudaMalloc(&area, area_bytes));
        CUDA_CHECK(cudaMalloc((void **)&unscored_topk, sizeof(int32_t) * outputs.picks + 1));

        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        status = fused ? enqueue_fused(&session, &device, first, &outputs, area, area_bytes,
                                       unscored_topk, stream)
                       : gpu_enqueue(&session, &device, first, &outputs, decode, stream);
        /* A call the capture does not allow invalidates it: report, then go on. */
        const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
        CHECK(status == MSAIDX_SUCCESS, "%s: capture: %s", label, msaidx_last_error());
        CHECK(ended == cudaSuccess, "%s: cudaStreamEndCapture: %s", label,
              cudaGetErrorString(ended));
        if (ended == cudaSuccess) CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        cudaGetLastError();

        const bc_batch *rounds[3] = {first, &second.batch, first};
        for (int r = 0; exec && r < 3; ++r) {
            gpu_upload_meta(&device, rounds[r]); /* in place, outside the capture */
            gpu_outputs_poison(&outputs);
            if (fused) { /* another poison than the scored top-k's, so neither can pass as the other
                          */
                CUDA_CHECK(cudaMemset(unscored_topk, 0x3C, sizeof(int32_t) * outputs.picks));
                CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy stream: see gpu_outputs_poison */
            }
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CHECK_OK(msaidx_plan_check(session.plan, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            char round_label[160];
            snprintf(round_label, sizeof round_label, "%s replay %d", label, r);
            check_replay(rounds[r], &session, &outputs, round_label);
            if (fused) {
                CUDA_CHECK(cudaMemcpy(unscored_host, unscored_topk, sizeof(int32_t) * outputs.picks,
                                      cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(scored_host, outputs.topk, sizeof(int32_t) * outputs.picks,
                                      cudaMemcpyDeviceToHost));
                CHECK(memcmp(unscored_host, scored_host, sizeof(int32_t) * outputs.picks) == 0,
                      "%s: prefill_topk without scores picks differently", round_label);
            }
        }
        if (exec) check_plan_repeats(&session, exec, stream, label);
        if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
        if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
        CUDA_CHECK(cudaFree(area));
        CUDA_CHECK(cudaFree(unscored_topk));
        free(unscored_host);
        free(scored_host);
        gpu_outputs_release(&outputs);
        gpu_release(&device);
    }
    gpu_session_release(&session);
    free(second.arrays);
    bc_free(first);
}

/* A context created while the thread captures a graph (an engine that builds its indexer lazily
 * inside its first captured forward): `auto` must resolve as it does outside, and the capture must
 * survive, so context creation may touch no stream. */
static void context_under_capture(msaidx_dtype dtype, cudaStream_t stream) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = 0;
    config.dtype = dtype;
    msaidx_context *outside = NULL, *inside = NULL;
    msaidx_backend expected = MSAIDX_BACKEND_AUTO, got = MSAIDX_BACKEND_AUTO;
    CHECK_OK(msaidx_context_create(&outside, &config));
    CHECK_OK(msaidx_context_backend(outside, &expected));
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const msaidx_status created = msaidx_context_create(&inside, &config);
    cudaGraph_t graph = NULL;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    CHECK(created == MSAIDX_SUCCESS, "context_create under capture: %s", msaidx_last_error());
    CHECK(ended == cudaSuccess, "the capture around context_create ended with %s",
          cudaGetErrorString(ended));
    if (created == MSAIDX_SUCCESS) {
        CHECK_OK(msaidx_context_backend(inside, &got));
        CHECK(got == expected, "auto under capture resolved to %s, outside to %s",
              msaidx_backend_name(got), msaidx_backend_name(expected));
    }
    cudaGetLastError();
    if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
    CHECK_OK(msaidx_context_destroy(inside));
    CHECK_OK(msaidx_context_destroy(outside));
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        for (int bf16 = 0; bf16 < 2; ++bf16)
            for (int decode = 0; decode < 2; ++decode)
                for (int decode_only = 0; decode_only < 2; ++decode_only)
                    for (int fused = 0; fused < 2 - decode; ++fused)
                        graph_test(gpu_backend_at(i), bf16 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                                   decode, decode_only, fused, stream, &rng);
    }
    context_under_capture(MSAIDX_DTYPE_E4M3, stream);
    context_under_capture(MSAIDX_DTYPE_BF16, stream);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_graph");
}

#else

int main(void) { return 77; }

#endif
