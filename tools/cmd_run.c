/* msaidx run: the main job. A MiniMax-M3-like ragged prefill batch, scored and top-k selected
 * on the GPU when there is one (else the CPU), checked against an FP64 reference. */
#include "session.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Decode requests first, then prefill chunks with prefixes (SPEC.md section 2). */
static const char *const cpu_default_q = "1,4,1024,3072";
static const char *const cpu_default_kv = "16384,8196,9216,3072";
static const char *const gpu_default_q = "1,1,4,2048,4096,1024";
static const char *const gpu_default_kv = "131072,32768,65540,34816,4096,102400";

static void run_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx run [options]\n"
        "\n"
        "Builds a MiniMax-M3-like batch (Q and K Gaussian, RMS-normalised per row, stored as\n"
        "E4M3 or BF16; a ragged batch of decode and prefill requests over a scattered block\n"
        "table), plans, scores and top-k selects it on the GPU if one is present (else the CPU),\n"
        "checks sampled rows against an FP64 reference (SPEC tolerance 2e-4) and the top-k "
        "against\n"
        "the cpu top-k of the same scores. Exit status 0 = checks passed, 1 = a check failed,\n"
        "2 = usage or runtime error.\n"
        "\n"
        "options:\n"
        "  --backend B     auto (default), cpu, dense, split, persistent\n"
        "  --cpu           use host memory and the cpu backend even when a GPU is present\n"
        "  --precision P   default (persistent sums E4M3 on FP8 tensor cores; the FP64 check then\n"
        "                  allows " TOOL_FP8_BOUND_TEXT ") or exact (every backend:\n"
        "                  " TOOL_EXACT_BOUND_TEXT "); --fast-accumulation is the old spelling of\n"
        "                  --precision default\n"
        "  --heads H       index heads (default 4)\n"
        "  --dtype D       e4m3 (default) or bf16\n"
        "  --q-lens LIST   new tokens per request (CPU default %s; GPU default %s)\n"
        "  --kv-lens LIST  total context per request incl. the new tokens (CPU default %s;\n"
        "                  GPU default %s)\n"
        "  --page-pad N    extra bytes per key-cache page (multiple of 16, default 0)\n"
        "  --repeat N      timed runs after one warm-up, median reported (default 3 on the CPU,\n"
        "                  10 on a GPU)\n"
        "  --sample N      query tokens checked against FP64 (default 48; first and last of each\n"
        "                  request always included)\n"
        "  --threads N     cpu worker threads (default: all)\n"
        "  --seed N        random seed (default: from the clock, printed)\n",
        cpu_default_q, gpu_default_q, cpu_default_kv, gpu_default_kv);
}

typedef struct run_options {
    msaidx_backend backend;
    bool force_cpu;
    msaidx_precision precision;
    int heads;
    msaidx_dtype dtype;
    const char *q_text, *kv_text;
    long page_pad, repeat, sample, threads;
    uint64_t seed;
} run_options;

static int parse_options(int argc, char **argv, run_options *o) {
    *o = (run_options){.backend = MSAIDX_BACKEND_AUTO,
                       .heads = 4,
                       .dtype = MSAIDX_DTYPE_E4M3,
                       .repeat = -1,
                       .sample = 48,
                       .seed = tool_seed_from_clock()};
    unsigned precision_seen = 0;
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            run_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--cpu")) {
            o->force_cpu = true;
            continue;
        } else if (!strcmp(a, "--fast-accumulation")) {
            if (!tool_precision_option(a, NULL, &precision_seen, &o->precision)) return 2;
            continue;
        }
        if (!v) {
            fprintf(stderr, "msaidx run: unknown option or missing value: %s\n", a);
            return 2;
        }
        ++i;
        bool ok = true;
        if (!strcmp(a, "--backend"))
            ok = tool_parse_backend(v, &o->backend);
        else if (!strcmp(a, "--heads"))
            ok = tool_parse_int(v, a, 1, 16, &n), o->heads = (int)n;
        else if (!strcmp(a, "--dtype"))
            ok = tool_parse_dtype(v, &o->dtype);
        else if (!strcmp(a, "--precision"))
            ok = tool_precision_option(a, v, &precision_seen, &o->precision);
        else if (!strcmp(a, "--q-lens"))
            o->q_text = v;
        else if (!strcmp(a, "--kv-lens"))
            o->kv_text = v;
        else if (!strcmp(a, "--page-pad"))
            ok = tool_parse_int(v, a, 0, 1 << 20, &o->page_pad);
        else if (!strcmp(a, "--repeat"))
            ok = tool_parse_int(v, a, 1, 100000, &o->repeat);
        else if (!strcmp(a, "--sample"))
            ok = tool_parse_int(v, a, 1, 1 << 24, &o->sample);
        else if (!strcmp(a, "--threads"))
            ok = tool_parse_int(v, a, 0, 4096, &o->threads);
        else if (!strcmp(a, "--seed"))
            ok = tool_parse_int(v, a, 0, INT64_MAX, &n), o->seed = (uint64_t)n;
        else {
            fprintf(stderr, "msaidx run: unknown option %s (see msaidx run --help)\n", a);
            return 2;
        }
        if (!ok) return 2;
    }
    if (o->page_pad % 16) {
        fprintf(stderr, "msaidx run: --page-pad = %ld: must be a multiple of 16\n", o->page_pad);
        return 2;
    }
    return -1; /* go on */
}

