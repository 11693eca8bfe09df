/* msaidx check: accuracy. Exactness of every backend against FP64, top-16 recall of E4M3 and
 * BF16 storage against unquantized FP32 Q/K, and needle retrieval through FP8. */
#include "session.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NEEDLES 12
#define TOPK 16

static void check_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx check [options]\n"
        "\n"
        "  exactness  max |S - ref| / max(1, |ref|) of each backend against an FP64 reference on\n"
        "             sampled tokens of a ragged batch, E4M3 and BF16 (SPEC tolerance 2e-4)\n"
        "  recall     top-16 block sets selected from unquantized FP32 RMS-normalised Q/K vs from\n"
        "             E4M3 and BF16 storage: mean and worst per-row recall, contexts 8K .. 128K\n"
        "             (up to 1M on a GPU)\n"
        "  needles    12 key blocks aligned with the query planted at depths spread over 8K-128K\n"
        "             contexts among Gaussian noise, FP8: n/12 retrieved per backend\n"
        "Exit status 1 when a backend fails exactness, or retrieves fewer needles than the\n"
        "unquantized FP32 selection does.\n"
        "\n"
        "options:\n"
        "  --only PART       exactness, recall or needles\n"
        "  --cpu             host memory and the cpu backend only, even with a GPU\n"
        "  --precision P     default (persistent sums E4M3 with FP8 tensor cores; exactness then\n"
        "                    allows " TOOL_FP8_BOUND_TEXT ")\n"
        "                    or exact (every backend: " TOOL_EXACT_BOUND_TEXT "); each part\n"
        "                    reports the worst error as a fraction of its bound and recall adds "
        "how\n"
        "                    many top-16 picks differ from those of an FP64 sum of the same "
        "stored\n"
        "                    data; --fast-accumulation is the old spelling of --precision default\n"
        "  --max-context N   largest recall context (default 131072 on the CPU, 1048576 on a GPU)\n"
        "  --queries N       query tokens per recall context (default 16), H = 4\n"
        "  --threads N       cpu worker threads (default: all)\n"
        "  --seed N          random seed (default: from the clock, printed)\n");
}

typedef struct check_options {
    const char *only;
    bool force_cpu;
    msaidx_precision precision;
    long max_context, queries, threads;
    uint64_t seed;
} check_options;

static int parse_options(int argc, char **argv, check_options *o) {
    *o = (check_options){.max_context = -1, .queries = 16, .seed = tool_seed_from_clock()};
    unsigned precision_seen = 0;
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            check_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--cpu")) {
            o->force_cpu = true;
            continue;
        }
        if (!strcmp(a, "--fast-accumulation")) {
            if (!tool_precision_option(a, NULL, &precision_seen, &o->precision)) return 2;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "msaidx check: unknown option or missing value: %s\n", a);
            return 2;
        }
        ++i;
        long n = 0;
        bool ok = true;
        if (!strcmp(a, "--only")) {
            o->only = v;
            ok = !strcmp(v, "exactness") || !strcmp(v, "recall") || !strcmp(v, "needles");
            if (!ok)
                fprintf(stderr, "msaidx check: --only %s: expected exactness, recall or needles\n",
                        v);
        } else if (!strcmp(a, "--precision"))
            ok = tool_precision_option(a, v, &precision_seen, &o->precision);
        else if (!strcmp(a, "--max-context"))
            ok = tool_parse_int(v, a, 8192, 1 << 24, &o->max_context);
        else if (!strcmp(a, "--queries"))
            ok = tool_parse_int(v, a, 1, 4096, &o->queries);
        else if (!strcmp(a, "--threads"))
            ok = tool_parse_int(v, a, 0, 4096, &o->threads);
        else if (!strcmp(a, "--seed"))
            ok = tool_parse_int(v, a, 0, INT64_MAX, &n), o->seed = (uint64_t)n;
        else {
            fprintf(stderr, "msaidx check: unknown option %s (see msaidx check --help)\n", a);
            return 2;
        }
        if (!ok) return 2;
    }
    return -1;
}

/* Scores and top-k of `batch` on one backend, copied back to host buffers [T, H, pitch] and
 * [T, H, 16] (scores poisoned with 0xFF before the run, so unwritten cells stay NaN). */
