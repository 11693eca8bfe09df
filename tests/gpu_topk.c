/* The CUDA top-k on its own (SPEC.md section 4) against the full-sort oracle: edge nvp values,
 * ties, NaN, infinities, signed zeros, subnormals, rows past 1024 pages, short and long rows
 * in one call, batches of up to 9600 rows, topk {1,16,64}, H {1,2,3,4},
 * init/local {0,1,2}, deterministic, and bounded by max_nvp (rows above it all -1); then
 * msaidx_num_valid_pages on the device, and the admission rules of every CUDA backend. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

#ifdef MSAIDX_TEST_SANITIZE
enum { ROUNDS = 20 };
#else
enum { ROUNDS = 150 };
#endif

/* One selection into a poisoned `out`, against `want`, nothing written past the rows: through
 * msaidx_topk_select, or msaidx_topk_select_bounded when max_nvp > 0. Leaves it in `got`. */
static void select_and_compare(msaidx_context *context, const bc_topk_case *tc, const float *scores,
                               const int32_t *nvp, int32_t max_nvp, int32_t *out,
                               const int32_t *want, int32_t *got, cudaStream_t stream,
                               const char *label) {
    const int32_t T = tc->num_tokens, H = tc->config.num_heads;
    const size_t picks = (size_t)T * H * tc->config.topk;
    CUDA_CHECK(cudaMemset(out, 0x5A, sizeof(int32_t) * (picks + GPU_GUARD)));
    CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy stream's memset lands first */
    if (max_nvp > 0)
        CHECK_OK(msaidx_topk_select_bounded(context, scores, tc->pitch, max_nvp, nvp, T, out,
                                            (int64_t)H * tc->config.topk, tc->config.topk, stream));
    else
        CHECK_OK(msaidx_topk_select(context, scores, tc->pitch, nvp, T, out, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(got, out, sizeof(int32_t) * (picks + GPU_GUARD), cudaMemcpyDeviceToHost));
    long differ = 0, guard = 0;
    int64_t first_row = -1;
    for (size_t i = 0; i < picks; ++i)
        if (got[i] != want[i]) {
            if (!differ++) first_row = (int64_t)(i / (size_t)tc->config.topk);
        }
    for (size_t i = picks; i < picks + GPU_GUARD; ++i) guard += got[i] != 0x5A5A5A5A;
    CHECK(differ == 0, "%s%s: %ld slots differ from the oracle (first row %lld, nvp %d)", label,
          max_nvp > 0 ? " bounded" : "", differ, (long long)first_row,
          first_row >= 0 ? tc->nvp[first_row / H] : 0);
    CHECK(guard == 0, "%s: wrote past T*H*topk", label);
}

static void topk_rounds(msaidx_backend backend, cudaStream_t stream, harness_rng *rng) {
    /* MSAIDX_TEST_ROUNDS shortens the run under compute-sanitizer. */
    const char *rounds_env = getenv("MSAIDX_TEST_ROUNDS");
    const int rounds = rounds_env ? atoi(rounds_env) : ROUNDS;
    for (int round = 0; round < rounds; ++round) {
        bc_topk_case tc;
        /* Every 10th round a batch of 1000-2400 tokens under a pitch past a warp's 1024
         * candidates: more rows than the top-k grid has CTAs resident, so that one CTA deals
         * several rows, short ones to its warps and long ones to itself (and, past 4224 rows, 8
         * rows a CTA). Every 10th round (another) as many tokens under a pitch of at most 60 or
         * 250 pages: thousands of short rows, each form of the preloading warp kernel over many
         * waves of CTAs. Every 5th round a pitch up to 9000 pages. */
        const bool many_rows = round % 10 == 3, many_short_rows = round % 10 == 7;
        bc_topk_case_make(&tc, rng, round, many_rows ? 1100 : 1,
                          round % 5 == 0    ? 9000
                          : many_rows       ? 1500
                          : many_short_rows ? (round / 10 % 2 ? 250 : 60)
                                            : 300,
                          many_rows || many_short_rows ? 1000 : 1,
                          many_rows || many_short_rows ? 2400 : 40);
        tc.config.backend = backend;
        tc.config.device = 0;
        if (msaidx_backend_supported(backend, &tc.config) != MSAIDX_SUCCESS) {
            bc_topk_case_free(&tc); /* persistent and H = 3: the other backends share the kernels */
            continue;
        }
        const int32_t T = tc.num_tokens, H = tc.config.num_heads;
        const size_t cells = (size_t)T * H * tc.pitch, picks = (size_t)T * H * tc.config.topk;
        char label[128];
        snprintf(label, sizeof label, "%s topk round %d (H=%d T=%d pitch=%d topk=%d/%d/%d)",
                 msaidx_backend_name(backend), round, H, T, tc.pitch, tc.config.topk,
                 tc.config.init_blocks, tc.config.local_blocks);
        msaidx_context *context = NULL;
        const msaidx_status status = msaidx_context_create(&context, &tc.config);
        CHECK(status == MSAIDX_SUCCESS, "%s: %s", label, msaidx_last_error());
        if (status != MSAIDX_SUCCESS) {
            bc_topk_case_free(&tc);
            continue;
        }
        float *scores;
        int32_t *nvp, *out;
        CUDA_CHECK(cudaMalloc((void **)&scores, sizeof(float) * cells));
        CUDA_CHECK(cudaMalloc((void **)&nvp, sizeof(int32_t) * (size_t)T + 4));
        CUDA_CHECK(cudaMalloc((void **)&out, sizeof(int32_t) * (picks + GPU_GUARD)));
        int32_t *nvp_slice = nvp + 1; /* 4-byte, not 16-byte, aligned */
        CUDA_CHECK(cudaMemcpy(scores, tc.scores, sizeof(float) * cells, cudaMemcpyHostToDevice));
        CUDA_CHECK(
            cudaMemcpy(nvp_slice, tc.nvp, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice));
        /* A pageable cudaMemcpy may return before its DMA lands, and `stream` (non-blocking) does
         * not wait for the legacy stream. */
        CUDA_CHECK(cudaDeviceSynchronize());
        int32_t *want = malloc(sizeof(int32_t) * picks);
        int32_t *got = malloc(sizeof(int32_t) * (picks + GPU_GUARD));
        int32_t *first = malloc(sizeof(int32_t) * picks);
        if (!want || !got || !first) exit(2);
        bc_topk_oracle(&tc.config, tc.scores, tc.pitch, tc.nvp, T, want);
        for (int run = 0; run < 2; ++run) {
            select_and_compare(context, &tc, scores, nvp_slice, 0, out, want, got, stream, label);
            if (run == 0)
                memcpy(first, got, sizeof(int32_t) * picks);
            else
                CHECK(memcmp(first, got, sizeof(int32_t) * picks) == 0, "%s: not deterministic",
                      label);
        }
        /* Bounded by the batch's longest row, the kernels of the batch's own length select the
         * same pages; every 4th round a smaller bound leaves the rows above it all -1. */
        int32_t longest = 1;
        for (int32_t t = 0; t < T; ++t) longest = tc.nvp[t] > longest ? tc.nvp[t] : longest;
        const int32_t bound = round % 4 == 1 ? (int32_t)harness_int(rng, 1, longest) : longest;
        for (int32_t t = 0; t < T; ++t)
            if (tc.nvp[t] > bound)
                for (size_t i = (size_t)t * H * tc.config.topk;
                     i < (size_t)(t + 1) * H * tc.config.topk; ++i)
                    want[i] = -1;
        select_and_compare(context, &tc, scores, nvp_slice, bound, out, want, got, stream, label);
        free(want);
        free(got);
        free(first);
        CUDA_CHECK(cudaFree(scores));
        CUDA_CHECK(cudaFree(nvp));
        CUDA_CHECK(cudaFree(out));
        msaidx_context_destroy(context);
        bc_topk_case_free(&tc);
    }
}

static void device_num_valid_pages(msaidx_backend backend, cudaStream_t stream, harness_rng *rng) {
    for (int round = 0; round < 10; ++round) {
        bc_spec spec;
        bc_random_spec(&spec, rng, true);
        spec.dtype = MSAIDX_DTYPE_E4M3;
        bc_batch *batch = bc_build(&spec, rng);
        msaidx_config config = batch->config;
        config.backend = backend;
        config.device = 0;
        msaidx_context *context = NULL;
        CHECK_OK(msaidx_context_create(&context, &config));
        gpu_batch device;
        gpu_upload(&device, batch);
        const int32_t T = batch->desc.num_tokens;
        int32_t *nvp, *host = malloc(sizeof(int32_t) * ((size_t)T + 1));
        if (!host) exit(2);
        CUDA_CHECK(cudaMalloc((void **)&nvp, sizeof(int32_t) * ((size_t)T + 1)));
        CUDA_CHECK(cudaMemset(nvp, 0x5A, sizeof(int32_t) * ((size_t)T + 1)));
        CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy stream's memset lands first */
        CHECK_OK(msaidx_num_valid_pages(context, device.cu_seqlens_q, device.seq_lens,
                                        batch->desc.batch_size, T, nvp, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(
            cudaMemcpy(host, nvp, sizeof(int32_t) * ((size_t)T + 1), cudaMemcpyDeviceToHost));
        long bad = 0;
        for (int32_t t = 0; t < T; ++t) bad += host[t] != batch->nvp[t];
        CHECK(bad == 0, "%s num_valid_pages: %ld of %d entries wrong", msaidx_backend_name(backend),
              bad, T);
        CHECK(host[T] == 0x5A5A5A5A, "%s num_valid_pages wrote past num_tokens",
              msaidx_backend_name(backend));
        CUDA_CHECK(cudaFree(nvp));
        free(host);
        gpu_release(&device);
        msaidx_context_destroy(context);
        bc_free(batch);
    }
}

static void expect_not_supported(msaidx_backend backend, const msaidx_config *config,
                                 const char *needle) {
    const msaidx_status status = msaidx_backend_supported(backend, config);
    CHECK(status == MSAIDX_ERROR_NOT_SUPPORTED && strstr(msaidx_last_error(), needle) &&
              strstr(msaidx_last_error(), msaidx_backend_name(backend)),
          "%s: %s \"%s\", want NOT_SUPPORTED naming %s", msaidx_backend_name(backend),
          msaidx_status_string(status), msaidx_last_error(), needle);
    msaidx_context *context = NULL;
    msaidx_config forced = *config;
    forced.backend = backend;
    CHECK(msaidx_context_create(&context, &forced) == MSAIDX_ERROR_NOT_SUPPORTED && !context,
          "%s: forced context for a config it does not admit", msaidx_backend_name(backend));
}

static void admission_rules(void) {
    msaidx_config base;
    msaidx_config_init(&base);
    base.device = 0;
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        const msaidx_backend backend = gpu_backend_at(i);
        if (!gpu_backend_admitted(backend)) continue;
        msaidx_config c = base;
        c.head_dim = 64;
        expect_not_supported(backend, &c, "config.head_dim");
        c = base;
        c.page_size = 64;
        expect_not_supported(backend, &c, "config.page_size");
        if (backend == MSAIDX_BACKEND_PERSISTENT) {
            c = base;
            c.num_heads = 8;
            expect_not_supported(backend, &c, "config.num_heads");
        }
    }
    /* AUTO: persistent when admitted, else dense (SPEC.md section 7). */
    for (int bf16 = 0; bf16 < 2; ++bf16)
        for (int heads = 1; heads <= 8; heads *= 2) {
            msaidx_config c = base;
            c.dtype = bf16 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
            c.num_heads = heads;
            msaidx_config forced = c;
            forced.backend = MSAIDX_BACKEND_PERSISTENT;
            const bool persistent =
                msaidx_backend_supported(MSAIDX_BACKEND_PERSISTENT, &forced) == MSAIDX_SUCCESS;
            msaidx_context *context = NULL;
            CHECK_OK(msaidx_context_create(&context, &c));
            msaidx_backend resolved = MSAIDX_BACKEND_AUTO;
            CHECK_OK(msaidx_context_backend(context, &resolved));
            CHECK(resolved == (persistent ? MSAIDX_BACKEND_PERSISTENT : MSAIDX_BACKEND_DENSE),
                  "AUTO (%s, H=%d) resolved to %s", bf16 ? "bf16" : "e4m3", heads,
                  msaidx_backend_name(resolved));
            msaidx_context_destroy(context);
        }
    msaidx_config c = base;
    c.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    CHECK(msaidx_context_create(&context, &c) == MSAIDX_ERROR_NOT_SUPPORTED,
          "cpu backend accepted config.device = 0");
    c = base;
    c.device = 4096;
    c.backend = MSAIDX_BACKEND_DENSE;
    const msaidx_status status = msaidx_context_create(&context, &c);
    CHECK(status != MSAIDX_SUCCESS && strstr(msaidx_last_error(), "device"),
          "device 4096: %s \"%s\"", msaidx_status_string(status), msaidx_last_error());
    CUDA_CHECK(cudaGetLastError());
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    admission_rules();
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        topk_rounds(gpu_backend_at(i), stream, &rng);
        device_num_valid_pages(gpu_backend_at(i), stream, &rng);
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_topk");
}

#else

int main(void) { return 77; }

#endif
