/* msaidx bench: times the backends on a shapes file; on a GPU also measures the ceilings
 * (cuBLASLt FP8 GEMM, device copy) that the numbers are compared against. */
#include "session.h"
#include "cpu/cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_BACKENDS 4
#define DATASHEET_FP8_TFLOPS 1979.0
#define DATASHEET_HBM_TBPS 4.8
/* Timed runs of one shape and backend are capped near this many milliseconds of work. */
#define RUN_BUDGET_MS 2000.0
#define MIN_RUNS 3
/* The subset whose effective TFLOP/s the summary reports: enough rows and context to be compute bound. */
#define COMPUTE_BOUND_ROWS 4096
#define COMPUTE_BOUND_KV 131072
/* The shape whose score time the summary compares with its floor (long context, few queries). */
#define LONG_CONTEXT_SHAPE "q128_kv1024k_h1"
/* "Never above 0.95x": a backend counts as at least as fast when its time <= this x the other's. */
#define MARGIN 0.95

static void bench_usage(FILE *out) {
    fprintf(out,
            "usage: msaidx bench [options]\n"
            "\n"
            "Times score and top-k separately per shape and backend (median of repeats, warm-up\n"
            "excluded; on a GPU with CUDA events and the L2 flushed before every run) and reports\n"
            "time, effective TFLOP/s (2*128*H*visible query-key pairs), the ratio to the floor and\n"
            "speedups between backends. On a GPU it first measures cuBLASLt FP8 E4M3 GEMM 8192^3 and\n"
            "device-copy bandwidth, and per shape the read-once time: a minimal kernel (one warp per\n"
            "256-cell row segment, coalesced) that reads every valid score cell once, timed the same\n"
            "way; top-k / read-once says how close top-k is to reading its input once from HBM. The\n"
            "K read-once time is the same for scoring: a kernel that reads every key page of the\n"
            "batch once (16-byte loads, 4 pages per block, 1 in small batches), what any scorer must\n"
            "read; score / K RO says how close a memory-bound scorer is to it. Each pair is timed a\n"
            "second time as one interval, score then top-k with no event between (\"call\", as an\n"
            "engine's stream runs them: the top-k is launched while the scorer ends).\n"
            "\n"
            "options:\n"
            "  --shapes FILE    tsv: name, H, q_lens, kv_lens (default bench/shapes/prefill78.tsv,\n"
            "                   else ../shared/bench/prefill78.tsv); floors come from\n"
            "                   h200_reference.tsv next to it when present, else max(GFLOP / %.0f\n"
            "                   TFLOP/s, K bytes / %.1f TB/s)\n"
            "  --backend LIST   comma list (default: every GPU backend compiled in and admitted, or\n"
            "                   cpu without a GPU)\n"
            "  --cpu            bench the cpu backend even when a GPU is present\n"
            "  --all            every shape (the CPU default is the shapes of <= --max-gflop work)\n"
            "  --max-gflop X    CPU subset bound (default 70: includes q2k_kv32k_h1, q512_kv128k_h4)\n"
            "  --filter TEXT    only shapes whose name contains TEXT\n"
            "  --repeat N       timed runs per shape and backend (default 10 on a GPU, 3 on the CPU;\n"
            "                   fewer, but at least 3, when they would take over 2 s)\n"
            "  --max-seconds S  stop starting new shapes after S seconds (the rest are reported as\n"
            "                   skipped; JSON and Markdown hold what ran)\n"
            "  --dtype D        e4m3 (default) or bf16\n"
            "  --fast-accumulation\n"
            "                   every backend with config.fast_accumulation = 1 (persistent then sums\n"
            "                   with FP8 tensor cores, within 2^-5 * sum_d |q_d * k_d| per dot; the\n"
            "                   other backends ignore it); the output records the mode\n"
            "  --threads N      cpu worker threads (default: all)\n"
            "  --reference      cpu: also time the scalar reference scorer once per shape (one\n"
            "                   thread, FP64 sums) and report the cpu backend's speedup over it\n"
            "  --no-ceilings    skip the GEMM and copy ceilings\n"
            "  --json FILE      write all numbers as JSON\n"
            "  --markdown FILE  write a Markdown table\n"
            "  --seed N         data seed (default 1)\n",
            DATASHEET_FP8_TFLOPS, DATASHEET_HBM_TBPS);
}

typedef struct bench_options {
    const char *shapes_path, *backend_list, *filter, *json_path, *markdown_path;
    bool force_cpu, all, no_ceilings, reference, fast_accumulation;
    double max_gflop;
    long repeat, threads;
    double max_seconds;
    msaidx_dtype dtype;
    uint64_t seed;
} bench_options;

typedef struct reference_row {
    char name[64];
    double gflop, floor_us, vllm_score_us, vllm_topk_us;
} reference_row;

typedef struct result {
    bool ran;
    int runs; /* timed runs behind the medians */
    double score_us, topk_us;
    double call_us; /* score then top-k as an engine issues them, one interval (no event between) */
    int64_t topk_rows_differ; /* vs the first backend that ran */
} result;

typedef struct shape_row {
    const tool_shape *shape;
    double gflop, floor_us, k_bytes;
    double read_once_us; /* 0: not measured (no GPU, or it failed) */
    double key_read_us;  /* the batch's key pages read once; 0: not measured */
    double reference_us; /* scalar reference scorer, one run (--reference on the CPU); 0: not run */
    bool compute_bound;  /* Q*H >= COMPUTE_BOUND_ROWS and the longest context >= COMPUTE_BOUND_KV */
    const reference_row *reference;
    result results[MAX_BACKENDS];
} shape_row;

