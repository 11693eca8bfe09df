/* msaidx bench --decode: decode as an engine runs it, on the grid of the vLLM Triton decode
 * reference (dtype x H x requests x context, one query token per request), per-layer decode
 * scores + top-16 timed as CUDA-graph replays, the plan timed apart, against the reference and
 * against a plain read of the same key bytes under the same L2 flush. */
#include "tool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DECODE_DEFAULT_REFERENCE "bench/shapes/h200_vllm_triton_decode.tsv"

typedef struct decode_options {
    long repeat;
    msaidx_backend backend;
    const char *reference_path, *json_path, *markdown_path;
} decode_options;

static void decode_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx bench --decode [options]\n"
        "\n"
        "The decode grid of the vLLM Triton reference: dtype e4m3/bf16 x H 1,4 x 1,16,64 requests "
        "x\n"
        "context 8K,32K,128K,1M, one query token per request, pitch 8192, scattered pages. Per\n"
        "configuration: the plan (msaidx_plan_batch) replayed as a CUDA graph; one layer\n"
        "(decode_scores + topk_select) and the scorer alone replayed as graphs; a plain read of\n"
        "the batch's key pages (16-byte loads). Each is timed with CUDA events after an L2 flush,\n"
        "two kinds: memset (writing 2 x L2, as the reference) and read (reading 2 x L2);\n"
        "medians of --repeat runs. Ratios: Triton / layer (speedup, memset flush as the\n"
        "reference) and layer / read under each flush.\n"
        "\n"
        "options:\n"
        "  --repeat N        timed replays per measurement (default 20)\n"
        "  --backend NAME    auto (default), dense, split or persistent\n"
        "  --reference FILE  the Triton reference (default " DECODE_DEFAULT_REFERENCE ")\n"
        "  --json FILE       write all numbers as JSON\n"
        "  --markdown FILE   write the table as Markdown\n");
}

static int parse_decode_options(int argc, char **argv, decode_options *o) {
    *o = (decode_options){
        .repeat = 20, .backend = MSAIDX_BACKEND_AUTO, .reference_path = DECODE_DEFAULT_REFERENCE};
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--decode")) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            decode_usage(stdout);
            return 0;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "msaidx bench --decode: unknown option or missing value: %s\n", a);
            return 2;
        }
        ++i;
        bool ok = true;
        if (!strcmp(a, "--repeat"))
            ok = tool_parse_int(v, a, 1, 100000, &o->repeat);
        else if (!strcmp(a, "--backend"))
            ok = tool_parse_backend(v, &o->backend);
        else if (!strcmp(a, "--reference"))
            o->reference_path = v;
        else if (!strcmp(a, "--json"))
            o->json_path = v;
        else if (!strcmp(a, "--markdown"))
            o->markdown_path = v;
        else {
            fprintf(stderr,
                    "msaidx bench --decode: unknown option %s (see msaidx bench --decode --help)\n",
                    a);
            return 2;
        }
        if (!ok) return 2;
    }
    return -1;
}

#ifdef MSAIDX_WITH_CUDA
#include <cuda_runtime.h>

#define DECODE_PITCH 8192 /* vLLM's score pitch: 1M tokens */
#define DECODE_TOPK 16

static const msaidx_dtype grid_dtypes[] = {MSAIDX_DTYPE_E4M3, MSAIDX_DTYPE_BF16};
static const int grid_heads[] = {1, 4};
static const int grid_batches[] = {1, 16, 64};
static const int32_t grid_contexts[] = {8192, 32768, 131072, 1048576};
#define GRID_SIZE 48

enum { FLUSH_MEMSET, FLUSH_READ, FLUSH_KINDS };
static const char *flush_names[FLUSH_KINDS] = {"memset", "read"};

typedef struct decode_row {
    msaidx_dtype dtype;
    int heads, batch;
    int32_t context;
    double key_bytes;
    double triton_us; /* 0: not in the reference */
    bool ok;
    msaidx_backend resolved;
    double plan_us;               /* msaidx_plan_batch replayed as a graph, memset flush */
    double layer_us[FLUSH_KINDS]; /* decode_scores + topk_select, one graph */
    double score_us[FLUSH_KINDS]; /* decode_scores alone */
    double read_us[FLUSH_KINDS];  /* the key pages read once */
} decode_row;

