/* msaidx e2e: the engine's view of one indexer step of a MiniMax-M3-like forward (all sparse layers
 * of one mixed prefill + decode batch) captured as one CUDA graph, per backend choice. */
#include "tool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MSAIDX_WITH_CUDA
#include <cuda_runtime.h>
#endif

#define E2E_TOTAL_HEADS 4 /* index heads of the model; TP splits them */
#define E2E_MAX_LIST 16
#define E2E_MAX_BACKENDS 4
#define E2E_TOPK 16
/* Timed replays of one config stop near this much work (at least one after the warm-up). */
#define E2E_REPLAY_TARGET_S 0.1

static void e2e_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx e2e [options]\n"
        "\n"
        "Times the indexer's share of one forward step as an engine runs it: a ragged batch of "
        "one\n"
        "prefill chunk of P tokens at context C (prefix C - P) plus D decode rows at context C, "
        "for\n"
        "every sparse layer: plan the prefill and the decode batch once, then per layer prefill\n"
        "scores + decode scores + top-k of both, each layer with its own Q and its own key cache\n"
        "(so the L2 carries nothing between layers) over one shared scattered block table. The\n"
        "whole step is captured as one CUDA graph; after a warm-up replay, replays are timed with\n"
        "CUDA events (L2 flushed before each) and the median is reported as ms per forward.\n"
        "Each config's time is estimated first and configs over --max-config-seconds are skipped.\n"
        "\n"
        "options:\n"
        "  --tp LIST                 tensor-parallel degrees, H per GPU = %d / TP (default 1,2,4)\n"
        "  --prefill LIST            prefill chunk tokens P (default 512,2048,8192,32768)\n"
        "  --context LIST            context C incl. the chunk (default "
        "8192,32768,153600,1048576);\n"
        "                            pairs with P > C are left out\n"
        "  --decode N                decode rows D, each at context C (default 16)\n"
        "  --layers N                sparse layers (default 57)\n"
        "  --backends LIST           backend choices to compare (default auto,dense; speedups are\n"
        "                            of each over the last one)\n"
        "  --max-config-seconds X    skip a config whose estimated forward takes longer (default "
        "2)\n"
        "  --max-seconds X           stop starting configs after this much wall time (default 50)\n"
        "  --max-replays N           timed replays at most (default 10; fewer for long configs)\n"
        "  --prepare                 each layer first prepares its index Q/K from a BF16 "
        "projection\n"
        "                            (msaidx_index_prepare: norm, RoPE, E4M3 cast, key insert)\n"
        "  --fused                   also time each backend with the prefill layer as one\n"
        "                            msaidx_prefill_topk call without a score buffer (a fused\n"
        "                            column beside each backend's)\n"
        "  --precision P             default (persistent sums E4M3 with FP8 tensor cores) or "
        "exact\n"
        "                            (every backend); --fast-accumulation is the old spelling of\n"
        "                            --precision default\n"
        "  --json FILE               write every config's result as JSON\n"
        "  --markdown FILE           write the tables as Markdown\n"
        "  --seed N                  data seed (default 1)\n",
        E2E_TOTAL_HEADS);
}

typedef struct e2e_options {
    int32_t *tp, *prefill, *context;
    int num_tp, num_prefill, num_context;
    long decode, layers, max_replays, seed;
    double max_config_seconds, max_seconds;
    msaidx_precision precision;
    bool prepare, fused;
    msaidx_backend backends[E2E_MAX_BACKENDS];
    int num_backends;
    const char *json_path, *markdown_path;
} e2e_options;

static bool parse_seconds(const char *text, const char *option, double *value) {
    char *end = NULL;
    const double parsed = strtod(text, &end);
    if (end == text || *end || !(parsed > 0) || !isfinite(parsed)) {
        fprintf(stderr, "msaidx e2e: %s = '%s': expected a positive number of seconds\n", option,
                text);
        return false;
    }
    *value = parsed;
    return true;
}

static bool parse_backends(const char *text, e2e_options *o) {
    char *list = strdup(text), *save = NULL;
    bool ok = list != NULL;
    o->num_backends = 0;
    for (char *name = list ? strtok_r(list, ",", &save) : NULL; ok && name;
         name = strtok_r(NULL, ",", &save)) {
        msaidx_backend b;
        ok = tool_parse_backend(name, &b) && b != MSAIDX_BACKEND_CPU &&
             o->num_backends < E2E_MAX_BACKENDS;
        if (ok) o->backends[o->num_backends++] = b;
    }
    free(list);
    if (!ok || !o->num_backends)
        fprintf(stderr,
                "msaidx e2e: --backends %s: expected up to %d of auto, dense, split, persistent\n",
                text, E2E_MAX_BACKENDS);
    return ok && o->num_backends;
}

