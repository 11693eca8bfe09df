/* msaidx e2e, one engine step on the device (e2e_step.h). Compiled to nothing without CUDA. */
#include "e2e_step.h"

#ifdef MSAIDX_WITH_CUDA

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void e2e_data_free(e2e_data *d) {
    void *buffers[] = {d->k_cache,     d->q,          d->scores,    d->topk,       d->cu_prefill,
                       d->seq_prefill, d->bt_prefill, d->cu_decode, d->seq_decode, d->bt_decode,
                       d->cu_step,     d->seq_step,   d->nvp_step,  d->projection, d->norm_weights,
                       d->cos_sin,     d->positions,  d->slots};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) cudaFree(buffers[i]);
    *d = (e2e_data){0};
}

static bool device_alloc(void *pointer, size_t bytes, const char *what) {
    void **p = (void **)pointer;
    *p = NULL;
    return tool_cuda_ok(cudaMalloc(p, bytes ? bytes : 1), what);
}

static bool upload(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
    return tool_cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                        "metadata upload");
}

/* A shuffled order of the cache's pages per request: the prefill request's own, then each
 * decode row's (each reads the same physical pages in a different order). */
static void shuffled_pages(int32_t *row, int32_t pages, tool_rng *rng) {
    for (int32_t i = 0; i < pages; ++i) row[i] = i;
    for (int32_t i = pages - 1; i > 0; --i) {
        const int32_t j = (int32_t)(tool_rng_next(rng) % (uint64_t)(i + 1));
        const int32_t swap = row[i];
        row[i] = row[j];
        row[j] = swap;
    }
}

/* Rows of the --prepare cos/sin table; positions wrap around it (a chunk reads distinct rows). */
#define E2E_TABLE_ROWS 65536

/* The --prepare inputs. The prefill tokens' keys go to their own slots (the pages the scorer
 * reads); the decode rows skip the key insert (slot -1): their synthetic block-table rows share
 * the physical pages, so their slots would collide. */