/* Device buffers sized for the largest configuration of the grid. */
typedef struct decode_buffers {
    void *k_cache, *q, *read_flush;
    float *scores;
    int32_t *topk, *cu_seqlens_q, *seq_lens, *block_table, *flush_pages;
    uint32_t *sink;
    void *workspace;
    size_t workspace_bytes;
    int64_t flush_pages_count;
} decode_buffers;

/* Fills triton_us of the grid rows from the reference tsv (dtype H batch context key_bytes graph_us
 * ...). */
static void load_reference(const char *path, decode_row *rows, int count) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "msaidx bench --decode: cannot read the reference %s: ratios left out\n",
                path);
        return;
    }
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        char dtype[16];
        int heads = 0, batch = 0;
        long context = 0;
        double key_bytes = 0, graph_us = 0;
        if (sscanf(line, "%15s %d %d %ld %lf %lf", dtype, &heads, &batch, &context, &key_bytes,
                   &graph_us) != 6)
            continue;
        const msaidx_dtype d = !strcmp(dtype, "bf16") ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
        for (int i = 0; i < count; ++i)
            if (rows[i].dtype == d && rows[i].heads == heads && rows[i].batch == batch &&
                rows[i].context == context)
                rows[i].triton_us = graph_us;
    }
    fclose(f);
}

static bool flush(const tool_exec *exec, const decode_buffers *b, int kind) {
    if (kind == FLUSH_MEMSET) return exec->flush_cache();
    return tool_gpu_key_read(b->read_flush, 16384, 16384, b->flush_pages, b->flush_pages_count,
                             b->sink, exec->stream);
}

static int compare_doubles(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Median over `repeat` runs of `graph` (or of the key read when graph is NULL), flushed before
 * each. */
static double time_runs(const tool_exec *exec, const decode_buffers *b, int kind,
                        cudaGraphExec_t graph, int64_t read_pages, int32_t page_bytes,
                        int64_t page_stride, long repeat) {
    double *times = malloc(sizeof(double) * (size_t)repeat);
    if (!times) return -1.0;
    bool ok = true;
    for (long i = -1; ok && i < repeat; ++i) { /* run -1 warms up */
        ok = flush(exec, b, kind) && exec->mark(0) &&
             (graph
                  ? tool_cuda_ok(cudaGraphLaunch(graph, (cudaStream_t)exec->stream), "graph replay")
                  : tool_gpu_key_read(b->k_cache, page_stride, page_bytes, b->block_table,
                                      read_pages, b->sink, exec->stream)) &&
             exec->mark(1) && exec->sync();
        if (ok && i >= 0) times[i] = exec->elapsed_ms(0, 1) * 1e3;
    }
    double median = -1.0;
    if (ok) {
        qsort(times, (size_t)repeat, sizeof(double), compare_doubles);
        median = repeat % 2 ? times[repeat / 2] : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
    }
    free(times);
    return median;
}

typedef enum { CAPTURE_PLAN, CAPTURE_LAYER, CAPTURE_SCORE } capture_kind;

/* The layer's top-k as an engine issues it: bounded by the batch's longest row (the pages of the
 * max_seq_len it planned with), under vLLM's pitch. */
static bool decode_topk(msaidx_context *context, const decode_buffers *b, const int32_t *nvp,
                        int32_t batch, int32_t max_nvp, int32_t heads, cudaStream_t stream) {
    return tool_ok(msaidx_topk_select_bounded(context, b->scores, DECODE_PITCH, max_nvp, nvp, batch,
                                              b->topk, (int64_t)heads * DECODE_TOPK, DECODE_TOPK,
                                              stream),
                   "top-k");
}

static bool capture(msaidx_context *context, msaidx_plan *plan, const decode_buffers *b,
                    const int32_t *nvp, int32_t batch, int32_t max_nvp, int32_t heads,
                    capture_kind kind, cudaStream_t stream, cudaGraphExec_t *graph_exec) {
    cudaGraph_t graph = NULL;
    *graph_exec = NULL;
    if (!tool_cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                      "begin capture"))
        return false;
    bool issued;
    if (kind == CAPTURE_PLAN)
        issued = tool_ok(msaidx_plan_batch(plan, b->cu_seqlens_q, b->seq_lens, b->block_table,
                                           b->workspace, b->workspace_bytes, stream),
                         "plan batch");
    else
        issued =
            tool_ok(msaidx_decode_scores(plan, b->q, b->k_cache, b->scores, stream),
                    "decode scores") &&
            (kind == CAPTURE_SCORE || decode_topk(context, b, nvp, batch, max_nvp, heads, stream));
    const bool ended = tool_cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    const bool ok = issued && ended && graph &&
                    tool_cuda_ok(cudaGraphInstantiate(graph_exec, graph, 0), "graph instantiate");
    if (graph) cudaGraphDestroy(graph);
    if (!ok) (void)cudaGetLastError();
    return ok;
}

