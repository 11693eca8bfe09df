/* msaidx bench, the prefill shapes: the summary (geomeans against the floors, the backend
 * comparisons, speedups over vLLM's Triton) and the JSON and Markdown files. */
#include "bench_prefill.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int find_backend(const msaidx_backend *backends, int num_backends, msaidx_backend wanted) {
    for (int b = 0; b < num_backends; ++b)
        if (backends[b] == wanted) return b;
    return -1;
}

/* The one-kernel bound of a shape in us (bench_summary), 0 where the K read-once or the GEMM
 * rate was not measured. */
static double one_kernel_bound_us(const shape_row *r, double gemm_tflops) {
    if (r->key_read_us <= 0 || gemm_tflops <= 0) return 0.0;
    const double compute_us = r->gflop / gemm_tflops * 1e3;
    const double bound = r->key_read_us > compute_us ? r->key_read_us : compute_us;
    return bound > r->floor_us ? bound : r->floor_us;
}

static void summarize(const msaidx_backend *backends, int num_backends, const shape_row *rows,
                      int num_rows, double gemm_tflops, bench_summary *sum) {
    *sum = (bench_summary){0};
    double *values = malloc(sizeof(double) * (size_t)(num_rows > 0 ? num_rows : 1));
    if (!values) return;
    for (int s = 0; s < num_rows; ++s) {
        const double bound = one_kernel_bound_us(&rows[s], gemm_tflops);
        if (bound > 0) values[sum->bound_shapes++] = bound / rows[s].floor_us;
    }
    sum->bound_floor_geomean = geomean(values, sum->bound_shapes);
    for (int b = 0; b < num_backends; ++b) {
        backend_summary *bs = &sum->backends[b];
        double gflop = 0.0, us = 0.0;
        double same_gflop = 0.0, same_score_us = 0.0, gemm_gflop = 0.0, gemm_us = 0.0;
        for (int s = 0; s < num_rows; ++s)
            if (rows[s].results[b].ran)
                values[bs->shapes++] = total_us(&rows[s].results[b]) / rows[s].floor_us;
        bs->floor_geomean = geomean(values, bs->shapes);
        for (int s = 0, n = 0; s < num_rows; ++s)
            if (rows[s].results[b].ran) values[n++] = rows[s].results[b].call_us / rows[s].floor_us;
        bs->call_floor_geomean = geomean(values, bs->shapes);
        for (int s = 0, n = 0; s < num_rows; ++s) {
            const result *x = &rows[s].results[b];
            if (!x->ran) continue;
            values[n++] = x->fused_us / rows[s].floor_us;
            bs->fused_faster += x->fused_us < x->call_us;
            if (!bs->fused_worst_shape || x->fused_us / x->call_us > bs->fused_worst_ratio) {
                bs->fused_worst_ratio = x->fused_us / x->call_us;
                bs->fused_worst_shape = rows[s].shape->name;
            }
        }
        bs->fused_floor_geomean = geomean(values, bs->shapes);
        if (sum->bound_shapes == num_rows) {
            for (int s = 0, n = 0; s < num_rows; ++s)
                if (rows[s].results[b].ran)
                    values[n++] =
                        rows[s].results[b].score_us / one_kernel_bound_us(&rows[s], gemm_tflops);
            bs->score_over_bound_geomean = geomean(values, bs->shapes);
            for (int s = 0, n = 0; s < num_rows; ++s)
                if (rows[s].results[b].ran)
                    values[n++] =
                        rows[s].results[b].fused_us / one_kernel_bound_us(&rows[s], gemm_tflops);
            bs->fused_over_bound_geomean = geomean(values, bs->shapes);
        }
        for (int s = 0; s < num_rows; ++s) {
            const shape_row *r = &rows[s];
            const result *x = &r->results[b];
            if (!x->ran) continue;
            if (r->read_once_us > 0 && x->topk_us > 0)
                values[bs->read_once_shapes++] = topk_over_read_once(r, x);
            if (r->compute_bound) {
                ++bs->compute_bound_shapes;
                gflop += r->gflop;
                us += x->score_us;
            }
            if (r->compute_bound && r->same_work_gemm_us > 0) {
                same_gflop += r->gflop;
                same_score_us += x->score_us;
                gemm_gflop += r->same_work_gemm_gflop;
                gemm_us += r->same_work_gemm_us;
            }
            if (!strcmp(r->shape->name, LONG_CONTEXT_SHAPE)) {
                bs->long_context_score_us = x->score_us;
                bs->long_context_floor_us = r->floor_us;
                bs->long_context_key_read_us = r->key_read_us;
            }
        }
        bs->topk_read_once_geomean = geomean(values, bs->read_once_shapes);
        bs->compute_bound_tflops = us > 0 ? tflops(gflop, us) : 0.0;
        if (gemm_us > 0) {
            bs->same_work_gemm_tflops = tflops(gemm_gflop, gemm_us);
            bs->same_work_score_tflops = tflops(same_gflop, same_score_us);
        }
    }
    free(values);
    const int dense = find_backend(backends, num_backends, MSAIDX_BACKEND_DENSE);
    const int split = find_backend(backends, num_backends, MSAIDX_BACKEND_SPLIT);
    const int persistent = find_backend(backends, num_backends, MSAIDX_BACKEND_PERSISTENT);
    const comparison wanted[MAX_COMPARISONS] = {
        {"persistent score below dense on every shape?", dense, persistent, 1.0, true, 0, 0, 0.0,
         NULL},
        {"persistent score never above 0.95x split?", split, persistent, MARGIN, false, 0, 0, 0.0,
         NULL},
        {"split score never slower than 0.95x dense's speed (split <= dense / 0.95)?", dense, split,
         1.0 / MARGIN, false, 0, 0, 0.0, NULL},
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
static void print_summary(FILE *f, const char *bullet, const msaidx_backend *backends,
                          int num_backends, double gemm_tflops, const bench_summary *sum) {
    if (sum->bound_shapes)
        fprintf(f,
                "%sone-kernel bound (per shape the largest of the K read-once, the GFLOP at this "
                "run's %.4g TFLOP/s cuBLASLt FP8 rate, and the floor) / floor: geomean %.2fx over "
                "%d shapes\n",
                bullet, gemm_tflops, sum->bound_floor_geomean, sum->bound_shapes);
    for (int b = 0; b < num_backends; ++b) {
        const backend_summary *bs = &sum->backends[b];
        if (!bs->shapes) continue;
        fprintf(f,
                "%s%s: (score + top-k) / floor geomean %.2fx over %d shapes (as one call: %.2fx)",
                bullet, msaidx_backend_name(backends[b]), bs->floor_geomean, bs->shapes,
                bs->call_floor_geomean);
        fprintf(f,
                "; fused (prefill_topk, no score buffer) / floor geomean %.2fx, faster than the "
                "call on %d of %d shapes, worst fused / call %.3fx (%s)",
                bs->fused_floor_geomean, bs->fused_faster, bs->shapes, bs->fused_worst_ratio,
                bs->fused_worst_shape ? bs->fused_worst_shape : "-");
        if (bs->score_over_bound_geomean > 0)
            fprintf(f, "; score / one-kernel bound geomean %.2fx, fused / bound %.2fx",
                    bs->score_over_bound_geomean, bs->fused_over_bound_geomean);
        if (bs->read_once_shapes)
            fprintf(f, "; top-k / read-once geomean %.2fx over %d shapes (target <= 2x)",
                    bs->topk_read_once_geomean, bs->read_once_shapes);
        if (bs->compute_bound_shapes)
            fprintf(f,
                    "; scoring %.4g TFLOP/s on the %d compute-bound shapes (Q*H >= %d, kv >= %dK)",
                    bs->compute_bound_tflops, bs->compute_bound_shapes, COMPUTE_BOUND_ROWS,
                    COMPUTE_BOUND_KV / 1024);
        if (bs->same_work_gemm_tflops > 0)
            fprintf(f,
                    " = %.2fx cuBLASLt FP8 on GEMMs of the same work after the same flush (%.4g "
                    "TFLOP/s, %d x %d x K per shape)",
                    bs->same_work_score_tflops / bs->same_work_gemm_tflops,
                    bs->same_work_gemm_tflops, SAME_WORK_MN, SAME_WORK_MN);
        if (bs->long_context_score_us > 0)
            fprintf(f, "; %s score %.1f us = %.2fx its %.1f us floor", LONG_CONTEXT_SHAPE,
                    bs->long_context_score_us,
                    bs->long_context_score_us / bs->long_context_floor_us,
                    bs->long_context_floor_us);
        if (bs->long_context_score_us > 0 && bs->long_context_key_read_us > 0)
            fprintf(f, " and %.2fx the %.1f us K read-once",
                    bs->long_context_score_us / bs->long_context_key_read_us,
                    bs->long_context_key_read_us);
        fprintf(f, "\n");
    }
    for (int c = 0; c < sum->num_comparisons; ++c) {
        const comparison *q = &sum->comparisons[c];
        if (!q->compared) continue;
        fprintf(f, "%s%s %s: %d of %d shapes; worst %s at %.3fx\n", bullet, q->question,
                q->held == q->compared ? "yes" : "NO", q->held, q->compared, q->worst_shape,
                q->worst_ratio);
    }
}

/* `, "key": value` with null for a value that is not finite (a ratio to a zero floor). */
static void json_field(FILE *f, const char *key, double value, int decimals) {
    fprintf(f, ", \"%s\": ", key);
    tool_json_number(f, value, decimals);
}

static void write_json_summary(FILE *f, const msaidx_backend *backends, int num_backends,
                               const bench_summary *sum) {
    fprintf(f,
            "  \"summary\": {\n    \"one_kernel_bound_shapes\": %d, "
            "\"one_kernel_bound_floor_geomean\": %.3f,\n    \"backends\": {",
            sum->bound_shapes, sum->bound_floor_geomean);
    bool first = true;
    for (int b = 0; b < num_backends; ++b) {
        const backend_summary *bs = &sum->backends[b];
        if (!bs->shapes) continue;
        fprintf(f, "%s\n      \"%s\": {\"shapes\": %d", first ? "" : ",",
                msaidx_backend_name(backends[b]), bs->shapes);
        json_field(f, "floor_ratio_geomean", bs->floor_geomean, 3);
        json_field(f, "call_floor_ratio_geomean", bs->call_floor_geomean, 3);
        json_field(f, "fused_floor_ratio_geomean", bs->fused_floor_geomean, 3);
        fprintf(f, ", \"fused_faster_shapes\": %d", bs->fused_faster);
        json_field(f, "fused_worst_over_call", bs->fused_worst_ratio, 3);
        fprintf(f, ", \"read_once_shapes\": %d", bs->read_once_shapes);
        json_field(f, "topk_over_read_once_geomean", bs->topk_read_once_geomean, 3);
        fprintf(f, ", \"compute_bound_shapes\": %d", bs->compute_bound_shapes);
        json_field(f, "compute_bound_score_tflops", bs->compute_bound_tflops, 1);
        fprintf(f, ", \"long_context_shape\": \"%s\"", LONG_CONTEXT_SHAPE);
        json_field(f, "long_context_score_us", bs->long_context_score_us, 3);
        json_field(f, "long_context_floor_us", bs->long_context_floor_us, 3);
        json_field(f, "long_context_key_read_us", bs->long_context_key_read_us, 3);
        json_field(f, "same_work_gemm_tflops", bs->same_work_gemm_tflops, 1);
        json_field(f, "same_work_score_tflops", bs->same_work_score_tflops, 1);
        json_field(f, "score_over_bound_geomean", bs->score_over_bound_geomean, 3);
        json_field(f, "fused_over_bound_geomean", bs->fused_over_bound_geomean, 3);
        fprintf(f, "}");
        first = false;
    }
    fprintf(f, "\n    },\n    \"score_comparisons\": [");
    for (int c = 0; c < sum->num_comparisons; ++c) {
        const comparison *q = &sum->comparisons[c];
        fprintf(f, "%s\n      {\"question\": \"%s\", \"baseline\": \"%s\", \"backend\": \"%s\"",
                c ? "," : "", q->question, msaidx_backend_name(backends[q->a]),
                msaidx_backend_name(backends[q->b]));
        json_field(f, "limit", q->limit, 4);
        fprintf(f, ", \"strict\": %s, \"compared\": %d, \"held\": %d, \"worst_shape\": ",
                q->strict ? "true" : "false", q->compared, q->held);
        tool_json_string(f, q->worst_shape ? q->worst_shape : "");
        json_field(f, "worst_ratio", q->worst_ratio, 4);
        fprintf(f, "}");
    }
    fprintf(f, "\n    ]\n  },\n");
}

/* The precision a result was measured at, for its header lines. */
const char *bench_accumulation_mode(msaidx_precision precision) {
    return precision == MSAIDX_PRECISION_DEFAULT
               ? "default precision (persistent sums E4M3 with FP8 tensor cores, within "
                 "131*2^-13 * sum|q*k| per dot; BF16, dense, split and cpu are exact)"
               : "exact precision (FP32 sums of exact products on every backend)";
}

const char *bench_floor_source(const bench_run *run) {
    if (!run->m.on_gpu)
        return "computed: max(GFLOP / the SIMD path's measured peak, K bytes / the measured read "
               "rate)";
    return run->reference_rows ? run->reference_path
                               : "computed: max(GFLOP / 1979 TFLOP/s, K bytes / 4.8 TB/s)";
}

void bench_print_header(const bench_run *run) {
    const bench_options *o = &run->o;
    printf("msaidx bench: %s\n", run->m.device);
    if (run->m.gemm_tflops > 0 || run->m.copy_tbps > 0)
        printf("ceilings: cuBLASLt FP8 E4M3 GEMM 8192^3 (TN, bf16 out) %.0f TFLOP/s; device copy "
               "%.2f TB/s (read + "
               "write)\n",
               run->m.gemm_tflops, run->m.copy_tbps);
    if (!run->m.on_gpu)
        printf("ceilings: %s arithmetic peak %.1f GFLOP/s; read %.1f GB/s (STREAM-like: each "
               "thread's best sum of 8 MiB "
               "chunks of a 256 MiB buffer, over all threads)\n",
               run->m.cpu.simd, run->m.cpu.peak_gflops, run->m.cpu.read_gbps);
    printf("shapes: %d of %d from %s%s; floors: %s; dtype %s; median of %ld, warm-up excluded%s\n",
           run->num_rows, run->num_shapes, run->shapes_path,
           !run->m.on_gpu && !o->all ? " (CPU subset, --all for every shape)" : "",
           bench_floor_source(run), o->dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", o->repeat,
           !run->m.on_gpu  ? ""
           : o->read_flush ? ", L2 flushed by a 2 x L2 read, CUDA events"
                           : ", L2 flushed by a 2 x L2 memset, CUDA events");
    printf("accumulation: %s\n", bench_accumulation_mode(o->precision));
    if (o->pitch) printf("score pitch: at least %d pages\n", o->pitch);
    printf("%-22s %2s %9s %9s", "shape", "H", "GFLOP", "floor us");
    for (int b = 0; b < run->num_backends; ++b)
        printf(" | %-10s %9s %8s %8s %7s %8s %6s", msaidx_backend_name(run->backends[b]),
               "score us", "top-k us", rate_unit(run), "x floor", "fused us", "/call");
    if (run->m.on_gpu)
        printf(
            " | read-once us, top-k / read-once per backend | K read-once us, score / K read-once");
    if (run->same_work_gemm)
        printf(" | compute-bound shapes: same-work GEMM us (cuBLASLt FP8 %d x %d x K, K from the "
               "shape's GFLOP, same flush), score / it at equal FLOPs",
               SAME_WORK_MN, SAME_WORK_MN);
    printf("\n");
    fflush(stdout);
}

static void write_json(FILE *f, const void *context) {
    const bench_run *run = context;
    const bench_options *o = &run->o;
    fprintf(f, "{\n  \"device\": ");
    tool_json_string(f, run->m.device);
    fprintf(f,
            ",\n  \"dtype\": \"%s\",\n  \"precision\": \"%s\",\n  \"flush\": \"%s\",\n"
            "  \"repeat\": %ld,\n  \"min_pitch\": %d,\n  \"shapes_file\": ",
            o->dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", tool_precision_name(o->precision),
            !run->m.on_gpu  ? "none"
            : o->read_flush ? "read"
                            : "memset",
            o->repeat, o->pitch);
    tool_json_string(f, run->shapes_path);
    fprintf(f, ",\n  \"floor_source\": ");
    tool_json_string(f, bench_floor_source(run));
    if (run->m.on_gpu)
        fprintf(f,
                ",\n  \"ceilings\": {\"cublaslt_fp8_gemm_8192_tflops\": %.1f, "
                "\"device_copy_tbps\": %.3f},\n",
                run->m.gemm_tflops, run->m.copy_tbps);
    else
        fprintf(f,
                ",\n  \"ceilings\": {\"cpu_simd\": \"%s\", \"cpu_peak_gflops\": %.1f, "
                "\"cpu_read_gbps\": %.2f},\n",
                run->m.cpu.simd, run->m.cpu.peak_gflops, run->m.cpu.read_gbps);
    fprintf(f, "  \"backends\": [");
    for (int b = 0; b < run->num_backends; ++b)
        fprintf(f, "%s\"%s\"", b ? ", " : "", msaidx_backend_name(run->backends[b]));
    fprintf(f, "],\n");
    write_json_summary(f, run->backends, run->num_backends, &run->summary);
    fprintf(f, "  \"shapes\": [\n");
    for (int s = 0; s < run->rows_run; ++s) {
        const shape_row *r = &run->rows[s];
        fprintf(f, "    {\"name\": ");
        tool_json_string(f, r->shape->name);
        fprintf(f, ", \"heads\": %d, \"requests\": %d", r->shape->heads, r->shape->num_requests);
        json_field(f, "gflop", r->gflop, 4);
        json_field(f, "floor_us", r->floor_us, 3);
        fprintf(f, ", \"tokens\": %lld, \"max_kv\": %d, \"compute_bound\": %s",
                (long long)tool_total_tokens(r->shape->q_lens, r->shape->num_requests),
                max_kv_of(r->shape), r->compute_bound ? "true" : "false");
        if (r->read_once_us > 0) json_field(f, "read_once_us", r->read_once_us, 3);
        if (r->key_read_us > 0) json_field(f, "key_read_once_us", r->key_read_us, 3);
        if (r->same_work_gemm_us > 0) {
            json_field(f, "same_work_gemm_us", r->same_work_gemm_us, 3);
            json_field(f, "same_work_gemm_gflop", r->same_work_gemm_gflop, 4);
        }
        if (r->reference_us > 0) json_field(f, "reference_score_us", r->reference_us, 1);
        if (r->reference) {
            json_field(f, "vllm_score_us", r->reference->vllm_score_us, 1);
            json_field(f, "vllm_topk_us", r->reference->vllm_topk_us, 1);
        }
        fprintf(f, ", \"results\": {");
        bool first = true;
        for (int b = 0; b < run->num_backends; ++b) {
            const result *x = &r->results[b];
            if (!x->ran) continue;
            fprintf(f, "%s\"%s\": {\"runs\": %d", first ? "" : ", ",
                    msaidx_backend_name(run->backends[b]), x->runs);
            json_field(f, "score_us", x->score_us, 3);
            json_field(f, "topk_us", x->topk_us, 3);
            json_field(f, "total_us", total_us(x), 3);
            json_field(f, "score_tflops", tflops(r->gflop, x->score_us), 4);
            json_field(f, "floor_ratio", total_us(x) / r->floor_us, 2);
            fprintf(f, ", \"topk_rows_differ\": %lld", (long long)x->topk_rows_differ);
            json_field(f, "call_us", x->call_us, 3);
            json_field(f, "call_floor_ratio", x->call_us / r->floor_us, 2);
            json_field(f, "fused_us", x->fused_us, 3);
            json_field(f, "fused_floor_ratio", x->fused_us / r->floor_us, 2);
            json_field(f, "fused_over_call", x->fused_us / x->call_us, 3);
            fprintf(f, ", \"fused_rows_differ\": %lld", (long long)x->fused_rows_differ);
            if (r->read_once_us > 0)
                json_field(f, "topk_over_read_once", topk_over_read_once(r, x), 3);
            if (r->key_read_us > 0)
                json_field(f, "score_over_key_read_once", score_over_key_read(r, x), 3);
            fprintf(f, "}");
            first = false;
        }
        fprintf(f, "}}%s\n", s + 1 < run->rows_run ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
}

/* A Markdown cell of a value that may be missing (<= 0). */
static void markdown_cell(FILE *f, const char *format, bool present, double value) {
    if (!present) {
        fprintf(f, " - |");
        return;
    }
    fprintf(f, " ");
    fprintf(f, format, value);
    fprintf(f, " |");
}

static void write_markdown(FILE *f, const void *context) {
    const bench_run *run = context;
    const bool have_vllm = run->reference_rows > 0 && run->m.on_gpu;
    fprintf(f, "Device: %s", run->m.device);
    if (run->m.gemm_tflops > 0)
        fprintf(f, "; cuBLASLt FP8 GEMM 8192^3 %.0f TFLOP/s; device copy %.2f TB/s",
                run->m.gemm_tflops, run->m.copy_tbps);
    if (!run->m.on_gpu)
        fprintf(f, "; ceilings measured in this run: %s peak %.0f GFLOP/s, read %.1f GB/s",
                run->m.cpu.simd, run->m.cpu.peak_gflops, run->m.cpu.read_gbps);
    fprintf(f, "\n\nFloors: %s", bench_floor_source(run));
    fprintf(f, "\n\nAccumulation: %s", bench_accumulation_mode(run->o.precision));
    if (run->o.pitch) fprintf(f, "\n\nScore pitch: at least %d pages", run->o.pitch);
    fprintf(f,
            "\n\nSummary (score comparisons use score times; worst = the largest time ratio):\n\n");
    print_summary(f, "- ", run->backends, run->num_backends, run->m.gemm_tflops, &run->summary);
    fprintf(f,
            "\nTimes in us (median); %s of scoring; x floor = (score + top-k) / floor; read-once = "
            "a kernel "
            "reading every valid score cell once; top-k / RO = top-k time / read-once time; K "
            "read-once = a "
            "kernel reading every key page of the batch once; score / K RO = score time / K "
            "read-once time; fused = msaidx_prefill_topk without a score buffer, one interval; "
            "fused / call = fused over score + top-k issued as one interval.\n\n",
            rate_unit(run));
    fprintf(f, "| shape | H | GFLOP | floor us | read-once us | K read-once us |");
    for (int b = 0; b < run->num_backends; ++b) {
        const char *name = msaidx_backend_name(run->backends[b]);
        fprintf(f,
                " %s score | %s top-k | %s %s | %s x floor | %s top-k / RO | %s score / K RO | "
                "%s fused | %s fused / call |",
                name, name, name, rate_unit(run), name, name, name, name, name);
    }
    if (have_vllm) fprintf(f, " vLLM Triton us |");
    fprintf(f, "\n|---|---:|---:|---:|---:|---:|");
    for (int b = 0; b < run->num_backends; ++b)
        fprintf(f, "---:|---:|---:|---:|---:|---:|---:|---:|");
    if (have_vllm) fprintf(f, "---:|");
    fprintf(f, "\n");
    for (int s = 0; s < run->rows_run; ++s) {
        const shape_row *r = &run->rows[s];
        fprintf(f, "| %s | %d | %.2f | %.2f |", r->shape->name, r->shape->heads, r->gflop,
                r->floor_us);
        markdown_cell(f, "%.1f", r->read_once_us > 0, r->read_once_us);
        markdown_cell(f, "%.1f", r->key_read_us > 0, r->key_read_us);
        for (int b = 0; b < run->num_backends; ++b) {
            const result *x = &r->results[b];
            markdown_cell(f, "%.1f", x->ran, x->score_us);
            markdown_cell(f, "%.1f", x->ran, x->topk_us);
            markdown_cell(f, "%.1f", x->ran, x->ran ? rate(run, r->gflop, x->score_us) : 0.0);
            markdown_cell(f, "%.1f", x->ran, total_us(x) / r->floor_us);
            markdown_cell(f, "%.2f", x->ran && r->read_once_us > 0, topk_over_read_once(r, x));
            markdown_cell(f, "%.2f", x->ran && r->key_read_us > 0, score_over_key_read(r, x));
            markdown_cell(f, "%.1f", x->ran, x->fused_us);
            markdown_cell(f, "%.3f", x->ran, x->ran ? x->fused_us / x->call_us : 0.0);
        }
        if (have_vllm)
            fprintf(f, " %.1f |",
                    r->reference ? r->reference->vllm_score_us + r->reference->vllm_topk_us : 0.0);
        fprintf(f, "\n");
    }
}

/* Wins, losses and geomean of the speedup of backend b over backend a (score + top-k). */
static void print_speedups(const char *label_b, const char *label_a, const shape_row *rows,
                           int num_rows, int a, int b, bool a_is_vllm) {
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
        printf("  %-10s vs %-10s: geomean speedup %.2fx, %d wins, %d losses of %d (range %.2fx .. "
               "%.2fx)\n",
               label_b, label_a, geomean(ratios, n), wins, losses, n, worst, best);
    free(ratios);
}

int bench_report(bench_run *run) {
    const bench_options *o = &run->o;
    summarize(run->backends, run->num_backends, run->rows, run->rows_run, run->m.gemm_tflops,
              &run->summary);
    printf("summary (%s precision):\n", tool_precision_name(o->precision));
    print_summary(stdout, "  ", run->backends, run->num_backends, run->m.gemm_tflops,
                  &run->summary);
    printf("speedups (score + top-k):\n");
    for (int a = 0; a < run->num_backends; ++a)
        for (int b = a + 1; b < run->num_backends; ++b)
            print_speedups(msaidx_backend_name(run->backends[b]),
                           msaidx_backend_name(run->backends[a]), run->rows, run->rows_run, a, b,
                           false);
    if (run->reference_rows && run->m.on_gpu)
        for (int b = 0; b < run->num_backends; ++b)
            print_speedups(msaidx_backend_name(run->backends[b]),
                           "vLLM Triton (h200_reference*.tsv)", run->rows, run->rows_run, 0, b,
                           true);
    bool written = true;
    if (o->json_path) written = tool_write_file("bench", o->json_path, write_json, run) && written;
    if (o->markdown_path)
        written = tool_write_file("bench", o->markdown_path, write_markdown, run) && written;
    return written ? 0 : 1;
}
