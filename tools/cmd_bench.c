/* msaidx bench: times the backends on a shapes file against ceilings measured in the same run: on a
 * GPU cuBLASLt FP8 GEMM (8192^3, and of each compute-bound shape's work) and device copy, on a CPU
 * the SIMD path's peak and a STREAM-like read. */
#include "bench_prefill.h"
#include "cpu/cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DATASHEET_FP8_TFLOPS 1979.0
#define DATASHEET_HBM_TBPS 4.8
/* Timed runs of one shape and backend are capped near this many milliseconds of work. */
#define RUN_BUDGET_MS 2000.0
#define MIN_RUNS 3

static void bench_usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx bench [options]\n"
        "       msaidx bench --decode [options]   (the decode grid; msaidx bench --decode --help)\n"
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
        "A third interval times msaidx_prefill_topk without a score buffer (\"fused\"), its\n"
        "selection checked bitwise against the pair's; the summary gives fused / floor and how\n"
        "often fused beats the call. For E4M3 at the default precision, each compute-bound\n"
        "shape is also timed against cuBLASLt's FP8 GEMM of the same work (8192 x 8192 x K, K\n"
        "from its GFLOP, after the same flush), the ceiling the summary compares scoring with.\n"
        "The summary's one-kernel bound is, per shape, the largest of the K read-once, the\n"
        "shape's GFLOP at the run's cuBLASLt FP8 8192^3 rate and the floor: what one kernel\n"
        "doing the work is not expected to beat here; score and fused are given against it.\n"
        "\n"
        "options:\n"
        "  --shapes FILE    tsv: name, H, q_lens, kv_lens (default: bench/shapes/prefill78.tsv in\n"
        "                   the current directory, else next to the executable). GPU floors come\n"
        "                   from h200_reference.tsv (bf16: h200_reference_bf16.tsv) next to it "
        "when\n"
        "                   present, else max(GFLOP / %.0f TFLOP/s, K bytes / %.1f TB/s); CPU\n"
        "                   floors are max(GFLOP / the SIMD path's peak, K bytes / the read "
        "rate),\n"
        "                   both measured in the same run\n"
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
        "  --precision P    default (persistent sums E4M3 with FP8 tensor cores, within\n"
        "                   " TOOL_FP8_BOUND_TEXT "; the other backends and BF16\n"
        "                   are exact) or exact (every backend); the output records it.\n"
        "                   --fast-accumulation is the old spelling of --precision default\n"
        "  --threads N      cpu worker threads (default: all)\n"
        "  --reference      cpu: also time the scalar reference scorer once per shape (one\n"
        "                   thread, FP64 sums) and report the cpu backend's speedup over it\n"
        "  --no-ceilings    skip the GPU's GEMM and copy ceilings, the same-work GEMMs too (a\n"
        "                   CPU's are always measured: its floors come from them)\n"
        "  --json FILE      write all numbers as JSON\n"
        "  --markdown FILE  write a Markdown table (either file not writable: exit status 1)\n"
        "  --seed N         data seed (default 1)\n"
        "  --pitch N        score rows of at least N pages, as engines size them for their\n"
        "                   longest context (vLLM: 8192, 1M tokens); default: each shape's\n"
        "                   longest row, the least memory. The top-k and the fused call are\n"
        "                   bounded by the plan's max_seq_len either way\n"
        "  --flush F        GPU L2 flush before every timed run: memset (default; a 2 x L2 "
        "memset,\n"
        "                   as Triton's do_bench, leaves dirty lines the next kernel writes back)\n"
        "                   or read (a 2 x L2 read: clean lines, a streaming kernel's own limit)\n",
        DATASHEET_FP8_TFLOPS, DATASHEET_HBM_TBPS);
}

