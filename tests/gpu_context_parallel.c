/*
 * Context parallel on the CUDA backends (SPEC.md section 12), W ranks simulated on one GPU: each
 * rank's sharded plan (desc.cp_*) on dense, split and persistent scores its pages, its candidates
 * carry global page ids, and the device merge (msaidx_merge_candidates on a CUDA context) of the
 * gathered candidates must give bitwise the ids msaidx_prefill_topk gives for the unsharded batch
 * on the same backend and precision. Random ragged batches (prefill and decode rows, H 1/2/4,
 * rows with nvp <= topk, padding rows, NaN inputs, forced init/local pages), both layouts,
 * W = 1..4; each rank's scores (prefill and decode scorer) bitwise the unsharded ones of its
 * columns, cells past its nvp untouched; on persistent, a batch of 1M-token rows whose ranks'
 * candidates without a score buffer select from chunk maxima. Then the device merge bitwise
 * against the cpu merge on hostile candidates, and a sharded plan captured in a CUDA graph,
 * replayed after a rewrite of the metadata in place.
 */
#include "cp_oracle.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

#include <math.h>

static void *host_alloc(size_t bytes) {
    void *pointer = calloc(1, bytes + 64);
    if (!pointer) exit(2);
    return pointer;
}
static void *device_alloc(size_t bytes) {
    void *pointer = NULL;
    CUDA_CHECK(cudaMalloc(&pointer, bytes + 64));
    return pointer;
}
static void upload(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
}
static void download(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
static float *poisoned_scores(size_t cells) {
    float *host = host_alloc(sizeof(float) * cells);
    bc_poison(host, cells);
    float *device = device_alloc(sizeof(float) * cells);
    upload(device, host, sizeof(float) * cells);
    free(host);
    return device;
}

/* The unsharded batch on one backend: selection, prefill and decode scores, global nvp. */
typedef struct unsharded {
    msaidx_topk_args args;
    int32_t *selection, *nvp;
    float *scores, *decode_scores;
} unsharded;

typedef struct rank_setup {
    int32_t W, r, layout;
    bool decode;
    bool keep_scores; /* candidates with a score buffer (else into the workspace) */
} rank_setup;

/* A sharded plan of rank r: scores (prefill, and decode when asked) and candidates into the
 * device buffers cand_scores / cand_pages; checks against the unsharded results. */
static void run_rank(const bc_batch *batch, msaidx_context *context, const gpu_batch *g,
                     const unsharded *u, rank_setup s, harness_rng *rng, float *cand_scores,
                     int32_t *cand_pages, cudaStream_t stream, const char *label) {
    const msaidx_batch_desc *full = &batch->desc;
    const int32_t T = full->num_tokens, H = batch->config.num_heads, K = u->args.topk;
    const int32_t P = batch->config.page_size, B = full->batch_size;
    const int32_t local_max = ceil_div(ceil_div(full->max_seq_len, P), s.W);
    msaidx_batch_desc desc = *full;
    desc.cp_world = s.W;
    desc.cp_rank = s.r;
    desc.cp_layout = s.layout;
    desc.bt_stride = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    desc.pitch = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    const size_t table_ints = (size_t)(B > 0 ? B : 1) * desc.bt_stride;
    int32_t *table = host_alloc(sizeof(int32_t) * table_ints);
    /* map: the request's owned global pages by local index (every request's pages fit in
     * full->bt_stride). */
    int32_t *map =
        host_alloc(sizeof(int32_t) * (size_t)(full->bt_stride > 0 ? full->bt_stride : 1));
    for (int32_t b = 0; b < B; ++b) {
        const int32_t owned = owned_pages(s.layout, s.W, s.r, ceil_div(batch->seq_lens[b], P), map);
        for (int32_t i = 0; i < desc.bt_stride; ++i)
            table[(size_t)b * desc.bt_stride + i] =
                i < owned ? batch->block_table[(size_t)b * full->bt_stride + map[i]] : -7;
    }
    int32_t *device_table = device_alloc(sizeof(int32_t) * table_ints);
    upload(device_table, table, sizeof(int32_t) * table_ints);
    msaidx_plan *plan = NULL;
    size_t bytes = 0, area_bytes = 0;
    CHECK_OK(msaidx_plan_create(&plan, context, &desc));
    if (!plan) {
        free(table);
        free(map);
        CUDA_CHECK(cudaFree(device_table));
        return;
    }
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes));
    void *workspace = device_alloc(bytes), *area = device_alloc(area_bytes);
    CHECK_OK(msaidx_plan_batch(plan, g->cu_seqlens_q, g->seq_lens, device_table, workspace, bytes,
                               stream));
    const size_t cells = (size_t)T * H * desc.pitch;
    float *scores = poisoned_scores(cells), *decode_scores = NULL;
    const bool keep_scores = s.keep_scores;
    msaidx_topk_args args = u->args;
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    CHECK_OK(msaidx_prefill_topk_candidates(plan, g->q, g->k_cache, &args,
                                            keep_scores ? scores : NULL, cand_scores, cand_pages,
                                            stream));
    if (s.decode) {
        decode_scores = poisoned_scores(cells);
        CHECK_OK(msaidx_decode_scores(plan, g->q, g->k_cache, decode_scores, stream));
    }
    CHECK_OK(msaidx_plan_check(plan, stream));
    const int32_t *device_nvp = NULL;
    CHECK_OK(msaidx_plan_nvp(plan, &device_nvp));
    int32_t *nvp = host_alloc(sizeof(int32_t) * (size_t)T);
    int32_t *pages = host_alloc(sizeof(int32_t) * (size_t)T * H * K);
    float *got = host_alloc(sizeof(float) * cells), *got_decode = host_alloc(sizeof(float) * cells);
    if (device_nvp) download(nvp, device_nvp, sizeof(int32_t) * (size_t)T);
    download(pages, cand_pages, sizeof(int32_t) * (size_t)T * H * K);
    download(got, scores, sizeof(float) * cells);
    if (decode_scores) download(got_decode, decode_scores, sizeof(float) * cells);
    long bad_nvp = 0, bad_cells = 0, bad_decode = 0, bad_pages = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t request_pages = ceil_div(batch->seq_lens[b], P);
        owned_pages(s.layout, s.W, s.r, request_pages, map);
        for (int32_t t = batch->cu_seqlens_q[b]; t < batch->cu_seqlens_q[b + 1]; ++t) {
            const int32_t local = owned_below(s.layout, s.W, s.r, request_pages, u->nvp[t]);
            bad_nvp += nvp[t] != local;
            for (int32_t h = 0; h < H; ++h) {
                const size_t row = (size_t)t * H + h;
                for (int32_t i = 0; i < desc.pitch; ++i) {
                    const size_t at = row * desc.pitch + i;
                    if (i >= local) {
                        bad_cells += keep_scores && !bc_is_poison(got[at]);
                        bad_decode += s.decode && !bc_is_poison(got_decode[at]);
                        continue;
                    }
                    const size_t want = row * full->pitch + map[i];
                    bad_cells += keep_scores && memcmp(got + at, u->scores + want, 4) != 0;
                    bad_decode +=
                        s.decode && memcmp(got_decode + at, u->decode_scores + want, 4) != 0;
                }
                const int32_t *row_pages = pages + row * K;
                for (int32_t k = 0; k < K; ++k) {
                    const int32_t p = row_pages[k];
                    if (k >= (local < K ? local : K))
                        bad_pages += p != -1;
                    else
                        bad_pages += p < 0 || p >= u->nvp[t] ||
                                     !owns(s.layout, s.W, s.r, request_pages, p) ||
                                     (k > 0 && p <= row_pages[k - 1]);
                }
            }
        }
    }
    for (int32_t t = B > 0 ? batch->cu_seqlens_q[B] : 0; t < T; ++t) {
        bad_nvp += nvp[t] != 0;
        for (int32_t k = 0; k < H * K; ++k) bad_pages += pages[(size_t)t * H * K + k] != -1;
        for (size_t i = 0; i < (size_t)H * desc.pitch; ++i) {
            bad_cells += keep_scores && !bc_is_poison(got[(size_t)t * H * desc.pitch + i]);
            bad_decode += s.decode && !bc_is_poison(got_decode[(size_t)t * H * desc.pitch + i]);
        }
    }
    CHECK(bad_nvp == 0, "%s rank %d: %ld nvp entries are not the owned visible pages", label, s.r,
          bad_nvp);
    CHECK(bad_cells == 0, "%s rank %d: %ld prefill score cells differ from the unsharded ones",
          label, s.r, bad_cells);
    CHECK(bad_decode == 0, "%s rank %d: %ld decode score cells differ from the unsharded ones",
          label, s.r, bad_decode);
    CHECK(bad_pages == 0, "%s rank %d: %ld candidate pages are not ascending owned global pages",
          label, s.r, bad_pages);
    msaidx_plan_destroy(plan);
    CUDA_CHECK(cudaFree(workspace));
    CUDA_CHECK(cudaFree(area));
    CUDA_CHECK(cudaFree(scores));
    if (decode_scores) CUDA_CHECK(cudaFree(decode_scores));
    CUDA_CHECK(cudaFree(device_table));
    free(table);
    free(map);
    free(nvp);
    free(pages);
    free(got);
    free(got_decode);
}

