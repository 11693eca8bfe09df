/* Device-side helpers of the gpu_* tests (CUDA runtime C API): availability, checked calls,
 * a bc_batch uploaded to device memory, and one full plan + scores + top-k run. */
#ifndef MSAIDX_TEST_GPU_DEVICE_H
#define MSAIDX_TEST_GPU_DEVICE_H

#ifdef MSAIDX_WITH_CUDA

#include "backend_cases.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

/* A failed CUDA call ends the test: the device state is unknown after it. */
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t cuda_check_error_ = (call);                                                    \
        if (cuda_check_error_ != cudaSuccess) {                                                    \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                          \
                    cudaGetErrorString(cuda_check_error_));                                        \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* True when a CUDA device is usable; the tests exit 77 (skipped) otherwise. */
static inline bool gpu_available(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        printf("no CUDA device: skipped\n");
        return false;
    }
    return true;
}

/* A device copy of a batch's inputs. Metadata sits 4 bytes past a 256-byte boundary. */
typedef struct gpu_batch {
    char *meta_base;
    int32_t *cu_seqlens_q, *seq_lens, *block_table;
    void *q, *k_cache;
} gpu_batch;

static inline size_t gpu_meta_ints(const bc_batch *b) {
    return (size_t)b->desc.batch_size + 1 + (size_t)b->desc.batch_size +
           (size_t)(b->desc.batch_size > 0 ? b->desc.batch_size : 1) * b->desc.bt_stride + 8;
}