/* Replaces *values with the parsed list; every entry must lie in [lo, hi]. */
static bool parse_bounded_list(const char *text, const char *option, long lo, long hi,
                               int32_t **values, int *count) {
    int32_t *parsed = NULL;
    int n = 0;
    if (!tool_parse_list(text, option, &parsed, &n)) return false;
    for (int i = 0; i < n; ++i)
        if (parsed[i] < lo || parsed[i] > hi || n > E2E_MAX_LIST) {
            fprintf(stderr, "msaidx e2e: %s = '%s': expected at most %d values in [%ld, %ld]\n",
                    option, text, E2E_MAX_LIST, lo, hi);
            free(parsed);
            return false;
        }
    free(*values);
    *values = parsed;
    *count = n;
    return true;
}

static bool set_default_list(const int32_t *defaults, int count, int32_t **values, int *n) {
    *values = malloc(sizeof(int32_t) * (size_t)count);
    if (!*values) return false;
    memcpy(*values, defaults, sizeof(int32_t) * (size_t)count);
    *n = count;
    return true;
}

static void free_options(e2e_options *o) {
    free(o->tp);
    free(o->prefill);
    free(o->context);
}

/* -1: go on; otherwise the exit status. */
static int parse_options(int argc, char **argv, e2e_options *o) {
    *o = (e2e_options){.decode = 16,
                       .layers = 57,
                       .max_replays = 10,
                       .seed = 1,
                       .max_config_seconds = 2.0,
                       .max_seconds = 50.0,
                       .num_backends = 2,
                       .backends = {MSAIDX_BACKEND_AUTO, MSAIDX_BACKEND_DENSE}};
    if (!set_default_list((const int32_t[]){1, 2, 4}, 3, &o->tp, &o->num_tp) ||
        !set_default_list((const int32_t[]){512, 2048, 8192, 32768}, 4, &o->prefill,
                          &o->num_prefill) ||
        !set_default_list((const int32_t[]){8192, 32768, 153600, 1048576}, 4, &o->context,
                          &o->num_context))
        return 1;
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            e2e_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--fast-accumulation")) {
            o->precision = MSAIDX_PRECISION_DEFAULT;
            continue;
        }
        if (!strcmp(a, "--fused")) {
            o->fused = true;
            continue;
        }
        if (!strcmp(a, "--prepare")) {
            o->prepare = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr,
                    "msaidx e2e: unknown option or missing value: %s (see msaidx e2e --help)\n", a);
            return 2;
        }
        ++i;
        bool ok = true;
        if (!strcmp(a, "--tp")) {
            ok = parse_bounded_list(v, a, 1, E2E_TOTAL_HEADS, &o->tp, &o->num_tp);
            for (int t = 0; ok && t < o->num_tp; ++t)
                if (E2E_TOTAL_HEADS % o->tp[t]) {
                    fprintf(stderr, "msaidx e2e: --tp %d does not divide the %d index heads\n",
                            o->tp[t], E2E_TOTAL_HEADS);
                    ok = false;
                }
        } else if (!strcmp(a, "--precision"))
            ok = tool_parse_precision(v, &o->precision);
        else if (!strcmp(a, "--prefill"))
            ok = parse_bounded_list(v, a, 1, 1 << 20, &o->prefill, &o->num_prefill);
        else if (!strcmp(a, "--context"))
            ok = parse_bounded_list(v, a, 1, 1 << 24, &o->context, &o->num_context);
        else if (!strcmp(a, "--decode"))
            ok = tool_parse_int(v, a, 0, 4096, &o->decode);
        else if (!strcmp(a, "--layers"))
            ok = tool_parse_int(v, a, 1, 1024, &o->layers);
        else if (!strcmp(a, "--max-replays"))
            ok = tool_parse_int(v, a, 1, 1000, &o->max_replays);
        else if (!strcmp(a, "--seed"))
            ok = tool_parse_int(v, a, 0, 1L << 48, &o->seed);
        else if (!strcmp(a, "--backends"))
            ok = parse_backends(v, o);
        else if (!strcmp(a, "--max-config-seconds"))
            ok = parse_seconds(v, a, &o->max_config_seconds);
        else if (!strcmp(a, "--max-seconds"))
            ok = parse_seconds(v, a, &o->max_seconds);
        else if (!strcmp(a, "--json"))
            o->json_path = v;
        else if (!strcmp(a, "--markdown"))
            o->markdown_path = v;
        else {
            fprintf(stderr, "msaidx e2e: unknown option %s (see msaidx e2e --help)\n", a);
            return 2;
        }
        if (!ok) return 2;
    }
    return -1;
}

#ifdef MSAIDX_WITH_CUDA

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
    bool prepare; /* --prepare */
    e2e_result results[E2E_MAX_BACKENDS];
} e2e_config;

/*
 * Estimated seconds of one forward, a model fitted to the 2026-11-30 H200 bench of the three
 * backends: persistent scores at ~500 TFLOP/s; dense at ~180 TFLOP/s, but one CTA walks a query
 * tile's whole context (~20 ns per key) so few queries at long context take that long; decode
 * streams its keys; top-k reads its scores at ~0.22 TB/s; ~6 us per launch.
 */
