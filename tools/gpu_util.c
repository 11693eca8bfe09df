/* The tool's CUDA side: device buffers, event timing, L2 flush, and the ceilings (cuBLASLt FP8
 * GEMM, device copy) that bench compares against. Compiled to nothing without CUDA. */
#include "tool.h"

#ifdef MSAIDX_WITH_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct {
    bool ready;
    cudaStream_t stream;
    cudaEvent_t events[TOOL_MARKS];
    void *flush_buffer;
    size_t flush_bytes;
    unsigned flush_value;
    bool read_flush;      /* tool_gpu_set_read_flush */
    int32_t *flush_pages; /* 0 .. flush_bytes / TOOL_FLUSH_PAGE_BYTES - 1, for the read flush */
    uint32_t *flush_sink;
    char name[256];
} gpu;

bool tool_cuda_ok(int error, const char *what) {
    if (error == cudaSuccess) return true;
    fprintf(stderr, "msaidx: %s: %s (%s)\n", what, cudaGetErrorString((cudaError_t)error),
            cudaGetErrorName((cudaError_t)error));
    return false;
}

int tool_gpu_count(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver or no device: a CPU-only machine */
        return 0;
    }
    return count;
}

static bool gpu_alloc(void **pointer, size_t bytes) {
    *pointer = NULL;
    return tool_cuda_ok(cudaMalloc(pointer, bytes ? bytes : 1), "cudaMalloc");
}
static void gpu_release(void *pointer) { cudaFree(pointer); }
static bool gpu_upload(void *dst, const void *src, size_t bytes) {
    return tool_cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, gpu.stream),
                        "upload") &&
           tool_cuda_ok(cudaStreamSynchronize(gpu.stream), "upload sync");
}
static bool gpu_download(void *dst, const void *src, size_t bytes) {
    return tool_cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, gpu.stream),
                        "download") &&
           tool_cuda_ok(cudaStreamSynchronize(gpu.stream), "download sync");
}
static bool gpu_poison(void *dst, size_t bytes) {
    return tool_cuda_ok(cudaMemsetAsync(dst, 0xFF, bytes, gpu.stream), "poison");
}
static bool gpu_sync(void) {
    return tool_cuda_ok(cudaStreamSynchronize(gpu.stream), "stream sync");
}
static bool gpu_mark(int slot) {
    return tool_cuda_ok(cudaEventRecord(gpu.events[slot], gpu.stream), "event record");
}
static double gpu_elapsed(int from, int to) {
    float ms = 0.0f;
    if (!tool_cuda_ok(cudaEventElapsedTime(&ms, gpu.events[from], gpu.events[to]), "event elapsed"))
        return -1.0;
    return ms;
}
/* Pages of the flush buffer as the read flush walks it (the key read-once kernel's page size). */
#define TOOL_FLUSH_PAGE_BYTES 16384

/* Writing twice the L2 size evicts whatever the previous run left there, but leaves the L2 full of
 * dirty lines that the next kernel pays to write back (as Triton's do_bench flush does); reading
 * twice the L2 size evicts it and leaves clean lines, which shows a streaming kernel's own limit.
 */
static bool gpu_flush(void) {
    if (gpu.read_flush)
        return tool_gpu_key_read(
            gpu.flush_buffer, TOOL_FLUSH_PAGE_BYTES, TOOL_FLUSH_PAGE_BYTES, gpu.flush_pages,
            (int64_t)(gpu.flush_bytes / TOOL_FLUSH_PAGE_BYTES), gpu.flush_sink, gpu.stream);
    gpu.flush_value = (gpu.flush_value + 1) & 0xFF;
    return tool_cuda_ok(
        cudaMemsetAsync(gpu.flush_buffer, (int)gpu.flush_value, gpu.flush_bytes, gpu.stream),
        "L2 flush");
}

void tool_gpu_set_read_flush(bool read) { gpu.read_flush = read; }

static tool_exec gpu_exec = {
    .name = gpu.name,
    .device = 0,
    .stream = NULL,
    .alloc = gpu_alloc,
    .release = gpu_release,
    .upload = gpu_upload,
    .download = gpu_download,
    .poison = gpu_poison,
    .sync = gpu_sync,
    .mark = gpu_mark,
    .elapsed_ms = gpu_elapsed,
    .flush_cache = gpu_flush,
};

