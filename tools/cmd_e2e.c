/* msaidx e2e: the engine's view of one indexer step of a MiniMax-M3-like forward (all sparse layers
 * of one mixed prefill + decode batch) captured as one CUDA graph, per backend choice. */
#include "e2e_step.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define E2E_TOTAL_HEADS 4 /* index heads of the model; TP splits them */
#define E2E_MAX_LIST 16

static void e2e_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx e2e [options]\n"
        "\n"
        "Times the indexer's share of one forward step as an engine runs it: a ragged batch of "
        "one\n"
        "prefill chunk of P tokens at context C (prefix C - P) plus D decode rows at context C, "
        "for\n"
        "every sparse layer: plan the prefill and the decode batch once (and the step's visible\n"
        "pages), then per layer prefill scores and decode scores into one buffer and one top-k of\n"
        "every row, each layer with its own Q and its own key cache\n"
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
        "                            (msaidx_index_prepare: norm, RoPE, E4M3 cast, key insert),\n"
        "                            one call for the step's prefill and decode tokens\n"
        "  --fused                   also time each backend with the prefill layer as one\n"
        "                            msaidx_prefill_topk call without a score buffer (a fused\n"
        "                            column beside each backend's, the decode rows then\n"
        "                            selected apart; both graphs on one engine, their replays\n"
        "                            alternating)\n"
        "  --precision P             default (persistent sums E4M3 with FP8 tensor cores) or "
        "exact\n"
        "                            (every backend); --fast-accumulation is the old spelling of\n"
        "                            --precision default\n"
        "  --json FILE               write every config's result as JSON\n"
        "  --markdown FILE           write the tables as Markdown\n"
        "  --seed N                  data seed (default 1)\n"
        "  --pitch N                 score rows of at least N pages, as engines size them for\n"
        "                            their longest context (vLLM: 8192); default: C's pages.\n"
        "                            The top-k is bounded by C's pages either way\n"
        "                            (msaidx_topk_select_bounded, as the plans' max_seq_len)\n",
        E2E_TOTAL_HEADS);
}

typedef struct e2e_options {
    int32_t *tp, *prefill, *context;
    int num_tp, num_prefill, num_context;
    long decode, layers, max_replays, seed, pitch;
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
    unsigned precision_seen = 0;
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            e2e_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--fast-accumulation")) {
            if (!tool_precision_option(a, NULL, &precision_seen, &o->precision)) return 2;
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
            ok = tool_precision_option(a, v, &precision_seen, &o->precision);
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
        else if (!strcmp(a, "--pitch"))
            ok = tool_parse_int(v, a, 1, INT32_MAX, &o->pitch);
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
    /* --prepare: BF16 (H + 1) x 128 in, E4M3 out per token at ~1.5 TB/s, one launch. */
    const double prepare_s =
        c->prepare ? (P + D) * (H + 1) * TOOL_HEAD_DIM * 3 / 1.5e12 + 6e-6 : 0.0;
    return (double)c->layers * (prefill_s + decode_s + topk_s + prepare_s + 4 * 6e-6);
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
            "  \"total_heads\": %d,\n  \"min_pitch\": %ld,\n",
            tool_precision_name(o->precision), o->layers, o->decode, E2E_TOTAL_HEADS, o->pitch);
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
            if (r->state != E2E_OK) fprintf(f, ", \"why\": \"%s\"", r->why ? r->why : "");
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
        "before each): plan + %ld x (prefill scores + decode scores + one top-k of all rows) for "
        "one "
        "prefill "
        "chunk of P tokens at context C plus %ld decode rows at C; speedup = time of the last "
        "backend / "
        "time of the other%s. Precision: %s.\n",
        report->device, o->layers, o->decode,
        o->fused ? "; fused = the same step with each prefill layer's scores and top-k as one "
                   "msaidx_prefill_topk call without a score buffer, its replays alternating "
                   "with the step's on one engine"
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
    if (o->pitch) printf("score rows of at least %ld pages\n", o->pitch);
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
                c->pages = tool_pages_of(c->context);
                c->pitch = c->pages > o->pitch ? c->pages : (int32_t)o->pitch;
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
            data_ready = e2e_data_alloc(&data, c, (uint64_t)o->seed + (uint64_t)i,
                                        (cudaStream_t)exec->stream);
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
                e2e_run_backend(o->backends[b], o->precision, c, &data, exec, o->max_replays,
                                o->fused, r);
                if (r->state == E2E_OK)
                    printf("  %s %.2f ms (%d replays, est. %.2f ms, %.1f s wall)",
                           backend_label(r, o->backends[b], label, sizeof label), r->ms_per_forward,
                           r->replays, r->estimate_s * 1e3, (tool_now_ms() - before_ms) * 1e-3);
                if (r->state == E2E_OK && o->fused)
                    printf(", fused %.2f ms", r->fused_ms_per_forward);
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
        e2e_data_free(&data);
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
    if (!tool_outputs_writable("e2e", o.json_path, o.markdown_path)) {
        status = 1;
    } else if (tool_pick_gpu()) {
#ifdef MSAIDX_WITH_CUDA
        status = run_e2e(&o);
#endif
    } else {
        char why[512];
        tool_no_gpu_reason(MSAIDX_BACKEND_AUTO, why, sizeof why);
        /* Status 0 (nothing to measure is not a failure) unless a result file was asked for. */
        const bool file_wanted = o.json_path || o.markdown_path;
        fprintf(file_wanted ? stderr : stdout, "e2e: needs a CUDA device (%s); nothing to do%s\n",
                why, file_wanted ? ", no file written" : "");
        status = file_wanted ? 1 : 0;
    }
    free_options(&o);
    return status;
}