/* Scattered pages: a permutation of the first batch * pages pages of the cache. */
static bool upload_metadata(const tool_exec *exec, const decode_buffers *b, int batch,
                            int32_t context, uint64_t seed) {
    const int32_t pages = context / TOOL_PAGE;
    const int64_t total = (int64_t)batch * pages;
    int32_t *table = malloc(sizeof(int32_t) * (size_t)total);
    int32_t *cu = malloc(sizeof(int32_t) * (size_t)(batch + 1)),
            *seq = malloc(sizeof(int32_t) * (size_t)batch);
    bool ok = table && cu && seq;
    if (ok) {
        tool_rng rng = tool_rng_make(seed, (uint64_t)total);
        for (int64_t i = 0; i < total; ++i) table[i] = (int32_t)i;
        for (int64_t i = total - 1; i > 0; --i) {
            const int64_t j = (int64_t)(tool_rng_next(&rng) % (uint64_t)(i + 1));
            const int32_t t = table[i];
            table[i] = table[j];
            table[j] = t;
        }
        for (int r = 0; r <= batch; ++r) cu[r] = r;
        for (int r = 0; r < batch; ++r) seq[r] = context;
        ok = exec->upload(b->block_table, table, sizeof(int32_t) * (size_t)total) &&
             exec->upload(b->cu_seqlens_q, cu, sizeof(int32_t) * (size_t)(batch + 1)) &&
             exec->upload(b->seq_lens, seq, sizeof(int32_t) * (size_t)batch);
    }
    free(table);
    free(cu);
    free(seq);
    return ok;
}