const tool_exec *tool_gpu_exec(void) {
    if (gpu.ready) return &gpu_exec;
    struct cudaDeviceProp prop;
    if (!tool_cuda_ok(cudaSetDevice(0), "cudaSetDevice(0)") ||
        !tool_cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties") ||
        !tool_cuda_ok(cudaStreamCreateWithFlags(&gpu.stream, cudaStreamNonBlocking),
                      "stream create"))
        return NULL;
    for (int i = 0; i < TOOL_MARKS; ++i)
        if (!tool_cuda_ok(cudaEventCreate(&gpu.events[i]), "event create")) return NULL;
    const size_t l2 = (size_t)(prop.l2CacheSize > 0 ? prop.l2CacheSize : 64 << 20);
    gpu.flush_bytes =
        (2 * l2 + TOOL_FLUSH_PAGE_BYTES - 1) / TOOL_FLUSH_PAGE_BYTES * TOOL_FLUSH_PAGE_BYTES;
    const size_t flush_pages = gpu.flush_bytes / TOOL_FLUSH_PAGE_BYTES;
    int32_t *pages = malloc(sizeof(int32_t) * flush_pages);
    if (!pages) return NULL;
    for (size_t i = 0; i < flush_pages; ++i) pages[i] = (int32_t)i;
    const bool flush_ready =
        tool_cuda_ok(cudaMalloc(&gpu.flush_buffer, gpu.flush_bytes), "L2 flush buffer") &&
        tool_cuda_ok(cudaMemset(gpu.flush_buffer, 0, gpu.flush_bytes), "L2 flush buffer fill") &&
        tool_cuda_ok(cudaMalloc((void **)&gpu.flush_pages, sizeof(int32_t) * flush_pages),
                     "L2 flush page list") &&
        tool_cuda_ok(cudaMemcpy(gpu.flush_pages, pages, sizeof(int32_t) * flush_pages,
                                cudaMemcpyHostToDevice),
                     "L2 flush page list upload") &&
        tool_cuda_ok(cudaMalloc((void **)&gpu.flush_sink, sizeof(uint32_t)), "L2 flush sink");
    free(pages);
    if (!flush_ready) return NULL;
    snprintf(gpu.name, sizeof gpu.name, "%s", prop.name);
    gpu_exec.stream = gpu.stream;
    gpu.ready = true;
    return &gpu_exec;
}

void tool_gpu_describe(char *text, size_t size) {
    struct cudaDeviceProp prop;
    int driver = 0, runtime = 0;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        snprintf(text, size, "unknown CUDA device");
        return;
    }
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    snprintf(text, size, "%s, sm_%d%d, %d SMs, L2 %.0f MB, %.1f GiB, driver %d, runtime %d",
             prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize / 1e6,
             (double)prop.totalGlobalMem / (1 << 30), driver, runtime);
}

static bool lt_ok(cublasStatus_t status, const char *what) {
    if (status == CUBLAS_STATUS_SUCCESS) return true;
    fprintf(stderr, "msaidx: cuBLASLt %s: status %d\n", what, (int)status);
    return false;
}

/* Random E4M3 codes with |x| < 2 (exponent field <= 7): never NaN, and never all zeros, which
 * would time the tensor cores on a cheaper input than real data. */
static bool upload_random_e4m3(void *dst, size_t bytes) {
    uint8_t *host = malloc(bytes);
    if (!host) return false;
    tool_rng rng = tool_rng_make(0x6E33, 1);
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t r = tool_rng_next(&rng);
        for (size_t j = 0; j < 8 && i + j < bytes; ++j)
            host[i + j] = (uint8_t)((r >> (8 * j)) & 0xBF);
    }
    bool ok = gpu_upload(dst, host, bytes);
    free(host);
    return ok;
}

/* One set of operands for cuBLASLt FP8 GEMMs m x n x k, every k <= max_k (the leading k x m and
 * k x n of A and B, K-major). */
struct tool_gemm {
    int m, n, max_k;
    void *a, *b, *d, *workspace;
    cublasLtHandle_t lt;
};
#define TOOL_GEMM_WORKSPACE_BYTES (64u << 20)

void tool_gpu_gemm_close(tool_gemm *g) {
    if (!g) return;
    if (g->lt) cublasLtDestroy(g->lt);
    gpu_release(g->workspace);
    gpu_release(g->d);
    gpu_release(g->b);
    gpu_release(g->a);
    free(g);
}

