/* The msaidx command-line tool: shared pieces of its subcommands (run, bench, check). */
#ifndef MSAIDX_TOOL_H
#define MSAIDX_TOOL_H

#include "msaidx.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define TOOL_HEAD_DIM 128
#define TOOL_PAGE 128

int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_check(int argc, char **argv);
int cmd_e2e(int argc, char **argv);
int cmd_bench_decode(int argc, char **argv); /* msaidx bench --decode */

/* ---- small helpers (helpers.c) ---- */

/* Prints "msaidx <what>: <status>: <last error>" to stderr when status is not SUCCESS. */
bool tool_ok(msaidx_status status, const char *what);
double tool_now_ms(void);
/* Parses "a,b,c" into a new int32 array; false (after printing) on a malformed list. */
bool tool_parse_list(const char *text, const char *option, int32_t **values, int *count);
bool tool_parse_int(const char *text, const char *option, long lo, long hi, long *value);
/* A positive, finite number (a fraction allowed); prints why not. */
bool tool_parse_positive(const char *text, const char *option, double *value);
bool tool_parse_backend(const char *text, msaidx_backend *backend);
bool tool_parse_dtype(const char *text, msaidx_dtype *dtype);
double tool_median(double *values, int count); /* sorts values in place */
/* --precision: "default" or "exact" (SPEC section 3); false on anything else. */
bool tool_parse_precision(const char *text, msaidx_precision *precision);
/* Every command's precision options: --precision P (`value`), or its old spelling
 * --fast-accumulation (--precision default; `value` unused). `seen` (0 before the first option)
 * remembers which were given: false, with a message, when both are, as Python refuses both
 * keywords. */
bool tool_precision_option(const char *option, const char *value, unsigned *seen,
                           msaidx_precision *precision);
const char *tool_precision_name(msaidx_precision precision);
/* aligned_alloc wants a size that is a multiple of the alignment. */
static inline size_t tool_round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

/* ---- result files (report.c): the one writer of bench's and e2e's JSON and Markdown ---- */
typedef void (*tool_writer)(FILE *file, const void *context);
/* Whether the --json and --markdown files (NULL: not wanted) can be written, checked before a long
 * run: two different paths, each writable; prints why not. */
bool tool_outputs_writable(const char *command, const char *json_path, const char *markdown_path);
/* Writes `path` through `write`; false, after printing the file and the reason, when it cannot be
 * opened, written or closed (a partly written file is removed). Prints "wrote PATH" on success. */
bool tool_write_file(const char *command, const char *path, tool_writer write, const void *context);
/* `text` as a quoted, escaped JSON string. */
void tool_json_string(FILE *file, const char *text);
/* `value` with `decimals` digits, or null where it is not finite (a ratio to a zero floor). */
void tool_json_number(FILE *file, double value, int decimals);

/* ---- the host CPU (host_cpu.c): what the cpu bench names and is judged against ---- */
typedef struct tool_cpu_ceilings {
    const char *simd;   /* the cpu backend's SIMD path: avx512_bf16, avx512, avx2, scalar */
    double peak_gflops; /* that path's arithmetic peak on `threads` threads, measured */
    double read_gbps;   /* a STREAM-like read of a buffer far larger than the caches, measured */
    int threads;        /* the cpu backend's threads (measured on at most one per core) */
} tool_cpu_ceilings;
/* The CPU's model name (/proc/cpuinfo), or "unknown CPU". */
void tool_cpu_model(char *text, size_t size);
/* Measures both ceilings (about a second); threads 0 = all. */
void tool_cpu_measure_ceilings(int threads, tool_cpu_ceilings *ceilings);

/* ---- random numbers: splitmix64, one independent stream per (seed, stream id) ---- */
typedef struct tool_rng {
    uint64_t state;
} tool_rng;
tool_rng tool_rng_make(uint64_t seed, uint64_t stream);
uint64_t tool_rng_next(tool_rng *rng);
double tool_rng_uniform(tool_rng *rng); /* [0, 1) */
double tool_rng_normal(tool_rng *rng);
uint64_t tool_seed_from_clock(void);

/* ---- benchmark shapes (workload.c; tsv: name, H, q_lens, kv_lens) ---- */
typedef struct tool_shape {
    char name[64];
    int heads;
    int num_requests;
    int32_t *q_lens;
    int32_t *kv_lens; /* total context incl. the chunk: prefix = kv - q */
} tool_shape;

bool tool_load_shapes(const char *path, tool_shape **shapes, int *count);
void tool_free_shapes(tool_shape *shapes, int count);
int64_t tool_visible_pairs(const int32_t *q_lens, const int32_t *kv_lens, int num_requests);
/* The pages that hold `tokens` tokens; computed in 64 bits, so any int32 length fits. */
static inline int32_t tool_pages_of(int32_t tokens) {
    return (int32_t)(((int64_t)tokens + TOOL_PAGE - 1) / TOOL_PAGE);
}
int64_t tool_total_pages(const int32_t *kv_lens, int num_requests);
int64_t tool_total_tokens(const int32_t *q_lens, int num_requests);
double tool_gflop(int heads, int64_t pairs); /* 2 * D * H * pairs */