static double estimate_seconds(msaidx_backend backend, const e2e_config *c) {
    const double P = c->prefill, C = c->context, D = c->decode, H = c->heads;
    const double prefill_pairs = P * (C - P) + P * (P + 1) / 2, decode_pairs = D * C;
    const double prefill_cells = prefill_pairs / TOOL_PAGE + P, decode_cells = D * c->pages;
    const double prefill_flop = 2.0 * TOOL_HEAD_DIM * H * prefill_pairs;
    double prefill_s;
    if (backend == MSAIDX_BACKEND_PERSISTENT)
        prefill_s = prefill_flop / 500e12;
    else if (backend == MSAIDX_BACKEND_SPLIT)
        prefill_s = prefill_flop / 200e12;
    else
        prefill_s = fmax(prefill_flop / 180e12, C * 2e-8 * fmax(1.0, P * H / 8192.0));
    const double decode_s =
        decode_pairs * TOOL_HEAD_DIM / 3e12 + 2.0 * TOOL_HEAD_DIM * H * decode_pairs / 150e12;
    const double topk_s = (prefill_cells + decode_cells) * H * sizeof(float) / 0.22e12;
    /* --prepare: BF16 (H + 1) x 128 in, E4M3 out per token at ~1.5 TB/s. */
    const double prepare_s =
        c->prepare ? (P + D) * (H + 1) * TOOL_HEAD_DIM * 3 / 1.5e12 + 2 * 6e-6 : 0.0;
    return (double)c->layers * (prefill_s + decode_s + topk_s + prepare_s + 4 * 6e-6);
}

static bool cuda_ok(cudaError_t error, const char *what) {
    if (error == cudaSuccess) return true;
    fprintf(stderr, "msaidx e2e: %s: %s (%s)\n", what, cudaGetErrorString(error),
            cudaGetErrorName(error));
    return false;
}

/* Device buffers of one (TP, C, P) config, shared by the backends compared on it. */
typedef struct e2e_data {
    uint8_t *k_cache, *q_prefill, *q_decode; /* [layers][...] */
    float *scores_prefill, *scores_decode;
    int32_t *topk_prefill, *topk_decode;
    int32_t *cu_prefill, *seq_prefill, *bt_prefill, *cu_decode, *seq_decode, *bt_decode;
    size_t k_layer_bytes, q_prefill_layer_bytes, q_decode_layer_bytes;
    /* --prepare: BF16 rows [q heads | key] of the P + D new tokens per layer, the norm weights
     * (q then k), a cos/sin table, and the new tokens' positions and slots. */
    uint16_t *projection, *norm_weights;
    float *cos_sin;
    int64_t *positions, *slots;
    size_t projection_layer_elems;
} e2e_data;

static void data_free(e2e_data *d) {
    void *buffers[] = {d->k_cache,       d->q_prefill,    d->q_decode,     d->scores_prefill,
                       d->scores_decode, d->topk_prefill, d->topk_decode,  d->cu_prefill,
                       d->seq_prefill,   d->bt_prefill,   d->cu_decode,    d->seq_decode,
                       d->bt_decode,     d->projection,   d->norm_weights, d->cos_sin,
                       d->positions,     d->slots};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) cudaFree(buffers[i]);
    *d = (e2e_data){0};
}

static bool device_alloc(void *pointer, size_t bytes, const char *what) {
    void **p = (void **)pointer;
    *p = NULL;
    return cuda_ok(cudaMalloc(p, bytes ? bytes : 1), what);
}

static bool upload(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
    return cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
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
            ok = cuda_ok(cudaMemcpyAsync(d->projection + l * T * row, d->projection,
                                         sizeof(uint16_t) * T * row, cudaMemcpyDeviceToDevice,
                                         stream),
                         "prepare projection copy");
        for (size_t i = 0; i < 2 * TOOL_HEAD_DIM; ++i)
            values[i] = (float)(0.5 * tool_rng_uniform(&rng));
        msaidx_bf16_from_float(values, bf16, 2 * TOOL_HEAD_DIM);
        ok = ok && upload(d->norm_weights, bf16, sizeof(uint16_t) * 2 * TOOL_HEAD_DIM, stream) &&
             cuda_ok(cudaStreamSynchronize(stream),
                     "prepare upload"); /* the host buffers are reused */
        double inverse_frequency[32];   /* MiniMax-M3: theta 5e6 */
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
             cuda_ok(cudaStreamSynchronize(stream), "prepare upload");
    } else if (!values || !bf16 || !positions || !slots) {
        fprintf(stderr, "msaidx e2e: out of host memory for the --prepare inputs\n");
    }
    free(values);
    free(bf16);
    free(positions);
    free(slots);
    return ok;
}