static int parse_options(int argc, char **argv, bench_options *o) {
    *o = (bench_options){.max_gflop = 70.0, .repeat = -1, .dtype = MSAIDX_DTYPE_E4M3, .seed = 1};
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--decode")) return cmd_bench_decode(argc, argv); /* tools/cmd_bench_decode.c */
        if (!strcmp(a, "--cpu")) { o->force_cpu = true; continue; }
        if (!strcmp(a, "--reference")) { o->reference = true; continue; }
        if (!strcmp(a, "--all")) { o->all = true; continue; }
        if (!strcmp(a, "--no-ceilings")) { o->no_ceilings = true; continue; }
        if (!strcmp(a, "--fast-accumulation")) { o->fast_accumulation = true; continue; }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "msaidx bench: unknown option or missing value: %s\n", a);
            return 2;
        }
        ++i;
        long n = 0;
        bool ok = true;
        if (!strcmp(a, "--shapes")) o->shapes_path = v;
        else if (!strcmp(a, "--backend")) o->backend_list = v;
        else if (!strcmp(a, "--filter")) o->filter = v;
        else if (!strcmp(a, "--json")) o->json_path = v;
        else if (!strcmp(a, "--markdown")) o->markdown_path = v;
        else if (!strcmp(a, "--repeat")) ok = tool_parse_int(v, a, 1, 100000, &o->repeat);
        else if (!strcmp(a, "--threads")) ok = tool_parse_int(v, a, 0, 4096, &o->threads);
        else if (!strcmp(a, "--dtype")) ok = tool_parse_dtype(v, &o->dtype);
        else if (!strcmp(a, "--seed")) ok = tool_parse_int(v, a, 0, INT64_MAX, &n), o->seed = (uint64_t)n;
        else if (!strcmp(a, "--max-seconds")) ok = tool_parse_int(v, a, 1, 1L << 30, &n), o->max_seconds = (double)n;
        else if (!strcmp(a, "--max-gflop")) {
            char *end = NULL;
            o->max_gflop = strtod(v, &end);
            ok = end != v && !*end && o->max_gflop > 0;
            if (!ok) fprintf(stderr, "msaidx bench: --max-gflop = '%s': expected a positive number\n", v);
        } else {
            fprintf(stderr, "msaidx bench: unknown option %s (see msaidx bench --help)\n", a);
            return 2;
        }
        if (!ok) return 2;
    }
    return -1;
}

static const char *default_shapes_path(void) {
    static const char *const candidates[] = {"bench/shapes/prefill78.tsv", "../shared/bench/prefill78.tsv",
                                             "/work/shared/bench/prefill78.tsv"};
    for (size_t i = 0; i < sizeof candidates / sizeof *candidates; ++i)
        if (access(candidates[i], R_OK) == 0) return candidates[i];
    return candidates[0];
}

/* h200_reference.tsv beside the shapes file: name, gflop, floor_us, vLLM score us, top-k us. */
static int load_reference(const char *shapes_path, reference_row **rows, char *path, size_t path_size) {
    const char *slash = strrchr(shapes_path, '/');
    snprintf(path, path_size, "%.*sh200_reference.tsv", slash ? (int)(slash - shapes_path + 1) : 0, shapes_path);
    *rows = NULL;
    FILE *file = fopen(path, "r");
    if (!file) return 0;
    int count = 0, capacity = 0;
    char line[512];
    while (fgets(line, sizeof line, file)) {
        if (line[0] == '#') continue;
        reference_row row;
        if (sscanf(line, "%63s %lf %lf %lf %lf", row.name, &row.gflop, &row.floor_us, &row.vllm_score_us,
                   &row.vllm_topk_us) != 5)
            continue;
        if (count == capacity) {
            capacity = capacity ? 2 * capacity : 128;
            reference_row *grown = realloc(*rows, sizeof(reference_row) * (size_t)capacity);
            if (!grown) break;
            *rows = grown;
        }
        (*rows)[count++] = row;
    }
    fclose(file);
    return count;
}

static double geomean(const double *values, int count) {
    double log_sum = 0.0;
    for (int i = 0; i < count; ++i) log_sum += log(values[i]);
    return count ? exp(log_sum / count) : 0.0;
}

static double total_us(const result *r) { return r->score_us + r->topk_us; }

/* GFLOP per microsecond is PFLOP/s. */
static double tflops(double gflop, double us) { return gflop / us * 1e3; }

/* Times one backend on the current batch. False when the backend is not admitted or failed. */
static bool time_backend(const tool_exec *exec, const tool_batch *batch, msaidx_backend backend,
                         const bench_options *o, long repeat, const void *q, const void *k, float *scores,
                         int32_t *topk, double *score_ms, double *topk_ms, result *out) {
    tool_session session;
    msaidx_config config;
    tool_session_config(&config, exec, batch, backend, (int)o->threads, o->fast_accumulation);
    if (msaidx_backend_supported(backend, &config) != MSAIDX_SUCCESS) return false;
    if (!tool_session_open(&session, exec, batch, backend, (int)o->threads, o->fast_accumulation)) return false;
    const int32_t T = batch->desc.num_tokens, pitch = batch->desc.pitch;
    bool ok = true;
    for (long i = -1; ok && i < repeat; ++i) { /* one warm-up run */
        ok = exec->flush_cache() && exec->mark(0) && tool_session_scores(&session, q, k, scores) && exec->mark(1) &&
             tool_session_topk(&session, scores, pitch, T, topk) && exec->mark(2) && exec->sync();
        if (ok && i < 0) {
            /* Slow shapes get fewer runs (at least 3) so a whole table stays within minutes. Each
             * run below times the pair twice. */
            const double warm_ms = 2 * exec->elapsed_ms(0, 2);
            if (warm_ms * (double)repeat > RUN_BUDGET_MS) {
                const long fitting = (long)(RUN_BUDGET_MS / warm_ms);
                repeat = fitting < MIN_RUNS ? MIN_RUNS : fitting;
            }
            continue;
        }
        if (!ok) break;
        score_ms[i] = exec->elapsed_ms(0, 1);
        topk_ms[i] = exec->elapsed_ms(1, 2);
        /* The same pair with no event between the two, what an engine's stream runs (the top-k may
         * be launched before the scorer ends), interleaved with the run above so that both see the
         * same clocks. score_ms has room for 2 x repeat. */
        ok = exec->flush_cache() && exec->mark(0) && tool_session_scores(&session, q, k, scores) &&
             tool_session_topk(&session, scores, pitch, T, topk) && exec->mark(1) && exec->sync();
        if (ok) score_ms[repeat + i] = exec->elapsed_ms(0, 1);
    }
    ok = ok && tool_session_check(&session);
    tool_session_close(&session);
    if (!ok) return false;
    out->ran = true;
    out->runs = (int)repeat;
    out->score_us = tool_median(score_ms, (int)repeat) * 1e3;
    out->topk_us = tool_median(topk_ms, (int)repeat) * 1e3;
    out->call_us = tool_median(score_ms + repeat, (int)repeat) * 1e3;
    return true;
}

