/* msaidx e2e, one engine step on the device: the buffers of one (TP, C, P) config, shared by the
 * backends compared on it, and one backend's run of it (context, plans, one eager layer, the
 * forward captured as one CUDA graph, timed replays). cmd_e2e.c parses the options, estimates
 * and schedules the runs, and writes the report. */
#ifndef MSAIDX_E2E_STEP_H
#define MSAIDX_E2E_STEP_H

#include "tool.h"

/* Backends one run compares (the --backends list). */
#define E2E_MAX_BACKENDS 4

#ifdef MSAIDX_WITH_CUDA

#include <cuda_runtime.h>

#define E2E_TOPK 16
/* Timed replays of one config stop near this much work (at least one after the warm-up). */
#define E2E_REPLAY_TARGET_S 0.1

typedef enum e2e_state { E2E_PENDING, E2E_OK, E2E_SKIPPED, E2E_FAILED } e2e_state;

typedef struct e2e_result {
    e2e_state state;
    msaidx_backend resolved;
    double estimate_s, ms_per_forward;
    double fused_ms_per_forward; /* --fused: the prefill layer as msaidx_prefill_topk; 0: none */
    int replays;
    const char *why; /* of a skip or failure */
} e2e_result;

typedef struct e2e_config {
    int tp, heads;
    int32_t prefill, context, decode, layers, pages;
    int32_t pitch; /* score rows: at least pages (--pitch) */
    bool prepare;  /* --prepare */
    e2e_result results[E2E_MAX_BACKENDS];
} e2e_config;

/* Device buffers of one (TP, C, P) config, shared by the backends compared on it. */
typedef struct e2e_data {
    /* [layers][...]; a layer's Q holds the prefill chunk's rows, then the decode rows, so that one
     * msaidx_index_prepare call writes both, as an engine prepares a step's tokens. */
    uint8_t *k_cache, *q;
    /* The step's scores and top-k: the prefill chunk's rows, then the decode rows. */
    float *scores;
    int32_t *topk;
    int32_t *cu_prefill, *seq_prefill, *bt_prefill, *cu_decode, *seq_decode, *bt_decode;
    /* The whole step as one batch (the chunk's request, then the decode requests): what the one
     * top-k of a layer selects by, from one msaidx_num_valid_pages per forward. */
    int32_t *cu_step, *seq_step, *nvp_step;
    size_t k_layer_bytes, q_layer_bytes, q_decode_offset;
    /* --prepare: BF16 rows [q heads | key] of the P + D new tokens per layer, the norm weights
     * (q then k), a cos/sin table, and the new tokens' positions and slots. */
    uint16_t *projection, *norm_weights;
    float *cos_sin;
    int64_t *positions, *slots;
    size_t projection_layer_elems;
} e2e_data;

/* Allocates and fills a config's buffers on `stream` (seeded); false after a message. */
bool e2e_data_alloc(e2e_data *d, const e2e_config *c, uint64_t seed, cudaStream_t stream);
void e2e_data_free(e2e_data *d);

/* One backend on one config: engine, one eager layer, capture, warm-up, timed replays; with
 * `fused` a second graph whose prefill layers go through msaidx_prefill_topk, captured on the same
 * engine and replayed alternately with the first (out->fused_ms_per_forward). */
void e2e_run_backend(msaidx_backend backend, msaidx_precision precision, e2e_config *c,
                     const e2e_data *d, const tool_exec *exec, long max_replays, bool fused,
                     e2e_result *out);

#endif /* MSAIDX_WITH_CUDA */

#endif