static void run_unsharded(const bc_batch *batch, msaidx_context *context, const gpu_batch *g,
                          unsharded *u, cudaStream_t stream) {
    const int32_t T = batch->desc.num_tokens, H = batch->config.num_heads;
    msaidx_topk_args_init(&u->args);
    u->args.topk = batch->config.topk;
    u->args.init_blocks = batch->config.init_blocks;
    u->args.local_blocks = batch->config.local_blocks;
    const size_t cells = bc_score_count(batch), picks = (size_t)T * H * u->args.topk;
    u->selection = host_alloc(sizeof(int32_t) * picks);
    u->nvp = host_alloc(sizeof(int32_t) * (size_t)T);
    u->scores = host_alloc(sizeof(float) * cells);
    u->decode_scores = host_alloc(sizeof(float) * cells);
    msaidx_plan *plan = NULL;
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_create(&plan, context, &batch->desc));
    if (!plan) return;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    void *workspace = device_alloc(bytes);
    float *scores = poisoned_scores(cells), *decode_scores = poisoned_scores(cells);
    int32_t *selection = device_alloc(sizeof(int32_t) * picks), *nvp = device_alloc(4 * (size_t)T);
    CHECK_OK(msaidx_plan_batch(plan, g->cu_seqlens_q, g->seq_lens, g->block_table, workspace, bytes,
                               stream));
    CHECK_OK(msaidx_prefill_topk(plan, g->q, g->k_cache, &u->args, scores, selection, stream));
    CHECK_OK(msaidx_decode_scores(plan, g->q, g->k_cache, decode_scores, stream));
    CHECK_OK(msaidx_num_valid_pages(context, g->cu_seqlens_q, g->seq_lens, batch->desc.batch_size,
                                    T, nvp, stream));
    download(u->selection, selection, sizeof(int32_t) * picks);
    download(u->nvp, nvp, sizeof(int32_t) * (size_t)T);
    download(u->scores, scores, sizeof(float) * cells);
    download(u->decode_scores, decode_scores, sizeof(float) * cells);
    msaidx_plan_destroy(plan);
    CUDA_CHECK(cudaFree(workspace));
    CUDA_CHECK(cudaFree(scores));
    CUDA_CHECK(cudaFree(decode_scores));
    CUDA_CHECK(cudaFree(selection));
    CUDA_CHECK(cudaFree(nvp));
}

