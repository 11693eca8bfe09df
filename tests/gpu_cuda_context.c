/* The CUDA backends under a CUDA context other than the device's primary one (a driver-API
 * context, as some engines make), as include/msaidx.h documents: each call runs in the CUDA context
 * current at the call.
 *  - An msaidx context created while that CUDA context is current: every cross-backend case, with
 *    buffers and a stream of that context, checked against the reference.
 *  - An msaidx context created under the primary context, then called under the other one with
 *    that context's buffers: bitwise the results of the first kind, nothing left pending, and the
 *    first kind still runs after it. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

#include <cudaTypedefs.h>

/* The driver API through the runtime's entry points, as the library reaches it: linking libcuda
 * would keep the test from starting (and skipping) on a machine without a driver. */
static struct {
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuCtxCreate_v3020 create;
    PFN_cuCtxDestroy_v4000 destroy;
    PFN_cuCtxPushCurrent_v4000 push;
    PFN_cuCtxPopCurrent_v4000 pop;
} driver;

static void *driver_function(const char *name, int version) {
    void *function = NULL;
    enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(
        cudaGetDriverEntryPointByVersion(name, &function, version, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !function) {
        fprintf(stderr, "the CUDA driver has no %s\n", name);
        exit(1);
    }
    return function;
}

#define CU_CHECK(call)                                                                             \
    do {                                                                                           \
        CUresult cu_check_result_ = (call);                                                        \
        if (cu_check_result_ != CUDA_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: %s: CUresult %d\n", __FILE__, __LINE__, #call,                 \
                    (int)cu_check_result_);                                                        \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct runner_state {
    msaidx_backend backend;
    CUcontext context; /* current during every call of the runner */
} runner_state;

/* One run of `batch` with `session` (made by the caller) in the current CUDA context: buffers
 * and a stream of that context; outputs copied back where the run succeeded. */
static msaidx_status run_session(const gpu_session *session, const bc_batch *batch, float *scores,
                                 int32_t *nvp, int32_t *topk) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    gpu_batch device;
    gpu_upload(&device, batch);
    gpu_outputs outputs;
    gpu_outputs_create(&outputs, batch);
    gpu_outputs_poison(&outputs);
    msaidx_status status =
        gpu_enqueue(session, &device, batch, &outputs, batch->spec.decode, stream);
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_check(session->plan, stream);
    if (status == MSAIDX_SUCCESS) {
        CUDA_CHECK(cudaStreamSynchronize(stream));
        gpu_collect(session, batch, &outputs, scores, nvp, topk);
    }
    gpu_outputs_release(&outputs);
    gpu_release(&device);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return status;
}

static msaidx_status run_in_context(void *user, const bc_batch *batch, float *scores, int32_t *nvp,
                                    int32_t *topk) {
    const runner_state *state = user;
    CU_CHECK(driver.push(state->context));
    gpu_session session;
    msaidx_status status = gpu_session_create(&session, batch, state->backend);
    if (status == MSAIDX_SUCCESS) status = run_session(&session, batch, scores, nvp, topk);
    gpu_session_release(&session);
    CUcontext popped = NULL;
    CU_CHECK(driver.pop(&popped));
    CHECK(popped == state->context, "the driver context is no longer current after the calls");
    return status;
}

/* A context made under the primary CUDA context, called under `other`. */
static void foreign_context(msaidx_backend backend, CUcontext other, harness_rng *rng) {
    bc_spec spec;
    bc_fixed_spec(0, &spec, rng);
    bc_batch *batch = bc_build(&spec, rng);
    const size_t cells = bc_score_count(batch);
    const size_t picks = (size_t)batch->desc.num_tokens * batch->config.num_heads * spec.topk;
    float *want_scores = malloc(sizeof(float) * cells), *got_scores = malloc(sizeof(float) * cells);
    int32_t *want_topk = malloc(sizeof(int32_t) * picks),
            *got_topk = malloc(sizeof(int32_t) * picks);
    int32_t *nvp = malloc(sizeof(int32_t) * (size_t)batch->desc.num_tokens);
    if (!want_scores || !got_scores || !want_topk || !got_topk || !nvp) exit(2);

    runner_state state = {backend, other};
    if (run_in_context(&state, batch, want_scores, nvp, want_topk) == MSAIDX_ERROR_NOT_SUPPORTED)
        goto done;

    /* The msaidx context and plan under the primary context; every buffer, the workspace too,
     * in the other CUDA context (each has its own address space on the device). */
    gpu_session session = {0};
    msaidx_config config = batch->config;
    config.backend = backend;
    config.device = 0;
    msaidx_status status = msaidx_context_create(&session.context, &config);
    if (status == MSAIDX_SUCCESS)
        status = msaidx_plan_create(&session.plan, session.context, &batch->desc);
    if (status == MSAIDX_SUCCESS)
        status = msaidx_plan_workspace_size(session.plan, &session.workspace_bytes);
    CHECK(status == MSAIDX_SUCCESS, "%s: context under the primary context: %s",
          msaidx_backend_name(backend), msaidx_last_error());
    CU_CHECK(driver.push(other));
    CUDA_CHECK(cudaMalloc(&session.workspace, session.workspace_bytes));
    status = run_session(&session, batch, got_scores, nvp, got_topk);
    CHECK(status == MSAIDX_SUCCESS, "%s, made under the primary context, under another: %s (%s)",
          msaidx_backend_name(backend), msaidx_status_string(status), msaidx_last_error());
    CHECK(status != MSAIDX_SUCCESS ||
              (memcmp(got_scores, want_scores, sizeof(float) * cells) == 0 &&
               memcmp(got_topk, want_topk, sizeof(int32_t) * picks) == 0),
          "%s, made under the primary context, under another: results differ from a context made "
          "there",
          msaidx_backend_name(backend));
    CHECK(cudaGetLastError() == cudaSuccess, "%s: an error was left pending",
          msaidx_backend_name(backend));
    gpu_session_release(&session);
    CUcontext popped = NULL;
    CU_CHECK(driver.pop(&popped));
    /* The call left nothing behind: the same work still runs where it was made. */
    CHECK(run_in_context(&state, batch, got_scores, nvp, got_topk) == MSAIDX_SUCCESS &&
              memcmp(got_scores, want_scores, sizeof(float) * cells) == 0,
          "%s: a run in the driver context after the foreign call differs",
          msaidx_backend_name(backend));
done:
    free(want_scores);
    free(got_scores);
    free(want_topk);
    free(got_topk);
    free(nvp);
    bc_free(batch);
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaFree(NULL)); /* the primary context, current */
    driver.device_get = (PFN_cuDeviceGet_v2000)driver_function("cuDeviceGet", 2000);
    driver.create = (PFN_cuCtxCreate_v3020)driver_function("cuCtxCreate", 3020);
    driver.destroy = (PFN_cuCtxDestroy_v4000)driver_function("cuCtxDestroy", 4000);
    driver.push = (PFN_cuCtxPushCurrent_v4000)driver_function("cuCtxPushCurrent", 4000);
    driver.pop = (PFN_cuCtxPopCurrent_v4000)driver_function("cuCtxPopCurrent", 4000);
    CUdevice device;
    CU_CHECK(driver.device_get(&device, 0));
    CUcontext other = NULL;
    CU_CHECK(driver.create(&other, 0, device));
    CUcontext previous = NULL;
    CU_CHECK(driver.pop(&previous)); /* cuCtxCreate pushed it */
    bc_options options = {.sm90a = gpu_runs_sm90a(), .device_shapes = true, .random_cases = 4};
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        const msaidx_backend backend = gpu_backend_at(i);
        if (!gpu_backend_admitted(backend)) continue;
        runner_state state = {backend, other};
        options.backend = backend;
        char label[64];
        snprintf(label, sizeof label, "%s in a driver-API context", msaidx_backend_name(backend));
        printf("%s\n", label);
        bc_run_backend(label, run_in_context, &state, &options, &rng);
        foreign_context(backend, other, &rng);
    }
    CU_CHECK(driver.destroy(other));
    return harness_finish("gpu_cuda_context");
}

#else

int main(void) { return 77; }

#endif
