/* One plan shared by host threads and streams on every CUDA backend admitted
 * (tests/backend_cases.c, bc_check_shared_plan): four threads score and select layers at once on
 * one context and one plan, two on streams of their own and two on their per-thread default stream
 * (stream NULL), each layer bitwise the same as run alone. tests/test_shared_plan.c is the cpu
 * backend's run. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

#include <time.h>

enum { WORKERS = 4, ROUNDS = 10, LAYERS = 5, CASES = 12 };

/* A worker's device outputs (poisoned, GPU_GUARD cells past each) and stream. */
typedef struct worker_slot {
    cudaStream_t stream; /* NULL on odd workers: the per-thread default stream */
    gpu_outputs outputs;
    int32_t *fused; /* picks + GPU_GUARD */
    void *fused_workspace;
} worker_slot;

typedef struct shared_gpu {
    const bc_batch *batch;
    gpu_session session;
    gpu_batch device;
    void *q[LAYERS];
    size_t fused_bytes;
    float *poison; /* cells + GPU_GUARD poisoned floats: the image copied over the scores */
    worker_slot slots[WORKERS];
} shared_gpu;

static msaidx_status run_layer(void *user, int worker, int layer, float *scores, int32_t *topk,
                               int32_t *fused, long *guard_hits) {
    const shared_gpu *s = user;
    const bc_batch *b = s->batch;
    const worker_slot *slot = &s->slots[worker];
    const gpu_outputs *o = &slot->outputs;
    /* The library reads stream NULL as the per-thread default stream; so do the copies here. */
    cudaStream_t stream = slot->stream ? slot->stream : cudaStreamPerThread;
    CUDA_CHECK(cudaMemcpyAsync(o->scores, s->poison, sizeof(float) * (o->cells + GPU_GUARD),
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemsetAsync(o->topk, 0x5A, sizeof(int32_t) * (o->picks + GPU_GUARD), stream));
    CUDA_CHECK(
        cudaMemsetAsync(slot->fused, 0x5A, sizeof(int32_t) * (o->picks + GPU_GUARD), stream));
    const msaidx_status status = bc_layer_calls(
        s->session.context, s->session.plan, b, s->q[layer], s->device.k_cache, o->scores, o->topk,
        slot->fused, slot->fused_workspace, s->fused_bytes, slot->stream);
    /* On the worker's stream: a copy on the legacy stream would wait for the other workers. */
    float score_tail[GPU_GUARD];
    int32_t topk_tail[GPU_GUARD], fused_tail[GPU_GUARD];
    if (status == MSAIDX_SUCCESS) {
        CUDA_CHECK(cudaMemcpyAsync(scores, o->scores, sizeof(float) * o->cells,
                                   cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(score_tail, o->scores + o->cells, sizeof score_tail,
                                   cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(topk, o->topk, sizeof(int32_t) * o->picks,
                                   cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(topk_tail, o->topk + o->picks, sizeof topk_tail,
                                   cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(fused, slot->fused, sizeof(int32_t) * o->picks,
                                   cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(fused_tail, slot->fused + o->picks, sizeof fused_tail,
                                   cudaMemcpyDeviceToHost, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream)); /* also after a refused call's earlier work */
    if (status == MSAIDX_SUCCESS)
        for (int i = 0; i < GPU_GUARD; ++i)
            *guard_hits += !bc_is_poison(score_tail[i]) + (topk_tail[i] != 0x5A5A5A5A) +
                           (fused_tail[i] != 0x5A5A5A5A);
    return status;
}

/* Sets up `s` for `batch` on `backend` and plans it; NOT_SUPPORTED when the backend refuses the
 * batch's config. */
static msaidx_status shared_create(shared_gpu *s, const bc_batch *batch, msaidx_backend backend) {
    memset(s, 0, sizeof *s);
    s->batch = batch;
    msaidx_status status = gpu_session_create(&s->session, batch, backend);
    if (status != MSAIDX_SUCCESS) return status;
    CHECK_OK(msaidx_prefill_topk_workspace_size(s->session.plan, 0, &s->fused_bytes));
    gpu_upload(&s->device, batch);
    void *host_q = malloc(batch->q_bytes);
    if (!host_q) exit(2);
    for (int l = 0; l < LAYERS; ++l) {
        bc_layer_q(batch, l, host_q);
        CUDA_CHECK(cudaMalloc(&s->q[l], batch->q_bytes));
        CUDA_CHECK(cudaMemcpy(s->q[l], host_q, batch->q_bytes, cudaMemcpyHostToDevice));
    }
    free(host_q);
    const size_t cells = bc_score_count(batch);
    s->poison = malloc(sizeof(float) * (cells + GPU_GUARD));
    if (!s->poison) exit(2);
    bc_poison(s->poison, cells + GPU_GUARD);
    for (int w = 0; w < WORKERS; ++w) {
        worker_slot *slot = &s->slots[w];
        if (w % 2 == 0) CUDA_CHECK(cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking));
        gpu_outputs_create(&slot->outputs, batch);
        CUDA_CHECK(
            cudaMalloc((void **)&slot->fused, sizeof(int32_t) * (slot->outputs.picks + GPU_GUARD)));
        if (s->fused_bytes) CUDA_CHECK(cudaMalloc(&slot->fused_workspace, s->fused_bytes));
    }
    status = msaidx_plan_batch(s->session.plan, s->device.cu_seqlens_q, s->device.seq_lens,
                               s->device.block_table, s->session.workspace,
                               s->session.workspace_bytes, NULL);
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_check(s->session.plan, NULL);
    return status;
}

static void shared_release(shared_gpu *s) {
    for (int w = 0; w < WORKERS; ++w) {
        worker_slot *slot = &s->slots[w];
        if (slot->stream) CUDA_CHECK(cudaStreamDestroy(slot->stream));
        if (slot->outputs.allocation) gpu_outputs_release(&slot->outputs);
        if (slot->fused) CUDA_CHECK(cudaFree(slot->fused));
        if (slot->fused_workspace) CUDA_CHECK(cudaFree(slot->fused_workspace));
    }
    for (int l = 0; l < LAYERS; ++l)
        if (s->q[l]) CUDA_CHECK(cudaFree(s->q[l]));
    if (s->device.q) gpu_release(&s->device);
    free(s->poison);
    gpu_session_release(&s->session);
}

static void CUDART_CB hold_stream(void *seconds) {
    const struct timespec pause = {0, (long)(*(const double *)seconds * 1e9)};
    nanosleep(&pause, NULL);
}

/* The header's last threads-and-streams promise: a plan and its context destroyed while their
 * work waits on a stream (held there by a host function) leave that work as it would have been. */
static void destroy_while_queued(const bc_batch *batch, msaidx_backend backend) {
    static const double hold_seconds = 0.05;
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    gpu_batch device;
    gpu_upload(&device, batch);
    const size_t cells = bc_score_count(batch),
                 picks =
                     (size_t)batch->desc.num_tokens * batch->config.num_heads * batch->config.topk;
    float *scores[2] = {malloc(sizeof(float) * (cells + 1)), malloc(sizeof(float) * (cells + 1))};
    int32_t *topk[2] = {malloc(sizeof(int32_t) * (picks + 1)),
                        malloc(sizeof(int32_t) * (picks + 1))};
    int32_t *nvp = malloc(sizeof(int32_t) * ((size_t)batch->desc.num_tokens + 1));
    if (!scores[0] || !scores[1] || !topk[0] || !topk[1] || !nvp) exit(2);
    for (int run = 0; run < 2; ++run) { /* run 0 destroys early, run 1 after its work */
        gpu_session session;
        CHECK_OK(gpu_session_create(&session, batch, backend));
        gpu_outputs outputs;
        gpu_outputs_create(&outputs, batch);
        gpu_outputs_poison(&outputs);
        if (run == 0) CUDA_CHECK(cudaLaunchHostFunc(stream, hold_stream, (void *)&hold_seconds));
        CHECK_OK(gpu_enqueue(&session, &device, batch, &outputs, batch->spec.decode, stream));
        if (run == 0) {
            msaidx_plan_destroy(session.plan);
            msaidx_context_destroy(session.context);
            session.plan = NULL;
            session.context = NULL;
            CUDA_CHECK(cudaStreamSynchronize(stream));
            CHECK(gpu_outputs_fetch(&outputs, scores[0], topk[0]) == 0,
                  "%s: writes past the outputs", msaidx_backend_name(backend));
        } else {
            CUDA_CHECK(cudaStreamSynchronize(stream));
            gpu_collect(&session, batch, &outputs, scores[1], nvp, topk[1]);
        }
        gpu_outputs_release(&outputs);
        gpu_session_release(&session);
    }
    CHECK(memcmp(scores[0], scores[1], sizeof(float) * cells) == 0 &&
              memcmp(topk[0], topk[1], sizeof(int32_t) * picks) == 0,
          "%s: work queued before its plan and context were destroyed differs",
          msaidx_backend_name(backend));
    for (int i = 0; i < 2; ++i) {
        free(scores[i]);
        free(topk[i]);
    }
    free(nvp);
    gpu_release(&device);
    CUDA_CHECK(cudaStreamDestroy(stream));
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    const bool sm90a = gpu_runs_sm90a();
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        const msaidx_backend backend = gpu_backend_at(i);
        if (!gpu_backend_admitted(backend)) continue;
        for (int c = 0; c < CASES; ++c) {
            bc_spec spec;
            bc_random_spec(&spec, &rng, true);
            spec.name = "shared plan";
            spec.decode = c % 4 == 3;
            spec.fp8_accumulation = c % 2 == 0; /* persistent's default precision on E4M3 */
            bc_batch *batch = bc_build(&spec, &rng);
            shared_gpu s;
            const msaidx_status status = shared_create(&s, batch, backend);
            if (status == MSAIDX_SUCCESS) {
                bc_check_shared_plan(msaidx_backend_name(backend), batch, run_layer, &s, WORKERS,
                                     ROUNDS, LAYERS);
            } else {
                CHECK(status == MSAIDX_ERROR_NOT_SUPPORTED &&
                          !bc_must_admit(backend, sm90a, &batch->config),
                      "%s: %s: %s", msaidx_backend_name(backend), msaidx_status_string(status),
                      msaidx_last_error());
            }
            shared_release(&s);
            if (c == 0 && status == MSAIDX_SUCCESS) destroy_while_queued(batch, backend);
            bc_free(batch);
        }
    }
    return harness_finish("gpu_shared_plan");
}

#else

int main(void) { return 77; }

#endif
