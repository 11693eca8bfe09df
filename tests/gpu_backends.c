/* The cross-backend check (tests/backend_cases.c) on every CUDA backend compiled in and
 * admitted: dense, split and persistent. Same cases and comparison as tests/test_backends.c.
 * Then persistent again at MSAIDX_PRECISION_DEFAULT, the one backend with a faster accumulation
 * (FP8 tensor cores for E4M3), checked within that mode's documented bound. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

typedef struct runner_state {
    msaidx_backend backend;
    cudaStream_t stream;
} runner_state;

static msaidx_status run_device(void *user, const bc_batch *batch, float *scores, int32_t *nvp,
                                int32_t *topk) {
    const runner_state *state = user;
    gpu_session session;
    msaidx_status status = gpu_session_create(&session, batch, state->backend);
    if (status != MSAIDX_SUCCESS) {
        gpu_session_release(&session);
        return status;
    }
    gpu_batch device;
    gpu_upload(&device, batch);
    gpu_outputs outputs;
    gpu_outputs_create(&outputs, batch);
    gpu_outputs_poison(&outputs);
    status = gpu_enqueue(&session, &device, batch, &outputs, batch->spec.decode, state->stream);
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_check(session.plan, state->stream);
    if (status == MSAIDX_SUCCESS) {
        CUDA_CHECK(cudaStreamSynchronize(state->stream));
        gpu_collect(&session, batch, &outputs, scores, nvp, topk);
    }
    gpu_outputs_release(&outputs);
    gpu_release(&device);
    gpu_session_release(&session);
    return status;
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    runner_state state;
    CUDA_CHECK(cudaStreamCreateWithFlags(&state.stream, cudaStreamNonBlocking));
    /* The scalar reference runs on one host core: sampled rows of the biggest cases keep the
     * device time short (every row is still checked written, and its top-k exact). */
    bc_options options = {.sm90a = gpu_runs_sm90a(),
                          .device_shapes = true,
                          .run_large = true,
                          .random_cases = 30,
                          .sample_above_macs = 2e8};
    int ran = 0;
    bool persistent_ran = false;
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        state.backend = options.backend = gpu_backend_at(i);
        printf("backend %s\n", msaidx_backend_name(state.backend));
        bc_run_backend(msaidx_backend_name(state.backend), run_device, &state, &options, &rng);
        ++ran;
        persistent_ran = persistent_ran || state.backend == MSAIDX_BACKEND_PERSISTENT;
    }
    CHECK(ran >= 2, "only %d CUDA backends admitted (dense and split must be)", ran);
    if (persistent_ran) {
        bc_options fast = options;
        fast.fp8_accumulation = true;
        state.backend = fast.backend = MSAIDX_BACKEND_PERSISTENT;
        printf("backend persistent, fast accumulation\n");
        bc_run_backend("persistent-fast", run_device, &state, &fast, &rng);
    }
    CUDA_CHECK(cudaStreamDestroy(state.stream));
    return harness_finish("gpu_backends");
}

#else

int main(void) { return 77; }

#endif