static bool data_alloc(e2e_data *d, const e2e_config *c, uint64_t seed, cudaStream_t stream) {
    *d = (e2e_data){0};
    const size_t L = (size_t)c->layers, P = (size_t)c->prefill, D = (size_t)c->decode,
                 H = (size_t)c->heads;
    const size_t pages = (size_t)c->pages;
    d->k_layer_bytes = pages * TOOL_PAGE * TOOL_HEAD_DIM;
    d->q_prefill_layer_bytes = P * H * TOOL_HEAD_DIM;
    d->q_decode_layer_bytes = D * H * TOOL_HEAD_DIM;
    int32_t *bt_host = malloc(sizeof(int32_t) * pages * (D + 1));
    int32_t *cu_decode = malloc(sizeof(int32_t) * (D + 1)),
            *seq_decode = malloc(sizeof(int32_t) * (D + 1));
    const int32_t cu_prefill[2] = {0, c->prefill};
    bool ok = bt_host && cu_decode && seq_decode &&
              device_alloc(&d->k_cache, L * d->k_layer_bytes, "key caches") &&
              device_alloc(&d->q_prefill, L * d->q_prefill_layer_bytes, "prefill Q") &&
              device_alloc(&d->q_decode, L * d->q_decode_layer_bytes, "decode Q") &&
              device_alloc(&d->scores_prefill, P * H * pages * sizeof(float), "prefill scores") &&
              device_alloc(&d->scores_decode, D * H * pages * sizeof(float), "decode scores") &&
              device_alloc(&d->topk_prefill, P * H * E2E_TOPK * sizeof(int32_t), "prefill top-k") &&
              device_alloc(&d->topk_decode, D * H * E2E_TOPK * sizeof(int32_t), "decode top-k") &&
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
        for (size_t r = 0; r < D; ++r) seq_decode[r] = c->context;
        ok = tool_gpu_fill_random(d->k_cache, L * d->k_layer_bytes, seed * 3 + 1, stream) &&
             tool_gpu_fill_random(d->q_prefill, L * d->q_prefill_layer_bytes, seed * 3 + 2,
                                  stream) &&
             tool_gpu_fill_random(d->q_decode, L * d->q_decode_layer_bytes, seed * 3 + 3, stream) &&
             upload(d->cu_prefill, cu_prefill, sizeof cu_prefill, stream) &&
             upload(d->seq_prefill, &c->context, sizeof(int32_t), stream) &&
             upload(d->bt_prefill, bt_host, sizeof(int32_t) * pages, stream) &&
             upload(d->cu_decode, cu_decode, sizeof(int32_t) * (D + 1), stream) &&
             (!D || upload(d->seq_decode, seq_decode, sizeof(int32_t) * D, stream)) &&
             (!D || upload(d->bt_decode, bt_host + pages, sizeof(int32_t) * pages * D, stream)) &&
             cuda_ok(cudaStreamSynchronize(stream), "data fill") &&
             (!c->prepare || prepare_alloc(d, c, bt_host, seed, stream));
    } else if (!bt_host || !cu_decode || !seq_decode) {
        fprintf(stderr, "msaidx e2e: out of host memory for the metadata\n");
    }
    free(bt_host);
    free(cu_decode);
    free(seq_decode);
    if (!ok) data_free(d);
    return ok;
}

/* A context, its two plans and their workspaces. */
typedef struct e2e_engine {
    msaidx_context *context;
    msaidx_plan *prefill_plan, *decode_plan;
    void *prefill_workspace, *decode_workspace;
    size_t prefill_workspace_bytes, decode_workspace_bytes;
    const int32_t *prefill_nvp, *decode_nvp;
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
    desc->pitch = c->pages;
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
         tool_ok(msaidx_plan_check(e->prefill_plan, stream), "prefill plan check") &&
         tool_ok(msaidx_plan_nvp(e->prefill_plan, &e->prefill_nvp), "prefill nvp");
    if (ok && c->decode)
        ok = tool_ok(msaidx_plan_batch(e->decode_plan, d->cu_decode, d->seq_decode, d->bt_decode,
                                       e->decode_workspace, e->decode_workspace_bytes, stream),
                     "decode plan batch") &&
             tool_ok(msaidx_plan_check(e->decode_plan, stream), "decode plan check") &&
             tool_ok(msaidx_plan_nvp(e->decode_plan, &e->decode_nvp), "decode nvp");
    if (!ok) engine_close(e);
    return ok;
}

/* --prepare: layer `layer`'s index Q (prefill chunk, then decode rows) and the chunk's keys from
 * its BF16 projection rows. */
static bool issue_prepare(const e2e_engine *e, const e2e_config *c, const e2e_data *d,
                          int32_t layer, cudaStream_t stream) {
    const int64_t row = (int64_t)(c->heads + 1) * TOOL_HEAD_DIM;
    const uint16_t *projection = d->projection + (size_t)layer * d->projection_layer_elems;
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    a.num_tokens = c->prefill;
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
    a.q_out = d->q_prefill + (size_t)layer * d->q_prefill_layer_bytes;
    bool ok = tool_ok(msaidx_index_prepare(e->context, &a, stream), "index prepare (prefill)");
    if (ok && c->decode) {
        a.num_tokens = c->decode;
        a.q_in = projection + (size_t)c->prefill * (size_t)row;
        a.k_in = (const uint16_t *)a.q_in + (size_t)c->heads * TOOL_HEAD_DIM;
        a.positions = d->positions + c->prefill;
        a.slot_mapping = d->slots + c->prefill;
        a.q_out = d->q_decode + (size_t)layer * d->q_decode_layer_bytes;
        ok = tool_ok(msaidx_index_prepare(e->context, &a, stream), "index prepare (decode)");
    }
    return ok;
}