static bool run_backend(const tool_exec *exec, const tool_batch *batch, msaidx_backend backend,
                        const check_options *o, float *scores, int32_t *topk) {
    const msaidx_batch_desc *d = &batch->desc;
    const size_t score_bytes =
        (size_t)d->num_tokens * batch->heads * (size_t)d->pitch * sizeof(float);
    const size_t topk_bytes = (size_t)d->num_tokens * batch->heads * TOPK * sizeof(int32_t);
    tool_session session = {0};
    void *q = NULL, *k = NULL, *scores_dev = NULL, *topk_dev = NULL;
    bool ok = tool_session_open(&session, exec, batch, backend, (int)o->threads, o->precision) &&
              exec->alloc(&q, batch->q_bytes) && exec->alloc(&k, batch->k_bytes) &&
              exec->alloc(&scores_dev, score_bytes) && exec->alloc(&topk_dev, topk_bytes) &&
              exec->upload(q, batch->q, batch->q_bytes) &&
              exec->upload(k, batch->k_cache, batch->k_bytes) &&
              exec->poison(scores_dev, score_bytes) &&
              tool_session_scores(&session, q, k, scores_dev) &&
              tool_session_topk(&session, scores_dev, d->pitch, d->num_tokens, topk_dev) &&
              tool_session_check(&session) && exec->download(scores, scores_dev, score_bytes) &&
              exec->download(topk, topk_dev, topk_bytes);
    exec->release(q);
    exec->release(k);
    exec->release(scores_dev);
    exec->release(topk_dev);
    tool_session_close(&session);
    return ok;
}

typedef struct backend_list {
    int count;
    msaidx_backend ids[4];
    const tool_exec *execs[4];
} backend_list;

static backend_list available_backends(const tool_exec *gpu) {
    backend_list list = {.count = 1, .ids = {MSAIDX_BACKEND_CPU}, .execs = {tool_host_exec()}};
    if (!gpu) return list;
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = gpu->device;
    for (int b = MSAIDX_BACKEND_DENSE; b <= MSAIDX_BACKEND_PERSISTENT; ++b)
        if (msaidx_backend_supported((msaidx_backend)b, &config) == MSAIDX_SUCCESS) {
            list.ids[list.count] = (msaidx_backend)b;
            list.execs[list.count++] = gpu;
        }
    return list;
}

static bool alloc_outputs(const tool_batch *batch, float **scores, int32_t **topk) {
    const msaidx_batch_desc *d = &batch->desc;
    *scores = malloc((size_t)d->num_tokens * batch->heads * (size_t)d->pitch * sizeof(float));
    *topk = malloc((size_t)d->num_tokens * batch->heads * TOPK * sizeof(int32_t));
    if (*scores && *topk) return true;
    fprintf(stderr, "msaidx check: out of host memory for scores\n");
    free(*scores);
    free(*topk);
    return false;
}

/* ---- exactness ---- */