static int32_t max_kv_of(const tool_shape *shape) {
    int32_t max_kv = 0;
    for (int b = 0; b < shape->num_requests; ++b) max_kv = shape->kv_lens[b] > max_kv ? shape->kv_lens[b] : max_kv;
    return max_kv;
}

static double topk_over_read_once(const shape_row *r, const result *x) {
    return r->read_once_us > 0 ? x->topk_us / r->read_once_us : 0.0;
}

static double score_over_key_read(const shape_row *r, const result *x) {
    return r->key_read_us > 0 ? x->score_us / r->key_read_us : 0.0;
}

/* The summary's per-backend aggregates (n = 0: nothing to report). */
typedef struct backend_summary {
    int shapes;
    double floor_geomean;     /* (score + top-k) / floor */
    double call_floor_geomean; /* call / floor */
    int read_once_shapes;
    double topk_read_once_geomean; /* top-k / read-once */
    int compute_bound_shapes;
    double compute_bound_tflops; /* sum GFLOP / sum score time over the compute-bound subset */
    double long_context_score_us, long_context_floor_us, long_context_key_read_us;
} backend_summary;

/* One "is backend b always faster than a?" question on score times: ok when b / a < limit (or <=). */
typedef struct comparison {
    const char *question;
    int a, b;
    double limit;
    bool strict;
    int compared, held;
    double worst_ratio; /* largest b / a */
    const char *worst_shape;
} comparison;

#define MAX_COMPARISONS 3

typedef struct bench_summary {
    backend_summary backends[MAX_BACKENDS];
    comparison comparisons[MAX_COMPARISONS];
    int num_comparisons;
} bench_summary;

static int find_backend(const msaidx_backend *backends, int num_backends, msaidx_backend wanted) {
    for (int b = 0; b < num_backends; ++b)
        if (backends[b] == wanted) return b;
    return -1;
}

static void summarize(const msaidx_backend *backends, int num_backends, const shape_row *rows, int num_rows,
                      bench_summary *sum) {
    *sum = (bench_summary){0};
    double *values = malloc(sizeof(double) * (size_t)(num_rows > 0 ? num_rows : 1));
    if (!values) return;
    for (int b = 0; b < num_backends; ++b) {
        backend_summary *bs = &sum->backends[b];
        double gflop = 0.0, us = 0.0;
        for (int s = 0; s < num_rows; ++s)
            if (rows[s].results[b].ran) values[bs->shapes++] = total_us(&rows[s].results[b]) / rows[s].floor_us;
        bs->floor_geomean = geomean(values, bs->shapes);
        for (int s = 0, n = 0; s < num_rows; ++s)
            if (rows[s].results[b].ran) values[n++] = rows[s].results[b].call_us / rows[s].floor_us;
        bs->call_floor_geomean = geomean(values, bs->shapes);
        for (int s = 0; s < num_rows; ++s) {
            const shape_row *r = &rows[s];
            const result *x = &r->results[b];
            if (!x->ran) continue;
            if (r->read_once_us > 0 && x->topk_us > 0) values[bs->read_once_shapes++] = topk_over_read_once(r, x);
            if (r->compute_bound) {
                ++bs->compute_bound_shapes;
                gflop += r->gflop;
                us += x->score_us;
            }
            if (!strcmp(r->shape->name, LONG_CONTEXT_SHAPE)) {
                bs->long_context_score_us = x->score_us;
                bs->long_context_floor_us = r->floor_us;
                bs->long_context_key_read_us = r->key_read_us;
            }
        }
        bs->topk_read_once_geomean = geomean(values, bs->read_once_shapes);
        bs->compute_bound_tflops = us > 0 ? tflops(gflop, us) : 0.0;
    }
    free(values);
    const int dense = find_backend(backends, num_backends, MSAIDX_BACKEND_DENSE);
    const int split = find_backend(backends, num_backends, MSAIDX_BACKEND_SPLIT);
    const int persistent = find_backend(backends, num_backends, MSAIDX_BACKEND_PERSISTENT);
    const comparison wanted[MAX_COMPARISONS] = {
        {"persistent score below dense on every shape?", dense, persistent, 1.0, true, 0, 0, 0.0, NULL},
        {"persistent score never above 0.95x split?", split, persistent, MARGIN, false, 0, 0, 0.0, NULL},
        {"split score never slower than 0.95x dense's speed (split <= dense / 0.95)?", dense, split, 1.0 / MARGIN,
         false, 0, 0, 0.0, NULL},
    };
    for (int c = 0; c < MAX_COMPARISONS; ++c) {
        if (wanted[c].a < 0 || wanted[c].b < 0) continue;
        comparison *q = &sum->comparisons[sum->num_comparisons++];
        *q = wanted[c];
        for (int s = 0; s < num_rows; ++s) {
            const result *xa = &rows[s].results[q->a], *xb = &rows[s].results[q->b];
            if (!xa->ran || !xb->ran || xa->score_us <= 0) continue;
            const double ratio = xb->score_us / xa->score_us;
            ++q->compared;
            q->held += q->strict ? ratio < q->limit : ratio <= q->limit;
            if (!q->worst_shape || ratio > q->worst_ratio) {
                q->worst_ratio = ratio;
                q->worst_shape = rows[s].shape->name;
            }
        }
    }
}