/* The batch on `backend`: for W = 1..max_world ranks in both layouts, each rank's candidates
 * (with a score buffer at random, or never with `no_score_buffer`), merged. */
static void check_backend(const bc_batch *batch, msaidx_backend backend, msaidx_context *cpu,
                          harness_rng *rng, cudaStream_t stream, const char *label,
                          int32_t max_world, bool no_score_buffer) {
    msaidx_config config = batch->config;
    config.backend = backend;
    config.device = 0;
    msaidx_context *context = NULL;
    if (msaidx_context_create(&context, &config) != MSAIDX_SUCCESS) {
        CHECK(!bc_must_admit(backend, gpu_runs_sm90a(), &config),
              "%s %s: refused, though documented as admitted: %s", label,
              msaidx_backend_name(backend), msaidx_last_error());
        return;
    }
    gpu_batch g;
    gpu_upload(&g, batch);
    unsharded u;
    run_unsharded(batch, context, &g, &u, stream);
    const int32_t T = batch->desc.num_tokens, H = config.num_heads, K = u.args.topk;
    const size_t per_rank = (size_t)T * H * K;
    int32_t *merged = host_alloc(sizeof(int32_t) * per_rank);
    int32_t *cpu_merged = host_alloc(sizeof(int32_t) * per_rank);
    int32_t *merged_device = device_alloc(sizeof(int32_t) * per_rank);
    int32_t *nvp_device = device_alloc(sizeof(int32_t) * (size_t)T);
    upload(nvp_device, u.nvp, sizeof(int32_t) * (size_t)T);
    for (int32_t W = 1; W <= max_world; ++W)
        for (int32_t layout = 0; layout < 2; ++layout) {
            const int64_t rank_stride = (int64_t)per_rank + (harness_int(rng, 0, 3) ? 0 : 5);
            const size_t gathered = (size_t)rank_stride * W;
            float *cand_scores = device_alloc(sizeof(float) * gathered);
            int32_t *cand_pages = device_alloc(sizeof(int32_t) * gathered);
            CUDA_CHECK(cudaMemsetAsync(cand_pages, 0x5A, sizeof(int32_t) * gathered, stream));
            char what[200];
            snprintf(what, sizeof what, "%s %s W=%d %s", label, msaidx_backend_name(backend), W,
                     layout ? "contiguous" : "interleaved");
            for (int32_t r = 0; r < W; ++r) {
                const rank_setup s = {W, r, layout, batch->spec.decode || r == 0,
                                      !no_score_buffer && harness_int(rng, 0, 2) != 0};
                run_rank(batch, context, &g, &u, s, rng, cand_scores + r * rank_stride,
                         cand_pages + r * rank_stride, stream, what);
            }
            CUDA_CHECK(cudaMemsetAsync(merged_device, 0x5A, sizeof(int32_t) * per_rank, stream));
            CHECK_OK(msaidx_merge_candidates(context, &u.args, W, T, nvp_device, cand_scores,
                                             cand_pages, rank_stride, merged_device, stream));
            download(merged, merged_device, sizeof(int32_t) * per_rank);
            long differ = 0;
            for (size_t i = 0; i < per_rank; ++i) differ += merged[i] != u.selection[i];
            CHECK(differ == 0, "%s: %ld of %zu merged ids differ from msaidx_prefill_topk's", what,
                  differ, per_rank);
            /* The cpu merge of the same gathered candidates. */
            float *host_scores = host_alloc(sizeof(float) * gathered);
            int32_t *host_pages = host_alloc(sizeof(int32_t) * gathered);
            download(host_scores, cand_scores, sizeof(float) * gathered);
            download(host_pages, cand_pages, sizeof(int32_t) * gathered);
            CHECK_OK(msaidx_merge_candidates(cpu, &u.args, W, T, u.nvp, host_scores, host_pages,
                                             rank_stride, cpu_merged, NULL));
            differ = 0;
            for (size_t i = 0; i < per_rank; ++i) differ += merged[i] != cpu_merged[i];
            CHECK(differ == 0, "%s: %ld device merge ids differ from the cpu merge's", what,
                  differ);
            free(host_scores);
            free(host_pages);
            CUDA_CHECK(cudaFree(cand_scores));
            CUDA_CHECK(cudaFree(cand_pages));
        }
    free(merged);
    free(cpu_merged);
    CUDA_CHECK(cudaFree(merged_device));
    CUDA_CHECK(cudaFree(nvp_device));
    free(u.selection);
    free(u.nvp);
    free(u.scores);
    free(u.decode_scores);
    gpu_release(&g);
    msaidx_context_destroy(context);
}

