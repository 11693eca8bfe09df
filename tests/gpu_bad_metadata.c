/* SPEC.md section 6: bad metadata found on the device never crashes or writes out of bounds;
 * msaidx_plan_check returns MSAIDX_ERROR_BAD_METADATA naming the right bits; the valid requests
 * of the same batch are still correct and the skipped rows are untouched. */
#include "backend_cases.h"
#include "cpu/cpu.h"
#include "gpu_device.h"

#include <math.h>
#include <string.h>

#ifdef MSAIDX_WITH_CUDA

enum { B = 4 };
static const int32_t q_lens[B] = {3, 20, 1, 9}, prefixes[B] = {500, 130, 1400, 60};

typedef struct corruption {
    const char *name;
    uint32_t bits;    /* at least these bits must be set */
    uint32_t allowed; /* no bits outside these */
    int bad_request;  /* its rows stay untouched; -1: no row checks (the batch is unusable) */
} corruption;

static const corruption corruptions[] = {
    {"page id >= num_pages", MSAIDX_BAD_PAGE_ID, MSAIDX_BAD_PAGE_ID, 1},
    {"negative page id", MSAIDX_BAD_PAGE_ID, MSAIDX_BAD_PAGE_ID, 2},
    {"q_len > seq_len", MSAIDX_BAD_SEQ_LEN, MSAIDX_BAD_SEQ_LEN, 1},
    {"negative seq_len", MSAIDX_BAD_SEQ_LEN, MSAIDX_BAD_SEQ_LEN, 0},
    {"seq_len > max_seq_len, nvp > pitch", 0, MSAIDX_BAD_SEQ_LEN | MSAIDX_BAD_NVP, 2},
    {"too many tokens", MSAIDX_BAD_TOKEN_COUNT,
     MSAIDX_BAD_TOKEN_COUNT | MSAIDX_BAD_CU_SEQLENS | MSAIDX_BAD_SEQ_LEN, 3},
    {"q_len > max_q_len", MSAIDX_BAD_TOKEN_COUNT, MSAIDX_BAD_TOKEN_COUNT, 3},
    {"cu_seqlens_q[0] != 0", MSAIDX_BAD_CU_SEQLENS, 0xFFFFFFFFu, -1},
    {"decreasing cu_seqlens_q", MSAIDX_BAD_CU_SEQLENS, 0xFFFFFFFFu, -1},
};
enum { NUM_CORRUPTIONS = sizeof corruptions / sizeof corruptions[0] };

static void corrupt(bc_batch *batch, int which) {
    int32_t *cu = batch->cu_seqlens_q, *seq = batch->seq_lens, *bt = batch->block_table;
    const int32_t stride = batch->desc.bt_stride;
    switch (which) {
    case 0: bt[1 * stride + 1] = batch->desc.num_pages + 3; break;
    case 1: bt[2 * stride + 5] = -2; break;
    case 2: seq[1] = q_lens[1] - 1; break;
    case 3: seq[0] = -100; break;
    case 4: seq[2] = (batch->desc.pitch + 2) * 128; break;
    case 5: cu[4] = batch->desc.num_tokens + 40; break;
    case 6: cu[4] = cu[3] + batch->desc.max_q_len + 1; break; /* from the padding */
    case 7: cu[0] = 2; break;
    default: cu[2] = cu[1] - 1; break;
    }
}

/* Names of the bits in msaidx_plan_check's message. */
static const char *bit_text(uint32_t bit) {
    switch (bit) {
    case MSAIDX_BAD_CU_SEQLENS: return "cu_seqlens_q";
    case MSAIDX_BAD_SEQ_LEN: return "seq_lens";
    case MSAIDX_BAD_TOKEN_COUNT: return "tokens exceed";
    case MSAIDX_BAD_PAGE_ID: return "block_table";
    default: return "visible pages";
    }
}