static int parse_options(int argc, char **argv, bench_options *o) {
    *o = (bench_options){.max_gflop = 70.0, .repeat = -1, .dtype = MSAIDX_DTYPE_E4M3, .seed = 1};
    unsigned precision_seen = 0;
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--decode")) return cmd_bench_decode(argc, argv); /* cmd_bench_decode.c */
        if (!strcmp(a, "--cpu")) {
            o->force_cpu = true;
            continue;
        }
        if (!strcmp(a, "--reference")) {
            o->reference = true;
            continue;
        }
        if (!strcmp(a, "--all")) {
            o->all = true;
            continue;
        }
        if (!strcmp(a, "--no-ceilings")) {
            o->no_ceilings = true;
            continue;
        }
        if (!strcmp(a, "--fast-accumulation")) {
            if (!tool_precision_option(a, NULL, &precision_seen, &o->precision)) return 2;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "msaidx bench: unknown option or missing value: %s\n", a);
            return 2;
        }
        ++i;
        long n = 0;
        bool ok = true;
        if (!strcmp(a, "--shapes"))
            o->shapes_path = v;
        else if (!strcmp(a, "--backend"))
            o->backend_list = v;
        else if (!strcmp(a, "--filter"))
            o->filter = v;
        else if (!strcmp(a, "--json"))
            o->json_path = v;
        else if (!strcmp(a, "--markdown"))
            o->markdown_path = v;
        else if (!strcmp(a, "--repeat"))
            ok = tool_parse_int(v, a, 1, 100000, &o->repeat);
        else if (!strcmp(a, "--threads"))
            ok = tool_parse_int(v, a, 0, 4096, &o->threads);
        else if (!strcmp(a, "--precision"))
            ok = tool_precision_option(a, v, &precision_seen, &o->precision);
        else if (!strcmp(a, "--flush")) {
            ok = !strcmp(v, "memset") || !strcmp(v, "read");
            o->read_flush = !strcmp(v, "read");
            if (!ok) fprintf(stderr, "msaidx bench: --flush %s: expected memset or read\n", v);
        } else if (!strcmp(a, "--dtype"))
            ok = tool_parse_dtype(v, &o->dtype);
        else if (!strcmp(a, "--pitch"))
            ok = tool_parse_int(v, a, 1, INT32_MAX, &n), o->pitch = (int32_t)n;
        else if (!strcmp(a, "--seed"))
            ok = tool_parse_int(v, a, 0, INT64_MAX, &n), o->seed = (uint64_t)n;
        else if (!strcmp(a, "--max-seconds"))
            ok = tool_parse_positive(v, a, &o->max_seconds);
        else if (!strcmp(a, "--max-gflop"))
            ok = tool_parse_positive(v, a, &o->max_gflop);
        else {
            fprintf(stderr, "msaidx bench: unknown option %s (see msaidx bench --help)\n", a);
            return 2;
        }
        if (!ok) return 2;
    }
    return -1;
}

/* h200_reference.tsv (E4M3) or h200_reference_bf16.tsv (BF16) beside the shapes file: name, gflop,
 * floor_us, vLLM score us, top-k us, the floor and vLLM's Triton times for that dtype. */