/* Copies the metadata of `b` (which may have been rewritten) into the device buffers. */
static inline void gpu_upload_meta(const gpu_batch *g, const bc_batch *b) {
    const size_t B = (size_t)b->desc.batch_size;
    CUDA_CHECK(cudaMemcpy(g->cu_seqlens_q, b->cu_seqlens_q, sizeof(int32_t) * (B + 1),
                          cudaMemcpyHostToDevice));
    if (B) {
        CUDA_CHECK(
            cudaMemcpy(g->seq_lens, b->seq_lens, sizeof(int32_t) * B, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(g->block_table, b->block_table,
                              sizeof(int32_t) * B * (size_t)b->desc.bt_stride,
                              cudaMemcpyHostToDevice));
    }
    /* A pageable cudaMemcpy may return before its DMA lands, and the tests' non-blocking streams
     * do not wait for the legacy stream. */
    CUDA_CHECK(cudaDeviceSynchronize());
}

static inline void gpu_upload(gpu_batch *g, const bc_batch *b) {
    const size_t B = (size_t)b->desc.batch_size;
    CUDA_CHECK(cudaMalloc((void **)&g->meta_base, sizeof(int32_t) * gpu_meta_ints(b) + 256));
    g->cu_seqlens_q = (int32_t *)(g->meta_base + 4);
    g->seq_lens = g->cu_seqlens_q + B + 1;
    g->block_table = g->seq_lens + B;
    CUDA_CHECK(cudaMalloc(&g->q, b->q_bytes));
    CUDA_CHECK(cudaMalloc(&g->k_cache, b->k_bytes));
    CUDA_CHECK(cudaMemcpy(g->q, b->q, b->q_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(g->k_cache, b->k_cache, b->k_bytes, cudaMemcpyHostToDevice));
    gpu_upload_meta(g, b);
}

static inline void gpu_release(gpu_batch *g) {
    CUDA_CHECK(cudaFree(g->meta_base));
    CUDA_CHECK(cudaFree(g->q));
    CUDA_CHECK(cudaFree(g->k_cache));
    memset(g, 0, sizeof *g);
}

/* Device buffers of one run's outputs, poisoned from the host. */
typedef struct gpu_outputs {
    float *scores; /* cells + guard; 4-byte (not 16) aligned for odd T, as the API allows */
    int32_t *topk; /* picks + guard */
    size_t cells, picks;
    float *allocation;
} gpu_outputs;

enum { GPU_GUARD = 64 };

static inline void gpu_outputs_create(gpu_outputs *o, const bc_batch *b) {
    o->cells = bc_score_count(b);
    o->picks = (size_t)b->desc.num_tokens * b->config.num_heads * b->config.topk;
    CUDA_CHECK(cudaMalloc((void **)&o->allocation, sizeof(float) * (o->cells + GPU_GUARD + 1)));
    o->scores = o->allocation + (b->desc.num_tokens % 2);
    CUDA_CHECK(cudaMalloc((void **)&o->topk, sizeof(int32_t) * (o->picks + GPU_GUARD)));
}

static inline void gpu_outputs_poison(const gpu_outputs *o) {
    float *host = malloc(sizeof(float) * (o->cells + GPU_GUARD));
    if (!host) exit(2);
    bc_poison(host, o->cells + GPU_GUARD);
    CUDA_CHECK(cudaMemcpy(o->scores, host, sizeof(float) * (o->cells + GPU_GUARD),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(o->topk, 0x5A, sizeof(int32_t) * (o->picks + GPU_GUARD)));
    /* cudaMemset runs on the legacy stream, which the tests' non-blocking streams do not wait
     * for: without this the poison can land after the outputs. */
    CUDA_CHECK(cudaDeviceSynchronize());
    free(host);
}

static inline void gpu_outputs_release(gpu_outputs *o) {
    CUDA_CHECK(cudaFree(o->allocation));
    CUDA_CHECK(cudaFree(o->topk));
}

/* Copies back scores and top-k (topk may be NULL); returns guard cells past them that changed. */
static inline long gpu_outputs_fetch(const gpu_outputs *o, float *scores, int32_t *topk) {
    float score_guard[GPU_GUARD];
    int32_t topk_guard[GPU_GUARD];
    CUDA_CHECK(cudaMemcpy(scores, o->scores, sizeof(float) * o->cells, cudaMemcpyDeviceToHost));
    CUDA_CHECK(
        cudaMemcpy(score_guard, o->scores + o->cells, sizeof score_guard, cudaMemcpyDeviceToHost));
    if (topk)
        CUDA_CHECK(cudaMemcpy(topk, o->topk, sizeof(int32_t) * o->picks, cudaMemcpyDeviceToHost));
    CUDA_CHECK(
        cudaMemcpy(topk_guard, o->topk + o->picks, sizeof topk_guard, cudaMemcpyDeviceToHost));
    long guard_hits = 0;
    for (int i = 0; i < GPU_GUARD; ++i)
        guard_hits += !bc_is_poison(score_guard[i]) + (topk_guard[i] != 0x5A5A5A5A);
    return guard_hits;
}

/* Context + plan + device workspace for `backend` on `device` (the workspace is allocated on
 * the current device: the caller makes it `device` first). */
typedef struct gpu_session {
    msaidx_context *context;
    msaidx_plan *plan;
    void *workspace;
    size_t workspace_bytes;
} gpu_session;

static inline msaidx_status gpu_session_create_on(gpu_session *s, const bc_batch *b,
                                                  msaidx_backend backend, int32_t device) {
    memset(s, 0, sizeof *s);
    msaidx_config config = b->config;
    config.backend = backend;
    config.device = device;
    msaidx_status status = msaidx_context_create(&s->context, &config);
    if (status != MSAIDX_SUCCESS) return status;
    status = msaidx_plan_create(&s->plan, s->context, &b->desc);
    if (status != MSAIDX_SUCCESS) return status;
    status = msaidx_plan_workspace_size(s->plan, &s->workspace_bytes);
    if (status != MSAIDX_SUCCESS) return status;
    CUDA_CHECK(cudaMalloc(&s->workspace, s->workspace_bytes));
    return MSAIDX_SUCCESS;
}

static inline msaidx_status gpu_session_create(gpu_session *s, const bc_batch *b,
                                               msaidx_backend backend) {
    return gpu_session_create_on(s, b, backend, 0);
}

static inline void gpu_session_release(gpu_session *s) {
    if (s->workspace) CUDA_CHECK(cudaFree(s->workspace));
    msaidx_plan_destroy(s->plan);
    msaidx_context_destroy(s->context);
    memset(s, 0, sizeof *s);
}

/* plan_batch + scores (prefill or decode) + top-k of the plan's nvp, all on `stream`. */
static inline msaidx_status gpu_enqueue(const gpu_session *s, const gpu_batch *g, const bc_batch *b,
                                        const gpu_outputs *o, bool decode, cudaStream_t stream) {
    msaidx_status status = msaidx_plan_batch(s->plan, g->cu_seqlens_q, g->seq_lens, g->block_table,
                                             s->workspace, s->workspace_bytes, stream);
    if (status != MSAIDX_SUCCESS) return status;
    status = decode ? msaidx_decode_scores(s->plan, g->q, g->k_cache, o->scores, stream)
                    : msaidx_prefill_scores(s->plan, g->q, g->k_cache, o->scores, stream);
    if (status != MSAIDX_SUCCESS) return status;
    const int32_t *nvp = NULL;
    status = msaidx_plan_nvp(s->plan, &nvp);
    if (status != MSAIDX_SUCCESS) return status;
    return msaidx_topk_select(s->context, o->scores, b->desc.pitch, nvp, b->desc.num_tokens,
                              o->topk, stream);
}

/* The plan's nvp [T], copied back. */
static inline void gpu_fetch_nvp(const gpu_session *s, const bc_batch *b, int32_t *nvp) {
    const int32_t *device_nvp = NULL;
    if (msaidx_plan_nvp(s->plan, &device_nvp) != MSAIDX_SUCCESS) exit(1);
    CUDA_CHECK(cudaMemcpy(nvp, device_nvp, sizeof(int32_t) * (size_t)b->desc.num_tokens,
                          cudaMemcpyDeviceToHost));
}

/* After a run that succeeded and whose work finished: its scores, top-k and nvp copied back, and
 * no write past the output buffers. */
static inline void gpu_collect(const gpu_session *s, const bc_batch *b, const gpu_outputs *o,
                               float *scores, int32_t *nvp, int32_t *topk) {
    CUDA_CHECK(cudaGetLastError());
    msaidx_backend backend = MSAIDX_BACKEND_AUTO;
    msaidx_context_backend(s->context, &backend);
    const long guard = gpu_outputs_fetch(o, scores, topk);
    CHECK(guard == 0, "%s %s: %ld writes past the score / top-k buffers",
          msaidx_backend_name(backend), b->spec.name, guard);
    gpu_fetch_nvp(s, b, nvp);
}

/* The CUDA backends, for loops over gpu_backend_at(0 .. GPU_NUM_BACKENDS - 1). */
enum { GPU_NUM_BACKENDS = 3 };
static inline msaidx_backend gpu_backend_at(int index) {
    return index == 0   ? MSAIDX_BACKEND_DENSE
           : index == 1 ? MSAIDX_BACKEND_SPLIT
                        : MSAIDX_BACKEND_PERSISTENT;
}

/* Whether `backend` is admitted for the D = page = 128 E4M3 default config on device 0. */
/* Whether this build carries sm_90a code (CMAKE_CUDA_ARCHITECTURES) and device 0 is an sm_90:
 * where the persistent backend is documented to run. */
static inline bool gpu_runs_sm90a(void) {
#ifdef MSAIDX_TEST_BUILT_SM90A
    int major = 0, minor = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
    return major == 9 && minor == 0;
#else
    return false;
#endif
}

/* Whether `backend` is admitted on device 0 (default config); a refusal where bc_must_admit says
 * it runs is a failure. */
static inline bool gpu_backend_admitted(msaidx_backend backend) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = 0;
    config.backend = backend;
    const msaidx_status status = msaidx_backend_supported(backend, &config);
    if (status != MSAIDX_SUCCESS) {
        printf("backend %s not admitted: %s\n", msaidx_backend_name(backend), msaidx_last_error());
        CHECK(!bc_must_admit(backend, gpu_runs_sm90a(), &config),
              "backend %s refused on a device it is documented for: %s",
              msaidx_backend_name(backend), msaidx_last_error());
    }
    return status == MSAIDX_SUCCESS;
}

#endif /* MSAIDX_WITH_CUDA */
#endif