static bool check_exactness(const check_options *o, const backend_list *backends, bool on_gpu) {
    static const int32_t cpu_q[] = {1, 4, 1024, 3072}, cpu_kv[] = {16384, 8196, 9216, 3072};
    static const int32_t gpu_q[] = {1, 1, 4, 2048, 1024},
                         gpu_kv[] = {131072, 32768, 65540, 34816, 102400};
    const int32_t *q_lens = on_gpu ? gpu_q : cpu_q, *kv_lens = on_gpu ? gpu_kv : cpu_kv;
    const int B = on_gpu ? 5 : 4, H = 4;
    bool all_pass = true;
    printf("\nexactness: max |S - ref| / max(1, |ref|) vs FP64, precision %s "
           "(bound " TOOL_EXACT_BOUND_TEXT "%s), H=%d, q_lens",
           tool_precision_name(o->precision),
           o->precision == MSAIDX_PRECISION_DEFAULT ? "; E4M3 on persistent " TOOL_FP8_BOUND_TEXT
                                                    : "",
           H);
    for (int b = 0; b < B; ++b) printf("%s%d", b ? "," : " ", q_lens[b]);
    printf(", kv_lens");
    for (int b = 0; b < B; ++b) printf("%s%d", b ? "," : " ", kv_lens[b]);
    printf("\n  %-11s %-5s %8s %12s %10s %s\n", "backend", "dtype", "cells", "max rel err",
           "bad cells", "status (worst error / bound)");
    for (int dt = 0; dt < 2; ++dt) {
        const msaidx_dtype dtype = dt ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
        tool_batch batch = {0};
        float *scores = NULL;
        int32_t *topk = NULL;
        if (!tool_batch_layout(&batch, H, dtype, q_lens, kv_lens, B, 0, 0, 0,
                               o->seed + (uint64_t)dt) ||
            !tool_batch_fill(&batch, (int64_t)batch.desc.num_tokens * H, o->seed + (uint64_t)dt,
                             true) ||
            !alloc_outputs(&batch, &scores, &topk)) {
            tool_batch_free(&batch);
            return false;
        }
        /* Sampled tokens: the first and last of every request, then every stride-th. */
        const int32_t T = batch.desc.num_tokens, stride = T / 32 > 0 ? T / 32 : 1;
        for (int i = 0; i < backends->count; ++i) {
            msaidx_config admitted;
            msaidx_config_init(&admitted);
            admitted.dtype = dtype;
            admitted.num_heads = H;
            admitted.device = backends->ids[i] == MSAIDX_BACKEND_CPU ? MSAIDX_DEVICE_HOST
                                                                     : backends->execs[i]->device;
            if (msaidx_backend_supported(backends->ids[i], &admitted) != MSAIDX_SUCCESS) {
                printf("  %-11s %-5s %8s %12s %10s not admitted (%s)\n",
                       msaidx_backend_name(backends->ids[i]), dt ? "bf16" : "e4m3", "-", "-", "-",
                       msaidx_last_error());
                continue;
            }
            tool_accuracy acc = {0};
            const bool ran =
                run_backend(backends->execs[i], &batch, backends->ids[i], o, scores, topk);
            if (ran) {
#pragma omp parallel
                {
                    double *scratch =
                        malloc(sizeof(double) * 2 * (size_t)H * (size_t)batch.desc.pitch);
                    tool_accuracy mine = {0};
#pragma omp for schedule(dynamic)
                    for (int32_t t = 0; t < T; ++t) {
                        const int b = tool_request_of(&batch, t);
                        const bool edge =
                            t == batch.cu_seqlens_q[b] || t == batch.cu_seqlens_q[b + 1] - 1;
                        if (scratch && (edge || t % stride == 0))
                            tool_compare_token(
                                &batch, t, scores,
                                tool_fp8_bound(&batch, backends->ids[i], o->precision), scratch,
                                &mine);
                    }
#pragma omp critical
                    {
                        acc.cells += mine.cells;
                        acc.bad_cells += mine.bad_cells + mine.written_past_nvp;
                        acc.max_rel_error = fmax(acc.max_rel_error, mine.max_rel_error);
                        acc.max_bound_ratio = fmax(acc.max_bound_ratio, mine.max_bound_ratio);
                    }
                    free(scratch);
                }
            }
            const bool pass = ran && acc.cells > 0 && acc.bad_cells == 0;
            all_pass = all_pass && pass;
            printf("  %-11s %-5s %8lld %12.3g %10lld %s", msaidx_backend_name(backends->ids[i]),
                   dt ? "bf16" : "e4m3", (long long)acc.cells, acc.max_rel_error,
                   (long long)acc.bad_cells,
                   !ran   ? "ERROR"
                   : pass ? "PASS"
                          : "FAIL");
            if (ran) printf(" (%.3g)", acc.max_bound_ratio);
            printf("\n");
            fflush(stdout);
        }
        free(scores);
        free(topk);
        tool_batch_free(&batch);
    }
    return all_pass;
}

/* ---- quantization recall ---- */

/* Unquantized rows from the same streams tool_batch_fill quantizes. */
static float *float_rows(int64_t rows, uint64_t seed, uint64_t first_stream) {
    float *rows_out = malloc(sizeof(float) * TOOL_HEAD_DIM * (size_t)rows);
    if (!rows_out) {
        fprintf(stderr, "msaidx check: out of host memory for %lld FP32 rows\n", (long long)rows);
        return NULL;
    }
    const int64_t chunk = 1024;
#pragma omp parallel for schedule(static)
    for (int64_t first = 0; first < rows; first += chunk)
        tool_gaussian_rows(rows_out + first * TOOL_HEAD_DIM,
                           rows - first < chunk ? rows - first : chunk, seed,
                           first_stream + (uint64_t)first);
    return rows_out;
}