/* The summary as text lines (stdout and Markdown share it). */
static void print_summary(FILE *f, const char *bullet, const msaidx_backend *backends, int num_backends,
                          const bench_summary *sum) {
    for (int b = 0; b < num_backends; ++b) {
        const backend_summary *bs = &sum->backends[b];
        if (!bs->shapes) continue;
        fprintf(f, "%s%s: (score + top-k) / floor geomean %.2fx over %d shapes (as one call: %.2fx)", bullet,
                msaidx_backend_name(backends[b]), bs->floor_geomean, bs->shapes, bs->call_floor_geomean);
        if (bs->read_once_shapes)
            fprintf(f, "; top-k / read-once geomean %.2fx over %d shapes (target <= 2x)", bs->topk_read_once_geomean,
                    bs->read_once_shapes);
        if (bs->compute_bound_shapes)
            fprintf(f, "; scoring %.0f TFLOP/s on the %d compute-bound shapes (Q*H >= %d, kv >= %dK)",
                    bs->compute_bound_tflops, bs->compute_bound_shapes, COMPUTE_BOUND_ROWS, COMPUTE_BOUND_KV / 1024);
        if (bs->long_context_score_us > 0)
            fprintf(f, "; %s score %.1f us = %.2fx its %.1f us floor", LONG_CONTEXT_SHAPE, bs->long_context_score_us,
                    bs->long_context_score_us / bs->long_context_floor_us, bs->long_context_floor_us);
        if (bs->long_context_score_us > 0 && bs->long_context_key_read_us > 0)
            fprintf(f, " and %.2fx the %.1f us K read-once", bs->long_context_score_us / bs->long_context_key_read_us,
                    bs->long_context_key_read_us);
        fprintf(f, "\n");
    }
    for (int c = 0; c < sum->num_comparisons; ++c) {
        const comparison *q = &sum->comparisons[c];
        if (!q->compared) continue;
        fprintf(f, "%s%s %s: %d of %d shapes; worst %s at %.3fx\n", bullet, q->question,
                q->held == q->compared ? "yes" : "NO", q->held, q->compared, q->worst_shape, q->worst_ratio);
    }
}

static void write_json_summary(FILE *f, const msaidx_backend *backends, int num_backends, const bench_summary *sum) {
    fprintf(f, "  \"summary\": {\n    \"backends\": {");
    bool first = true;
    for (int b = 0; b < num_backends; ++b) {
        const backend_summary *bs = &sum->backends[b];
        if (!bs->shapes) continue;
        fprintf(f, "%s\n      \"%s\": {\"shapes\": %d, \"floor_ratio_geomean\": %.3f, \"call_floor_ratio_geomean\": %.3f, "
                   "\"read_once_shapes\": %d, "
                   "\"topk_over_read_once_geomean\": %.3f, \"compute_bound_shapes\": %d, "
                   "\"compute_bound_score_tflops\": %.1f, \"long_context_shape\": \"%s\", "
                   "\"long_context_score_us\": %.3f, \"long_context_floor_us\": %.3f, "
                   "\"long_context_key_read_us\": %.3f}",
                first ? "" : ",", msaidx_backend_name(backends[b]), bs->shapes, bs->floor_geomean,
                bs->call_floor_geomean, bs->read_once_shapes,
                bs->topk_read_once_geomean, bs->compute_bound_shapes, bs->compute_bound_tflops, LONG_CONTEXT_SHAPE,
                bs->long_context_score_us, bs->long_context_floor_us, bs->long_context_key_read_us);
        first = false;
    }
    fprintf(f, "\n    },\n    \"score_comparisons\": [");
    for (int c = 0; c < sum->num_comparisons; ++c) {
        const comparison *q = &sum->comparisons[c];
        fprintf(f, "%s\n      {\"question\": \"%s\", \"baseline\": \"%s\", \"backend\": \"%s\", \"limit\": %.4f, "
                   "\"strict\": %s, \"compared\": %d, \"held\": %d, \"worst_shape\": \"%s\", \"worst_ratio\": %.4f}",
                c ? "," : "", q->question, msaidx_backend_name(backends[q->a]), msaidx_backend_name(backends[q->b]),
                q->limit, q->strict ? "true" : "false", q->compared, q->held, q->worst_shape ? q->worst_shape : "",
                q->worst_ratio);
    }
    fprintf(f, "\n    ]\n  },\n");
}

#ifdef MSAIDX_WITH_CUDA
typedef bool (*baseline_launch)(const void *args, void *stream);

/* Median time in us of a baseline kernel, timed like the backends (L2 flushed before each run, one
 * warm-up run); 0 on failure. */
static double time_baseline(const tool_exec *exec, long repeat, double *times, baseline_launch launch,
                            const void *args) {
    bool ok = true;
    for (long i = -1; ok && i < repeat; ++i) {
        ok = exec->flush_cache() && exec->mark(0) && launch(args, exec->stream) && exec->mark(1) && exec->sync();
        if (ok && i >= 0) times[i] = exec->elapsed_ms(0, 1);
    }
    return ok ? tool_median(times, (int)repeat) * 1e3 : 0.0;
}

typedef struct read_once_args {
    const float *scores;
    const int32_t *nvp;
    int32_t pitch, num_tokens;
    int heads;
    float *segment_max;
} read_once_args;

static bool launch_read_once(const void *args, void *stream) {
    const read_once_args *a = args;
    return tool_gpu_read_once(a->scores, a->pitch, a->nvp, a->num_tokens, a->heads, a->segment_max, stream);
}

/* The read-once kernel on the shape's score layout (backend independent). */
static double time_read_once(const tool_exec *exec, const tool_batch *batch, long repeat, const float *scores,
                             double *times) {
    const int32_t T = batch->desc.num_tokens, pitch = batch->desc.pitch;
    read_once_args args = {scores, NULL, pitch, T, batch->heads, NULL};
    double us = 0.0;
    if (exec->alloc((void **)&args.nvp, sizeof(int32_t) * (size_t)(T > 0 ? T : 1)) &&
        exec->upload((void *)args.nvp, batch->nvp, sizeof(int32_t) * (size_t)T) &&
        exec->alloc((void **)&args.segment_max, sizeof(float) * tool_gpu_read_once_floats(T, batch->heads, pitch)))
        us = time_baseline(exec, repeat, times, launch_read_once, &args);
    exec->release((void *)args.nvp);
    exec->release(args.segment_max);
    return us;
}

typedef struct key_read_args {
    const void *k_cache;
    int64_t page_stride, num_pages;
    int32_t page_bytes;
    const int32_t *pages;
    uint32_t *sink;
} key_read_args;

static bool launch_key_read(const void *args, void *stream) {
    const key_read_args *a = args;
    return tool_gpu_key_read(a->k_cache, a->page_stride, a->page_bytes, a->pages, a->num_pages, a->sink, stream);
}

/* Reading the batch's key pages once: pages [0, ceil(seq_len / page)) of every request, through its
 * block-table row. */