tool_gemm *tool_gpu_gemm_open(int m, int n, int max_k) {
    if (!tool_gpu_exec()) return NULL;
    tool_gemm *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->m = m;
    g->n = n;
    g->max_k = max_k;
    const size_t a_bytes = (size_t)m * max_k, b_bytes = (size_t)n * max_k;
    if (gpu_alloc(&g->a, a_bytes) && gpu_alloc(&g->b, b_bytes) &&
        gpu_alloc(&g->d, (size_t)m * n * 2) &&
        gpu_alloc(&g->workspace, TOOL_GEMM_WORKSPACE_BYTES) && upload_random_e4m3(g->a, a_bytes) &&
        upload_random_e4m3(g->b, b_bytes) && lt_ok(cublasLtCreate(&g->lt), "create"))
        return g;
    tool_gpu_gemm_close(g);
    return NULL;
}

double tool_gpu_gemm_ms(tool_gemm *g, int k, int repeat, bool flush) {
    if (!g || k < 1 || k > g->max_k || repeat < 1) return 0.0;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t a_layout = NULL, b_layout = NULL, d_layout = NULL;
    cublasLtMatmulPreference_t preference = NULL;
    double *times = calloc((size_t)repeat, sizeof *times);
    double ms = 0.0;
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    const size_t workspace_limit = TOOL_GEMM_WORKSPACE_BYTES;
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    bool ok =
        times && lt_ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc") &&
        /* FP8 needs the TN layout: A transposed, B not, both K-major. */
        lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                             sizeof transpose),
              "transa") &&
        lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep),
              "transb") &&
        lt_ok(cublasLtMatrixLayoutCreate(&a_layout, CUDA_R_8F_E4M3, k, g->m, k), "A layout") &&
        lt_ok(cublasLtMatrixLayoutCreate(&b_layout, CUDA_R_8F_E4M3, k, g->n, k), "B layout") &&
        lt_ok(cublasLtMatrixLayoutCreate(&d_layout, CUDA_R_16BF, g->m, g->n, g->m), "D layout") &&
        lt_ok(cublasLtMatmulPreferenceCreate(&preference), "preference") &&
        lt_ok(cublasLtMatmulPreferenceSetAttribute(preference,
                                                   CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &workspace_limit, sizeof workspace_limit),
              "workspace pref") &&
        lt_ok(cublasLtMatmulAlgoGetHeuristic(g->lt, op, a_layout, b_layout, d_layout, d_layout,
                                             preference, 1, &heuristic, &found),
              "heuristic");
    if (ok && found < 1) {
        fprintf(stderr, "msaidx: cuBLASLt found no FP8 algorithm for %d x %d x %d\n", g->m, g->n,
                k);
        ok = false;
    }
    const float alpha = 1.0f, beta = 0.0f;
    for (int i = -2; ok && i < repeat; ++i) { /* two warm-up runs */
        ok = (!flush || gpu_flush()) && gpu_mark(0) &&
             lt_ok(cublasLtMatmul(g->lt, op, &alpha, g->a, a_layout, g->b, b_layout, &beta, g->d,
                                  d_layout, g->d, d_layout, &heuristic.algo, g->workspace,
                                  TOOL_GEMM_WORKSPACE_BYTES, gpu.stream),
                   "matmul") &&
             gpu_mark(1) && gpu_sync();
        if (ok && i >= 0) times[i] = gpu_elapsed(0, 1);
    }
    if (ok) ms = tool_median(times, repeat);
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d_layout) cublasLtMatrixLayoutDestroy(d_layout);
    if (b_layout) cublasLtMatrixLayoutDestroy(b_layout);
    if (a_layout) cublasLtMatrixLayoutDestroy(a_layout);
    if (op) cublasLtMatmulDescDestroy(op);
    free(times);
    return ms;
}

double tool_gpu_copy_tbps(size_t bytes, int repeat) {
    if (!tool_gpu_exec()) return 0.0;
    void *src = NULL, *dst = NULL;
    double *times = calloc((size_t)repeat, sizeof *times);
    double tbps = 0.0;
    bool ok = times && gpu_alloc(&src, bytes) && gpu_alloc(&dst, bytes) &&
              tool_cuda_ok(cudaMemsetAsync(src, 0x5A, bytes, gpu.stream), "copy source fill");
    for (int i = -2; ok && i < repeat; ++i) {
        ok = gpu_mark(0) &&
             tool_cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, gpu.stream),
                          "device copy") &&
             gpu_mark(1) && gpu_sync();
        if (ok && i >= 0) times[i] = gpu_elapsed(0, 1);
    }
    if (ok) tbps = 2.0 * (double)bytes / (tool_median(times, repeat) * 1e-3) * 1e-12;
    gpu_release(dst);
    gpu_release(src);
    free(times);
    return tbps;
}

#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int tool_gpu_util_needs_cuda;
#endif