/* Candidates no rank would send (pages anywhere, repeated, NaN and infinite scores), any nvp,
 * strided outputs: the device merge equals the cpu merge bitwise. */
static void check_hostile_merge(harness_rng *rng, cudaStream_t stream, int round) {
    const int32_t H = (int32_t)harness_int(rng, 1, 4), K = (int32_t)harness_int(rng, 1, 64);
    const int32_t T = (int32_t)harness_int(rng, 1, 40), W = (int32_t)harness_int(rng, 1, 5);
    const int32_t init = (int32_t)harness_int(rng, 0, K),
                  local = (int32_t)harness_int(rng, 0, K - init);
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = H;
    msaidx_context *cpu = NULL, *device = NULL;
    CHECK_OK(msaidx_context_create(&cpu, &config));
    config.device = 0;
    config.backend = MSAIDX_BACKEND_DENSE;
    CHECK_OK(msaidx_context_create(&device, &config));
    if (!cpu || !device) return;
    const size_t per_rank = (size_t)T * H * K, count = per_rank * W;
    float *scores = host_alloc(sizeof(float) * count);
    int32_t *pages = host_alloc(sizeof(int32_t) * count), *nvp = host_alloc(sizeof(int32_t) * T);
    hostile_candidates(rng, scores, pages, count, nvp, T, round % 3 == 0); /* now and then ties */
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    args.init_blocks = init;
    args.local_blocks = local;
    const bool transposed = harness_int(rng, 0, 1);
    if (transposed) { /* the [H, T, topk] buffer's transpose, as vLLM keeps top-k */
        args.out_stride_t = K;
        args.out_stride_h = (int64_t)T * K;
    }
    int32_t *want = host_alloc(sizeof(int32_t) * per_rank), *got = host_alloc(4 * per_rank);
    CHECK_OK(msaidx_merge_candidates(cpu, &args, W, T, nvp, scores, pages, (int64_t)per_rank, want,
                                     NULL));
    float *d_scores = device_alloc(sizeof(float) * count);
    int32_t *d_pages = device_alloc(4 * count), *d_nvp = device_alloc(4 * (size_t)T);
    int32_t *d_out = device_alloc(4 * per_rank);
    upload(d_scores, scores, sizeof(float) * count);
    upload(d_pages, pages, 4 * count);
    upload(d_nvp, nvp, 4 * (size_t)T);
    CHECK_OK(msaidx_merge_candidates(device, &args, W, T, d_nvp, d_scores, d_pages,
                                     (int64_t)per_rank, d_out, stream));
    download(got, d_out, 4 * per_rank);
    long differ = 0;
    for (size_t i = 0; i < per_rank; ++i) differ += got[i] != want[i];
    CHECK(differ == 0, "hostile merge round %d (H %d, topk %d, init %d, local %d, W %d): %ld ids",
          round, H, K, init, local, W, differ);
    if (!transposed) { /* in place over rank 0's candidate pages: every read before the writes */
        CHECK_OK(msaidx_merge_candidates(device, &args, W, T, d_nvp, d_scores, d_pages,
                                         (int64_t)per_rank, d_pages, stream));
        download(got, d_pages, 4 * per_rank);
        differ = 0;
        for (size_t i = 0; i < per_rank; ++i) differ += got[i] != want[i];
        CHECK(differ == 0, "hostile merge in place, round %d (H %d, topk %d, W %d): %ld ids", round,
              H, K, W, differ);
    }
    free(scores);
    free(pages);
    free(nvp);
    free(want);
    free(got);
    CUDA_CHECK(cudaFree(d_scores));
    CUDA_CHECK(cudaFree(d_pages));
    CUDA_CHECK(cudaFree(d_nvp));
    CUDA_CHECK(cudaFree(d_out));
    msaidx_context_destroy(cpu);
    msaidx_context_destroy(device);
}