static double time_key_read(const tool_exec *exec, const tool_batch *batch, long repeat, const void *k_cache,
                            double *times) {
    const msaidx_batch_desc *d = &batch->desc;
    key_read_args args = {k_cache, d->page_stride, 0, TOOL_PAGE * TOOL_HEAD_DIM * (batch->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1),
                          NULL, NULL};
    for (int32_t b = 0; b < d->batch_size; ++b) args.num_pages += (batch->seq_lens[b] + TOOL_PAGE - 1) / TOOL_PAGE;
    const size_t page_list_bytes = sizeof(int32_t) * (size_t)(args.num_pages > 0 ? args.num_pages : 1);
    int32_t *pages = malloc(page_list_bytes);
    if (!pages) return 0.0;
    int64_t n = 0;
    for (int32_t b = 0; b < d->batch_size; ++b)
        for (int32_t p = 0; p < (batch->seq_lens[b] + TOOL_PAGE - 1) / TOOL_PAGE; ++p)
            pages[n++] = batch->block_table[(int64_t)b * d->bt_stride + p];
    double us = 0.0;
    if (exec->alloc((void **)&args.pages, page_list_bytes) &&
        exec->upload((void *)args.pages, pages, sizeof(int32_t) * (size_t)args.num_pages) &&
        exec->alloc((void **)&args.sink, sizeof(uint32_t)))
        us = time_baseline(exec, repeat, times, launch_key_read, &args);
    exec->release((void *)args.pages);
    exec->release(args.sink);
    free(pages);
    return us;
}

/* A baseline's time and each backend's ratio to it, on the progress line. */
static void print_baseline(const char *label, double us, const shape_row *r, int num_backends,
                           double (*ratio)(const shape_row *, const result *)) {
    if (us <= 0) {
        printf(" | %s failed", label);
        return;
    }
    printf(" | %.1f", us);
    for (int b = 0; b < num_backends; ++b)
        if (r->results[b].ran) printf(" %.2f", ratio(r, &r->results[b]));
}
#endif

static void write_json(const char *path, const bench_options *o, const char *device, const char *shapes_path,
                       const char *reference_path, int reference_rows, double gemm_tflops, double copy_tbps,
                       const msaidx_backend *backends, int num_backends, const shape_row *rows, int num_rows,
                       const bench_summary *sum) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "msaidx bench: cannot write %s\n", path);
        return;
    }
    fprintf(f, "{\n  \"device\": \"%s\",\n  \"dtype\": \"%s\",\n  \"fast_accumulation\": %s,\n  \"repeat\": %ld,\n"
               "  \"shapes_file\": \"%s\",\n",
            device, o->dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", o->fast_accumulation ? "true" : "false",
            o->repeat, shapes_path);
    fprintf(f, "  \"floor_source\": \"%s\",\n", reference_rows ? reference_path : "computed");
    fprintf(f, "  \"ceilings\": {\"cublaslt_fp8_gemm_8192_tflops\": %.1f, \"device_copy_tbps\": %.3f},\n",
            gemm_tflops, copy_tbps);
    fprintf(f, "  \"backends\": [");
    for (int b = 0; b < num_backends; ++b) fprintf(f, "%s\"%s\"", b ? ", " : "", msaidx_backend_name(backends[b]));
    fprintf(f, "],\n");
    write_json_summary(f, backends, num_backends, sum);
    fprintf(f, "  \"shapes\": [\n");
    for (int s = 0; s < num_rows; ++s) {
        const shape_row *r = &rows[s];
        fprintf(f, "    {\"name\": \"%s\", \"heads\": %d, \"requests\": %d, \"gflop\": %.4f, \"floor_us\": %.3f"
                   ", \"tokens\": %lld, \"max_kv\": %d, \"compute_bound\": %s",
                r->shape->name, r->shape->heads, r->shape->num_requests, r->gflop, r->floor_us,
                (long long)tool_total_tokens(r->shape->q_lens, r->shape->num_requests), max_kv_of(r->shape),
                r->compute_bound ? "true" : "false");
        if (r->read_once_us > 0) fprintf(f, ", \"read_once_us\": %.3f", r->read_once_us);
        if (r->key_read_us > 0) fprintf(f, ", \"key_read_once_us\": %.3f", r->key_read_us);
        if (r->reference_us > 0) fprintf(f, ", \"reference_score_us\": %.1f", r->reference_us);
        if (r->reference)
            fprintf(f, ", \"vllm_score_us\": %.1f, \"vllm_topk_us\": %.1f", r->reference->vllm_score_us,
                    r->reference->vllm_topk_us);
        fprintf(f, ", \"results\": {");
        bool first = true;
        for (int b = 0; b < num_backends; ++b) {
            const result *x = &r->results[b];
            if (!x->ran) continue;
            fprintf(f, "%s\"%s\": {\"score_us\": %.3f, \"topk_us\": %.3f, \"total_us\": %.3f, \"score_tflops\": %.2f, "
                       "\"floor_ratio\": %.2f, \"topk_rows_differ\": %lld, \"runs\": %d",
                    first ? "" : ", ", msaidx_backend_name(backends[b]), x->score_us, x->topk_us, total_us(x),
                    tflops(r->gflop, x->score_us), total_us(x) / r->floor_us,
                    (long long)x->topk_rows_differ, x->runs);
            fprintf(f, ", \"call_us\": %.3f, \"call_floor_ratio\": %.2f", x->call_us, x->call_us / r->floor_us);
            if (r->read_once_us > 0) fprintf(f, ", \"topk_over_read_once\": %.3f", topk_over_read_once(r, x));
            if (r->key_read_us > 0) fprintf(f, ", \"score_over_key_read_once\": %.3f", score_over_key_read(r, x));
            fprintf(f, "}");
            first = false;
        }
        fprintf(f, "}}%s\n", s + 1 < num_rows ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);
    printf("wrote %s\n", path);
}

/* The accumulation mode a result was measured in, for its header lines. */
static const char *accumulation_mode(bool fast_accumulation) {
    return fast_accumulation ? "fast (config.fast_accumulation = 1: persistent sums with FP8 tensor cores, within "
                               "2^-5 * sum|q*k| per dot; dense, split and cpu stay exact)"
                             : "exact (config.fast_accumulation = 0, the default: FP32 sums on every backend)";
}

