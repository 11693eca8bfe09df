/* The CUDA backends on a device other than the caller's current one: every buffer and the stream
 * live on the last device while device 0 stays current. Each call must run on config.device and
 * give the caller its current device back; the results are checked by the cross-backend cases
 * (tests/backend_cases.c) as in gpu_backends. Also the NULL stream (the per-thread default
 * stream of config.device). Skipped with fewer than two devices. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

typedef struct runner_state {
    msaidx_backend backend;
    int32_t device;      /* where the buffers and the context live */
    cudaStream_t stream; /* of `device`, or NULL */
} runner_state;

static void expect_current(int want, const char *after) {
    int current = -1;
    CUDA_CHECK(cudaGetDevice(&current));
    CHECK(current == want, "after %s the current device is %d, not the caller's %d", after, current,
          want);
}

static msaidx_status run_elsewhere(void *user, const bc_batch *batch, float *scores, int32_t *nvp,
                                   int32_t *topk) {
    const runner_state *state = user;
    CUDA_CHECK(cudaSetDevice(state->device));
    gpu_session session;
    msaidx_status status = gpu_session_create_on(&session, batch, state->backend, state->device);
    gpu_batch device;
    gpu_upload(&device, batch);
    gpu_outputs outputs;
    gpu_outputs_create(&outputs, batch);
    gpu_outputs_poison(&outputs);
    CUDA_CHECK(cudaSetDevice(0));
    if (status == MSAIDX_SUCCESS) {
        status = gpu_enqueue(&session, &device, batch, &outputs, batch->spec.decode, state->stream);
        expect_current(0, "plan, scores and top-k");
    }
    if (status == MSAIDX_SUCCESS) {
        status = msaidx_plan_check(session.plan, state->stream);
        expect_current(0, "msaidx_plan_check");
    }
    CUDA_CHECK(cudaSetDevice(state->device));
    if (status == MSAIDX_SUCCESS) {
        CUDA_CHECK(cudaDeviceSynchronize());
        gpu_collect(&session, batch, &outputs, scores, nvp, topk);
    }
    gpu_outputs_release(&outputs);
    gpu_release(&device);
    gpu_session_release(&session);
    CUDA_CHECK(cudaSetDevice(0));
    return status;
}

int main(void) {
    if (!gpu_available()) return 77;
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices < 2) {
        printf("one CUDA device: skipped\n");
        return 77;
    }
    harness_rng rng = {harness_seed()};
    runner_state state = {.device = devices - 1};
    CUDA_CHECK(cudaSetDevice(state.device));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaSetDevice(0));
    /* One host's devices are alike: device 0 answers for the last one. */
    bc_options options = {.sm90a = gpu_runs_sm90a(), .device_shapes = true, .random_cases = 6};
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        state.backend = options.backend = gpu_backend_at(i);
        for (int null_stream = 0; null_stream < 2; ++null_stream) {
            state.stream = null_stream ? NULL : stream;
            char label[64];
            snprintf(label, sizeof label, "%s on device %d, %s stream",
                     msaidx_backend_name(state.backend), state.device,
                     null_stream ? "NULL" : "its own");
            printf("%s\n", label);
            bc_run_backend(label, run_elsewhere, &state, &options, &rng);
        }
    }
    CUDA_CHECK(cudaSetDevice(state.device));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_multi_device");
}

#else

int main(void) { return 77; }

#endif