/* The plans and then every layer's (--prepare: preparation,) scores and top-k, issued on the
 * stream; `fused`: the prefill scores and top-k as one msaidx_prefill_topk without scores. */
static bool issue_forward(const e2e_engine *e, const e2e_config *c, const e2e_data *d,
                          int32_t layers, bool fused, cudaStream_t stream) {
    bool ok =
        tool_ok(msaidx_plan_batch(e->prefill_plan, d->cu_prefill, d->seq_prefill, d->bt_prefill,
                                  e->prefill_workspace, e->prefill_workspace_bytes, stream),
                "prefill plan batch");
    if (ok && c->decode)
        ok = tool_ok(msaidx_plan_batch(e->decode_plan, d->cu_decode, d->seq_decode, d->bt_decode,
                                       e->decode_workspace, e->decode_workspace_bytes, stream),
                     "decode plan batch");
    for (int32_t l = 0; ok && l < layers; ++l) {
        const uint8_t *k = d->k_cache + (size_t)l * d->k_layer_bytes;
        if (c->prepare && !issue_prepare(e, c, d, l, stream)) return false;
        const uint8_t *q = d->q_prefill + (size_t)l * d->q_prefill_layer_bytes;
        if (fused)
            ok = tool_ok(msaidx_prefill_topk(e->prefill_plan, q, k, &e->fused, NULL,
                                             d->topk_prefill, stream),
                         "prefill_topk");
        else
            ok = tool_ok(msaidx_prefill_scores(e->prefill_plan, q, k, d->scores_prefill, stream),
                         "prefill scores") &&
                 tool_ok(msaidx_topk_select(e->context, d->scores_prefill, c->pages, e->prefill_nvp,
                                            c->prefill, d->topk_prefill, stream),
                         "prefill top-k");
        if (ok && c->decode)
            ok = tool_ok(msaidx_decode_scores(e->decode_plan,
                                              d->q_decode + (size_t)l * d->q_decode_layer_bytes, k,
                                              d->scores_decode, stream),
                         "decode scores") &&
                 tool_ok(msaidx_topk_select(e->context, d->scores_decode, c->pages, e->decode_nvp,
                                            c->decode, d->topk_decode, stream),
                         "decode top-k");
    }
    return ok;
}