static bool prepare_alloc(e2e_data *d, const e2e_config *c, const int32_t *bt_prefill,
                          uint64_t seed, cudaStream_t stream) {
    const size_t L = (size_t)c->layers, P = (size_t)c->prefill, T = P + (size_t)c->decode;
    const size_t row = (size_t)(c->heads + 1) * TOOL_HEAD_DIM;
    d->projection_layer_elems = T * row;
    float *values =
        malloc(sizeof(float) * (T * row > E2E_TABLE_ROWS * 64 ? T * row : E2E_TABLE_ROWS * 64));
    uint16_t *bf16 = malloc(sizeof(uint16_t) * T * row);
    int64_t *positions = malloc(sizeof(int64_t) * T), *slots = malloc(sizeof(int64_t) * T);
    bool ok =
        values && bf16 && positions && slots &&
        device_alloc(&d->projection, sizeof(uint16_t) * L * T * row, "prepare projection") &&
        device_alloc(&d->norm_weights, sizeof(uint16_t) * 2 * TOOL_HEAD_DIM, "prepare weights") &&
        device_alloc(&d->cos_sin, sizeof(float) * E2E_TABLE_ROWS * 64, "prepare cos/sin") &&
        device_alloc(&d->positions, sizeof(int64_t) * T, "prepare positions") &&
        device_alloc(&d->slots, sizeof(int64_t) * T, "prepare slots");
    if (ok) {
        tool_rng rng = tool_rng_make(seed, 0x9E7A);
        for (size_t i = 0; i < T * row; ++i)
            values[i] = (float)(4.0 * tool_rng_uniform(&rng) - 2.0);
        msaidx_bf16_from_float(values, bf16, T * row);
        ok = upload(d->projection, bf16, sizeof(uint16_t) * T * row, stream);
        for (size_t l = 1; ok && l < L; ++l)
            ok = tool_cuda_ok(cudaMemcpyAsync(d->projection + l * T * row, d->projection,
                                              sizeof(uint16_t) * T * row, cudaMemcpyDeviceToDevice,
                                              stream),
                              "prepare projection copy");
        for (size_t i = 0; i < 2 * TOOL_HEAD_DIM; ++i)
            values[i] = (float)(0.5 * tool_rng_uniform(&rng));
        msaidx_bf16_from_float(values, bf16, 2 * TOOL_HEAD_DIM);
        ok = ok && upload(d->norm_weights, bf16, sizeof(uint16_t) * 2 * TOOL_HEAD_DIM, stream) &&
             tool_cuda_ok(cudaStreamSynchronize(stream),
                          "prepare upload"); /* the host buffers are reused */
        double inverse_frequency[32];        /* MiniMax-M3: theta 5e6 */
        for (size_t i = 0; i < 32; ++i) inverse_frequency[i] = pow(5e6, -2.0 * (double)i / 64.0);
        for (size_t p = 0; p < E2E_TABLE_ROWS; ++p)
            for (size_t i = 0; i < 32; ++i) {
                const double angle = (double)p * inverse_frequency[i];
                values[p * 64 + i] = (float)cos(angle);
                values[p * 64 + 32 + i] = (float)sin(angle);
            }
        for (size_t t = 0; t < T; ++t) {
            const int64_t position =
                t < P ? (int64_t)c->context - (int64_t)P + (int64_t)t : c->context - 1;
            positions[t] = position % E2E_TABLE_ROWS;
            slots[t] =
                t < P ? (int64_t)bt_prefill[position / TOOL_PAGE] * TOOL_PAGE + position % TOOL_PAGE
                      : -1;
        }
        ok = ok && upload(d->cos_sin, values, sizeof(float) * E2E_TABLE_ROWS * 64, stream) &&
             upload(d->positions, positions, sizeof(int64_t) * T, stream) &&
             upload(d->slots, slots, sizeof(int64_t) * T, stream) &&
             tool_cuda_ok(cudaStreamSynchronize(stream), "prepare upload");
    } else if (!values || !bf16 || !positions || !slots) {
        fprintf(stderr, "msaidx e2e: out of host memory for the --prepare inputs\n");
    }
    free(values);
    free(bf16);
    free(positions);
    free(slots);
    return ok;
}