/* One rank of W = 2 (interleaved) captured in a graph: plan, candidates, merge of its own
 * candidates as world 1; replayed after the metadata is rewritten in place (longer contexts),
 * the replay must equal an eager run of the new metadata. */
static void check_graph(harness_rng *rng, msaidx_backend backend, cudaStream_t stream) {
    bc_spec spec;
    bc_random_spec(&spec, rng, true);
    spec.batch_size = 3;
    const int32_t q_lens[] = {1, 40, 3}, prefixes[] = {900, 2000, 300};
    for (int b = 0; b < 3; ++b) {
        spec.q_lens[b] = q_lens[b];
        spec.prefixes[b] = prefixes[b];
    }
    spec.pad_tokens = 1;
    bc_batch *batch = bc_build(&spec, rng);
    msaidx_config config = batch->config;
    config.backend = backend;
    config.device = 0;
    msaidx_context *context = NULL;
    if (msaidx_context_create(&context, &config) != MSAIDX_SUCCESS) {
        bc_free(batch);
        return;
    }
    gpu_batch g;
    gpu_upload(&g, batch);
    msaidx_batch_desc desc = batch->desc;
    desc.cp_world = 2;
    desc.cp_rank = 1;
    desc.max_seq_len += 128; /* room for the rewrite */
    const int32_t P = config.page_size, B = desc.batch_size, T = desc.num_tokens;
    const int32_t H = config.num_heads, K = config.topk;
    desc.bt_stride = desc.pitch = ceil_div(ceil_div(desc.max_seq_len, P), 2);
    /* Rank 1 owns the odd pages: point them at physical pages of the batch (any will do). */
    int32_t *table = host_alloc(sizeof(int32_t) * (size_t)B * desc.bt_stride);
    for (int32_t i = 0; i < B * desc.bt_stride; ++i)
        table[i] = (int32_t)harness_int(rng, 0, batch->desc.num_pages - 1);
    int32_t *device_table = device_alloc(sizeof(int32_t) * (size_t)B * desc.bt_stride);
    upload(device_table, table, sizeof(int32_t) * (size_t)B * desc.bt_stride);
    msaidx_plan *plan = NULL;
    size_t bytes = 0, area_bytes = 0;
    CHECK_OK(msaidx_plan_create(&plan, context, &desc));
    if (!plan) return;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    CHECK_OK(msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes));
    void *workspace = device_alloc(bytes), *area = device_alloc(area_bytes);
    const size_t picks = (size_t)T * H * K;
    float *cand_scores = device_alloc(sizeof(float) * picks);
    int32_t *cand_pages = device_alloc(4 * picks), *merged = device_alloc(4 * picks);
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = K;
    args.init_blocks = config.init_blocks;
    args.local_blocks = config.local_blocks;
    args.workspace = area;
    args.workspace_bytes = area_bytes;
    const int32_t *nvp = NULL;
    msaidx_status status = MSAIDX_SUCCESS;