static void run_config(const tool_exec *exec, msaidx_context *context, decode_buffers *b,
                       decode_row *row, long repeat) {
    cudaStream_t stream = (cudaStream_t)exec->stream;
    const int32_t pages = row->context / TOOL_PAGE;
    const int32_t elem = row->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    const int32_t page_bytes = TOOL_PAGE * TOOL_HEAD_DIM * elem;
    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = row->batch;
    desc.num_tokens = row->batch;
    desc.max_q_len = 1;
    desc.max_seq_len = row->context;
    desc.num_pages = row->batch * pages;
    desc.bt_stride = pages;
    desc.page_stride = page_bytes;
    desc.pitch = DECODE_PITCH;
    msaidx_plan *plan = NULL;
    cudaGraphExec_t graphs[3] = {NULL, NULL, NULL};
    const int32_t *nvp = NULL;
    size_t need = 0;
    bool ok = upload_metadata(exec, b, row->batch, row->context, 7) &&
              tool_ok(msaidx_plan_create(&plan, context, &desc), "plan create") &&
              tool_ok(msaidx_plan_workspace_size(plan, &need), "workspace size");
    if (ok && need > b->workspace_bytes) {
        exec->release(b->workspace);
        b->workspace = NULL;
        b->workspace_bytes = 0;
        ok = exec->alloc(&b->workspace, need);
        if (ok) b->workspace_bytes = need;
    }
    /* Plan and one layer eagerly: errors surface here, where they name their call. */
    ok =
        ok &&
        tool_ok(msaidx_plan_batch(plan, b->cu_seqlens_q, b->seq_lens, b->block_table, b->workspace,
                                  b->workspace_bytes, stream),
                "plan batch") &&
        tool_ok(msaidx_plan_nvp(plan, &nvp), "plan nvp") &&
        tool_ok(msaidx_decode_scores(plan, b->q, b->k_cache, b->scores, stream), "decode scores") &&
        decode_topk(context, b, nvp, row->batch, pages, row->heads, stream) &&
        tool_ok(msaidx_plan_check(plan, stream), "plan check") &&
        capture(context, plan, b, nvp, row->batch, pages, row->heads, CAPTURE_PLAN, stream,
                &graphs[0]) &&
        capture(context, plan, b, nvp, row->batch, pages, row->heads, CAPTURE_LAYER, stream,
                &graphs[1]) &&
        capture(context, plan, b, nvp, row->batch, pages, row->heads, CAPTURE_SCORE, stream,
                &graphs[2]);
    const int64_t read_pages = (int64_t)row->batch * pages;
    if (ok) {
        row->plan_us = time_runs(exec, b, FLUSH_MEMSET, graphs[0], 0, 0, 0, repeat);
        for (int k = 0; k < FLUSH_KINDS; ++k) {
            row->layer_us[k] = time_runs(exec, b, k, graphs[1], 0, 0, 0, repeat);
            row->score_us[k] = time_runs(exec, b, k, graphs[2], 0, 0, 0, repeat);
            row->read_us[k] =
                time_runs(exec, b, k, NULL, read_pages, page_bytes, page_bytes, repeat);
        }
        ok = row->plan_us > 0 && row->layer_us[0] > 0 && row->layer_us[1] > 0 &&
             row->read_us[0] > 0 && row->read_us[1] > 0 &&
             tool_ok(msaidx_plan_check(plan, stream), "plan check after replays");
    }
    row->ok = ok;
    for (int g = 0; g < 3; ++g)
        if (graphs[g]) cudaGraphExecDestroy(graphs[g]);
    msaidx_plan_destroy(plan);
    (void)cudaGetLastError();
}

static bool alloc_buffers(const tool_exec *exec, decode_buffers *b) {
    memset(b, 0, sizeof *b);
    int max_batch = 0, max_heads = 0;
    int32_t max_context = 0;
    for (size_t i = 0; i < sizeof grid_batches / sizeof grid_batches[0]; ++i)
        max_batch = grid_batches[i] > max_batch ? grid_batches[i] : max_batch;
    for (size_t i = 0; i < sizeof grid_heads / sizeof grid_heads[0]; ++i)
        max_heads = grid_heads[i] > max_heads ? grid_heads[i] : max_heads;
    for (size_t i = 0; i < sizeof grid_contexts / sizeof grid_contexts[0]; ++i)
        max_context = grid_contexts[i] > max_context ? grid_contexts[i] : max_context;
    const size_t pages = (size_t)max_batch * (size_t)(max_context / TOOL_PAGE);
    const size_t k_bytes = pages * TOOL_PAGE * TOOL_HEAD_DIM * 2;
    const size_t q_bytes = (size_t)max_batch * max_heads * TOOL_HEAD_DIM * 2;
    int l2 = 0;
    if (!tool_cuda_ok(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "L2 size"))
        return false;
    b->flush_pages_count = (2 * (int64_t)l2 + 16383) / 16384;
    int32_t *flush_list = malloc(sizeof(int32_t) * (size_t)b->flush_pages_count);
    if (!flush_list) return false;
    for (int64_t i = 0; i < b->flush_pages_count; ++i) flush_list[i] = (int32_t)i;
    bool ok =
        exec->alloc(&b->k_cache, k_bytes) && exec->alloc(&b->q, q_bytes) &&
        exec->alloc((void **)&b->scores,
                    sizeof(float) * (size_t)max_batch * max_heads * DECODE_PITCH) &&
        exec->alloc((void **)&b->topk,
                    sizeof(int32_t) * (size_t)max_batch * max_heads * DECODE_TOPK) &&
        exec->alloc((void **)&b->cu_seqlens_q, sizeof(int32_t) * (size_t)(max_batch + 1)) &&
        exec->alloc((void **)&b->seq_lens, sizeof(int32_t) * (size_t)max_batch) &&
        exec->alloc((void **)&b->block_table, sizeof(int32_t) * pages) &&
        exec->alloc(&b->read_flush, (size_t)b->flush_pages_count * 16384) &&
        exec->alloc((void **)&b->flush_pages, sizeof(int32_t) * (size_t)b->flush_pages_count) &&
        exec->alloc((void **)&b->sink, sizeof(uint32_t)) &&
        exec->upload(b->flush_pages, flush_list, sizeof(int32_t) * (size_t)b->flush_pages_count) &&
        tool_gpu_fill_random(b->k_cache, k_bytes, 11, exec->stream) &&
        tool_gpu_fill_random(b->q, q_bytes, 13, exec->stream) &&
        tool_gpu_fill_random(b->read_flush, (size_t)b->flush_pages_count * 16384, 17,
                             exec->stream) &&
        exec->sync();
    free(flush_list);
    if (ok)
        printf("key cache %.1f GB, read flush %.0f MB (2 x L2)\n", k_bytes / 1e9,
               b->flush_pages_count * 16384 / 1e6);
    return ok;
}