bool e2e_data_alloc(e2e_data *d, const e2e_config *c, uint64_t seed, cudaStream_t stream) {
    *d = (e2e_data){0};
    const size_t L = (size_t)c->layers, P = (size_t)c->prefill, D = (size_t)c->decode,
                 H = (size_t)c->heads;
    const size_t pages = (size_t)c->pages, pitch = (size_t)c->pitch;
    d->k_layer_bytes = pages * TOOL_PAGE * TOOL_HEAD_DIM;
    d->q_layer_bytes = (P + D) * H * TOOL_HEAD_DIM;
    d->q_decode_offset = P * H * TOOL_HEAD_DIM;
    int32_t *bt_host = malloc(sizeof(int32_t) * pages * (D + 1));
    int32_t *cu_decode = malloc(sizeof(int32_t) * (D + 1)),
            *seq_decode = malloc(sizeof(int32_t) * (D + 1)),
            *cu_step = malloc(sizeof(int32_t) * (D + 2));
    const int32_t cu_prefill[2] = {0, c->prefill};
    bool ok = bt_host && cu_decode && seq_decode && cu_step &&
              device_alloc(&d->k_cache, L * d->k_layer_bytes, "key caches") &&
              device_alloc(&d->q, L * d->q_layer_bytes, "Q") &&
              device_alloc(&d->scores, (P + D) * H * pitch * sizeof(float), "scores") &&
              device_alloc(&d->topk, (P + D) * H * E2E_TOPK * sizeof(int32_t), "top-k") &&
              device_alloc(&d->cu_step, sizeof(int32_t) * (D + 2), "metadata") &&
              device_alloc(&d->seq_step, sizeof(int32_t) * (D + 1), "metadata") &&
              device_alloc(&d->nvp_step, sizeof(int32_t) * (P + D), "metadata") &&
              device_alloc(&d->cu_prefill, sizeof cu_prefill, "metadata") &&
              device_alloc(&d->seq_prefill, sizeof(int32_t), "metadata") &&
              device_alloc(&d->bt_prefill, sizeof(int32_t) * pages, "metadata") &&
              device_alloc(&d->cu_decode, sizeof(int32_t) * (D + 1), "metadata") &&
              device_alloc(&d->seq_decode, sizeof(int32_t) * (D ? D : 1), "metadata") &&
              device_alloc(&d->bt_decode, sizeof(int32_t) * pages * (D ? D : 1), "metadata");
    if (ok) {
        tool_rng rng = tool_rng_make(seed, 0xB10C);
        for (size_t r = 0; r <= D; ++r) shuffled_pages(bt_host + r * pages, (int32_t)pages, &rng);
        for (size_t r = 0; r <= D; ++r) cu_decode[r] = (int32_t)r;
        cu_step[0] = 0; /* the chunk's request, then one request a decode row */
        for (size_t r = 0; r <= D; ++r) cu_step[r + 1] = (int32_t)(P + r);
        for (size_t r = 0; r <= D; ++r) seq_decode[r] = c->context;
        ok = tool_gpu_fill_random(d->k_cache, L * d->k_layer_bytes, seed * 3 + 1, stream) &&
             tool_gpu_fill_random(d->q, L * d->q_layer_bytes, seed * 3 + 2, stream) &&
             upload(d->cu_prefill, cu_prefill, sizeof cu_prefill, stream) &&
             upload(d->seq_prefill, &c->context, sizeof(int32_t), stream) &&
             upload(d->bt_prefill, bt_host, sizeof(int32_t) * pages, stream) &&
             upload(d->cu_decode, cu_decode, sizeof(int32_t) * (D + 1), stream) &&
             (!D || upload(d->seq_decode, seq_decode, sizeof(int32_t) * D, stream)) &&
             (!D || upload(d->bt_decode, bt_host + pages, sizeof(int32_t) * pages * D, stream)) &&
             upload(d->seq_step, seq_decode, sizeof(int32_t) * (D + 1), stream) &&
             upload(d->cu_step, cu_step, sizeof(int32_t) * (D + 2), stream) &&
             tool_cuda_ok(cudaStreamSynchronize(stream), "data fill") &&
             (!c->prepare || prepare_alloc(d, c, bt_host, seed, stream));
    } else if (!bt_host || !cu_decode || !seq_decode || !cu_step) {
        fprintf(stderr, "msaidx e2e: out of host memory for the metadata\n");
    }
    free(bt_host);
    free(cu_decode);
    free(seq_decode);
    free(cu_step);
    if (!ok) e2e_data_free(d);
    return ok;
}

/* A context, its two plans and their workspaces. */
typedef struct e2e_engine {
    msaidx_context *context;
    msaidx_plan *prefill_plan, *decode_plan;
    void *prefill_workspace, *decode_workspace;
    size_t prefill_workspace_bytes, decode_workspace_bytes;
    msaidx_topk_args fused; /* --fused: the prefill layer's msaidx_prefill_topk, its workspace */
} e2e_engine;

static void engine_close(e2e_engine *e) {
    msaidx_plan_destroy(e->prefill_plan);
    msaidx_plan_destroy(e->decode_plan);
    msaidx_context_destroy(e->context);
    cudaFree(e->prefill_workspace);
    cudaFree(e->decode_workspace);
    cudaFree(e->fused.workspace);
    *e = (e2e_engine){0};
}

static void describe_batch(msaidx_batch_desc *desc, int32_t requests, int32_t tokens, int32_t max_q,
                           const e2e_config *c) {
    msaidx_batch_desc_init(desc);
    desc->batch_size = requests;
    desc->num_tokens = tokens;
    desc->max_q_len = max_q;
    desc->max_seq_len = c->context;
    desc->num_pages = c->pages;
    desc->bt_stride = c->pages;
    desc->page_stride = (int64_t)TOOL_PAGE * TOOL_HEAD_DIM;
    desc->pitch = c->pitch;
}