/* ---- a batch on the host (workload.c): metadata, Q [T, H, D] and a paged K cache ---- */
typedef struct tool_batch {
    int heads;
    msaidx_dtype dtype;
    msaidx_batch_desc desc;
    int32_t *cu_seqlens_q; /* [B + 1] */
    int32_t *seq_lens;     /* [B] */
    int32_t *block_table;  /* [B, bt_stride], a scattered permutation of the cache's pages */
    int32_t *nvp;          /* [T] */
    void *q;               /* [T, H, D] */
    void *k_cache;         /* [num_pages, page, D] at desc.page_stride */
    size_t q_bytes, k_bytes;
} tool_batch;

/*
 * Metadata of requests (q_lens, kv_lens) over a cache of `num_pages` pages (0: exactly the pages
 * the batch needs) whose page ids are shuffled with `seed`. pitch 0: the largest nvp.
 */
bool tool_batch_layout(tool_batch *batch, int heads, msaidx_dtype dtype, const int32_t *q_lens,
                       const int32_t *kv_lens, int num_requests, int32_t num_pages,
                       int64_t page_stride, int32_t pitch, uint64_t seed);
/*
 * Gaussian rows RMS-normalised to x / rms(x) (like MiniMax-M3's index Q and K), stored as
 * batch->dtype. Q gets `q_rows` rows of D, K all num_pages pages. Parallel, deterministic in seed.
 */
bool tool_batch_fill(tool_batch *batch, int64_t q_rows, uint64_t seed, bool progress);
/* Stream ids of tool_batch_fill: Q row r uses stream r, K row r (page * page_size + slot) this + r.
 */
#define TOOL_K_STREAM ((uint64_t)1 << 40)
void tool_batch_free(tool_batch *batch);
/* Fills n rows of D values with RMS-normalised Gaussians (float), row r from stream r. */
void tool_gaussian_rows(float *dst, int64_t rows, uint64_t seed, uint64_t first_stream);
/* Stores n floats as dtype at dst. */
void tool_store(msaidx_dtype dtype, const float *src, void *dst, size_t n);
void tool_load(msaidx_dtype dtype, const void *src, float *dst, size_t n);

/* ---- the FP64 reference and SPEC's checks of a batch (reference.c) ---- */

/* Request of token t (cu_seqlens_q search). */
int tool_request_of(const tool_batch *batch, int32_t t);
/*
 * FP64 reference of token t, all heads: ref[h * nvp + p], p < nvp[t]. abs_dots (NULL: not wanted)
 * gets, in the same layout, the largest sum_d |q_d * k_d| over the visible keys of each page.
 */
void tool_reference_token(const tool_batch *batch, int32_t t, double *ref, double *abs_dots);
/* The same on unquantized rows: q_rows [T, H, D], k_rows [num_pages, page, D] (dense pages). */
void tool_reference_token_float(const tool_batch *batch, int32_t t, const float *q_rows,
                                const float *k_rows, double *ref);
/* SPEC.md section 3 tolerance of a score against the FP64 reference, relative to max(1, |ref|). */
#define TOOL_SCORE_TOLERANCE 2e-4
/* SPEC section 3's bounds, as the tools print them: exact, and E4M3 at the default precision,
 * where a page max may be off by MSAIDX_FP8_ACCUMULATION_DOT_BOUND times the page's largest
 * A = sum_d |q_d * k_d| (FP8 tensor-core accumulation on persistent). */
#define TOOL_EXACT_BOUND_TEXT "2e-4*max(1,|ref|) + 2^-16*A"
#define TOOL_FP8_BOUND_TEXT "131*2^-13*A + 2e-4*max(1,|ref|) (FP8 accumulation)"

/* Whether E4M3 scores of `batch` from (resolved) `backend` at `precision` are judged by the
 * FP8-accumulation bound: only persistent sums on FP8 tensor cores; the others are exact at every
 * precision (SPEC section 3). */
bool tool_fp8_bound(const tool_batch *batch, msaidx_backend backend, msaidx_precision precision);

typedef struct tool_accuracy {
    int64_t cells;            /* scored cells compared */
    int64_t bad_cells;        /* NaN or outside the bound */
    int64_t written_past_nvp; /* cells p >= nvp that lost their 0xFF poison */
    double max_rel_error;     /* max |S - ref| / max(1, |ref|) */
    double max_bound_ratio;   /* max |S - ref| / the cell's bound */
} tool_accuracy;

