/* msaidx_prefill_topk and msaidx_prefill_topk_candidates on every CUDA backend admitted (dense,
 * split, persistent), exact and default precision, E4M3 and BF16 (tests/prefill_topk_cases.h:
 * bitwise msaidx_topk_select of the same backend's msaidx_prefill_scores, with and without a
 * score buffer, and without one from a CUDA graph replayed after a metadata rewrite). */
#include "gpu_device.h"
#include "prefill_topk_cases.h"

#ifdef MSAIDX_WITH_CUDA

static void *device_alloc(size_t bytes) {
    void *pointer = NULL;
    CUDA_CHECK(cudaMalloc(&pointer, bytes ? bytes : 16));
    return pointer;
}
static void device_release(void *pointer) { CUDA_CHECK(cudaFree(pointer)); }
/* Synchronous copies: the calls under test run on a non-blocking stream, synchronised first. */
static void device_upload(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
}
static void device_download(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
static void device_sync(void *stream) {
    CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
    CUDA_CHECK(cudaGetLastError());
}
static void *device_capture(void *stream, msaidx_status (*enqueue)(void *state, void *stream),
                            void *state) {
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CUDA_CHECK(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal));
    const msaidx_status status = enqueue(state, stream);
    /* A call the capture does not allow invalidates it: report, then go on. */
    const cudaError_t ended = cudaStreamEndCapture((cudaStream_t)stream, &graph);
    CHECK(status == MSAIDX_SUCCESS, "capture: %s", msaidx_last_error());
    CHECK(ended == cudaSuccess, "cudaStreamEndCapture: %s", cudaGetErrorString(ended));
    if (status == MSAIDX_SUCCESS && ended == cudaSuccess)
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
    cudaGetLastError();
    return exec;
}
static void device_launch(void *graph, void *stream) {
    CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, (cudaStream_t)stream));
}
static void device_destroy(void *graph) {
    CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const ptk_memory device = {0,
                               gpu_runs_sm90a(),
                               stream,
                               device_alloc,
                               device_release,
                               device_upload,
                               device_download,
                               device_sync,
                               device_capture,
                               device_launch,
                               device_destroy};
    /* MSAIDX_TEST_ROUNDS=N (the sanitizer runs): N random batches and no fixed case. */
    const char *rounds = getenv("MSAIDX_TEST_ROUNDS");
    const int random_cases = rounds ? atoi(rounds) : 16;
    int ran = 0;
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        ptk_run(gpu_backend_at(i), &device, true, !rounds, random_cases, &rng);
        ++ran;
    }
    CHECK(ran >= 2, "only %d CUDA backends admitted (dense and split must be)", ran);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_prefill_topk");
}

#else

int main(void) { return 77; }

#endif