static bool engine_open(e2e_engine *e, msaidx_backend backend, msaidx_precision precision,
                        const e2e_config *c, const e2e_data *d, bool fused, cudaStream_t stream,
                        msaidx_backend *resolved) {
    *e = (e2e_engine){0};
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = c->heads;
    config.dtype = MSAIDX_DTYPE_E4M3;
    config.backend = backend;
    config.device = 0;
    config.topk = E2E_TOPK;
    config.precision = precision;
    msaidx_batch_desc prefill_desc, decode_desc;
    describe_batch(&prefill_desc, 1, c->prefill, c->prefill, c);
    describe_batch(&decode_desc, c->decode, c->decode, 1, c);
    bool ok = tool_ok(msaidx_context_create(&e->context, &config), "context create") &&
              tool_ok(msaidx_context_backend(e->context, resolved), "context backend") &&
              tool_ok(msaidx_plan_create(&e->prefill_plan, e->context, &prefill_desc),
                      "prefill plan create") &&
              tool_ok(msaidx_plan_workspace_size(e->prefill_plan, &e->prefill_workspace_bytes),
                      "workspace size") &&
              device_alloc(&e->prefill_workspace, e->prefill_workspace_bytes, "prefill workspace");
    msaidx_topk_args_init(&e->fused);
    e->fused.topk = E2E_TOPK;
    if (ok && fused)
        ok = tool_ok(
                 msaidx_prefill_topk_workspace_size(e->prefill_plan, 0, &e->fused.workspace_bytes),
                 "prefill_topk workspace size") &&
             device_alloc(&e->fused.workspace, e->fused.workspace_bytes, "prefill_topk workspace");
    if (ok && c->decode)
        ok = tool_ok(msaidx_plan_create(&e->decode_plan, e->context, &decode_desc),
                     "decode plan create") &&
             tool_ok(msaidx_plan_workspace_size(e->decode_plan, &e->decode_workspace_bytes),
                     "workspace size") &&
             device_alloc(&e->decode_workspace, e->decode_workspace_bytes, "decode workspace");
    /* Plan once eagerly so that bad metadata is reported here, not inside the graph. */
    ok = ok &&
         tool_ok(msaidx_plan_batch(e->prefill_plan, d->cu_prefill, d->seq_prefill, d->bt_prefill,
                                   e->prefill_workspace, e->prefill_workspace_bytes, stream),
                 "prefill plan batch") &&
         tool_ok(msaidx_plan_check(e->prefill_plan, stream), "prefill plan check");
    if (ok && c->decode)
        ok = tool_ok(msaidx_plan_batch(e->decode_plan, d->cu_decode, d->seq_decode, d->bt_decode,
                                       e->decode_workspace, e->decode_workspace_bytes, stream),
                     "decode plan batch") &&
             tool_ok(msaidx_plan_check(e->decode_plan, stream), "decode plan check");
    if (!ok) engine_close(e);
    return ok;
}

/* --prepare: layer `layer`'s index Q (prefill chunk, then decode rows) and the new tokens' keys
 * from its BF16 projection rows, in one call. */
static bool issue_prepare(const e2e_engine *e, const e2e_config *c, const e2e_data *d,
                          int32_t layer, cudaStream_t stream) {
    const int64_t row = (int64_t)(c->heads + 1) * TOOL_HEAD_DIM;
    const uint16_t *projection = d->projection + (size_t)layer * d->projection_layer_elems;
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    a.num_tokens = c->prefill + c->decode;
    a.q_in = projection;
    a.k_in = projection + (size_t)c->heads * TOOL_HEAD_DIM;
    a.q_in_token_stride = a.k_in_token_stride = row;
    a.positions = d->positions;
    a.q_norm_weight = d->norm_weights;
    a.k_norm_weight = d->norm_weights + TOOL_HEAD_DIM;
    a.cos_sin_cache = d->cos_sin;
    a.max_position = E2E_TABLE_ROWS;
    a.slot_mapping = d->slots;
    a.k_cache = d->k_cache + (size_t)layer * d->k_layer_bytes;
    a.page_stride = (int64_t)TOOL_PAGE * TOOL_HEAD_DIM;
    a.num_pages = c->pages;
    a.q_out = d->q + (size_t)layer * d->q_layer_bytes;
    return tool_ok(msaidx_index_prepare(e->context, &a, stream), "index prepare");
}