/* Compares every head of token t of `scores` (host, [T, H, pitch], poisoned with 0xFF before the
 * run) with the FP64 reference, within SPEC's exact bound or, with `fp8_bound`
 * (tool_fp8_bound), the FP8-accumulation one; scratch needs 2 * H * nvp[t] doubles. */
void tool_compare_token(const tool_batch *batch, int32_t t, const float *scores, bool fp8_bound,
                        double *scratch, tool_accuracy *acc);

/* SPEC.md section 4 selection of one row, written independently of the library. */
void tool_topk_row(const float *row, int32_t nvp, int topk, int init_blocks, int local_blocks,
                   int32_t *out);

/* ---- where the buffers live: host memory (host_exec.c) or a CUDA device (gpu_util.c) ---- */
typedef struct tool_exec {
    const char *name; /* "host" or the GPU's name */
    int device;       /* MSAIDX_DEVICE_HOST or the CUDA ordinal */
    void *stream;
    bool (*alloc)(void **pointer, size_t bytes);
    void (*release)(void *pointer);
    bool (*upload)(void *dst, const void *src, size_t bytes);
    bool (*download)(void *dst, const void *src, size_t bytes);
    bool (*poison)(void *dst, size_t bytes); /* all bytes 0xFF: NaN floats, -1 ints */
    bool (*sync)(void);
    /* Timestamps: mark(slot) on the stream; elapsed_ms(a, b) after sync. */
    bool (*mark)(int slot);
    double (*elapsed_ms)(int from, int to);
    bool (*flush_cache)(void); /* evicts the last-level cache between timed runs */
} tool_exec;

#define TOOL_MARKS 4

const tool_exec *tool_host_exec(void);
/* The first CUDA device when this build has CUDA and one is present (else NULL). */
const tool_exec *tool_pick_gpu(void);
/* Why `backend` (auto or cpu: dense) has no CUDA device to run on, in the library's words (e.g.
 * no CUDA build, driver or device). */
void tool_no_gpu_reason(msaidx_backend backend, char *text, size_t size);

/* cuBLASLt GEMM operands and handle (gpu_util.c). */
typedef struct tool_gemm tool_gemm;

#ifdef MSAIDX_WITH_CUDA
/* True for cudaSuccess; else prints `what` with the error's name and text. */
bool tool_cuda_ok(int error, const char *what);
int tool_gpu_count(void);
const tool_exec *tool_gpu_exec(void);
/* The GPU exec's flush_cache: a memset of 2 x L2 (default, as Triton's do_bench), or, when `read`,
 * a read of 2 x L2 that leaves no dirty lines behind (bench --flush). */
void tool_gpu_set_read_flush(bool read);
/* One line: name, SMs, L2, memory. */
void tool_gpu_describe(char *text, size_t size);
/* cuBLASLt FP8 E4M3 GEMMs m x n x k (TN, BF16 out), every k <= max_k on one set of random
 * operands: the bench's ceilings. NULL on failure (message printed). */
tool_gemm *tool_gpu_gemm_open(int m, int n, int max_k);
/* Median milliseconds of `repeat` calls after two warm-up calls, each after the bench's L2 flush
 * (tool_gpu_set_read_flush) when `flush`, as the scorers are timed; 0 on failure. */
double tool_gpu_gemm_ms(tool_gemm *g, int k, int repeat, bool flush);
void tool_gpu_gemm_close(tool_gemm *g);
/* Device-to-device copy of `bytes`, TB/s counting read + write; 0 on failure. */
double tool_gpu_copy_tbps(size_t bytes, int repeat);
/*
 * The read-once baseline of top-k: reads every valid cell (p < nvp[t]) of scores [T, H, pitch]
 * once, coalesced, and writes one maximum per 256-cell row segment to segment_max, which holds
 * tool_gpu_read_once_floats(T, H, pitch) floats. Launch only (stream order); false on failure.
 */
size_t tool_gpu_read_once_floats(int32_t num_tokens, int heads, int32_t pitch);
bool tool_gpu_read_once(const float *scores, int32_t pitch, const int32_t *nvp, int32_t num_tokens,
                        int heads, float *segment_max, void *stream);
/*
 * The read-once baseline of scoring: reads each of the `num_pages` physical key pages listed in
 * `pages` (device memory) once, page_bytes (a multiple of 16) from k_cache + page * page_stride,
 * 16-byte loads, 4 pages per block (1 below 4096 pages); `sink` is one word. Launch only; false on
 * failure.
 */
bool tool_gpu_key_read(const void *k_cache, int64_t page_stride, int32_t page_bytes,
                       const int32_t *pages, int64_t num_pages, uint32_t *sink, void *stream);
/* Fills `bytes` with random E4M3 codes of magnitude < 2 (deterministic in seed), on the stream. */
bool tool_gpu_fill_random(void *dst, size_t bytes, uint64_t seed, void *stream);
#endif

#endif /* MSAIDX_TOOL_H */
