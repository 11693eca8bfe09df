/* msaidx bench, the prefill shapes: the baselines each shape's backends are compared with on a GPU,
 * timed like the backends (L2 flushed before each run, one warm-up run, median): a kernel reading
 * every valid score cell once (top-k's input), one reading every key page once (a scorer's), and
 * for compute-bound shapes cuBLASLt's FP8 GEMM of the same work. Compiled to nothing without CUDA.
 */
#include "bench_prefill.h"

#ifdef MSAIDX_WITH_CUDA

#include <stdio.h>
#include <stdlib.h>

typedef bool (*baseline_launch)(const void *args, void *stream);

/* Median time in us of a baseline kernel, timed like the backends (L2 flushed before each run, one
 * warm-up run); 0 on failure. */
static double time_baseline(const tool_exec *exec, long repeat, double *times,
                            baseline_launch launch, const void *args) {
    bool ok = true;
    for (long i = -1; ok && i < repeat; ++i) {
        ok = exec->flush_cache() && exec->mark(0) && launch(args, exec->stream) && exec->mark(1) &&
             exec->sync();
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
    return tool_gpu_read_once(a->scores, a->pitch, a->nvp, a->num_tokens, a->heads, a->segment_max,
                              stream);
}

/* The read-once kernel on the shape's score layout (backend independent). */
static double time_read_once(const tool_exec *exec, const tool_batch *batch, long repeat,
                             const float *scores, double *times) {
    const int32_t T = batch->desc.num_tokens, pitch = batch->desc.pitch;
    read_once_args args = {scores, NULL, pitch, T, batch->heads, NULL};
    double us = 0.0;
    if (exec->alloc((void **)&args.nvp, sizeof(int32_t) * (size_t)(T > 0 ? T : 1)) &&
        exec->upload((void *)args.nvp, batch->nvp, sizeof(int32_t) * (size_t)T) &&
        exec->alloc((void **)&args.segment_max,
                    sizeof(float) * tool_gpu_read_once_floats(T, batch->heads, pitch)))
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
    return tool_gpu_key_read(a->k_cache, a->page_stride, a->page_bytes, a->pages, a->num_pages,
                             a->sink, stream);
}

/* Reading the batch's key pages once: pages [0, ceil(seq_len / page)) of every request, through its
 * block-table row. */
static double time_key_read(const tool_exec *exec, const tool_batch *batch, long repeat,
                            const void *k_cache, double *times) {
    const msaidx_batch_desc *d = &batch->desc;
    key_read_args args = {
        k_cache, d->page_stride,
        0,       TOOL_PAGE * TOOL_HEAD_DIM * (batch->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1),
        NULL,    NULL};
    for (int32_t b = 0; b < d->batch_size; ++b) args.num_pages += tool_pages_of(batch->seq_lens[b]);
    const size_t page_list_bytes =
        sizeof(int32_t) * (size_t)(args.num_pages > 0 ? args.num_pages : 1);
    int32_t *pages = malloc(page_list_bytes);
    if (!pages) return 0.0;
    int64_t n = 0;
    for (int32_t b = 0; b < d->batch_size; ++b)
        for (int32_t p = 0; p < tool_pages_of(batch->seq_lens[b]); ++p)
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

void bench_time_baselines(bench_run *run, shape_row *r, const tool_batch *batch) {
    const tool_exec *exec = run->m.exec;
    const long repeat = run->o.repeat;
    r->read_once_us = time_read_once(exec, batch, repeat, run->scores_dev, run->score_ms);
    print_baseline("read-once", r->read_once_us, r, run->num_backends, topk_over_read_once);
    r->key_read_us = time_key_read(exec, batch, repeat, run->k_dev, run->score_ms);
    print_baseline("K read-once", r->key_read_us, r, run->num_backends, score_over_key_read);
    if (r->compute_bound && run->same_work_gemm) {
        const int k = same_work_k(r->gflop);
        r->same_work_gemm_gflop = 2.0 * SAME_WORK_MN * SAME_WORK_MN * k * 1e-9;
        r->same_work_gemm_us = tool_gpu_gemm_ms(run->same_work_gemm, k, (int)repeat, true) * 1e3;
        print_baseline("same-work GEMM", r->same_work_gemm_us, r, run->num_backends,
                       score_over_same_work);
    }
}

#endif /* MSAIDX_WITH_CUDA */
