/* msaidx bench, the prefill shapes: what the timing (cmd_bench.c) and the report (bench_report.c)
 * share: the run's options, per-shape results, summary and the small derived quantities. */
#ifndef MSAIDX_BENCH_PREFILL_H
#define MSAIDX_BENCH_PREFILL_H

#include "session.h"

#include <math.h>

#define MAX_BACKENDS 4
/* The subset whose effective TFLOP/s the summary reports: enough rows and context to be compute
 * bound. */
#define COMPUTE_BOUND_ROWS 4096
#define COMPUTE_BOUND_KV 131072
/* The shape whose score time the summary compares with its floor (long context, few queries). */
#define LONG_CONTEXT_SHAPE "q128_kv1024k_h1"
/* "Never above 0.95x": a backend counts as at least as fast when its time <= this x the other's. */
#define MARGIN 0.95

typedef struct bench_options {
    const char *shapes_path, *backend_list, *filter, *json_path, *markdown_path;
    bool force_cpu, all, no_ceilings, reference, read_flush;
    msaidx_precision precision;
    double max_gflop;
    long repeat, threads;
    double max_seconds;
    msaidx_dtype dtype;
    uint64_t seed;
    int32_t pitch; /* score rows of at least this many pages; 0: each shape's longest row */
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
    double fused_us;           /* msaidx_prefill_topk without a score buffer, one interval */
    int64_t topk_rows_differ;  /* vs the first backend that ran */
    int64_t fused_rows_differ; /* fused call vs score + top-k of the same backend */
} result;

typedef struct shape_row {
    const tool_shape *shape;
    double gflop, floor_us, k_bytes;
    double read_once_us; /* 0: not measured (no GPU, or it failed) */
    double key_read_us;  /* the batch's key pages read once; 0: not measured */
    double reference_us; /* scalar reference scorer, one run (--reference on the CPU); 0: not run */
    bool compute_bound;  /* Q*H >= COMPUTE_BOUND_ROWS and the longest context >= COMPUTE_BOUND_KV */
    /* Compute-bound shapes on a GPU: cuBLASLt's FP8 GEMM of the same work (same_work_k), timed
     * right after the shape as the scorers are, after the same flush; 0: not measured. */
    double same_work_gemm_us, same_work_gemm_gflop;
    const reference_row *reference;
    result results[MAX_BACKENDS];
} shape_row;

static inline double geomean(const double *values, int count) {
    double log_sum = 0.0;
    for (int i = 0; i < count; ++i) log_sum += log(values[i]);
    return count ? exp(log_sum / count) : 0.0;
}

static inline double total_us(const result *r) { return r->score_us + r->topk_us; }

/* GFLOP per microsecond is PFLOP/s. */
static inline double tflops(double gflop, double us) { return gflop / us * 1e3; }

static inline int32_t max_kv_of(const tool_shape *shape) {
    int32_t max_kv = 0;
    for (int b = 0; b < shape->num_requests; ++b)
        max_kv = shape->kv_lens[b] > max_kv ? shape->kv_lens[b] : max_kv;
    return max_kv;
}

static inline double topk_over_read_once(const shape_row *r, const result *x) {
    return r->read_once_us > 0 ? x->topk_us / r->read_once_us : 0.0;
}

static inline double score_over_key_read(const shape_row *r, const result *x) {
    return r->key_read_us > 0 ? x->score_us / r->key_read_us : 0.0;
}

/* The ceiling of a compute-bound shape's scoring rate: an FP8 GEMM SAME_WORK_MN x SAME_WORK_MN x K
 * with about the shape's FLOPs (K a multiple of 128), so that it runs as long as the scorer and
 * at the clocks a kernel of that length gets; the GEMM rate of one size alone (the 8192^3 of the
 * header) does not carry over to kernels of other lengths (bench/README.md). */
#define SAME_WORK_MN 8192
static inline int same_work_k(double gflop) {
    const long k = lround(gflop * 1e9 / (2.0 * SAME_WORK_MN * SAME_WORK_MN) / 128.0) * 128;
    return (int)(k < 128 ? 128 : k);
}

/* Score time over the same-work GEMM's time scaled to the shape's FLOPs (< 1: faster). */
static inline double score_over_same_work(const shape_row *r, const result *x) {
    return r->same_work_gemm_us > 0
               ? x->score_us / (r->same_work_gemm_us * r->gflop / r->same_work_gemm_gflop)
               : 0.0;
}