static void write_markdown(const char *path, const char *device, bool fast_accumulation, double gemm_tflops,
                           double copy_tbps, const msaidx_backend *backends, int num_backends, const shape_row *rows,
                           int num_rows, bool have_vllm, const bench_summary *sum) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "msaidx bench: cannot write %s\n", path);
        return;
    }
    fprintf(f, "Device: %s", device);
    if (gemm_tflops > 0) fprintf(f, "; cuBLASLt FP8 GEMM 8192^3 %.0f TFLOP/s; device copy %.2f TB/s", gemm_tflops, copy_tbps);
    fprintf(f, "\n\nAccumulation: %s", accumulation_mode(fast_accumulation));
    fprintf(f, "\n\nSummary (score comparisons use score times; worst = the largest time ratio):\n\n");
    print_summary(f, "- ", backends, num_backends, sum);
    fprintf(f, "\nTimes in us (median); TFLOP/s of scoring; x floor = (score + top-k) / floor; read-once = a kernel "
               "reading every valid score cell once; top-k / RO = top-k time / read-once time; K read-once = a "
               "kernel reading every key page of the batch once; score / K RO = score time / K read-once time.\n\n");
    fprintf(f, "| shape | H | GFLOP | floor us | read-once us | K read-once us |");
    for (int b = 0; b < num_backends; ++b) {
        const char *name = msaidx_backend_name(backends[b]);
        fprintf(f, " %s score | %s top-k | %s TFLOP/s | %s x floor | %s top-k / RO | %s score / K RO |", name, name,
                name, name, name, name);
    }
    if (have_vllm) fprintf(f, " vLLM Triton us |");
    fprintf(f, "\n|---|---:|---:|---:|---:|---:|");
    for (int b = 0; b < num_backends; ++b) fprintf(f, "---:|---:|---:|---:|---:|---:|");
    if (have_vllm) fprintf(f, "---:|");
    fprintf(f, "\n");
    for (int s = 0; s < num_rows; ++s) {
        const shape_row *r = &rows[s];
        fprintf(f, "| %s | %d | %.2f | %.2f |", r->shape->name, r->shape->heads, r->gflop, r->floor_us);
        if (r->read_once_us > 0) fprintf(f, " %.1f |", r->read_once_us);
        else fprintf(f, " - |");
        if (r->key_read_us > 0) fprintf(f, " %.1f |", r->key_read_us);
        else fprintf(f, " - |");
        for (int b = 0; b < num_backends; ++b) {
            const result *x = &r->results[b];
            if (x->ran)
                fprintf(f, " %.1f | %.1f | %.1f | %.1f |", x->score_us, x->topk_us, tflops(r->gflop, x->score_us),
                        total_us(x) / r->floor_us);
            else
                fprintf(f, " - | - | - | - |");
            if (x->ran && r->read_once_us > 0) fprintf(f, " %.2f |", topk_over_read_once(r, x));
            else fprintf(f, " - |");
            if (x->ran && r->key_read_us > 0) fprintf(f, " %.2f |", score_over_key_read(r, x));
            else fprintf(f, " - |");
        }
        if (have_vllm)
            fprintf(f, " %.1f |", r->reference ? r->reference->vllm_score_us + r->reference->vllm_topk_us : 0.0);
        fprintf(f, "\n");
    }
    fclose(f);
    printf("wrote %s\n", path);
}

/* Wins, losses and geomean of the speedup of backend b over backend a (score + top-k). */
static void print_speedups(const char *label_b, const char *label_a, const shape_row *rows, int num_rows, int a,
                           int b, bool a_is_vllm) {
    double *ratios = malloc(sizeof(double) * (size_t)(num_rows > 0 ? num_rows : 1));
    if (!ratios) return;
    int n = 0, wins = 0, losses = 0;
    double worst = INFINITY, best = 0.0;
    for (int s = 0; s < num_rows; ++s) {
        const shape_row *r = &rows[s];
        if (!r->results[b].ran || (a_is_vllm ? !r->reference : !r->results[a].ran)) continue;
        const double base = a_is_vllm ? r->reference->vllm_score_us + r->reference->vllm_topk_us
                                      : total_us(&r->results[a]);
        const double ratio = base / total_us(&r->results[b]);
        ratios[n++] = ratio;
        wins += ratio > 1.0;
        losses += ratio < 1.0;
        worst = fmin(worst, ratio);
        best = fmax(best, ratio);
    }
    if (n)
        printf("  %-10s vs %-10s: geomean speedup %.2fx, %d wins, %d losses of %d (range %.2fx .. %.2fx)\n", label_b,
               label_a, geomean(ratios, n), wins, losses, n, worst, best);
    free(ratios);
}

