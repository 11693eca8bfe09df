/*
 * Shared by the C test suites: batch builders for the SPEC.md section 9 cases and random ragged
 * batches, a brute-force FP64 scorer and top-k written independently of the library, and the
 * one cross-backend check (like ggml's test-backend-ops) that every backend driver runs:
 * tests/test_backends.c for the host backend, tests/gpu_backends.c for the CUDA ones.
 */
#ifndef MSAIDX_TEST_BACKEND_CASES_H
#define MSAIDX_TEST_BACKEND_CASES_H

#include "harness.h"
#include "msaidx.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define BC_MAX_REQUESTS 64

/* What to build. seq_lens[b] = prefixes[b] + q_lens[b]. */
typedef struct bc_spec {
    const char *name;
    msaidx_dtype dtype;
    int32_t num_heads, head_dim, page_size;
    int32_t topk, init_blocks, local_blocks;
    int32_t batch_size;
    int32_t q_lens[BC_MAX_REQUESTS];
    int32_t prefixes[BC_MAX_REQUESTS];
    int32_t pad_tokens;     /* rows past cu[B]: nvp 0, never written */
    int32_t page_pad_bytes; /* page_stride - page_size * head_dim * elem (multiple of 16) */
    int32_t extra_pages;    /* physical pages no request uses */
    int32_t pitch_extra;    /* pitch - pages of max_seq_len */
    int32_t sample_tokens;  /* 0: check every token; else about this many (large cases) */
    bool distinct;          /* q = 1, page p of a request all one distinct E4M3-exact constant */
    bool decode;            /* run through msaidx_decode_scores */
    bool large;             /* too slow for a scalar host scorer on every row */
    bool fp8_accumulation;  /* MSAIDX_PRECISION_DEFAULT (else EXACT): E4M3 checked within the FP8
                               bound */
    bool nan_inputs;        /* NaN planted in Q rows, single keys and whole pages (see bc_build) */
    bool subnormal_inputs;  /* BF16: subnormals whose products count (see bc_build) */
} bc_spec;

/* A built batch in host memory. Metadata sits at 4-byte (not 16-byte) aligned addresses. */
typedef struct bc_batch {
    bc_spec spec;
    msaidx_config config; /* backend AUTO, host memory; drivers override backend/device */
    msaidx_batch_desc desc;
    int32_t *cu_seqlens_q, *seq_lens, *block_table;
    void *q, *k_cache;
    size_t q_bytes, k_bytes;
    int32_t *nvp;        /* [T], computed by the test from its own reading of SPEC.md */
    bool *checked;       /* [T]: scores of this token are compared */
    int32_t *sample_map; /* sampled batches: token of the full batch each row came from */
    void *allocations[8];
} bc_batch;

/* Cell poison: a NaN payload no backend writes. */
#define BC_POISON_BITS 0x7FBADBADu
void bc_poison(float *scores, size_t count);
bool bc_is_poison(float value);

/* Independent decoders, from the bit fields (never src/convert.h). */
double bc_e4m3_value(uint8_t code);
double bc_bf16_value(uint16_t bits);
double bc_elem_value(msaidx_dtype dtype, const void *base, size_t index);

bc_batch *bc_build(const bc_spec *spec, harness_rng *rng);
void bc_free(bc_batch *batch);
/* One request per checked token of `full` (q_len 1, seq_len pos + 1): the same cells, cheaply. */
bc_batch *bc_sample(const bc_batch *full);
size_t bc_score_count(const bc_batch *batch); /* T * H * pitch */

/* FP64 max over the visible keys of every page p < nvp, for token t and head h. */
void bc_brute_row(const bc_batch *batch, int32_t token, int32_t head, double *pages_out);
/* The same max of sum_d |q_d * k_d| instead of the dot: what fast accumulation's error scales with.
 */
void bc_brute_abs_row(const bc_batch *batch, int32_t token, int32_t head, double *pages_out);
/* bc_brute_row of every checked token into scores [T, H, pitch]; other cells untouched. */
void bc_brute_scores(const bc_batch *batch, float *scores);
/* The same with bc_brute_abs_row: each cell's A of bc_exact_bound. */
void bc_brute_abs_scores(const bc_batch *batch, float *abs_scores);
/* Scores of every checked token through the library's scalar reference (sampled via
 * bc_sample for large batches); other cells untouched. */
void bc_reference_scores(const bc_batch *batch, float *scores);

/* SPEC.md section 3's exact tolerance of a cell: 2e-4 * max(1, |ref|) + 2^-16 * A, A the largest
 * sum_d |q_d * k_d| over the page's visible keys (bc_brute_abs_row), FP32 summation error where
 * large products cancel. */
double bc_exact_bound(double ref, double largest_abs_dot);

/* |got - ref| <= bc_exact_bound (or got == ref, e.g. both -inf) on checked tokens' cells p < nvp,
 * poison on every cell p >= nvp (and on whole padding rows). At the default precision (E4M3) the
 * bound grows by MSAIDX_FP8_ACCUMULATION_DOT_BOUND times the cell's bc_brute_abs_row. One CHECK per
 * kind of failure; returns bad cells. */
long bc_compare_scores(const bc_batch *batch, const float *got, const float *ref,
                       const char *label);

/* Top-k by a full sort (SPEC.md section 4). */
void bc_topk_oracle(const msaidx_config *config, const float *scores, int32_t pitch,
                    const int32_t *nvp, int32_t num_tokens, int32_t *out);