static bool capture_forward(const e2e_engine *e, const e2e_config *c, const e2e_data *d, bool fused,
                            cudaStream_t stream, cudaGraphExec_t *graph_exec) {
    cudaGraph_t graph = NULL;
    *graph_exec = NULL;
    if (!cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture"))
        return false;
    const bool issued = issue_forward(e, c, d, c->layers, fused, stream);
    /* The capture always ends, so the stream is usable again whatever failed inside it. */
    const bool ended = cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    bool ok = issued && ended && graph &&
              cuda_ok(cudaGraphInstantiate(graph_exec, graph, 0), "graph instantiate");
    if (graph) cudaGraphDestroy(graph);
    if (!ok) (void)cudaGetLastError();
    return ok;
}

/* One backend on one config: engine, one eager layer, capture, warm-up, timed replays (`fused`:
 * the prefill layers through msaidx_prefill_topk). */
static void run_backend(msaidx_backend backend, msaidx_precision precision, e2e_config *c,
                        const e2e_data *d, const tool_exec *exec, long max_replays, bool fused,
                        e2e_result *out) {
    cudaStream_t stream = (cudaStream_t)exec->stream;
    e2e_engine engine;
    cudaGraphExec_t graph_exec = NULL;
    double *times = calloc((size_t)max_replays, sizeof *times);
    out->state = E2E_FAILED;
    out->why = "failed (see the messages above)";
    bool ok =
        times && engine_open(&engine, backend, precision, c, d, fused, stream, &out->resolved);
    if (!ok) {
        free(times);
        return;
    }
    /* One eager layer surfaces launch errors outside the graph, where they name their call. */
    ok = issue_forward(&engine, c, d, 1, fused, stream) &&
         cuda_ok(cudaStreamSynchronize(stream), "eager layer") &&
         capture_forward(&engine, c, d, fused, stream, &graph_exec) && exec->flush_cache() &&
         exec->mark(0) && cuda_ok(cudaGraphLaunch(graph_exec, stream), "warm-up replay") &&
         exec->mark(1) && exec->sync();
    if (ok) {
        const double warm_s = exec->elapsed_ms(0, 1) * 1e-3;
        long replays = warm_s > 0 ? (long)(E2E_REPLAY_TARGET_S / warm_s) : max_replays;
        replays = replays < 1 ? 1 : replays > max_replays ? max_replays : replays;
        for (long i = 0; ok && i < replays; ++i) {
            ok = exec->flush_cache() && exec->mark(0) &&
                 cuda_ok(cudaGraphLaunch(graph_exec, stream), "replay") && exec->mark(1) &&
                 exec->sync();
            if (ok) times[i] = exec->elapsed_ms(0, 1);
        }
        ok = ok && tool_ok(msaidx_plan_check(engine.prefill_plan, stream), "prefill plan check") &&
             (!c->decode ||
              tool_ok(msaidx_plan_check(engine.decode_plan, stream), "decode plan check"));
        if (ok) {
            out->state = E2E_OK;
            out->replays = (int)replays;
            out->ms_per_forward = tool_median(times, (int)replays);
        }
    }
    if (graph_exec) cudaGraphExecDestroy(graph_exec);
    (void)cudaGetLastError();
    engine_close(&engine);
    free(times);
}

static const char *backend_label(const e2e_result *r, msaidx_backend asked, char *text,
                                 size_t size) {
    if (asked == MSAIDX_BACKEND_AUTO && r->state == E2E_OK)
        snprintf(text, size, "auto(%s)", msaidx_backend_name(r->resolved));
    else
        snprintf(text, size, "%s", msaidx_backend_name(asked));
    return text;
}

/* What the e2e writers read. */
typedef struct e2e_report {
    const e2e_options *o;
    const char *device;
    const e2e_config *configs;
    int num_configs;
} e2e_report;

static void write_json(FILE *f, const void *context) {
    const e2e_report *report = context;
    const e2e_options *o = report->o;
    fprintf(f, "{\n  \"device\": ");
    tool_json_string(f, report->device);
    fprintf(f,
            ",\n  \"precision\": \"%s\",\n  \"layers\": %ld,\n  \"decode_rows\": %ld,\n"
            "  \"total_heads\": %d,\n",
            tool_precision_name(o->precision), o->layers, o->decode, E2E_TOTAL_HEADS);
    fprintf(f, "  \"max_config_seconds\": %.3f,\n  \"backends\": [", o->max_config_seconds);
    for (int b = 0; b < o->num_backends; ++b)
        fprintf(f, "%s\"%s\"", b ? ", " : "", msaidx_backend_name(o->backends[b]));
    fprintf(f, "],\n  \"configs\": [\n");
    for (int i = 0; i < report->num_configs; ++i) {
        const e2e_config *c = &report->configs[i];
        fprintf(f,
                "    {\"tp\": %d, \"heads\": %d, \"prefill\": %d, \"context\": %d, \"decode\": %d, "
                "\"results\": {",
                c->tp, c->heads, c->prefill, c->context, c->decode);
        for (int b = 0; b < o->num_backends; ++b) {
            const e2e_result *r = &c->results[b];
            fprintf(f, "%s\"%s\": {\"state\": \"%s\", \"estimate_s\": %.4f", b ? ", " : "",
                    msaidx_backend_name(o->backends[b]),
                    r->state == E2E_OK        ? "ok"
                    : r->state == E2E_SKIPPED ? "skipped"
                                              : "failed",
                    r->estimate_s);
            if (r->state == E2E_OK)
                fprintf(f, ", \"resolved\": \"%s\", \"ms_per_forward\": %.4f, \"replays\": %d",
                        msaidx_backend_name(r->resolved), r->ms_per_forward, r->replays);
            if (r->state == E2E_OK && r->fused_ms_per_forward > 0)
                fprintf(f, ", \"fused_ms_per_forward\": %.4f", r->fused_ms_per_forward);
            else
                fprintf(f, ", \"why\": \"%s\"", r->why ? r->why : "");
            fprintf(f, "}");
        }
        fprintf(f, "}}%s\n", i + 1 < report->num_configs ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
}

/* ms per forward of each backend and the speedup of each over the last one, per TP. */
static void write_tables(FILE *f, const e2e_options *o, const e2e_config *configs, int num_configs,
                         bool markdown) {
    const int base = o->num_backends - 1;
    for (int t = 0; t < o->num_tp; ++t) {
        const int tp = o->tp[t];
        if (markdown)
            fprintf(f,
                    "\n### TP %d (H = %d per GPU), %ld layers, D = %ld decode rows\n\n| prefill P "
                    "| context C |",
                    tp, E2E_TOTAL_HEADS / tp, o->layers, o->decode);
        else
            fprintf(f,
                    "\nTP %d (H = %d per GPU), %ld layers, D = %ld decode rows: ms per "
                    "forward\n%9s %9s",
                    tp, E2E_TOTAL_HEADS / tp, o->layers, o->decode, "prefill", "context");
        for (int b = 0; b < o->num_backends; ++b) {
            fprintf(f, markdown ? " %s ms |" : " %22s", msaidx_backend_name(o->backends[b]));
            if (o->fused) {
                char header[64];
                snprintf(header, sizeof header, "%s fused", msaidx_backend_name(o->backends[b]));
                fprintf(f, markdown ? " %s ms |" : " %22s", header);
            }
        }
        for (int b = 0; b < base; ++b) {
            char header[64];
            snprintf(header, sizeof header, "%s / %s", msaidx_backend_name(o->backends[b]),
                     msaidx_backend_name(o->backends[base]));
            fprintf(f, markdown ? " %s speedup |" : " %22s", header);
        }
        fprintf(f, "\n");
        if (markdown) {
            fprintf(f, "|---:|---:|");
            const int columns = (o->fused ? 3 : 2) * o->num_backends - 1;
            for (int b = 0; b < columns; ++b) fprintf(f, "---:|");
            fprintf(f, "\n");
        }
        for (int i = 0; i < num_configs; ++i) {
            const e2e_config *c = &configs[i];
            if (c->tp != tp) continue;
            fprintf(f, markdown ? "| %d | %d |" : "%9d %9d", c->prefill, c->context);
            for (int b = 0; b < o->num_backends; ++b) {
                const e2e_result *r = &c->results[b];
                char cell[64];
                if (r->state == E2E_OK)
                    snprintf(cell, sizeof cell, "%.2f", r->ms_per_forward);
                else if (r->state == E2E_SKIPPED)
                    snprintf(cell, sizeof cell, "skipped (est. %.1f s)", r->estimate_s);
                else
                    snprintf(cell, sizeof cell, "failed");
                fprintf(f, markdown ? " %s |" : " %22s", cell);
                if (o->fused) {
                    if (r->state == E2E_OK && r->fused_ms_per_forward > 0)
                        snprintf(cell, sizeof cell, "%.2f", r->fused_ms_per_forward);
                    else
                        snprintf(cell, sizeof cell, "-");
                    fprintf(f, markdown ? " %s |" : " %22s", cell);
                }
            }
            for (int b = 0; b < base; ++b) {
                const e2e_result *r = &c->results[b], *against = &c->results[base];
                char cell[32] = "-";
                if (r->state == E2E_OK && against->state == E2E_OK && r->ms_per_forward > 0)
                    snprintf(cell, sizeof cell, "%.2fx",
                             against->ms_per_forward / r->ms_per_forward);
                fprintf(f, markdown ? " %s |" : " %22s", cell);
            }
            fprintf(f, "\n");
        }
    }
}

static void write_markdown(FILE *f, const void *context) {
    const e2e_report *report = context;
    const e2e_options *o = report->o;
    fprintf(
        f,
        "Device: %s\n\nIndexer time per forward step (ms, median of CUDA-graph replays, L2 flushed "
        "before each): plan + %ld x (prefill scores + decode scores + top-k of both) for one "
        "prefill "
        "chunk of P tokens at context C plus %ld decode rows at C; speedup = time of the last "
        "backend / "
        "time of the other%s. Precision: %s.\n",
        report->device, o->layers, o->decode,
        o->fused ? "; fused = the same step with each prefill layer's scores and top-k as one "
                   "msaidx_prefill_topk call without a score buffer"
                 : "",
        o->precision == MSAIDX_PRECISION_DEFAULT
            ? "default (persistent sums E4M3 with FP8 tensor cores)"
            : "exact (FP32 sums of exact products on every backend)");
    write_tables(f, o, report->configs, report->num_configs, true);
}

/* Whether a warm-up and a timed replay of the estimated length would run past the wall-time budget.
 */
static bool over_budget(const e2e_result *r, double start_ms, double max_seconds) {
    return (tool_now_ms() - start_ms) * 1e-3 + 2 * r->estimate_s > max_seconds;
}

static int run_e2e(const e2e_options *o) {
    const tool_exec *exec = tool_gpu_exec();
    if (!exec) return 1;
    char device[512];
    tool_gpu_describe(device, sizeof device);
    int capacity = o->num_tp * o->num_prefill * o->num_context, num_configs = 0;
    e2e_config *configs = calloc((size_t)(capacity > 0 ? capacity : 1), sizeof *configs);
    if (!configs) return 1;
    msaidx_config probe;
    msaidx_config_init(&probe);
    probe.device = 0;
    printf(
        "msaidx e2e: %s\n%ld layers, one prefill chunk P at context C + %ld decode rows at C, "
        "one CUDA graph per forward, median of up to %ld replays (L2 flushed), configs estimated "
        "over %.1f s skipped; %s precision%s\n",
        device, o->layers, o->decode, o->max_replays, o->max_config_seconds,
        tool_precision_name(o->precision), o->prepare ? "; each layer prepares its Q/K first" : "");
    for (int t = 0; t < o->num_tp; ++t)
        for (int ci = 0; ci < o->num_context; ++ci)
            for (int pi = 0; pi < o->num_prefill; ++pi) {
                if (o->prefill[pi] > o->context[ci]) continue;
                e2e_config *c = &configs[num_configs++];
                c->tp = o->tp[t];
                c->heads = E2E_TOTAL_HEADS / c->tp;
                c->prefill = o->prefill[pi];
                c->context = o->context[ci];
                c->decode = (int32_t)o->decode;
                c->layers = (int32_t)o->layers;
                c->pages = (c->context + TOOL_PAGE - 1) / TOOL_PAGE;
                c->prepare = o->prepare;
            }
    /* Estimates first, so the expected wall time is known before anything runs. */
    double expected_s = 0.0;
    int runs = 0, over_cap = 0;
    for (int i = 0; i < num_configs; ++i) {
        e2e_config *c = &configs[i];
        probe.num_heads = c->heads;
        for (int b = 0; b < o->num_backends; ++b) {
            msaidx_backend estimated_as = o->backends[b];
            if (estimated_as == MSAIDX_BACKEND_AUTO)
                estimated_as =
                    msaidx_backend_supported(MSAIDX_BACKEND_PERSISTENT, &probe) == MSAIDX_SUCCESS
                        ? MSAIDX_BACKEND_PERSISTENT
                        : MSAIDX_BACKEND_DENSE;
            const double estimate = c->results[b].estimate_s = estimate_seconds(estimated_as, c);
            if (estimate > o->max_config_seconds) {
                ++over_cap;
                continue;
            }
            const double replays =
                fmin(fmax(floor(E2E_REPLAY_TARGET_S / estimate), 1.0), (double)o->max_replays);
            expected_s += estimate * (1.0 + replays);
            ++runs;
        }
    }
    printf("%d config x backend runs, about %.0f s of replays expected; %d over "
           "--max-config-seconds\n",
           runs, expected_s, over_cap);
    fflush(stdout);
    const double start_ms = tool_now_ms();
    for (int i = 0; i < num_configs; ++i) {
        e2e_config *c = &configs[i];
        bool any = false;
        for (int b = 0; b < o->num_backends; ++b) {
            e2e_result *r = &c->results[b];
            if (r->estimate_s > o->max_config_seconds) {
                r->state = E2E_SKIPPED;
                r->why = "estimate over --max-config-seconds";
            } else {
                any = any || !over_budget(r, start_ms, o->max_seconds);
            }
        }
        printf("TP %d H %d P %6d C %7d:", c->tp, c->heads, c->prefill, c->context);
        fflush(stdout);
        e2e_data data = {0};
        bool data_ready = false;
        if (any) {
            data_ready =
                data_alloc(&data, c, (uint64_t)o->seed + (uint64_t)i, (cudaStream_t)exec->stream);
            if (!data_ready) (void)cudaGetLastError();
        }
        for (int b = 0; b < o->num_backends; ++b) {
            e2e_result *r = &c->results[b];
            char label[64];
            /* Not skipped by its estimate: failed allocation, the wall-time budget, or a run. */
            if (r->state != E2E_SKIPPED && any && !data_ready) {
                r->state = E2E_FAILED;
                r->why = "allocating or filling the buffers failed";
            } else if (r->state != E2E_SKIPPED &&
                       (!data_ready || over_budget(r, start_ms, o->max_seconds))) {
                r->state = E2E_SKIPPED;
                r->why = "--max-seconds reached";
            } else if (r->state != E2E_SKIPPED) {
                const double before_ms = tool_now_ms();
                run_backend(o->backends[b], o->precision, c, &data, exec, o->max_replays, false, r);
                if (r->state == E2E_OK)
                    printf("  %s %.2f ms (%d replays, est. %.2f ms, %.1f s wall)",
                           backend_label(r, o->backends[b], label, sizeof label), r->ms_per_forward,
                           r->replays, r->estimate_s * 1e3, (tool_now_ms() - before_ms) * 1e-3);
                if (r->state == E2E_OK && o->fused) {
                    e2e_result fused = *r;
                    run_backend(o->backends[b], o->precision, c, &data, exec, o->max_replays, true,
                                &fused);
                    if (fused.state == E2E_OK) {
                        r->fused_ms_per_forward = fused.ms_per_forward;
                        printf(", fused %.2f ms", fused.ms_per_forward);
                    } else {
                        printf(", fused failed");
                    }
                }
            }
            if (r->state == E2E_SKIPPED)
                printf("  %s skipped (estimated %.1f s%s)", msaidx_backend_name(o->backends[b]),
                       r->estimate_s,
                       r->estimate_s > o->max_config_seconds ? "" : "; --max-seconds reached");
            else if (r->state == E2E_FAILED)
                printf("  %s failed", msaidx_backend_name(o->backends[b]));
            fflush(stdout);
        }
        printf("\n");
        data_free(&data);
    }
    printf("\nwall %.1f s\n", (tool_now_ms() - start_ms) * 1e-3);
    write_tables(stdout, o, configs, num_configs, false);
    const e2e_report report = {o, device, configs, num_configs};
    bool written = true;
    if (o->json_path)
        written = tool_write_file("e2e", o->json_path, write_json, &report) && written;
    if (o->markdown_path)
        written = tool_write_file("e2e", o->markdown_path, write_markdown, &report) && written;
    free(configs);
    return written ? 0 : 1;
}

#endif /* MSAIDX_WITH_CUDA */

int cmd_e2e(int argc, char **argv) {
    e2e_options o;
    int parsed = parse_options(argc, argv, &o);
    if (parsed >= 0) {
        free_options(&o);
        return parsed;
    }
    int status = 0;
    if (!tool_output_writable("e2e", o.json_path) ||
        !tool_output_writable("e2e", o.markdown_path)) {
        status = 1;
    } else if (tool_pick_gpu()) {
#ifdef MSAIDX_WITH_CUDA
        status = run_e2e(&o);
#endif
    } else {
        char why[512];
        tool_no_gpu_reason(why, sizeof why);
        printf("e2e: needs a CUDA device (%s); nothing to do\n", why);
    }
    free_options(&o);
    return status;
}