/* The summary's per-backend aggregates (n = 0: nothing to report). */
typedef struct backend_summary {
    int shapes;
    double floor_geomean;       /* (score + top-k) / floor */
    double call_floor_geomean;  /* call / floor */
    double fused_floor_geomean; /* fused call / floor */
    int fused_faster;           /* shapes where the fused call beats score + top-k as one call */
    double fused_worst_ratio;   /* largest fused / call */
    const char *fused_worst_shape;
    int read_once_shapes;
    double topk_read_once_geomean; /* top-k / read-once */
    int compute_bound_shapes;
    double compute_bound_tflops; /* sum GFLOP / sum score time over the compute-bound subset */
    /* The compute-bound shapes with a same-work GEMM: the GEMMs' rate and this backend's. */
    double same_work_gemm_tflops, same_work_score_tflops;
    double long_context_score_us, long_context_floor_us, long_context_key_read_us;
    /* Score and fused call against the one-kernel bound (bench_summary), geomeans. */
    double score_over_bound_geomean, fused_over_bound_geomean;
} backend_summary;

/* One "is backend b always faster than a?" question on score times: ok when b / a < limit (or <=).
 */
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
    /* What one kernel is not expected to beat in this harness, per shape: the largest of the K
     * read-once (every scorer reads the keys), the shape's GFLOP at the run's cuBLASLt FP8 rate
     * and the floor; its geomean over the floors (bound_shapes = 0: not measured). */
    int bound_shapes;
    double bound_floor_geomean;
    backend_summary backends[MAX_BACKENDS];
    comparison comparisons[MAX_COMPARISONS];
    int num_comparisons;
} bench_summary;

/* Where the bench runs and the ceilings it is judged against, measured in the same run. */
typedef struct bench_machine {
    const tool_exec *exec;
    bool on_gpu;
    char device[512];
    double gemm_tflops, copy_tbps; /* GPU: cuBLASLt FP8 GEMM and device copy; 0 = not measured */
    tool_cpu_ceilings cpu;         /* CPU: the SIMD path's peak and the read rate */
} bench_machine;

/* One invocation: options, machine, shapes, backends, per-shape results and the shared buffers. */
typedef struct bench_run {
    bench_options o;
    bench_machine m;
    char shapes_path[1024], reference_path[1024];
    tool_shape *shapes;
    int num_shapes;
    reference_row *reference;
    int reference_rows; /* used only on a GPU: the file holds H200 floors and vLLM times */
    msaidx_backend backends[MAX_BACKENDS];
    int num_backends;
    bool backend_failed; /* a backend failed on some shape: the run ends with status 1 */
    shape_row *rows;
    int num_rows, rows_run;
    bench_summary summary;
    /* One pool of pages and queries big enough for every selected shape. */
    int64_t pool_pages, pool_q_rows;
    size_t score_floats, topk_ints;
    tool_batch pool;
    void *q_dev, *k_dev;
    float *scores_dev;
    int32_t *topk_dev, *topk_first, *topk_host;
    double *score_ms, *topk_ms; /* score_ms holds 3 x repeat: scores, calls, fused calls */
    tool_gemm *same_work_gemm;  /* GPU with ceilings: operands for the largest same-work K */
} bench_run;

/* Scoring rate as printed: TFLOP/s on a GPU, GFLOP/s on a CPU. */
static inline const char *rate_unit(const bench_run *run) {
    return run->m.on_gpu ? "TFLOP/s" : "GFLOP/s";
}
static inline double rate(const bench_run *run, double gflop, double us) {
    return run->m.on_gpu ? tflops(gflop, us) : gflop / us * 1e6;
}

/* Where the floors come from, and the precision a result was measured at, for headers. */
const char *bench_floor_source(const bench_run *run);
const char *bench_accumulation_mode(msaidx_precision precision);

/* The run's ceilings, shapes, flush, precision and the progress table's column heads, on stdout. */
void bench_print_header(const bench_run *run);

/* Summary and speedups on stdout, then the --json / --markdown files; non-zero when a file could
 * not be written. */
int bench_report(bench_run *run);

#ifdef MSAIDX_WITH_CUDA
/* A shape's GPU baselines (bench_baselines.c), after its backends ran: read-once of its scores,
 * its keys read once, and for compute-bound shapes the same-work GEMM; each on the progress line
 * with every backend's ratio to it. */
void bench_time_baselines(bench_run *run, shape_row *r, const tool_batch *batch);
#endif

#endif