static int overlap(const int32_t *a, const int32_t *b) {
    int common = 0;
    for (int i = 0; i < TOPK; ++i)
        for (int j = 0; j < TOPK; ++j) common += a[i] >= 0 && a[i] == b[j];
    return common;
}

/* Picks of `topk` [T, H, 16] that are not in the top-16 of FP64 sums of the batch's stored data:
 * what the backend's accumulation changes, quantization aside. */
static long long picks_differing_from_fp64(const tool_batch *batch, const int32_t *topk) {
    const int H = batch->heads;
    long long differ = 0;
#pragma omp parallel reduction(+ : differ)
    {
        double *ref = malloc(sizeof(double) * (size_t)H * (size_t)batch->desc.pitch);
        float *row = malloc(sizeof(float) * (size_t)batch->desc.pitch);
        int32_t exact[TOPK];
#pragma omp for schedule(dynamic)
        for (int32_t t = 0; t < batch->desc.num_tokens; ++t) {
            if (!ref || !row) continue;
            tool_reference_token(batch, t, ref, NULL);
            const int32_t nvp = batch->nvp[t];
            for (int h = 0; h < H; ++h) {
                for (int32_t p = 0; p < nvp; ++p) row[p] = (float)ref[(size_t)h * nvp + p];
                tool_topk_row(row, nvp, TOPK, 0, 1, exact);
                const int32_t *mine = topk + ((size_t)t * H + h) * TOPK;
                int present = 0;
                for (int i = 0; i < TOPK; ++i) present += mine[i] >= 0;
                differ += present - overlap(exact, mine);
            }
        }
        free(ref);
        free(row);
    }
    return differ;
}

/* Reports recall; false when a context could not be measured (memory, a backend error). */
static bool check_recall(const check_options *o, const tool_exec *exec, msaidx_backend backend) {
    const int H = 4;
    bool all_ran = true;
    printf("\nrecall of the top-%d block set: FP32 unquantized RMS-normalised Q/K vs E4M3 / BF16 "
           "storage\n"
           "  (backend %s, precision %s, H=%d, %ld query tokens at the end of each context; recall "
           "= |FP32 set &\n"
           "  stored set| / %d; 'vs FP64' = picks that differ from the top-%d of FP64 sums of the "
           "same stored data)\n",
           TOPK, msaidx_backend_name(backend), tool_precision_name(o->precision), H, o->queries,
           TOPK, TOPK);
    printf("  %8s %10s %10s %10s %10s %14s %14s\n", "context", "e4m3 mean", "e4m3 worst",
           "bf16 mean", "bf16 worst", "e4m3 vs FP64", "bf16 vs FP64");
    /* 8K, 32K, 128K, ... and the largest asked for (1M on a GPU). */
    for (long context = 8192; context <= o->max_context;
         context = context * 4 > o->max_context && context < o->max_context ? o->max_context
                                                                            : context * 4) {
        const int32_t q_len = (int32_t)o->queries, kv_len = (int32_t)context;
        tool_batch batch = {0};
        float *q_float = NULL, *k_float = NULL, *scores = NULL;
        int32_t *fp32_topk = NULL, *topk = NULL;
        double mean[2] = {0}, worst[2] = {1, 1};
        long long differ_fp64[2] = {0};
        bool ok = tool_batch_layout(&batch, H, MSAIDX_DTYPE_E4M3, &q_len, &kv_len, 1, 0, 0, 0,
                                    o->seed + (uint64_t)context);
        const int64_t q_rows = (int64_t)q_len * H,
                      k_rows = (int64_t)batch.desc.num_pages * TOOL_PAGE;
        ok = ok && (q_float = float_rows(q_rows, o->seed, 0)) &&
             (k_float = float_rows(k_rows, o->seed, TOOL_K_STREAM)) &&
             (fp32_topk = malloc(sizeof(int32_t) * TOPK * (size_t)q_rows)) &&
             alloc_outputs(&batch, &scores, &topk);
        if (ok) {
            bool scratch_failed = false;
#pragma omp parallel
            {
                double *ref = malloc(sizeof(double) * (size_t)H * (size_t)batch.desc.pitch);
                float *row = malloc(sizeof(float) * (size_t)batch.desc.pitch);
                if (!ref || !row) {
#pragma omp atomic write
                    scratch_failed = true;
                }
#pragma omp for schedule(dynamic)
                for (int32_t t = 0; t < q_len; ++t) {
                    if (!ref || !row) continue;
                    tool_reference_token_float(&batch, t, q_float, k_float, ref);
                    const int32_t nvp = batch.nvp[t];
                    for (int h = 0; h < H; ++h) {
                        for (int32_t p = 0; p < nvp; ++p) row[p] = (float)ref[(size_t)h * nvp + p];
                        tool_topk_row(row, nvp, TOPK, 0, 1, fp32_topk + ((size_t)t * H + h) * TOPK);
                    }
                }
                free(ref);
                free(row);
            }
            if (scratch_failed) {
                fprintf(stderr, "msaidx check: out of host memory for the FP32 reference\n");
                ok = false;
            }
        }
        for (int dt = 0; ok && dt < 2; ++dt) {
            batch.dtype = dt ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
            batch.desc.page_stride = (int64_t)TOOL_PAGE * TOOL_HEAD_DIM * (dt ? 2 : 1);
            ok = tool_batch_fill(&batch, q_rows, o->seed, false) &&
                 run_backend(exec, &batch, backend, o, scores, topk);
            for (int64_t r = 0; ok && r < q_rows; ++r) {
                const double recall = overlap(fp32_topk + r * TOPK, topk + r * TOPK) / (double)TOPK;
                mean[dt] += recall / (double)q_rows;
                worst[dt] = fmin(worst[dt], recall);
            }
            if (ok) differ_fp64[dt] = picks_differing_from_fp64(&batch, topk);
        }
        const double picks = (double)q_rows * TOPK;
        char label[32];
        if (context % 1024 == 0)
            snprintf(label, sizeof label, "%ldK", context / 1024);
        else
            snprintf(label, sizeof label, "%ld", context);
        if (ok)
            printf("  %8s %10.4f %10.4f %10.4f %10.4f %7lld %5.3f%% %7lld %5.3f%%\n", label,
                   mean[0], worst[0], mean[1], worst[1], differ_fp64[0],
                   100.0 * (double)differ_fp64[0] / picks, differ_fp64[1],
                   100.0 * (double)differ_fp64[1] / picks);
        else
            printf("  %8s failed\n", label);
        all_ran = all_ran && ok;
        fflush(stdout);
        free(q_float);
        free(k_float);
        free(fp32_topk);
        free(scores);
        free(topk);
        tool_batch_free(&batch);
    }
    return all_ran;
}