static void free_buffers(const tool_exec *exec, decode_buffers *b) {
    void *all[] = {b->k_cache,      b->q,        b->read_flush,  b->scores,      b->topk,
                   b->cu_seqlens_q, b->seq_lens, b->block_table, b->flush_pages, b->sink,
                   b->workspace};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        if (all[i]) exec->release(all[i]);
}

static const char *dtype_name(msaidx_dtype d) { return d == MSAIDX_DTYPE_BF16 ? "bf16" : "fp8"; }

typedef struct decode_summary {
    int compared, faster;
    double geomean_speedup;
    double worst_bandwidth_ratio[FLUSH_KINDS]; /* layer / read, 16-64 requests at >= 128K */
    double worst_single_us;                    /* layer, memset flush, 1 request at 8K-128K */
} decode_summary;

static decode_summary summarize(const decode_row *rows, int count) {
    decode_summary s = {0};
    double log_sum = 0;
    for (int i = 0; i < count; ++i) {
        const decode_row *r = &rows[i];
        if (!r->ok) continue;
        if (r->triton_us > 0) {
            ++s.compared;
            s.faster += r->layer_us[FLUSH_MEMSET] < r->triton_us;
            log_sum += log(r->triton_us / r->layer_us[FLUSH_MEMSET]);
        }
        if (r->batch >= 16 && r->context >= 131072)
            for (int k = 0; k < FLUSH_KINDS; ++k)
                s.worst_bandwidth_ratio[k] =
                    fmax(s.worst_bandwidth_ratio[k], r->layer_us[k] / r->read_us[k]);
        if (r->batch == 1 && r->context <= 131072)
            s.worst_single_us = fmax(s.worst_single_us, r->layer_us[FLUSH_MEMSET]);
    }
    s.geomean_speedup = s.compared ? exp(log_sum / s.compared) : 0;
    return s;
}