static void print_list(const char *label, const int32_t *values, int count) {
    printf("%s", label);
    for (int i = 0; i < count; ++i) printf("%s%d", i ? "," : "", values[i]);
    printf("\n");
}

static int compare_int32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sorts and drops repeats; returns the count left. */
static int sort_unique(int32_t *values, int n) {
    qsort(values, (size_t)n, sizeof(int32_t), compare_int32);
    int unique = 0;
    for (int i = 0; i < n; ++i)
        if (!unique || values[unique - 1] != values[i]) values[unique++] = values[i];
    return unique;
}

/* Tokens to check, sorted and distinct: the first and last of every request, then `wanted` more
 * drawn with the seed (or every token, when the batch has no more). */
static int pick_sample(const tool_batch *batch, long wanted, uint64_t seed, int32_t **tokens) {
    const int32_t T = batch->desc.num_tokens;
    const int B = batch->desc.batch_size;
    int32_t *picked = malloc(sizeof(int32_t) * ((size_t)wanted + 2 * (size_t)B + (size_t)T + 1));
    if (!picked) {
        fprintf(stderr, "msaidx run: out of host memory for the sampled tokens\n");
        return -1;
    }
    int n = 0;
    for (int b = 0; b < B; ++b)
        if (batch->cu_seqlens_q[b + 1] > batch->cu_seqlens_q[b]) {
            picked[n++] = batch->cu_seqlens_q[b];
            picked[n++] = batch->cu_seqlens_q[b + 1] - 1;
        }
    n = sort_unique(picked, n);
    const int fixed = n;
    const int goal = (int)(fixed + wanted < T ? fixed + wanted : T);
    tool_rng rng = tool_rng_make(seed, 0x5A3F1E);
    if (2L * goal >= T) {
        /* Most of the tokens: shuffle the ones not yet picked (after the picked ones in the same
         * buffer) and take as many as are missing; no repeats possible. */
        int32_t *rest = picked + fixed;
        int count = 0;
        for (int32_t t = 0, f = 0; t < T; ++t) {
            if (f < fixed && picked[f] == t) {
                ++f;
                continue;
            }
            rest[count++] = t;
        }
        for (int i = 0; i < goal - fixed; ++i) {
            const int j = i + (int)(tool_rng_next(&rng) % (uint64_t)(count - i));
            const int32_t swap = rest[i];
            rest[i] = rest[j];
            rest[j] = swap;
        }
        n = goal;
    } else {
        /* Few of the tokens (goal < T / 2): rounds of draws for the places still missing. Fewer
         * than half of a round's draws repeat a token, so the rounds are few. */
        while (n < goal) {
            for (int missing = goal - n; missing > 0; --missing)
                picked[n++] = (int32_t)(tool_rng_next(&rng) % (uint64_t)T);
            n = sort_unique(picked, n);
        }
    }
    *tokens = picked;
    return sort_unique(picked, n);
}