/* ---- needles ---- */

static bool check_needles(const check_options *o, const backend_list *backends) {
    /* 3 contexts x 4 depths; one decode query per needle, H = 1. */
    static const int32_t contexts[3] = {8192, 32768, 131072};
    static const double depths[4] = {0.1, 0.35, 0.6, 0.85};
    /* The planted key is alpha * q + sqrt(1 - alpha^2) * noise: its dot with q is alpha * D,
     * against noise maxima of about 5 sqrt(D) over 128K keys, so FP32 finds it and quantization
     * has to keep it. */
    const double alpha = 0.55;
    int32_t q_lens[NEEDLES], kv_lens[NEEDLES], needle_page[NEEDLES];
    for (int n = 0; n < NEEDLES; ++n) {
        q_lens[n] = 1;
        kv_lens[n] = contexts[n / 4];
    }
    tool_batch batch = {0};
    float *q_float = NULL, *k_float = NULL, *scores = NULL, *row = NULL;
    int32_t *topk = NULL;
    double *ref = NULL;
    bool pass = false;
    printf("\nneedle retrieval: %d needles (one key aligned with the query, alpha %.2f) at depths "
           "10/35/60/85%% of\n"
           "  8K, 32K and 128K contexts, E4M3, H=1, top-%d%s: needles whose page is selected\n",
           NEEDLES, alpha, TOPK, o->precision == MSAIDX_PRECISION_EXACT ? ", exact precision" : "");
    if (!tool_batch_layout(&batch, 1, MSAIDX_DTYPE_E4M3, q_lens, kv_lens, NEEDLES, 0, 0, 0,
                           o->seed) ||
        !(q_float = float_rows(NEEDLES, o->seed, 0)) ||
        !(k_float =
              float_rows((int64_t)batch.desc.num_pages * TOOL_PAGE, o->seed, TOOL_K_STREAM)) ||
        !alloc_outputs(&batch, &scores, &topk) ||
        !(row = malloc(sizeof(float) * (size_t)batch.desc.pitch)) ||
        !(ref = malloc(sizeof(double) * (size_t)batch.desc.pitch)))
        goto done;
    for (int n = 0; n < NEEDLES; ++n) {
        const int32_t pos = (int32_t)(depths[n % 4] * (kv_lens[n] - 1));
        needle_page[n] = pos / TOOL_PAGE;
        const int32_t physical =
            batch.block_table[(size_t)n * batch.desc.bt_stride + needle_page[n]];
        float *key =
            k_float + ((size_t)physical * TOOL_PAGE + (size_t)(pos % TOOL_PAGE)) * TOOL_HEAD_DIM;
        const float *q = q_float + (size_t)n * TOOL_HEAD_DIM;
        for (int e = 0; e < TOOL_HEAD_DIM; ++e)
            key[e] = (float)(alpha * q[e] + sqrt(1.0 - alpha * alpha) * key[e]);
    }
    /* Store the planted float rows as E4M3 (one byte each). */
    batch.q_bytes = NEEDLES * TOOL_HEAD_DIM;
    batch.k_bytes = (size_t)batch.desc.num_pages * TOOL_PAGE * TOOL_HEAD_DIM;
    batch.q = malloc(batch.q_bytes);
    batch.k_cache = aligned_alloc(256, (batch.k_bytes + 255) / 256 * 256);
    if (!batch.q || !batch.k_cache) goto done;
    tool_store(MSAIDX_DTYPE_E4M3, q_float, batch.q, NEEDLES * TOOL_HEAD_DIM);
    tool_store(MSAIDX_DTYPE_E4M3, k_float, batch.k_cache,
               (size_t)batch.desc.num_pages * TOOL_PAGE * TOOL_HEAD_DIM);

    int found_fp32 = 0;
    for (int n = 0; n < NEEDLES; ++n) {
        int32_t selected[TOPK];
        const int32_t nvp = batch.nvp[n];
        tool_reference_token_float(&batch, n, q_float, k_float, ref);
        for (int32_t p = 0; p < nvp; ++p) row[p] = (float)ref[p];
        tool_topk_row(row, nvp, TOPK, 0, 1, selected);
        for (int i = 0; i < TOPK; ++i) found_fp32 += selected[i] == needle_page[n];
    }
    printf("  %-11s %2d/%d\n", "fp32 (ref)", found_fp32, NEEDLES);
    pass = true;
    for (int i = 0; i < backends->count; ++i) {
        int found = 0;
        const bool ran = run_backend(backends->execs[i], &batch, backends->ids[i], o, scores, topk);
        for (int n = 0; ran && n < NEEDLES; ++n)
            for (int j = 0; j < TOPK; ++j) found += topk[(size_t)n * TOPK + j] == needle_page[n];
        printf("  %-11s %2d/%d%s\n", msaidx_backend_name(backends->ids[i]), found, NEEDLES,
               ran ? "" : " (ERROR)");
        pass = pass && ran && found >= found_fp32;
    }
done:
    free(q_float);
    free(k_float);
    free(scores);
    free(topk);
    free(row);
    free(ref);
    tool_batch_free(&batch);
    return pass;
}

int cmd_check(int argc, char **argv) {
    check_options o;
    int parsed = parse_options(argc, argv, &o);
    if (parsed >= 0) return parsed;
    const tool_exec *gpu = o.force_cpu ? NULL : tool_pick_gpu();
    if (o.max_context < 0) o.max_context = gpu ? 1048576 : 131072;
    const backend_list backends = available_backends(gpu);
    printf("msaidx check: seed %llu, device %s, backends", (unsigned long long)o.seed,
           gpu ? gpu->name : "host");
    for (int i = 0; i < backends.count; ++i) printf(" %s", msaidx_backend_name(backends.ids[i]));
    printf("; precision %s\n", tool_precision_name(o.precision));
    fflush(stdout);
    bool pass = true;
    if (!o.only || !strcmp(o.only, "exactness"))
        pass = check_exactness(&o, &backends, gpu != NULL) && pass;
    if (!o.only || !strcmp(o.only, "recall"))
        pass = check_recall(&o, gpu ? gpu : tool_host_exec(),
                            gpu ? MSAIDX_BACKEND_AUTO : MSAIDX_BACKEND_CPU) &&
               pass;
    if (!o.only || !strcmp(o.only, "needles")) pass = check_needles(&o, &backends) && pass;
    printf("\n%s\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