int cmd_bench(int argc, char **argv) {
    bench_options o;
    int parsed = parse_options(argc, argv, &o);
    if (parsed >= 0) return parsed;
    if (!o.shapes_path) o.shapes_path = default_shapes_path();

    const tool_exec *exec = o.force_cpu ? NULL : tool_pick_gpu();
    const bool on_gpu = exec != NULL;
    if (!exec) exec = tool_host_exec();
    if (o.repeat < 0) o.repeat = on_gpu ? 10 : 3;

    tool_shape *shapes = NULL;
    int num_shapes = 0;
    if (!tool_load_shapes(o.shapes_path, &shapes, &num_shapes)) return 2;
    reference_row *reference = NULL;
    char reference_path[1024];
    const int reference_rows = load_reference(o.shapes_path, &reference, reference_path, sizeof reference_path);

    /* Backends: the list given, else all compiled in and admitted on this machine. */
    msaidx_backend backends[MAX_BACKENDS];
    int num_backends = 0;
    int status = 2;
    shape_row *rows = calloc((size_t)num_shapes, sizeof *rows);
    double *score_ms = calloc(2 * (size_t)o.repeat, sizeof(double)); /* scores, then calls */
    double *topk_ms = calloc((size_t)o.repeat, sizeof(double));
    tool_batch pool = {0};
    void *q_dev = NULL, *k_dev = NULL;
    float *scores_dev = NULL;
    int32_t *topk_dev = NULL, *topk_first = NULL, *topk_host = NULL;
    if (!rows || !score_ms || !topk_ms) goto done;
    if (o.backend_list) {
        char *list = strdup(o.backend_list), *save = NULL;
        bool ok = list != NULL;
        for (char *name = list ? strtok_r(list, ",", &save) : NULL; ok && name; name = strtok_r(NULL, ",", &save)) {
            msaidx_backend b;
            ok = tool_parse_backend(name, &b) && b != MSAIDX_BACKEND_AUTO && num_backends < MAX_BACKENDS;
            if (ok) backends[num_backends++] = b;
        }
        free(list);
        if (!ok) {
            fprintf(stderr, "msaidx bench: --backend %s: expected up to %d of cpu, dense, split, persistent\n",
                    o.backend_list, MAX_BACKENDS);
            goto done;
        }
        for (int b = 0; b < num_backends; ++b)
            if ((backends[b] == MSAIDX_BACKEND_CPU) == on_gpu) {
                fprintf(stderr, "msaidx bench: backend %s does not run on %s (use --cpu for the cpu backend)\n",
                        msaidx_backend_name(backends[b]), on_gpu ? "the GPU" : "this machine without a GPU");
                goto done;
            }
    } else if (on_gpu) {
        msaidx_config config;
        msaidx_config_init(&config);
        config.device = exec->device;
        config.dtype = o.dtype;
        for (int b = MSAIDX_BACKEND_DENSE; b <= MSAIDX_BACKEND_PERSISTENT; ++b)
            if (msaidx_backend_supported((msaidx_backend)b, &config) == MSAIDX_SUCCESS)
                backends[num_backends++] = (msaidx_backend)b;
        if (!num_backends) {
            fprintf(stderr, "msaidx bench: no GPU backend is compiled in and admitted\n");
            goto done;
        }
    } else {
        backends[num_backends++] = MSAIDX_BACKEND_CPU;
    }

    /* The shapes to run and the pool they share: one cache and one Q big enough for any. */
    int num_rows = 0;
    int64_t pool_pages = 1, pool_q_rows = 1;
    size_t score_floats = 1, topk_ints = 1;
    const size_t elem = o.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    for (int s = 0; s < num_shapes; ++s) {
        const tool_shape *shape = &shapes[s];
        const double gflop = tool_gflop(shape->heads, tool_visible_pairs(shape->q_lens, shape->kv_lens, shape->num_requests));
        if (o.filter && !strstr(shape->name, o.filter)) continue;
        if (!on_gpu && !o.all && gflop > o.max_gflop) continue;
        shape_row *r = &rows[num_rows++];
        r->shape = shape;
        r->gflop = gflop;
        const int64_t pages = tool_total_pages(shape->kv_lens, shape->num_requests);
        const int64_t tokens = tool_total_tokens(shape->q_lens, shape->num_requests);
        const int32_t max_kv = max_kv_of(shape);
        const int64_t pitch = (max_kv + TOOL_PAGE - 1) / TOOL_PAGE;
        r->k_bytes = (double)pages * TOOL_PAGE * TOOL_HEAD_DIM * (double)elem;
        r->floor_us = fmax(gflop / DATASHEET_FP8_TFLOPS * 1e3, r->k_bytes / (DATASHEET_HBM_TBPS * 1e12) * 1e6);
        for (int i = 0; i < reference_rows; ++i)
            if (!strcmp(reference[i].name, shape->name)) {
                r->reference = &reference[i];
                if (o.dtype == MSAIDX_DTYPE_E4M3) r->floor_us = reference[i].floor_us;
            }
        r->compute_bound = tokens * shape->heads >= COMPUTE_BOUND_ROWS && max_kv >= COMPUTE_BOUND_KV;
        if (pages > pool_pages) pool_pages = pages;
        if (tokens * shape->heads > pool_q_rows) pool_q_rows = tokens * shape->heads;
        if ((size_t)(tokens * shape->heads * pitch) > score_floats) score_floats = (size_t)(tokens * shape->heads * pitch);
        if ((size_t)(tokens * shape->heads * 16) > topk_ints) topk_ints = (size_t)(tokens * shape->heads * 16);
    }
    if (!num_rows) {
        fprintf(stderr, "msaidx bench: no shape of %s selected\n", o.shapes_path);
        goto done;
    }

    char device[512];
    snprintf(device, sizeof device, "host CPU, %ld threads", o.threads ? o.threads : (long)sysconf(_SC_NPROCESSORS_ONLN));
    double gemm_tflops = 0.0, copy_tbps = 0.0;
#ifdef MSAIDX_WITH_CUDA
    if (on_gpu) {
        tool_gpu_describe(device, sizeof device);
        if (!o.no_ceilings) {
            fprintf(stderr, "measuring ceilings ...\n");
            gemm_tflops = tool_gpu_fp8_gemm_tflops(8192, 20);
            copy_tbps = tool_gpu_copy_tbps((size_t)1 << 30, 20);
        }
    }
#endif
    printf("msaidx bench: %s\n", device);
    if (gemm_tflops > 0 || copy_tbps > 0)
        printf("ceilings: cuBLASLt FP8 E4M3 GEMM 8192^3 (TN, bf16 out) %.0f TFLOP/s; device copy %.2f TB/s (read + write)\n",
               gemm_tflops, copy_tbps);
    printf("shapes: %d of %d from %s%s; floors: %s; dtype %s; median of %ld, warm-up excluded%s\n", num_rows, num_shapes,
           o.shapes_path, !on_gpu && !o.all ? " (CPU subset, --all for every shape)" : "",
           reference_rows ? reference_path : "computed", o.dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", o.repeat,
           on_gpu ? ", L2 flushed, CUDA events" : "");
    printf("accumulation: %s\n", accumulation_mode(o.fast_accumulation));
    fflush(stdout);

    /* One pool of pages and queries serves every shape; each shape shuffles its own block table. */
    int32_t one = 0;
    if (!tool_batch_layout(&pool, 1, o.dtype, &one, (int32_t[]){(int32_t)(pool_pages * TOOL_PAGE)}, 1, 0, 0, 0, o.seed) ||
        !tool_batch_fill(&pool, pool_q_rows, o.seed, true) || !exec->alloc(&q_dev, pool.q_bytes) ||
        !exec->alloc(&k_dev, pool.k_bytes) || !exec->upload(q_dev, pool.q, pool.q_bytes) ||
        !exec->upload(k_dev, pool.k_cache, pool.k_bytes) || !exec->alloc((void **)&scores_dev, score_floats * sizeof(float)) ||
        !exec->alloc((void **)&topk_dev, topk_ints * sizeof(int32_t)))
        goto done;
    topk_first = malloc(topk_ints * sizeof(int32_t));
    topk_host = malloc(topk_ints * sizeof(int32_t));
    if (!topk_first || !topk_host) goto done;

    printf("%-22s %2s %9s %9s", "shape", "H", "GFLOP", "floor us");
    for (int b = 0; b < num_backends; ++b)
        printf(" | %-10s %9s %8s %8s %7s", msaidx_backend_name(backends[b]), "score us", "top-k us", "TFLOP/s", "x floor");
    if (on_gpu) printf(" | read-once us, top-k / read-once per backend | K read-once us, score / K read-once");
    printf("\n");
    const double start_ms = tool_now_ms();
    int rows_run = 0;
    for (int s = 0; s < num_rows; ++s, rows_run = s) {
        shape_row *r = &rows[s];
        const tool_shape *shape = r->shape;
        tool_batch batch = {0};
        if (o.max_seconds > 0 && tool_now_ms() - start_ms > o.max_seconds * 1e3) {
            printf("stopped after %.0f s (--max-seconds): %d shapes skipped\n", o.max_seconds, num_rows - s);
            break;
        }
        if (!tool_batch_layout(&batch, shape->heads, o.dtype, shape->q_lens, shape->kv_lens, shape->num_requests,
                               pool.desc.num_pages, 0, 0, o.seed + (uint64_t)s))
            goto done;
        const size_t topk_bytes = (size_t)batch.desc.num_tokens * shape->heads * 16 * sizeof(int32_t);
        printf("%-22s %2d %9.2f %9.2f", shape->name, shape->heads, r->gflop, r->floor_us);
        fflush(stdout);
        int first = -1;
        for (int b = 0; b < num_backends; ++b) {
            result *x = &r->results[b];
            if (!time_backend(exec, &batch, backends[b], &o, o.repeat, q_dev, k_dev, scores_dev, topk_dev, score_ms,
                              topk_ms, x)) {
                printf(" | %-10s %9s %8s %8s %7s", msaidx_backend_name(backends[b]), "-", "-", "-", "-");
                continue;
            }
            if (!exec->download(first < 0 ? topk_first : topk_host, topk_dev, topk_bytes)) goto done;
            if (first < 0) {
                first = b;
            } else {
                for (size_t row = 0; row < (size_t)batch.desc.num_tokens * shape->heads; ++row)
                    x->topk_rows_differ += memcmp(topk_first + row * 16, topk_host + row * 16, 16 * sizeof(int32_t)) != 0;
            }
            printf(" | %-10s %9.1f %8.1f %8.1f %7.1f", "", x->score_us, x->topk_us, tflops(r->gflop, x->score_us),
                   total_us(x) / r->floor_us);
            if (x->topk_rows_differ) printf(" (top-k differs from %s in %lld rows)", msaidx_backend_name(backends[first]),
                                            (long long)x->topk_rows_differ);
            fflush(stdout);
        }
        if (o.reference && !on_gpu) {
            msaidx_config config;
            tool_session_config(&config, exec, &batch, MSAIDX_BACKEND_CPU, 1, false);
            const msaidx_cpu_batch reference = {.config = &config, .desc = &batch.desc,
                                                .cu_seqlens_q = batch.cu_seqlens_q, .seq_lens = batch.seq_lens,
                                                .block_table = batch.block_table, .q = q_dev, .k_cache = k_dev,
                                                .scores = scores_dev};
            const double reference_start = tool_now_ms();
            msaidx_cpu_scores_reference(&reference);
            r->reference_us = (tool_now_ms() - reference_start) * 1e3;
            printf(" | reference %.0f us (%.2f GFLOP/s)", r->reference_us, r->gflop / r->reference_us * 1e6);
            for (int b = 0; b < num_backends; ++b)
                if (r->results[b].ran)
                    printf(", %s %.1fx faster", msaidx_backend_name(backends[b]), r->reference_us / r->results[b].score_us);
        }
#ifdef MSAIDX_WITH_CUDA
        if (on_gpu && first >= 0) {
            r->read_once_us = time_read_once(exec, &batch, o.repeat, scores_dev, score_ms);
            print_baseline("read-once", r->read_once_us, r, num_backends, topk_over_read_once);
            r->key_read_us = time_key_read(exec, &batch, o.repeat, k_dev, score_ms);
            print_baseline("K read-once", r->key_read_us, r, num_backends, score_over_key_read);
        }
#endif
        printf("\n");
        tool_batch_free(&batch);
    }

    bench_summary sum;
    summarize(backends, num_backends, rows, rows_run, &sum);
    printf("summary (%s accumulation):\n", o.fast_accumulation ? "fast" : "exact");
    print_summary(stdout, "  ", backends, num_backends, &sum);
    printf("speedups (score + top-k):\n");
    for (int a = 0; a < num_backends; ++a)
        for (int b = a + 1; b < num_backends; ++b)
            print_speedups(msaidx_backend_name(backends[b]), msaidx_backend_name(backends[a]), rows, rows_run, a, b, false);
    if (reference_rows && on_gpu && o.dtype == MSAIDX_DTYPE_E4M3)
        for (int b = 0; b < num_backends; ++b)
            print_speedups(msaidx_backend_name(backends[b]), "vLLM Triton (h200_reference.tsv)", rows, rows_run, 0, b, true);
    if (o.json_path)
        write_json(o.json_path, &o, device, o.shapes_path, reference_path, reference_rows, gemm_tflops, copy_tbps,
                   backends, num_backends, rows, rows_run, &sum);
    if (o.markdown_path)
        write_markdown(o.markdown_path, device, o.fast_accumulation, gemm_tflops, copy_tbps, backends, num_backends,
                       rows, rows_run, reference_rows > 0 && on_gpu, &sum);
    status = 0;

done:
    if (exec) {
        exec->release(q_dev);
        exec->release(k_dev);
        exec->release(scores_dev);
        exec->release(topk_dev);
    }
    tool_batch_free(&pool);
    free(topk_first);
    free(topk_host);
    free(rows);
    free(score_ms);
    free(topk_ms);
    free(reference);
    tool_free_shapes(shapes, num_shapes);
    return status;
}