static void write_table(FILE *f, const decode_row *rows, int count, bool markdown) {
    if (markdown)
        fprintf(f,
                "| dtype | H | requests | context | key MB | plan us | layer us memset | layer us "
                "read | "
                "score us memset | read us memset | read us read | Triton us | speedup | "
                "layer/read memset | "
                "layer/read read "
                "|\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    else
        printf("%-5s %2s %4s %8s %8s %8s %10s %10s %10s %10s %10s %10s %8s %8s %8s\n", "dtype", "H",
               "B", "context", "key MB", "plan us", "layer(m)", "layer(r)", "score(m)", "read(m)",
               "read(r)", "Triton", "speedup", "l/rd(m)", "l/rd(r)");
    for (int i = 0; i < count; ++i) {
        const decode_row *r = &rows[i];
        if (!r->ok) {
            fprintf(f, markdown ? "| %s | %d | %d | %d | failed |\n" : "%-5s %2d %4d %8d failed\n",
                    dtype_name(r->dtype), r->heads, r->batch, r->context);
            continue;
        }
        const double speedup = r->triton_us > 0 ? r->triton_us / r->layer_us[FLUSH_MEMSET] : 0;
        fprintf(f,
                markdown ? "| %s | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
                           "%.1f | %.2f | %.2f | %.2f |\n"
                         : "%-5s %2d %4d %8d %8.1f %8.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f "
                           "%8.2f %8.2f %8.2f\n",
                dtype_name(r->dtype), r->heads, r->batch, r->context, r->key_bytes / 1e6,
                r->plan_us, r->layer_us[FLUSH_MEMSET], r->layer_us[FLUSH_READ],
                r->score_us[FLUSH_MEMSET], r->read_us[FLUSH_MEMSET], r->read_us[FLUSH_READ],
                r->triton_us, speedup, r->layer_us[FLUSH_MEMSET] / r->read_us[FLUSH_MEMSET],
                r->layer_us[FLUSH_READ] / r->read_us[FLUSH_READ]);
    }
    const decode_summary s = summarize(rows, count);
    fprintf(f,
            "%sfaster than Triton on %d of %d, geomean speedup %.2fx; 16-64 requests at >= 128K: "
            "layer / plain read "
            "<= %.2f (memset flush), %.2f (read flush); 1 request at 8K-128K: layer <= %.1f us\n",
            markdown ? "\n" : "", s.faster, s.compared, s.geomean_speedup,
            s.worst_bandwidth_ratio[FLUSH_MEMSET], s.worst_bandwidth_ratio[FLUSH_READ],
            s.worst_single_us);
}

/* What the --json and --markdown writers read. */
typedef struct decode_report {
    const char *device;
    const decode_options *o;
    const decode_row *rows;
    int count;
} decode_report;

static void write_json(FILE *f, const void *context) {
    const decode_report *report = context;
    const decode_row *rows = report->rows;
    const int count = report->count;
    const decode_summary s = summarize(rows, count);
    fprintf(f, "{\n  \"device\": ");
    tool_json_string(f, report->device);
    fprintf(f, ",\n  \"repeat\": %ld,\n  \"reference\": ", report->o->repeat);
    tool_json_string(f, report->o->reference_path);
    fprintf(f, ",\n  \"pitch\": %d,\n  \"summary\": {\"compared\": %d, \"faster\": %d",
            DECODE_PITCH, s.compared, s.faster);
    fprintf(f, ", \"geomean_speedup\": ");
    tool_json_number(f, s.geomean_speedup, 4);
    fprintf(f, ", \"worst_layer_over_read_memset\": ");
    tool_json_number(f, s.worst_bandwidth_ratio[FLUSH_MEMSET], 4);
    fprintf(f, ", \"worst_layer_over_read_read\": ");
    tool_json_number(f, s.worst_bandwidth_ratio[FLUSH_READ], 4);
    fprintf(f, ", \"worst_single_request_layer_us\": ");
    tool_json_number(f, s.worst_single_us, 3);
    fprintf(f, "},\n  \"rows\": [\n");
    for (int i = 0; i < count; ++i) {
        const decode_row *r = &rows[i];
        fprintf(f,
                "    {\"dtype\": \"%s\", \"heads\": %d, \"requests\": %d, \"context\": %d, "
                "\"key_bytes\": %.0f, \"ok\": %s",
                dtype_name(r->dtype), r->heads, r->batch, r->context, r->key_bytes,
                r->ok ? "true" : "false");
        if (r->ok) {
            fprintf(f, ", \"backend\": \"%s\", \"plan_us\": %.3f, \"triton_us\": %.3f",
                    msaidx_backend_name(r->resolved), r->plan_us, r->triton_us);
            for (int k = 0; k < FLUSH_KINDS; ++k)
                fprintf(f, ", \"layer_us_%s\": %.3f, \"score_us_%s\": %.3f, \"read_us_%s\": %.3f",
                        flush_names[k], r->layer_us[k], flush_names[k], r->score_us[k],
                        flush_names[k], r->read_us[k]);
        }
        fprintf(f, "}%s\n", i + 1 < count ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
}

static void write_markdown(FILE *f, const void *context) {
    const decode_report *report = context;
    fprintf(f, "device: %s; backend %s; medians of %ld graph replays, L2 flushed before each\n\n",
            report->device, msaidx_backend_name(report->o->backend), report->o->repeat);
    write_table(f, report->rows, report->count, true);
}

int cmd_bench_decode(int argc, char **argv) {
    decode_options o;
    const int parsed = parse_decode_options(argc, argv, &o);
    if (parsed >= 0) return parsed;
    if (!tool_outputs_writable("bench --decode", o.json_path, o.markdown_path)) return 1;
    const tool_exec *exec = tool_pick_gpu();
    if (!exec) {
        fprintf(stderr, "msaidx bench --decode: needs a CUDA device\n");
        return 1;
    }
    char device[512];
    tool_gpu_describe(device, sizeof device);
    printf("device: %s\nbackend %s, %ld replays per measurement\n", device,
           msaidx_backend_name(o.backend), o.repeat);

    decode_row rows[GRID_SIZE];
    int count = 0;
    for (size_t d = 0; d < sizeof grid_dtypes / sizeof grid_dtypes[0]; ++d)
        for (size_t h = 0; h < sizeof grid_heads / sizeof grid_heads[0]; ++h)
            for (size_t b = 0; b < sizeof grid_batches / sizeof grid_batches[0]; ++b)
                for (size_t c = 0; c < sizeof grid_contexts / sizeof grid_contexts[0]; ++c) {
                    decode_row *r = &rows[count++];
                    memset(r, 0, sizeof *r);
                    r->dtype = grid_dtypes[d];
                    r->heads = grid_heads[h];
                    r->batch = grid_batches[b];
                    r->context = grid_contexts[c];
                    r->key_bytes = (double)r->batch * r->context * TOOL_HEAD_DIM *
                                   (r->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1);
                }
    load_reference(o.reference_path, rows, count);

    decode_buffers buffers;
    if (!alloc_buffers(exec, &buffers)) {
        free_buffers(exec, &buffers);
        return 1;
    }
    int failed = 0;
    for (int i = 0; i < count;) {
        /* One context per (dtype, H): the rows are grouped so. */
        msaidx_config config;
        msaidx_config_init(&config);
        config.dtype = rows[i].dtype;
        config.num_heads = rows[i].heads;
        config.backend = o.backend;
        config.device = exec->device;
        msaidx_context *context = NULL;
        const bool created = tool_ok(msaidx_context_create(&context, &config), "context create");
        msaidx_backend resolved = o.backend;
        if (created) msaidx_context_backend(context, &resolved);
        int end = i;
        while (end < count && rows[end].dtype == rows[i].dtype && rows[end].heads == rows[i].heads)
            ++end;
        for (; i < end; ++i) {
            rows[i].resolved = resolved;
            if (created) run_config(exec, context, &buffers, &rows[i], o.repeat);
            failed += !rows[i].ok;
            fflush(stdout);
        }
        msaidx_context_destroy(context);
    }
    write_table(stdout, rows, count, false);
    const decode_report report = {.device = device, .o = &o, .rows = rows, .count = count};
    bool written = true;
    if (o.json_path)
        written = tool_write_file("bench --decode", o.json_path, write_json, &report) && written;
    if (o.markdown_path)
        written =
            tool_write_file("bench --decode", o.markdown_path, write_markdown, &report) && written;
    free_buffers(exec, &buffers);
    return failed || !written ? 1 : 0;
}

#else

int cmd_bench_decode(int argc, char **argv) {
    decode_options o;
    const int parsed = parse_decode_options(argc, argv, &o);
    if (parsed >= 0) return parsed;
    fprintf(stderr, "msaidx bench --decode: this build has no CUDA\n");
    return 1;
}

#endif