int cmd_run(int argc, char **argv) {
    run_options o;
    int parsed = parse_options(argc, argv, &o);
    if (parsed >= 0) return parsed;

    const tool_exec *exec = NULL;
    if (!o.force_cpu && o.backend != MSAIDX_BACKEND_CPU) exec = tool_pick_gpu();
    const bool on_gpu = exec != NULL;
    if (!exec) exec = tool_host_exec();
    if (o.force_cpu && o.backend != MSAIDX_BACKEND_AUTO && o.backend != MSAIDX_BACKEND_CPU) {
        fprintf(stderr, "msaidx run: --cpu runs the cpu backend; --backend %s is a GPU backend\n",
                msaidx_backend_name(o.backend));
        return 2;
    }
    if (!on_gpu && o.backend != MSAIDX_BACKEND_AUTO && o.backend != MSAIDX_BACKEND_CPU) {
        char why[512];
        tool_no_gpu_reason(o.backend, why, sizeof why);
        fprintf(stderr, "msaidx run: backend %s needs a CUDA device; none is usable here (%s)\n",
                msaidx_backend_name(o.backend), why);
        return 2;
    }
    if (o.repeat < 0) o.repeat = on_gpu ? 10 : 3;

    int32_t *q_lens = NULL, *kv_lens = NULL, *sample = NULL, *topk_out = NULL, *cpu_topk = NULL;
    int nq = 0, nkv = 0;
    tool_batch batch = {0};
    tool_session session = {0};
    msaidx_context *cpu_context = NULL;
    void *q_dev = NULL, *k_dev = NULL;
    float *scores_dev = NULL, *scores = NULL;
    int32_t *topk_dev = NULL;
    double *score_ms = calloc((size_t)o.repeat, sizeof(double));
    double *topk_ms = calloc((size_t)o.repeat, sizeof(double));
    int status = 2;

    if (!tool_parse_list(o.q_text ? o.q_text
                         : on_gpu ? gpu_default_q
                                  : cpu_default_q,
                         "--q-lens", &q_lens, &nq) ||
        !tool_parse_list(o.kv_text ? o.kv_text
                         : on_gpu  ? gpu_default_kv
                                   : cpu_default_kv,
                         "--kv-lens", &kv_lens, &nkv))
        goto done;
    if (nq != nkv) {
        fprintf(stderr, "msaidx run: %d q lens but %d kv lens\n", nq, nkv);
        goto done;
    }
    for (int b = 0; b < nq; ++b)
        if (q_lens[b] > kv_lens[b]) {
            fprintf(stderr, "msaidx run: request %d: q_len %d > kv_len %d\n", b, q_lens[b],
                    kv_lens[b]);
            goto done;
        }

    if (tool_total_tokens(q_lens, nq) == 0) {
        printf("msaidx run: the batch has no query tokens (every q_len is 0): nothing to score\n");
        status = 0;
        goto done;
    }

    const int64_t pairs = tool_visible_pairs(q_lens, kv_lens, nq);
    const double gflop = tool_gflop(o.heads, pairs);
    const size_t elem = o.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    const int64_t page_stride = (int64_t)TOOL_PAGE * TOOL_HEAD_DIM * (int64_t)elem + o.page_pad;
    /* A cache a little larger than the batch needs, so that unused pages sit among used ones. */
    const int64_t pages_needed = tool_total_pages(kv_lens, nq);
    const int64_t cache_pages = pages_needed + pages_needed / 8 + 1;
    if (cache_pages > INT32_MAX) {
        fprintf(stderr,
                "msaidx run: the batch needs a cache of %lld pages; the tool holds at most %d\n",
                (long long)cache_pages, INT32_MAX);
        goto done;
    }
    printf("msaidx run: seed %llu\n", (unsigned long long)o.seed);
    fflush(stdout);
    if (!tool_batch_layout(&batch, o.heads, o.dtype, q_lens, kv_lens, nq, (int32_t)cache_pages,
                           page_stride, 0, o.seed) ||
        !tool_batch_fill(&batch, (int64_t)batch.desc.num_tokens * o.heads, o.seed, true))
        goto done;
    const msaidx_batch_desc *d = &batch.desc;
    const int32_t T = d->num_tokens;
    const size_t score_count = (size_t)T * o.heads * (size_t)d->pitch;
    const size_t topk_count = (size_t)T * o.heads * 16;

    if (!tool_session_open(&session, exec, &batch, o.backend, (int)o.threads, o.precision))
        goto done;
    if (!exec->alloc(&q_dev, batch.q_bytes) || !exec->alloc(&k_dev, batch.k_bytes) ||
        !exec->alloc((void **)&scores_dev, score_count * sizeof(float)) ||
        !exec->alloc((void **)&topk_dev, topk_count * sizeof(int32_t)) ||
        !exec->upload(q_dev, batch.q, batch.q_bytes) ||
        !exec->upload(k_dev, batch.k_cache, batch.k_bytes) ||
        !exec->poison(scores_dev, score_count * sizeof(float)) ||
        !exec->poison(topk_dev, topk_count * sizeof(int32_t)))
        goto done;

    printf("backend    %s on %s (dtype %s, precision %s)\n", msaidx_backend_name(session.backend),
           exec->name, o.dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3",
           tool_precision_name(o.precision));
    printf(
        "batch      B=%d T=%d H=%d D=%d page=%d, %d cache pages (%lld used, scattered), pitch %d\n",
        nq, T, o.heads, TOOL_HEAD_DIM, TOOL_PAGE, d->num_pages, (long long)pages_needed, d->pitch);
    print_list("q_lens     ", q_lens, nq);
    print_list("kv_lens    ", kv_lens, nq);
    printf("work       %lld visible query-key pairs, %.3f GFLOP, K %.1f MB, Q %.1f MB\n",
           (long long)pairs, gflop,
           (double)pages_needed * TOOL_PAGE * TOOL_HEAD_DIM * (double)elem / 1e6,
           (double)batch.q_bytes / 1e6);
    fflush(stdout);

    fprintf(stderr, "  timing: 1 warm-up + %ld runs\n", o.repeat);
    for (int i = -1; i < o.repeat; ++i) {
        if (!exec->flush_cache() || !exec->mark(0) ||
            !tool_session_scores(&session, q_dev, k_dev, scores_dev) || !exec->mark(1) ||
            !tool_session_topk(&session, scores_dev, d->pitch, T, topk_dev) || !exec->mark(2) ||
            !exec->sync())
            goto done;
        if (i >= 0) {
            score_ms[i] = exec->elapsed_ms(0, 1);
            topk_ms[i] = exec->elapsed_ms(1, 2);
        }
    }
    if (!tool_session_check(&session)) goto done;
    const double score_median = tool_median(score_ms, (int)o.repeat);
    const double topk_median = tool_median(topk_ms, (int)o.repeat);
    printf("time       score %.3f ms, top-k %.3f ms (median of %ld%s)\n", score_median, topk_median,
           o.repeat, on_gpu ? ", L2 flushed, CUDA events" : "");
    const double score_gflops = gflop / (score_median * 1e-3),
                 total_gflops = gflop / ((score_median + topk_median) * 1e-3);
    printf("throughput %.1f GFLOP/s (%.2f TFLOP/s) scoring, %.1f GFLOP/s (%.2f TFLOP/s) score + "
           "top-k\n",
           score_gflops, score_gflops * 1e-3, total_gflops, total_gflops * 1e-3);

    /* Checks: scores vs FP64 on sampled tokens; top-k vs the cpu top-k of the same scores. */
    scores = malloc(score_count * sizeof(float));
    topk_out = malloc(topk_count * sizeof(int32_t));
    cpu_topk = malloc(topk_count * sizeof(int32_t));
    if (!scores || !topk_out || !cpu_topk) {
        fprintf(stderr, "msaidx run: out of host memory for the checks\n");
        goto done;
    }
    if (!exec->download(scores, scores_dev, score_count * sizeof(float)) ||
        !exec->download(topk_out, topk_dev, topk_count * sizeof(int32_t)))
        goto done;
    msaidx_config cpu_config;
    tool_session_config(&cpu_config, tool_host_exec(), &batch, MSAIDX_BACKEND_CPU, (int)o.threads,
                        false);
    if (!tool_ok(msaidx_context_create(&cpu_context, &cpu_config), "cpu context") ||
        !tool_ok(msaidx_topk_select(cpu_context, scores, d->pitch, batch.nvp, T, cpu_topk, NULL),
                 "cpu topk"))
        goto done;
    int64_t topk_rows_differ = 0;
    for (int64_t r = 0; r < (int64_t)T * o.heads; ++r)
        topk_rows_differ += memcmp(topk_out + r * 16, cpu_topk + r * 16, 16 * sizeof(int32_t)) != 0;

    int sample_count = pick_sample(&batch, o.sample, o.seed, &sample);
    if (sample_count < 0) goto done;
    tool_accuracy accuracy = {0};
    int64_t own_topk_differ = 0;
    int checked = 0;
    const bool fp8_bound = tool_fp8_bound(&batch, session.backend, o.precision);
    double last_print = tool_now_ms();
#pragma omp parallel
    {
        double *scratch = malloc(sizeof(double) * 2 * (size_t)o.heads * (size_t)d->pitch);
        tool_accuracy mine = {0};
        int64_t mine_topk = 0;
#pragma omp for schedule(dynamic)
        for (int s = 0; s < sample_count; ++s) {
            if (!scratch) continue;
            const int32_t t = sample[s];
            tool_compare_token(&batch, t, scores, fp8_bound, scratch, &mine);
            for (int h = 0; h < o.heads; ++h) {
                int32_t expected[16];
                const size_t row = (size_t)t * o.heads + h;
                tool_topk_row(scores + row * d->pitch, batch.nvp[t], 16, 0, 1, expected);
                mine_topk += memcmp(expected, topk_out + row * 16, sizeof expected) != 0;
            }
#pragma omp critical
            {
                ++checked;
                if (tool_now_ms() - last_print > 2000.0) {
                    last_print = tool_now_ms();
                    fprintf(stderr, "  FP64 reference: %d / %d tokens\n", checked, sample_count);
                }
            }
        }
#pragma omp critical
        {
            accuracy.cells += mine.cells;
            accuracy.bad_cells += mine.bad_cells;
            accuracy.written_past_nvp += mine.written_past_nvp;
            accuracy.max_rel_error = fmax(accuracy.max_rel_error, mine.max_rel_error);
            accuracy.max_bound_ratio = fmax(accuracy.max_bound_ratio, mine.max_bound_ratio);
            own_topk_differ += mine_topk;
        }
        free(scratch);
    }
    const bool scores_pass =
        accuracy.cells > 0 && accuracy.bad_cells == 0 && accuracy.written_past_nvp == 0;
    const bool topk_pass = topk_rows_differ == 0 && own_topk_differ == 0;
    char tolerance[160];
    snprintf(tolerance, sizeof tolerance, "tolerance %s; worst error / tolerance %.3g",
             fp8_bound ? TOOL_FP8_BOUND_TEXT : TOOL_EXACT_BOUND_TEXT, accuracy.max_bound_ratio);
    printf("check      %d tokens x %d heads, %lld cells vs FP64: max rel error %.3g (%s), "
           "%lld outside, %lld written past nvp: %s\n",
           sample_count, o.heads, (long long)accuracy.cells, accuracy.max_rel_error, tolerance,
           (long long)accuracy.bad_cells, (long long)accuracy.written_past_nvp,
           scores_pass ? "PASS" : "FAIL");
    printf("top-k      %lld of %lld rows differ from the cpu top-k of the same scores; %lld of %d "
           "sampled "
           "rows differ from the tool's own selection: %s\n",
           (long long)topk_rows_differ, (long long)T * o.heads, (long long)own_topk_differ,
           sample_count * o.heads, topk_pass ? "PASS" : "FAIL");
    printf("selected blocks (head 0, last token of each request; logical page ids):\n");
    for (int b = 0; b < nq && b < 8; ++b) {
        if (q_lens[b] == 0) continue;
        const int32_t t = batch.cu_seqlens_q[b + 1] - 1;
        printf("  request %d (pos %d, %d pages):", b, kv_lens[b] - 1, batch.nvp[t]);
        for (int i = 0; i < 16 && topk_out[(size_t)t * o.heads * 16 + i] >= 0; ++i)
            printf(" %d", topk_out[(size_t)t * o.heads * 16 + i]);
        printf("\n");
    }
    printf("%s\n", scores_pass && topk_pass ? "PASS" : "FAIL");
    status = scores_pass && topk_pass ? 0 : 1;

done:
    if (exec) {
        exec->release(q_dev);
        exec->release(k_dev);
        exec->release(scores_dev);
        exec->release(topk_dev);
    }
    tool_session_close(&session);
    msaidx_context_destroy(cpu_context);
    tool_batch_free(&batch);
    free(q_lens);
    free(kv_lens);
    free(sample);
    free(scores);
    free(topk_out);
    free(cpu_topk);
    free(score_ms);
    free(topk_ms);
    return status;
}
