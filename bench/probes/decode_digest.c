/* A digest of msaidx_decode_scores' output, to compare two builds of the decode scorer bitwise
 * (same seeds, same data): one line per case (dtype, H, batch kind) with an FNV-1a hash of the
 * whole score buffer, poisoned before the call, so the unwritten cells count too. Two builds that
 * sum every dot in the same order print the same lines. With the argument `prefill`: the same for
 * msaidx_prefill_scores on the persistent backend (E4M3 at both precisions, BF16), on batches
 * whose row tiles range from a few rows to full.
 *
 *   gcc -O2 -std=c11 -Iinclude -IBUILD/include bench/probes/decode_digest.c
 * BUILD/libmsaidx_static.a \
 *       -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart_static -lstdc++ -lgomp -lm \
 *       -ldl -lpthread -lrt -o decode_digest && ./decode_digest
 */
#include <msaidx.h>

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAGE 128
#define DIM 128
#define PHYSICAL_PAGES 4096
#define PAGE_PAD 256 /* bytes between pages past the keys: padded strides */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static int32_t random_int(int32_t lo, int32_t hi) {
    return lo + (int32_t)(next_random() % (uint64_t)(hi - lo + 1));
}

/* Finite values of moderate size: E4M3 codes with bit 6 clear (|x| < 2); BF16 with exponents
 * near 1. */
static void fill_values(uint8_t *dst, size_t bytes, msaidx_dtype dtype) {
    if (dtype == MSAIDX_DTYPE_E4M3) {
        for (size_t i = 0; i < bytes; ++i) dst[i] = (uint8_t)(next_random() & 0xBF);
        return;
    }
    uint16_t *v = (uint16_t *)dst;
    for (size_t i = 0; i < bytes / 2; ++i) {
        const uint64_t r = next_random();
        v[i] =
            (uint16_t)((r & 0x8000) | ((uint16_t)(120 + (r >> 16) % 12) << 7) | (r >> 32 & 0x7F));
    }
}

static bool ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    return false;
}
static bool lib_ok(msaidx_status s, const char *what) {
    if (s == MSAIDX_SUCCESS) return true;
    fprintf(stderr, "%s: %s\n", what, msaidx_last_error());
    return false;
}

typedef struct batch_kind {
    const char *name;
    int32_t requests, min_q_len, max_q_len, min_seq, max_seq;
} batch_kind;

static const batch_kind decode_kinds[] = {
    {"decode16", 16, 1, 1, 1, 200000},    {"spec6", 6, 1, 8, 1, 70000},
    {"long2", 2, 1, 1, 1048576, 1048576}, {"decode64", 64, 1, 1, 1, 40000},
    {"spec3x4", 3, 1, 4, 100, 300000},
};
static const batch_kind prefill_kinds[] = {
    {"q128_1m", 1, 128, 128, 1048576, 1048576}, {"q9_64", 3, 9, 64, 9, 300000},
    {"ragged8", 8, 9, 300, 300, 100000},        {"q600x2", 2, 500, 600, 600, 70000},
    {"q4k", 1, 4096, 4096, 4096, 20000},
};