/* A layer's top-k of `tokens` rows as an engine issues it, bounded by the batch's longest row
 * (the context's pages, as planned) whatever the pitch. */
static bool issue_topk(const e2e_engine *e, const e2e_config *c, const float *scores,
                       const int32_t *nvp, int32_t tokens, int32_t *out, cudaStream_t stream,
                       const char *what) {
    return tool_ok(msaidx_topk_select_bounded(e->context, scores, c->pitch, c->pages, nvp, tokens,
                                              out, (int64_t)c->heads * E2E_TOPK, E2E_TOPK, stream),
                   what);
}

/* The plans, the step's visible pages, then every layer's (--prepare: preparation,) scores and
 * top-k, issued on the stream. The chunk's and the decode rows' scores go to one buffer (the
 * decode plan's rows after the chunk's, the same pitch) and one top-k selects every row, as an
 * engine can with one msaidx_num_valid_pages of its whole batch per forward. `fused`: the chunk
 * as one msaidx_prefill_topk without scores, then the decode rows' own top-k. */
static bool issue_forward(const e2e_engine *e, const e2e_config *c, const e2e_data *d,
                          int32_t layers, bool fused, cudaStream_t stream) {
    const int32_t P = c->prefill, D = c->decode;
    const size_t decode_rows = (size_t)P * (size_t)c->heads;
    float *decode_scores = d->scores + decode_rows * (size_t)c->pitch;
    bool ok =
        tool_ok(msaidx_plan_batch(e->prefill_plan, d->cu_prefill, d->seq_prefill, d->bt_prefill,
                                  e->prefill_workspace, e->prefill_workspace_bytes, stream),
                "prefill plan batch") &&
        tool_ok(msaidx_num_valid_pages(e->context, d->cu_step, d->seq_step, 1 + D, P + D,
                                       d->nvp_step, stream),
                "step's visible pages");
    if (ok && D)
        ok = tool_ok(msaidx_plan_batch(e->decode_plan, d->cu_decode, d->seq_decode, d->bt_decode,
                                       e->decode_workspace, e->decode_workspace_bytes, stream),
                     "decode plan batch");
    for (int32_t l = 0; ok && l < layers; ++l) {
        const uint8_t *k = d->k_cache + (size_t)l * d->k_layer_bytes;
        if (c->prepare && !issue_prepare(e, c, d, l, stream)) return false;
        const uint8_t *q = d->q + (size_t)l * d->q_layer_bytes;
        ok = fused ? tool_ok(msaidx_prefill_topk(e->prefill_plan, q, k, &e->fused, NULL, d->topk,
                                                 stream),
                             "prefill_topk")
                   : tool_ok(msaidx_prefill_scores(e->prefill_plan, q, k, d->scores, stream),
                             "prefill scores");
        if (ok && D)
            ok = tool_ok(msaidx_decode_scores(e->decode_plan, q + d->q_decode_offset, k,
                                              decode_scores, stream),
                         "decode scores");
        if (ok && fused && D)
            ok = issue_topk(e, c, decode_scores, d->nvp_step + P, D,
                            d->topk + decode_rows * E2E_TOPK, stream, "decode top-k");
        if (ok && !fused)
            ok = issue_topk(e, c, d->scores, d->nvp_step, P + D, d->topk, stream, "top-k");
    }
    return ok;
}

static bool capture_forward(const e2e_engine *e, const e2e_config *c, const e2e_data *d, bool fused,
                            cudaStream_t stream, cudaGraphExec_t *graph_exec) {
    cudaGraph_t graph = NULL;
    *graph_exec = NULL;
    if (!tool_cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                      "begin capture"))
        return false;
    const bool issued = issue_forward(e, c, d, c->layers, fused, stream);
    /* The capture always ends, so the stream is usable again whatever failed inside it. */
    const bool ended = tool_cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    bool ok = issued && ended && graph &&
              tool_cuda_ok(cudaGraphInstantiate(graph_exec, graph, 0), "graph instantiate");
    if (graph) cudaGraphDestroy(graph);
    if (!ok) (void)cudaGetLastError();
    return ok;
}