/* Row shape: ascending, -1 only as tail, values < nvp, forced blocks present. */
/* What a case with nan_inputs promises, checked on the scores themselves: the NaN query row and
 * the all-NaN page 1 score exactly -inf; no visible cell is NaN. Returns bad cells. */
long bc_check_nan_semantics(const bc_batch *batch, const float *got, const char *what);
long bc_check_topk_shape(const msaidx_config *config, const int32_t *nvp, int32_t num_tokens,
                         const int32_t *out, const char *label);

/* Random scores [T, H, pitch] and nvp [T] for top-k: edge nvp values (<= 0, 16, 17, 1025, ...),
 * ties, NaN, infinities, signed zeros, subnormals; +inf past nvp; topk {1,16,64} by round,
 * init/local in {0,1,2}, H in {1,2,4}. */
typedef struct bc_topk_case {
    msaidx_config config;
    int32_t num_tokens, pitch;
    int32_t *nvp;
    float *scores;
} bc_topk_case;
/* T in [min_tokens, max_tokens], pitch in [min_pitch, max_pitch] (rounded up to a multiple of 4 on
 * odd rounds), rows of every kind (padding, short, long). */
void bc_topk_case_make(bc_topk_case *tc, harness_rng *rng, int round, int32_t min_pitch,
                       int32_t max_pitch, int32_t min_tokens, int32_t max_tokens);
void bc_topk_case_free(bc_topk_case *tc);

/* The SPEC.md section 9 cases and decode-shaped batches; `device_shapes` keeps D = page = 128. */
int bc_num_fixed_specs(void);
void bc_fixed_spec(int index, bc_spec *spec, harness_rng *rng);
void bc_random_spec(bc_spec *spec, harness_rng *rng, bool device_shapes);

/*
 * A backend under test. run() gets poisoned host buffers and must fill scores (its own kernel
 * output copied back), nvp (msaidx_plan_nvp of the plan) and topk (msaidx_topk_select of the
 * backend on its own scores). Returns MSAIDX_ERROR_NOT_SUPPORTED to skip a case.
 */
typedef msaidx_status (*bc_runner)(void *user, const bc_batch *batch, float *scores, int32_t *nvp,
                                   int32_t *topk);

typedef struct bc_options {
    msaidx_backend backend; /* the backend under test, for bc_must_admit (auto: no expectation) */
    bool sm90a;             /* the build and the device carry sm_90a code (persistent's need) */
    bool device_shapes;     /* D = page = 128 only */
    bool fp8_accumulation;  /* every case at MSAIDX_PRECISION_DEFAULT (else EXACT) */
    bool run_large;         /* run the large cases (sampled checks) */
    int random_cases;
    double sample_above_macs; /* > 0: check sampled rows only of fixed cases above this cost */
} bc_options;

/* Multiply-adds of a full reference run of `spec`. */
double bc_spec_macs(const bc_spec *spec);

/* Whether README and docs/engines.md say `backend` admits `config`: cpu every config; dense and
 * split D = page = 128; persistent those with H in {1, 2, 4} where build and device carry sm_90a
 * (`sm90a`). A refusal of such a config fails a test instead of skipping the case. */
bool bc_must_admit(msaidx_backend backend, bool sm90a, const msaidx_config *config);

/* Every case through `run`, checked against the scalar reference and the cpu top-k; a case the
 * backend refuses is skipped unless bc_must_admit(options->backend, options->sm90a, ...). */
void bc_run_backend(const char *label, bc_runner run, void *user, const bc_options *options,
                    harness_rng *rng);

/*
 * One plan shared by threads (the header's threads-and-streams rule). The driver plans `batch`
 * once; bc_check_shared_plan then runs layers on that plan through `run`, first one after another
 * from this thread (worker 0), then from `workers` threads at once, each `rounds` layers.
 */

/* Layer `layer`'s q: the batch's q with the sign of a pseudo-random half of its elements flipped
 * (layer 0: the batch's own q), so that concurrent layers have different scores. */
void bc_layer_q(const bc_batch *batch, int layer, void *q);

/* One layer on the shared plan, with worker `worker`'s outputs and stream: scores of
 * bc_layer_q(layer) (prefill or decode by batch->spec.decode), msaidx_topk_select of them, and
 * msaidx_prefill_topk without a score buffer, into the host buffers given (poisoned, each followed
 * by guard cells that bc_check_shared_plan checks). Runners with outputs elsewhere poison them
 * (BC_POISON_BITS, 0x5A bytes), copy them back, and add to *guard_hits the cells past them that
 * changed. Must not CHECK: it runs on several threads. */
typedef msaidx_status (*bc_layer_runner)(void *user, int worker, int layer, float *scores,
                                         int32_t *topk, int32_t *fused, long *guard_hits);

/* The calls of one layer, all on `stream`: scores (prefill or decode by batch->spec.decode),
 * msaidx_topk_select of them with the plan's nvp, then msaidx_prefill_topk without a score buffer
 * (the context's topk, init_blocks and local_blocks) with its workspace `fused_workspace`. */
msaidx_status bc_layer_calls(const msaidx_context *context, const msaidx_plan *plan,
                             const bc_batch *batch, const void *q, const void *k_cache,
                             float *scores, int32_t *topk, int32_t *fused, void *fused_workspace,
                             size_t fused_bytes, void *stream);

/* Checks the serial layers (layer 0's scores and top-k against the brute force and the oracle;
 * every prefill layer's fused selection equal to its top-k), then that every concurrent run is
 * bitwise the serial run of its layer, and that no run wrote past its outputs. */
void bc_check_shared_plan(const char *label, const bc_batch *batch, bc_layer_runner run, void *user,
                          int workers, int rounds, int layers);

#endif