#define ENQUEUE()                                                                                  \
    do {                                                                                           \
        status = msaidx_plan_batch(plan, g.cu_seqlens_q, g.seq_lens, device_table, workspace,      \
                                   bytes, stream);                                                 \
        if (status == MSAIDX_SUCCESS)                                                              \
            status = msaidx_prefill_topk_candidates(plan, g.q, g.k_cache, &args, NULL,             \
                                                    cand_scores, cand_pages, stream);              \
        if (status == MSAIDX_SUCCESS) status = msaidx_plan_nvp(plan, &nvp);                        \
        if (status == MSAIDX_SUCCESS)                                                              \
            status = msaidx_merge_candidates(context, &args, 1, T, nvp, cand_scores, cand_pages,   \
                                             (int64_t)picks, merged, stream);                      \
    } while (0)
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    ENQUEUE();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(status == MSAIDX_SUCCESS, "graph capture: %s", msaidx_last_error());
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    /* Rewrite: every request one token further (a decode step), in place. */
    for (int32_t b = 0; b < B; ++b) batch->seq_lens[b] += 1 + 127 * (b == 1);
    gpu_upload_meta(&g, batch);
    /* Each run's outputs poisoned first, with another byte each time: neither run can pass on
     * what the other (or nothing) left there. */
    CUDA_CHECK(cudaMemsetAsync(merged, 0x5A, 4 * picks, stream));
    CUDA_CHECK(cudaMemsetAsync(cand_pages, 0x5A, 4 * picks, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    int32_t *replayed = host_alloc(4 * picks), *eager = host_alloc(4 * picks);
    int32_t *replayed_pages = host_alloc(4 * picks), *eager_pages = host_alloc(4 * picks);
    download(replayed, merged, 4 * picks);
    download(replayed_pages, cand_pages, 4 * picks);
    CUDA_CHECK(cudaMemsetAsync(merged, 0x3C, 4 * picks, stream));
    CUDA_CHECK(cudaMemsetAsync(cand_pages, 0x3C, 4 * picks, stream));
    ENQUEUE();
#undef ENQUEUE
    CHECK_OK(status);
    CHECK_OK(msaidx_plan_check(plan, stream));
    download(eager, merged, 4 * picks);
    download(eager_pages, cand_pages, 4 * picks);
    long differ = 0;
    for (size_t i = 0; i < picks; ++i)
        differ += replayed[i] != eager[i] || replayed_pages[i] != eager_pages[i];
    CHECK(differ == 0, "graph %s: %ld ids of the replay differ from an eager run",
          msaidx_backend_name(backend), differ);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    free(table);
    free(replayed);
    free(eager);
    free(replayed_pages);
    free(eager_pages);
    CUDA_CHECK(cudaFree(device_table));
    CUDA_CHECK(cudaFree(workspace));
    CUDA_CHECK(cudaFree(area));
    CUDA_CHECK(cudaFree(cand_scores));
    CUDA_CHECK(cudaFree(cand_pages));
    CUDA_CHECK(cudaFree(merged));
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    gpu_release(&g);
    bc_free(batch);
}

/* One request at 1M tokens of context, 4400-5000 rows: each rank of W <= 2 holds past 2^24 score
 * cells, from which persistent's candidates without a score buffer select long rows from their
 * chunk maxima (W = 1 is the unsharded plan). */
static void check_long_rows(harness_rng *rng, cudaStream_t stream) {
    bc_spec spec;
    bc_random_spec(&spec, rng, true);
    spec.name = "long rows";
    spec.num_heads = 1 << (int32_t)harness_int(rng, 0, 2); /* the H persistent admits */
    spec.batch_size = 1;
    spec.q_lens[0] = (int32_t)harness_int(rng, 4400, 5000) / spec.num_heads;
    spec.prefixes[0] = (int32_t)harness_int(rng, 1000 * 1000, 1024 * 1024);
    spec.decode = false;
    spec.nan_inputs = false;
    spec.pad_tokens = (int32_t)harness_int(rng, 0, 3);
    bc_batch *batch = bc_build(&spec, rng);
    msaidx_config cpu_config = batch->config;
    cpu_config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *cpu = NULL;
    CHECK_OK(msaidx_context_create(&cpu, &cpu_config));
    char label[96];
    snprintf(label, sizeof label, "long rows (H %d, topk %d, %s)", spec.num_heads, spec.topk,
             spec.dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3");
    if (cpu) check_backend(batch, MSAIDX_BACKEND_PERSISTENT, cpu, rng, stream, label, 2, true);
    msaidx_context_destroy(cpu);
    bc_free(batch);
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    /* MSAIDX_TEST_ROUNDS=N (the sanitizer runs): N random batches. */
    const char *rounds = getenv("MSAIDX_TEST_ROUNDS");
    const int batches = rounds ? atoi(rounds) : 12;
    for (int i = 0; i < batches; ++i) {
        bc_spec spec;
        bc_random_spec(&spec, &rng, true);
        spec.nan_inputs = harness_int(&rng, 0, 2) == 0;
        spec.fp8_accumulation = harness_int(&rng, 0, 1) == 0;
        if (i % 4 == 3) { /* long chunks: tiles across several global pages, H 1 tiles of 256 */
            spec.batch_size = 3;
            const int32_t q_lens[] = {700, 1, 300}, prefixes[] = {1000, 4000, 130};
            for (int b = 0; b < 3; ++b) {
                spec.q_lens[b] = q_lens[b];
                spec.prefixes[b] = prefixes[b];
            }
        }
        bc_batch *batch = bc_build(&spec, &rng);
        msaidx_config cpu_config = batch->config;
        cpu_config.backend = MSAIDX_BACKEND_CPU;
        msaidx_context *cpu = NULL;
        CHECK_OK(msaidx_context_create(&cpu, &cpu_config));
        char label[96];
        snprintf(label, sizeof label, "batch %d (H %d, topk %d, init %d, local %d, %s%s)", i,
                 spec.num_heads, spec.topk, spec.init_blocks, spec.local_blocks,
                 spec.dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3",
                 spec.fp8_accumulation ? "" : " exact");
        for (int b = 0; b < GPU_NUM_BACKENDS && cpu; ++b)
            check_backend(batch, gpu_backend_at(b), cpu, &rng, stream, label, 4, false);
        msaidx_context_destroy(cpu);
        bc_free(batch);
    }
    /* Not under the sanitizers (MSAIDX_TEST_ROUNDS): minutes there, and gpu_prefill_topk runs
     * the same kernels under memcheck. */
    if (!rounds) check_long_rows(&rng, stream);
    for (int round = 0; round < (rounds ? 20 : 200); ++round)
        check_hostile_merge(&rng, stream, round);
    for (int b = 0; b < GPU_NUM_BACKENDS; ++b) check_graph(&rng, gpu_backend_at(b), stream);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_context_parallel");
}

#else

int main(void) { return 77; }

#endif