static void run_corruption(msaidx_backend backend, int which, bool decode, cudaStream_t stream,
                           harness_rng *rng) {
    const corruption *c = &corruptions[which];
    bc_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.name = c->name;
    spec.dtype = backend != MSAIDX_BACKEND_PERSISTENT && harness_int(rng, 0, 1) ? MSAIDX_DTYPE_BF16
                                                                                : MSAIDX_DTYPE_E4M3;
    spec.num_heads = 2;
    spec.head_dim = 128;
    spec.page_size = 128;
    spec.topk = 16;
    spec.local_blocks = 1;
    spec.batch_size = B;
    for (int b = 0; b < B; ++b) {
        spec.q_lens[b] = q_lens[b];
        spec.prefixes[b] = prefixes[b];
    }
    spec.pad_tokens = 30;
    bc_batch *batch = bc_build(&spec, rng);
    batch->desc.max_q_len = 20;
    const int32_t T = batch->desc.num_tokens;
    const size_t cells = bc_score_count(batch);
    float *ref = malloc(sizeof(float) * cells), *got = malloc(sizeof(float) * cells);
    int32_t *nvp = malloc(sizeof(int32_t) * (size_t)T);
    const size_t picks = (size_t)T * batch->config.num_heads * batch->config.topk;
    int32_t *topk = malloc(sizeof(int32_t) * picks), *want = malloc(sizeof(int32_t) * picks);
    if (!ref || !got || !nvp || !topk || !want) exit(2);
    float *abs_ref = malloc(sizeof(float) * cells);
    if (!abs_ref) exit(2);
    bc_poison(ref, cells);
    bc_reference_scores(batch, ref); /* of the valid batch */
    bc_brute_abs_scores(batch, abs_ref);
    int32_t *valid_nvp = malloc(sizeof(int32_t) * (size_t)T);
    int32_t valid_cu[B + 1];
    if (!valid_nvp) exit(2);
    memcpy(valid_nvp, batch->nvp, sizeof(int32_t) * (size_t)T);
    memcpy(valid_cu, batch->cu_seqlens_q, sizeof valid_cu);

    char label[160];
    snprintf(label, sizeof label, "%s %s %s", msaidx_backend_name(backend), c->name,
             decode ? "decode" : "prefill");
    gpu_session session;
    msaidx_status status = gpu_session_create(&session, batch, backend);
    CHECK(status == MSAIDX_SUCCESS, "%s: %s", label, msaidx_last_error());
    if (status == MSAIDX_SUCCESS) {
        corrupt(batch, which);
        gpu_batch device;
        gpu_upload(&device, batch);
        gpu_outputs outputs;
        gpu_outputs_create(&outputs, batch);
        gpu_outputs_poison(&outputs);
        status = gpu_enqueue(&session, &device, batch, &outputs, decode, stream);
        CHECK(status == MSAIDX_SUCCESS,
              "%s: enqueue: %s (device-side checks must not fail the launch)", label,
              msaidx_last_error());
        status = msaidx_plan_check(session.plan, stream);
        CHECK(status == MSAIDX_ERROR_BAD_METADATA, "%s: plan_check returned %s", label,
              msaidx_status_string(status));
        const char *message = msaidx_last_error();
        const char *hex = strstr(message, "error word 0x");
        unsigned word = 0;
        CHECK(hex && sscanf(hex, "error word 0x%x", &word) == 1, "%s: no error word in \"%s\"",
              label, message);
        CHECK((word & c->bits) == c->bits && (word & ~c->allowed) == 0 && word != 0,
              "%s: error word 0x%x, want bits 0x%x within 0x%x", label, word, c->bits, c->allowed);
        for (uint32_t bit = 1; bit <= MSAIDX_BAD_NVP; bit <<= 1)
            if (word & bit)
                CHECK(strstr(message, bit_text(bit)) != NULL, "%s: bit 0x%x not named in \"%s\"",
                      label, bit, message);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaGetLastError());
        const long guard = gpu_outputs_fetch(&outputs, got, topk);
        CHECK(guard == 0, "%s: %ld writes past the score / top-k buffers", label, guard);

        if (c->bad_request >= 0) {
            /* Valid requests: correct. The bad request's rows and padding: untouched. */
            const int32_t H = batch->config.num_heads, pitch = batch->desc.pitch;
            long wrong = 0, touched = 0;
            for (int32_t b = 0; b < B; ++b)
                for (int32_t t = valid_cu[b]; t < valid_cu[b + 1]; ++t)
                    for (int32_t h = 0; h < H; ++h)
                        for (int32_t p = 0; p < pitch; ++p) {
                            const size_t i = ((size_t)t * H + h) * pitch + p;
                            if (b == c->bad_request || p >= valid_nvp[t]) {
                                touched += !bc_is_poison(got[i]);
                            } else {
                                const double err = fabs((double)got[i] - (double)ref[i]);
                                wrong += !(err <= bc_exact_bound(ref[i], abs_ref[i]));
                            }
                        }
            for (size_t i = (size_t)valid_cu[B] * H * pitch; i < cells; ++i)
                touched += !bc_is_poison(got[i]); /* padding rows */
            CHECK(wrong == 0, "%s: %ld cells of valid requests wrong", label, wrong);
            CHECK(touched == 0, "%s: %ld cells of skipped rows / past nvp written", label, touched);
            gpu_fetch_nvp(&session, batch, nvp);
            long bad_nvp = 0;
            for (int32_t b = 0; b < B; ++b)
                if (b != c->bad_request)
                    for (int32_t t = valid_cu[b]; t < valid_cu[b + 1]; ++t)
                        bad_nvp += nvp[t] != valid_nvp[t];
            CHECK(bad_nvp == 0, "%s: %ld nvp entries of valid requests wrong", label, bad_nvp);
            /* Top-k stays consistent with what was written: the cpu top-k of the same cells. */
            for (int32_t t = 0; t < T; ++t)
                if (nvp[t] < 0 || nvp[t] > pitch) nvp[t] = 0;
            msaidx_cpu_topk_reference(&batch->config, got, pitch, nvp, T, want);
            long differ = 0;
            for (int32_t b = 0; b < B; ++b)
                if (b != c->bad_request)
                    for (size_t i = (size_t)valid_cu[b] * H * batch->config.topk;
                         i < (size_t)valid_cu[b + 1] * H * batch->config.topk; ++i)
                        differ += topk[i] != want[i];
            CHECK(differ == 0, "%s: top-k of valid requests differs from the cpu in %ld slots",
                  label, differ);
        }
        gpu_outputs_release(&outputs);
        gpu_release(&device);
    }
    gpu_session_release(&session);
    free(ref);
    free(abs_ref);
    free(got);
    free(nvp);
    free(topk);
    free(want);
    free(valid_nvp);
    bc_free(batch);
}