static bool run_case(msaidx_dtype dtype, msaidx_precision precision, int heads,
                     const batch_kind *kind, bool prefill, const uint8_t *k_dev,
                     uint64_t *digest_out) {
    const int32_t B = kind->requests;
    int32_t *cu = malloc(sizeof(int32_t) * (B + 1)), *seq = malloc(sizeof(int32_t) * B);
    cu[0] = 0;
    int32_t max_seq = 0, max_q_len = 0;
    for (int32_t b = 0; b < B; ++b) {
        seq[b] = random_int(kind->min_seq, kind->max_seq);
        const int32_t q_len =
            random_int(kind->min_q_len, kind->max_q_len < seq[b] ? kind->max_q_len : seq[b]);
        cu[b + 1] = cu[b] + q_len;
        max_seq = seq[b] > max_seq ? seq[b] : max_seq;
        max_q_len = q_len > max_q_len ? q_len : max_q_len;
    }
    const int32_t T = cu[B], bt_stride = (max_seq + PAGE - 1) / PAGE + 5, pitch = bt_stride + 3;
    const size_t elem = dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    int32_t *table = malloc(sizeof(int32_t) * (size_t)B * bt_stride);
    for (size_t i = 0; i < (size_t)B * bt_stride; ++i) table[i] = random_int(0, PHYSICAL_PAGES - 1);
    const size_t q_bytes = (size_t)T * heads * DIM * elem;
    const size_t score_bytes = sizeof(float) * (size_t)T * heads * pitch;
    uint8_t *q = malloc(q_bytes);
    float *scores = malloc(score_bytes);
    fill_values(q, q_bytes, dtype);

    msaidx_config config;
    msaidx_config_init(&config);
    config.dtype = dtype;
    config.num_heads = heads;
    config.device = 0;
    config.precision = precision;
    if (prefill) config.backend = MSAIDX_BACKEND_PERSISTENT;
    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = B;
    desc.num_tokens = T;
    desc.max_q_len = max_q_len;
    desc.max_seq_len = max_seq;
    desc.num_pages = PHYSICAL_PAGES;
    desc.bt_stride = bt_stride;
    desc.page_stride = (int64_t)PAGE * DIM * elem + PAGE_PAD;
    desc.pitch = pitch;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    void *q_dev = NULL, *workspace = NULL;
    float *scores_dev = NULL;
    int32_t *cu_dev = NULL, *seq_dev = NULL, *table_dev = NULL;
    size_t workspace_bytes = 0;
    bool good =
        lib_ok(msaidx_context_create(&context, &config), "context") &&
        lib_ok(msaidx_plan_create(&plan, context, &desc), "plan") &&
        lib_ok(msaidx_plan_workspace_size(plan, &workspace_bytes), "workspace size") &&
        ok(cudaMalloc(&workspace, workspace_bytes), "alloc") &&
        ok(cudaMalloc(&q_dev, q_bytes), "alloc") &&
        ok(cudaMalloc((void **)&scores_dev, score_bytes), "alloc") &&
        ok(cudaMalloc((void **)&cu_dev, sizeof(int32_t) * (B + 1)), "alloc") &&
        ok(cudaMalloc((void **)&seq_dev, sizeof(int32_t) * B), "alloc") &&
        ok(cudaMalloc((void **)&table_dev, sizeof(int32_t) * (size_t)B * bt_stride), "alloc") &&
        ok(cudaMemcpy(q_dev, q, q_bytes, cudaMemcpyHostToDevice), "upload") &&
        ok(cudaMemcpy(cu_dev, cu, sizeof(int32_t) * (B + 1), cudaMemcpyHostToDevice), "upload") &&
        ok(cudaMemcpy(seq_dev, seq, sizeof(int32_t) * B, cudaMemcpyHostToDevice), "upload") &&
        ok(cudaMemcpy(table_dev, table, sizeof(int32_t) * (size_t)B * bt_stride,
                      cudaMemcpyHostToDevice),
           "upload") &&
        ok(cudaMemset(scores_dev, 0xFF, score_bytes), "poison") &&
        lib_ok(
            msaidx_plan_batch(plan, cu_dev, seq_dev, table_dev, workspace, workspace_bytes, NULL),
            "plan batch") &&
        lib_ok(prefill ? msaidx_prefill_scores(plan, q_dev, k_dev, scores_dev, NULL)
                       : msaidx_decode_scores(plan, q_dev, k_dev, scores_dev, NULL),
               "scores") &&
        lib_ok(msaidx_plan_check(plan, NULL), "plan check") &&
        ok(cudaMemcpy(scores, scores_dev, score_bytes, cudaMemcpyDeviceToHost), "download");
    if (good) {
        uint64_t h = 0xCBF29CE484222325ull;
        for (size_t i = 0; i < score_bytes; ++i)
            h = (h ^ ((const uint8_t *)scores)[i]) * 0x100000001B3ull;
        *digest_out = h;
    }
    cudaFree(workspace);
    cudaFree(q_dev);
    cudaFree(scores_dev);
    cudaFree(cu_dev);
    cudaFree(seq_dev);
    cudaFree(table_dev);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    free(cu);
    free(seq);
    free(table);
    free(q);
    free(scores);
    return good;
}

int main(int argc, char **argv) {
    const bool prefill = argc > 1 && !strcmp(argv[1], "prefill");
    const batch_kind *kinds = prefill ? prefill_kinds : decode_kinds;
    const size_t num_kinds = prefill ? sizeof prefill_kinds / sizeof prefill_kinds[0]
                                     : sizeof decode_kinds / sizeof decode_kinds[0];
    /* E4M3 at the default precision, BF16, and (prefill) E4M3 exact. */
    const msaidx_dtype dtypes[] = {MSAIDX_DTYPE_E4M3, MSAIDX_DTYPE_BF16, MSAIDX_DTYPE_E4M3};
    const msaidx_precision precisions[] = {MSAIDX_PRECISION_DEFAULT, MSAIDX_PRECISION_DEFAULT,
                                           MSAIDX_PRECISION_EXACT};
    const char *names[] = {"e4m3", "bf16", "exact"};
    const int heads[] = {1, 2, 4};
    int failed = 0;
    for (int d = 0; d < (prefill ? 3 : 2); ++d) {
        const size_t elem = dtypes[d] == MSAIDX_DTYPE_BF16 ? 2 : 1;
        const size_t k_bytes = (size_t)PHYSICAL_PAGES * ((size_t)PAGE * DIM * elem + PAGE_PAD);
        uint8_t *k = malloc(k_bytes);
        void *k_dev = NULL;
        fill_values(k, k_bytes, dtypes[d]);
        if (!ok(cudaMalloc(&k_dev, k_bytes), "alloc keys") ||
            !ok(cudaMemcpy(k_dev, k, k_bytes, cudaMemcpyHostToDevice), "upload keys"))
            return 1;
        for (int h = 0; h < 3; ++h)
            for (size_t c = 0; c < num_kinds; ++c) {
                uint64_t digest = 0;
                const bool good = run_case(dtypes[d], precisions[d], heads[h], &kinds[c], prefill,
                                           k_dev, &digest);
                failed += !good;
                printf("%s H%d %-8s %016llx%s\n", names[d], heads[h], kinds[c].name,
                       (unsigned long long)digest, good ? "" : " FAILED");
            }
        cudaFree(k_dev);
        free(k);
    }
    return failed ? 1 : 0;
}