static int load_reference(const char *shapes_path, msaidx_dtype dtype, reference_row **rows,
                          char *path, size_t path_size) {
    const char *slash = strrchr(shapes_path, '/');
    snprintf(path, path_size, "%.*sh200_reference%s.tsv",
             slash ? (int)(slash - shapes_path + 1) : 0, shapes_path,
             dtype == MSAIDX_DTYPE_BF16 ? "_bf16" : "");
    *rows = NULL;
    FILE *file = fopen(path, "r");
    if (!file) return 0;
    int count = 0, capacity = 0;
    char line[512];
    while (fgets(line, sizeof line, file)) {
        if (line[0] == '#') continue;
        reference_row row;
        if (sscanf(line, "%63s %lf %lf %lf %lf", row.name, &row.gflop, &row.floor_us,
                   &row.vllm_score_us, &row.vllm_topk_us) != 5)
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

/* Times one backend on the current batch. False when the backend is not admitted or failed. */
static bool time_backend(const tool_exec *exec, const tool_batch *batch, msaidx_backend backend,
                         const bench_options *o, long repeat, const void *q, const void *k,
                         float *scores, int32_t *topk, double *score_ms, double *topk_ms,
                         result *out) {
    tool_session session;
    msaidx_config config;
    tool_session_config(&config, exec, batch, backend, (int)o->threads, o->precision);
    if (!tool_ok(msaidx_backend_supported(backend, &config), msaidx_backend_name(backend)))
        return false;
    if (!tool_session_open(&session, exec, batch, backend, (int)o->threads, o->precision))
        return false;
    const int32_t T = batch->desc.num_tokens, pitch = batch->desc.pitch;
    /* The fused call's arguments: the session's top-k parameters, its own score workspace. */
    msaidx_topk_args fused;
    msaidx_topk_args_init(&fused);
    fused.topk = config.topk;
    fused.init_blocks = config.init_blocks;
    fused.local_blocks = config.local_blocks;
    bool ok = tool_ok(msaidx_prefill_topk_workspace_size(session.plan, 0, &fused.workspace_bytes),
                      "prefill_topk workspace size") &&
              exec->alloc(&fused.workspace, fused.workspace_bytes);
    for (long i = -1; ok && i < repeat; ++i) { /* one warm-up run */
        ok = exec->flush_cache() && exec->mark(0) && tool_session_scores(&session, q, k, scores) &&
             exec->mark(1) && tool_session_topk(&session, scores, pitch, T, topk) &&
             exec->mark(2) && exec->sync();
        if (ok && i < 0) {
            /* Slow shapes get fewer runs (at least 3) so a whole table stays within minutes. Each
             * run below times the pair twice. */
            const double warm_ms = 2 * exec->elapsed_ms(0, 2);
            if (warm_ms * (double)repeat > RUN_BUDGET_MS) {
                const long fitting = (long)(RUN_BUDGET_MS / warm_ms);
                const long fewest =
                    repeat < MIN_RUNS ? repeat : MIN_RUNS; /* never above --repeat */
                repeat = fitting < fewest ? fewest : fitting;
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
        /* The fused call, same clocks again; it writes the same top-k (score_ms: 3 x repeat). */
        ok = ok && exec->flush_cache() && exec->mark(0) &&
             tool_ok(msaidx_prefill_topk(session.plan, q, k, &fused, NULL, topk, exec->stream),
                     "prefill_topk") &&
             exec->mark(1) && exec->sync();
        if (ok) score_ms[2 * repeat + i] = exec->elapsed_ms(0, 1);
    }
    /* The fused call's selection, bitwise against the two calls' (left in `topk`). */
    const size_t picks = (size_t)T * config.num_heads * config.topk;
    int32_t *two_calls = malloc(sizeof(int32_t) * (picks + 1)),
            *one_call = malloc(sizeof(int32_t) * (picks + 1));
    ok = ok && two_calls && one_call && exec->download(one_call, topk, sizeof(int32_t) * picks) &&
         tool_session_scores(&session, q, k, scores) &&
         tool_session_topk(&session, scores, pitch, T, topk) && exec->sync() &&
         exec->download(two_calls, topk, sizeof(int32_t) * picks);
    out->fused_rows_differ = 0;
    for (size_t row = 0; ok && row < picks / (size_t)config.topk; ++row)
        out->fused_rows_differ +=
            memcmp(one_call + row * config.topk, two_calls + row * config.topk,
                   sizeof(int32_t) * (size_t)config.topk) != 0;
    free(two_calls);
    free(one_call);
    ok = ok && tool_session_check(&session);
    if (fused.workspace) exec->release(fused.workspace);
    tool_session_close(&session);
    if (!ok) return false;
    out->ran = true;
    out->runs = (int)repeat;
    out->score_us = tool_median(score_ms, (int)repeat) * 1e3;
    out->topk_us = tool_median(topk_ms, (int)repeat) * 1e3;
    out->call_us = tool_median(score_ms + repeat, (int)repeat) * 1e3;
    out->fused_us = tool_median(score_ms + 2 * repeat, (int)repeat) * 1e3;
    return true;
}

/* The shapes file: --shapes, else bench/shapes/ under the current directory, else the copy next to
 * the executable (the build copies bench/shapes/ into its own directory), else bench/shapes/ of the
 * source tree the executable was built in (build/ inside the repository). */
static bool find_shapes_file(const char *given, char *path, size_t size) {
    if (given) {
        snprintf(path, size, "%s", given);
        return true;
    }
    static const char *const relative = "bench/shapes/prefill78.tsv";
    snprintf(path, size, "%s", relative);
    if (access(path, R_OK) == 0) return true;
    char executable[1024];
    const ssize_t length = readlink("/proc/self/exe", executable, sizeof executable - 1);
    if (length > 0) {
        executable[length] = '\0';
        char *slash = strrchr(executable, '/');
        if (slash) *slash = '\0';
        static const char *const beside[] = {"shapes/prefill78.tsv",
                                             "../bench/shapes/prefill78.tsv"};
        for (size_t i = 0; i < sizeof beside / sizeof *beside; ++i) {
            const int written = snprintf(path, size, "%s/%s", executable, beside[i]);
            if (written > 0 && (size_t)written < size && access(path, R_OK) == 0) return true;
        }
    }
    fprintf(stderr,
            "msaidx bench: no shapes file: looked for %s in the current directory and for "
            "shapes/prefill78.tsv and "
            "../bench/shapes/prefill78.tsv next to the executable; pass --shapes FILE\n",
            relative);
    return false;
}

/* Backends: the list given, else every GPU backend compiled in and admitted, else cpu. A backend
 * given that the library does not admit for these options (--threads, --precision, --dtype) is an
 * error here, with the library's reason, before any shape runs. */
static bool select_backends(bench_run *run) {
    const bench_options *o = &run->o;
    const bool on_gpu = run->m.on_gpu;
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = run->m.exec->device;
    config.dtype = o->dtype;
    config.num_threads = (int)o->threads;
    config.precision = o->precision;
    if (o->backend_list) {
        char *list = strdup(o->backend_list), *save = NULL;
        bool ok = list != NULL;
        for (char *name = list ? strtok_r(list, ",", &save) : NULL; ok && name;
             name = strtok_r(NULL, ",", &save)) {
            msaidx_backend b;
            ok = tool_parse_backend(name, &b) && b != MSAIDX_BACKEND_AUTO &&
                 run->num_backends < MAX_BACKENDS;
            if (ok) run->backends[run->num_backends++] = b;
        }
        free(list);
        if (!ok || !run->num_backends) {
            fprintf(
                stderr,
                "msaidx bench: --backend '%s': expected 1 to %d of cpu, dense, split, persistent\n",
                o->backend_list, MAX_BACKENDS);
            return false;
        }
        for (int b = 0; b < run->num_backends; ++b) {
            if ((run->backends[b] == MSAIDX_BACKEND_CPU) == on_gpu) {
                fprintf(stderr, "msaidx bench: backend %s does not run %s\n",
                        msaidx_backend_name(run->backends[b]),
                        on_gpu         ? "on the GPU (use --cpu for the cpu backend)"
                        : o->force_cpu ? "under --cpu, which benches the cpu backend"
                                       : "on this machine without a GPU");
                return false;
            }
            config.backend = run->backends[b];
            if (!tool_ok(msaidx_backend_supported(run->backends[b], &config), "bench --backend"))
                return false;
        }
        return true;
    }
    if (!on_gpu) {
        config.backend = MSAIDX_BACKEND_CPU;
        if (!tool_ok(msaidx_backend_supported(MSAIDX_BACKEND_CPU, &config), "bench")) return false;
        run->backends[run->num_backends++] = MSAIDX_BACKEND_CPU;
        return true;
    }
    for (int b = MSAIDX_BACKEND_DENSE; b <= MSAIDX_BACKEND_PERSISTENT; ++b)
        if (msaidx_backend_supported((msaidx_backend)b, &config) == MSAIDX_SUCCESS)
            run->backends[run->num_backends++] = (msaidx_backend)b;
    if (!run->num_backends)
        fprintf(stderr, "msaidx bench: no GPU backend is compiled in and admitted\n");
    return run->num_backends > 0;
}

/* Names the machine and measures its ceilings: on a GPU the FP8 GEMM and copy rates (unless
 * --no-ceilings), on a CPU the SIMD peak and read rate that its floors are computed from. */
static void describe_machine(bench_run *run) {
    bench_machine *m = &run->m;
    if (!m->on_gpu) {
        fprintf(stderr, "measuring the CPU's ceilings ...\n");
        tool_cpu_measure_ceilings((int)run->o.threads, &m->cpu);
        char model[256];
        tool_cpu_model(model, sizeof model);
        snprintf(m->device, sizeof m->device, "%s, %d threads, cpu backend SIMD path %s", model,
                 m->cpu.threads, m->cpu.simd);
        return;
    }
#ifdef MSAIDX_WITH_CUDA
    tool_gpu_describe(m->device, sizeof m->device);
    if (!run->o.no_ceilings) {
        fprintf(stderr, "measuring ceilings ...\n");
        /* The headline GEMM rate: 8192^3 back to back, as GEMM benchmarks quote it. */
        tool_gemm *cube = tool_gpu_gemm_open(8192, 8192, 8192);
        const double ms = tool_gpu_gemm_ms(cube, 8192, 20, false);
        m->gemm_tflops = ms > 0 ? 2.0 * 8192.0 * 8192.0 * 8192.0 / (ms * 1e-3) * 1e-12 : 0.0;
        tool_gpu_gemm_close(cube);
        m->copy_tbps = tool_gpu_copy_tbps((size_t)1 << 30, 20);
    }
#endif
}

/* The score row pitch of a shape whose longest context is max_kv tokens. */
static int32_t shape_pitch(const bench_options *o, int32_t max_kv) {
    const int32_t pages = tool_pages_of(max_kv);
    return pages > o->pitch ? pages : o->pitch;
}

/* The shapes to run, their work and floors, and the size of the pool that serves them all. */
static bool select_rows(bench_run *run) {
    const bench_options *o = &run->o;
    const bench_machine *m = &run->m;
    const size_t elem = o->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    run->pool_pages = run->pool_q_rows = 1;
    run->score_floats = run->topk_ints = 1;
    for (int s = 0; s < run->num_shapes; ++s) {
        const tool_shape *shape = &run->shapes[s];
        const double gflop = tool_gflop(
            shape->heads, tool_visible_pairs(shape->q_lens, shape->kv_lens, shape->num_requests));
        if (o->filter && !strstr(shape->name, o->filter)) continue;
        if (!m->on_gpu && !o->all && gflop > o->max_gflop) continue;
        shape_row *r = &run->rows[run->num_rows++];
        r->shape = shape;
        r->gflop = gflop;
        const int64_t pages = tool_total_pages(shape->kv_lens, shape->num_requests);
        const int64_t tokens = tool_total_tokens(shape->q_lens, shape->num_requests);
        const int32_t max_kv = max_kv_of(shape);
        const int64_t pitch = shape_pitch(o, max_kv);
        r->k_bytes = (double)pages * TOOL_PAGE * TOOL_HEAD_DIM * (double)elem;
        if (m->on_gpu) {
            r->floor_us = fmax(gflop / DATASHEET_FP8_TFLOPS * 1e3,
                               r->k_bytes / (DATASHEET_HBM_TBPS * 1e12) * 1e6);
            for (int i = 0; i < run->reference_rows; ++i)
                if (!strcmp(run->reference[i].name, shape->name)) {
                    r->reference = &run->reference[i];
                    r->floor_us = run->reference[i].floor_us;
                }
        } else {
            r->floor_us =
                fmax(gflop / m->cpu.peak_gflops * 1e6, r->k_bytes / (m->cpu.read_gbps * 1e9) * 1e6);
        }
        r->compute_bound =
            tokens * shape->heads >= COMPUTE_BOUND_ROWS && max_kv >= COMPUTE_BOUND_KV;
        if (pages > run->pool_pages) run->pool_pages = pages;
        if (tokens * shape->heads > run->pool_q_rows) run->pool_q_rows = tokens * shape->heads;
        if ((size_t)(tokens * shape->heads * pitch) > run->score_floats)
            run->score_floats = (size_t)(tokens * shape->heads * pitch);
        if ((size_t)(tokens * shape->heads * 16) > run->topk_ints)
            run->topk_ints = (size_t)(tokens * shape->heads * 16);
    }
    if (!run->num_rows)
        fprintf(stderr, "msaidx bench: no shape of %s selected\n", run->shapes_path);
    return run->num_rows > 0;
}

/* One pool of pages and queries serves every shape; each shape shuffles its own block table. */
static bool alloc_pool(bench_run *run) {
    const tool_exec *exec = run->m.exec;
    int32_t no_queries = 0;
    if (run->pool_pages > INT32_MAX / TOOL_PAGE) {
        fprintf(stderr,
                "msaidx bench: the shapes need a pool of %lld pages; at most %d fit the tool's "
                "int32 token count\n",
                (long long)run->pool_pages, INT32_MAX / TOOL_PAGE);
        return false;
    }
    const int32_t pool_tokens = (int32_t)(run->pool_pages * TOOL_PAGE);
    if (!tool_batch_layout(&run->pool, 1, run->o.dtype, &no_queries, &pool_tokens, 1, 0, 0, 0,
                           run->o.seed) ||
        !tool_batch_fill(&run->pool, run->pool_q_rows, run->o.seed, true) ||
        !exec->alloc(&run->q_dev, run->pool.q_bytes) ||
        !exec->alloc(&run->k_dev, run->pool.k_bytes) ||
        !exec->upload(run->q_dev, run->pool.q, run->pool.q_bytes) ||
        !exec->upload(run->k_dev, run->pool.k_cache, run->pool.k_bytes) ||
        !exec->alloc((void **)&run->scores_dev, run->score_floats * sizeof(float)) ||
        !exec->alloc((void **)&run->topk_dev, run->topk_ints * sizeof(int32_t)))
        return false;
    run->topk_first = malloc(run->topk_ints * sizeof(int32_t));
    run->topk_host = malloc(run->topk_ints * sizeof(int32_t));
    run->score_ms = calloc(3 * (size_t)run->o.repeat, sizeof(double));
    run->topk_ms = calloc((size_t)run->o.repeat, sizeof(double));
    return run->topk_first && run->topk_host && run->score_ms && run->topk_ms;
}

/* The scalar reference scorer once on the shape (--reference on the CPU). */
static void time_reference(bench_run *run, shape_row *r, const tool_batch *batch) {
    msaidx_config config;
    tool_session_config(&config, run->m.exec, batch, MSAIDX_BACKEND_CPU, 1, false);
    const msaidx_cpu_batch reference = {.config = &config,
                                        .desc = &batch->desc,
                                        .cu_seqlens_q = batch->cu_seqlens_q,
                                        .seq_lens = batch->seq_lens,
                                        .block_table = batch->block_table,
                                        .q = run->q_dev,
                                        .k_cache = run->k_dev,
                                        .scores = run->scores_dev};
    const double start = tool_now_ms();
    msaidx_cpu_scores_reference(&reference);
    r->reference_us = (tool_now_ms() - start) * 1e3;
    printf(" | reference %.0f us (%.2f GFLOP/s)", r->reference_us,
           r->gflop / r->reference_us * 1e6);
    for (int b = 0; b < run->num_backends; ++b)
        if (r->results[b].ran) {
            const double speedup = r->reference_us / r->results[b].score_us;
            printf(", %s %.1fx %s", msaidx_backend_name(run->backends[b]),
                   speedup >= 1 ? speedup : 1 / speedup, speedup >= 1 ? "faster" : "slower");
        }
}

/* Every backend on shape s, then its baselines; false when the tool itself failed. */
static bool bench_shape(bench_run *run, int s) {
    const bench_options *o = &run->o;
    const tool_exec *exec = run->m.exec;
    shape_row *r = &run->rows[s];
    const tool_shape *shape = r->shape;
    tool_batch batch = {0};
    if (!tool_batch_layout(&batch, shape->heads, o->dtype, shape->q_lens, shape->kv_lens,
                           shape->num_requests, run->pool.desc.num_pages, 0,
                           shape_pitch(o, max_kv_of(shape)), o->seed + (uint64_t)s))
        return false;
    const size_t rows = (size_t)batch.desc.num_tokens * shape->heads;
    printf("%-22s %2d %9.2f %9.2f", shape->name, shape->heads, r->gflop, r->floor_us);
    fflush(stdout);
    bool ok = true;
    int first = -1;
    for (int b = 0; ok && b < run->num_backends; ++b) {
        result *x = &r->results[b];
        if (!time_backend(exec, &batch, run->backends[b], o, o->repeat, run->q_dev, run->k_dev,
                          run->scores_dev, run->topk_dev, run->score_ms, run->topk_ms, x)) {
            printf(" | %-10s %9s %8s %8s %7s %8s %6s", msaidx_backend_name(run->backends[b]), "-",
                   "-", "-", "-", "-", "-");
            run->backend_failed = true;
            continue;
        }
        ok = exec->download(first < 0 ? run->topk_first : run->topk_host, run->topk_dev,
                            rows * 16 * sizeof(int32_t));
        if (!ok) break;
        if (first < 0) {
            first = b;
        } else {
            for (size_t row = 0; row < rows; ++row)
                x->topk_rows_differ += memcmp(run->topk_first + row * 16, run->topk_host + row * 16,
                                              16 * sizeof(int32_t)) != 0;
        }
        printf(" | %-10s %9.1f %8.1f %8.1f %7.1f %8.1f %6.2f", "", x->score_us, x->topk_us,
               rate(run, r->gflop, x->score_us), total_us(x) / r->floor_us, x->fused_us,
               x->fused_us / x->call_us);
        if (x->fused_rows_differ)
            printf(" (FUSED top-k differs from score + top-k in %lld rows)",
                   (long long)x->fused_rows_differ);
        if (x->topk_rows_differ)
            printf(" (top-k differs from %s in %lld rows)",
                   msaidx_backend_name(run->backends[first]), (long long)x->topk_rows_differ);
        fflush(stdout);
    }
    if (ok && o->reference && !run->m.on_gpu) time_reference(run, r, &batch);
#ifdef MSAIDX_WITH_CUDA
    if (ok && run->m.on_gpu && first >= 0) bench_time_baselines(run, r, &batch);
#endif
    printf("\n");
    tool_batch_free(&batch);
    return ok;
}

/* The prefill bench over the shapes file (exit status as cmd_bench's). */
static int bench_prefill(bench_run *run) {
    bench_options *o = &run->o;
    if (!tool_outputs_writable("bench", o->json_path, o->markdown_path)) return 1;
    if (!find_shapes_file(o->shapes_path, run->shapes_path, sizeof run->shapes_path)) return 2;
    run->m.exec = o->force_cpu ? NULL : tool_pick_gpu();
    run->m.on_gpu = run->m.exec != NULL;
#ifdef MSAIDX_WITH_CUDA
    if (run->m.on_gpu) tool_gpu_set_read_flush(o->read_flush);
#endif
    if (!run->m.exec) run->m.exec = tool_host_exec();
    if (!run->m.on_gpu && o->read_flush) {
        fprintf(stderr, "msaidx bench: --flush read flushes a GPU's L2; the cpu bench flushes no "
                        "cache\n");
        return 2;
    }
    if (o->repeat < 0) o->repeat = run->m.on_gpu ? 10 : 3;
    if (!select_backends(run)) return 2;
    if (!tool_load_shapes(run->shapes_path, &run->shapes, &run->num_shapes)) return 2;
    if (run->m.on_gpu)
        run->reference_rows = load_reference(run->shapes_path, o->dtype, &run->reference,
                                             run->reference_path, sizeof run->reference_path);
    run->rows = calloc((size_t)run->num_shapes + 1, sizeof *run->rows);
    if (!run->rows) return 2;
    describe_machine(run);
    if (!select_rows(run) || !alloc_pool(run)) return 2;
#ifdef MSAIDX_WITH_CUDA
    /* The same-work GEMM is the ceiling of FP8 accumulation only: E4M3 at the default precision
     * (exact and BF16 scoring run on FP16/BF16 tensor cores, compared with their peak instead). */
    if (run->m.on_gpu && !o->no_ceilings && o->dtype == MSAIDX_DTYPE_E4M3 &&
        o->precision == MSAIDX_PRECISION_DEFAULT) {
        int max_k = 0;
        for (int s = 0; s < run->num_rows; ++s)
            if (run->rows[s].compute_bound && same_work_k(run->rows[s].gflop) > max_k)
                max_k = same_work_k(run->rows[s].gflop);
        if (max_k) run->same_work_gemm = tool_gpu_gemm_open(SAME_WORK_MN, SAME_WORK_MN, max_k);
    }
#endif
    bench_print_header(run);
    const double start_ms = tool_now_ms();
    for (run->rows_run = 0; run->rows_run < run->num_rows; ++run->rows_run) {
        if (o->max_seconds > 0 && tool_now_ms() - start_ms > o->max_seconds * 1e3) {
            printf("stopped after %g s (--max-seconds): %d shapes skipped\n", o->max_seconds,
                   run->num_rows - run->rows_run);
            break;
        }
        if (!bench_shape(run, run->rows_run)) return 2;
    }
    const int report_status = bench_report(run);
    if (run->backend_failed)
        fprintf(stderr, "msaidx bench: a backend failed (its reason above; '-' in the table)\n");
    return report_status ? report_status : run->backend_failed ? 1 : 0;
}

static void free_run(bench_run *run) {
    const tool_exec *exec = run->m.exec;
    if (exec) {
        exec->release(run->q_dev);
        exec->release(run->k_dev);
        exec->release(run->scores_dev);
        exec->release(run->topk_dev);
    }
#ifdef MSAIDX_WITH_CUDA
    tool_gpu_gemm_close(run->same_work_gemm);
#endif
    tool_batch_free(&run->pool);
    free(run->topk_first);
    free(run->topk_host);
    free(run->score_ms);
    free(run->topk_ms);
    free(run->rows);
    free(run->reference);
    tool_free_shapes(run->shapes, run->num_shapes);
    free(run);
}

int cmd_bench(int argc, char **argv) {
    /* Bench modes with their own options and tables (e.g. a decode grid) dispatch here, before the
     * prefill bench parses argv. */
    bench_run *run = calloc(1, sizeof *run);
    if (!run) return 2;
    int status = parse_options(argc, argv, &run->o);
    if (status < 0) status = bench_prefill(run);
    free_run(run);
    return status;
}