/* A context of one head on device 0 for `backend`; NULL (the failure counted) if refused. */
static msaidx_context *one_head_context(msaidx_backend backend) {
    msaidx_config c;
    msaidx_config_init(&c);
    c.num_heads = 1;
    c.device = 0;
    c.backend = backend;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &c));
    return context;
}

/* A one-page cache may have any page stride: it is never stepped over. Every backend scores it
 * (persistent passed the stride to its TMA key map, which needs strides below 2^40, and failed
 * every call after accepting the plan); with two pages such a stride is refused at planning by a
 * backend that cannot map it, naming it. Q and K all E4M3 1.0: each visible cell is 128. */
static void one_page_any_stride(msaidx_backend backend, cudaStream_t stream) {
    enum { T = 100 };
    msaidx_context *context = one_head_context(backend);
    uint8_t *q = NULL, *k = NULL;
    int32_t *meta = NULL;
    float *scores = NULL;
    const int32_t host_meta[4] = {0, T, 128, 0}; /* cu_seqlens_q, seq_lens, block_table */
    CUDA_CHECK(cudaMalloc((void **)&q, T * 128));
    CUDA_CHECK(cudaMalloc((void **)&k, 2 * 128 * 128));
    CUDA_CHECK(cudaMalloc((void **)&meta, sizeof host_meta));
    CUDA_CHECK(cudaMalloc((void **)&scores, sizeof(float) * T));
    CUDA_CHECK(cudaMemset(q, 0x38, T * 128));
    CUDA_CHECK(cudaMemset(k, 0x38, 2 * 128 * 128));
    CUDA_CHECK(cudaMemset(scores, 0, sizeof(float) * T));
    CUDA_CHECK(cudaMemcpy(meta, host_meta, sizeof host_meta, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy stream's fills before `stream`'s calls */
    for (int32_t pages = 1; pages <= 2 && context; ++pages) {
        msaidx_batch_desc d;
        msaidx_batch_desc_init(&d);
        d.batch_size = 1;
        d.num_tokens = T;
        d.max_q_len = T;
        d.max_seq_len = 128;
        d.num_pages = pages;
        d.bt_stride = 1;
        d.page_stride = (int64_t)1 << 40;
        d.pitch = 1;
        msaidx_plan *plan = NULL;
        CHECK_OK(msaidx_plan_create(&plan, context, &d));
        size_t bytes = 0;
        void *workspace = NULL;
        if (plan) CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
        CUDA_CHECK(cudaMalloc(&workspace, bytes));
        const msaidx_status planned =
            plan ? msaidx_plan_batch(plan, meta, meta + 2, meta + 3, workspace, bytes, stream)
                 : MSAIDX_ERROR_INVALID_ARGUMENT;
        if (pages == 1 || planned == MSAIDX_SUCCESS) {
            CHECK(planned == MSAIDX_SUCCESS, "%s, one page: plan_batch: %s",
                  msaidx_backend_name(backend), msaidx_last_error());
            if (pages == 1) {
                CHECK_OK(msaidx_prefill_scores(plan, q, k, scores, stream));
                CUDA_CHECK(cudaStreamSynchronize(stream));
                float host[T];
                CUDA_CHECK(cudaMemcpy(host, scores, sizeof host, cudaMemcpyDeviceToHost));
                int wrong = 0;
                for (int t = 0; t < T; ++t) wrong += host[t] != 128.0f;
                CHECK(wrong == 0, "%s, one page of stride 2^40: %d of %d scores are not 128",
                      msaidx_backend_name(backend), wrong, T);
            }
        } else {
            CHECK(planned == MSAIDX_ERROR_NOT_SUPPORTED &&
                      strstr(msaidx_last_error(), "desc.page_stride") != NULL,
                  "%s, two pages of stride 2^40: %s (%s)", msaidx_backend_name(backend),
                  msaidx_status_string(planned), msaidx_last_error());
        }
        CUDA_CHECK(cudaFree(workspace));
        msaidx_plan_destroy(plan);
    }
    CUDA_CHECK(cudaFree(q));
    CUDA_CHECK(cudaFree(k));
    CUDA_CHECK(cudaFree(meta));
    CUDA_CHECK(cudaFree(scores));
    msaidx_context_destroy(context);
}

/* The last admitted positions: a request of INT32_MAX keys (2^24 pages, every block-table entry
 * page 0; nothing asks for distinct pages), its last two tokens at positions 2^31 - 3 and - 2.
 * Every visible cell must be written, by the prefill and the decode scorer (a page count taken
 * in int32 as (position + 128) / 128 wrapped negative there and skipped all of them). Q and K all
 * E4M3 1.0: each cell is 128. 2^31 keys a row: left out with MSAIDX_TEST_SMALL=1 (memcheck). */
static void positions_near_int32_max(msaidx_backend backend, cudaStream_t stream) {
    if (getenv("MSAIDX_TEST_SMALL")) return;
    enum { T = 2 };
    const int32_t pages = 1 << 24;
    msaidx_context *context = one_head_context(backend);
    msaidx_batch_desc d;
    msaidx_batch_desc_init(&d);
    d.batch_size = 1;
    d.num_tokens = T;
    d.max_q_len = T;
    d.max_seq_len = INT32_MAX;
    d.num_pages = 1;
    d.bt_stride = pages;
    d.page_stride = 128 * 128;
    d.pitch = pages;
    msaidx_plan *plan = NULL;
    if (context) CHECK_OK(msaidx_plan_create(&plan, context, &d));
    if (!plan) {
        msaidx_context_destroy(context);
        return;
    }
    size_t bytes = 0;
    CHECK_OK(msaidx_plan_workspace_size(plan, &bytes));
    const size_t cells = (size_t)T * pages;
    uint8_t *q = NULL, *k = NULL;
    int32_t *meta = NULL;
    float *scores = NULL;
    void *workspace = NULL;
    const int32_t host_meta[3] = {0, T, INT32_MAX}; /* cu_seqlens_q, seq_lens */
    CUDA_CHECK(cudaMalloc((void **)&q, T * 128));
    CUDA_CHECK(cudaMalloc((void **)&k, 128 * 128));
    CUDA_CHECK(cudaMalloc((void **)&meta, sizeof(int32_t) * (4 + (size_t)pages)));
    CUDA_CHECK(cudaMalloc((void **)&scores, sizeof(float) * cells));
    CUDA_CHECK(cudaMalloc(&workspace, bytes));
    CUDA_CHECK(cudaMemset(q, 0x38, T * 128));
    CUDA_CHECK(cudaMemset(k, 0x38, 128 * 128));
    CUDA_CHECK(cudaMemset(meta + 4, 0, sizeof(int32_t) * (size_t)pages)); /* the block table */
    CUDA_CHECK(cudaMemcpy(meta, host_meta, sizeof host_meta, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy stream's fills before `stream`'s calls */
    float *host = malloc(sizeof(float) * cells);
    if (!host) exit(2);
    CHECK_OK(msaidx_plan_batch(plan, meta, meta + 2, meta + 4, workspace, bytes, stream));
    for (int decode = 0; decode < 2; ++decode) {
        CUDA_CHECK(cudaMemsetAsync(scores, 0, sizeof(float) * cells, stream));
        CHECK_OK(decode ? msaidx_decode_scores(plan, q, k, scores, stream)
                        : msaidx_prefill_scores(plan, q, k, scores, stream));
        CHECK_OK(msaidx_plan_check(plan, stream));
        CUDA_CHECK(cudaMemcpy(host, scores, sizeof(float) * cells, cudaMemcpyDeviceToHost));
        size_t wrong = 0;
        for (size_t i = 0; i < cells; ++i) wrong += host[i] != 128.0f;
        CHECK(wrong == 0, "%s, %s, positions 2^31 - 3 and - 2: %zu of %zu cells are not 128",
              msaidx_backend_name(backend), decode ? "decode" : "prefill", wrong, cells);
    }
    free(host);
    CUDA_CHECK(cudaFree(q));
    CUDA_CHECK(cudaFree(k));
    CUDA_CHECK(cudaFree(meta));
    CUDA_CHECK(cudaFree(scores));
    CUDA_CHECK(cudaFree(workspace));
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
        if (!gpu_backend_admitted(gpu_backend_at(i))) continue;
        for (int which = 0; which < NUM_CORRUPTIONS; ++which)
            for (int decode = 0; decode < 2; ++decode)
                run_corruption(gpu_backend_at(i), which, decode, stream, &rng);
        one_page_any_stride(gpu_backend_at(i), stream);
        positions_near_int32_max(gpu_backend_at(i), stream);
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_bad_metadata");
}

#else

int main(void) { return 77; }

#endif