/* One timed replay of `graph` after an L2 flush, in ms; < 0 on failure. */
static double timed_replay(const tool_exec *exec, cudaGraphExec_t graph, cudaStream_t stream,
                           const char *what) {
    const bool ok = exec->flush_cache() && exec->mark(0) &&
                    tool_cuda_ok(cudaGraphLaunch(graph, stream), what) && exec->mark(1) &&
                    exec->sync();
    return ok ? exec->elapsed_ms(0, 1) : -1.0;
}

void e2e_run_backend(msaidx_backend backend, msaidx_precision precision, e2e_config *c,
                     const e2e_data *d, const tool_exec *exec, long max_replays, bool fused,
                     e2e_result *out) {
    cudaStream_t stream = (cudaStream_t)exec->stream;
    e2e_engine engine;
    /* [0]: scores and top-k as separate calls; [1] (--fused): prefill layers as one call. */
    cudaGraphExec_t graphs[2] = {NULL, NULL};
    const int modes = fused ? 2 : 1;
    /* With --fused at least 4 rounds of both graphs, an even count, in the order 0 1, 1 0, 0 1,
     * ...: in one round the second replay is 1.05-1.10x slower on the H200 whichever graph runs
     * second (150K and 1M contexts, one replay each), so each graph takes each place equally. */
    const long capacity = fused && max_replays < 4 ? 4 : max_replays;
    double *times = calloc(2 * (size_t)capacity, sizeof *times);
    out->state = E2E_FAILED;
    out->why = "failed (see the messages above)";
    bool ok =
        times && engine_open(&engine, backend, precision, c, d, fused, stream, &out->resolved);
    if (!ok) {
        free(times);
        return;
    }
    /* One eager layer surfaces launch errors outside the graph, where they name their call. */
    for (int m = 0; ok && m < modes; ++m)
        ok = issue_forward(&engine, c, d, 1, m == 1, stream) &&
             tool_cuda_ok(cudaStreamSynchronize(stream), "eager layer") &&
             capture_forward(&engine, c, d, m == 1, stream, &graphs[m]);
    double warm_ms = 0;
    for (int m = 0; ok && m < modes; ++m) {
        const double ms = timed_replay(exec, graphs[m], stream, "warm-up replay");
        ok = ms >= 0;
        if (ms > warm_ms) warm_ms = ms;
    }
    if (ok) {
        long replays = warm_ms > 0 ? (long)(E2E_REPLAY_TARGET_S / (warm_ms * 1e-3)) : max_replays;
        replays = replays < 1 ? 1 : replays > max_replays ? max_replays : replays;
        if (fused) {
            replays = replays < 4 ? 4 : replays + replays % 2;
            if (replays > capacity) replays = capacity - capacity % 2;
        }
        for (long i = 0; ok && i < replays; ++i)
            for (int k = 0; ok && k < modes; ++k) {
                const int m = i % 2 ? modes - 1 - k : k;
                times[m * capacity + i] = timed_replay(exec, graphs[m], stream, "replay");
                ok = times[m * capacity + i] >= 0;
            }
        ok = ok && tool_ok(msaidx_plan_check(engine.prefill_plan, stream), "prefill plan check") &&
             (!c->decode ||
              tool_ok(msaidx_plan_check(engine.decode_plan, stream), "decode plan check"));
        if (ok) {
            out->state = E2E_OK;
            out->replays = (int)replays;
            out->ms_per_forward = tool_median(times, (int)replays);
            if (fused) out->fused_ms_per_forward = tool_median(times + capacity, (int)replays);
        }
    }
    for (int m = 0; m < modes; ++m)
        if (graphs[m]) cudaGraphExecDestroy(graphs[m]);
    (void)cudaGetLastError();
    engine_close(&engine);
    free(times);
}

#endif /* MSAIDX_WITH_CUDA */
