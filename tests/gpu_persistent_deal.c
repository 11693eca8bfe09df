/* The persistent plan's deal on the device against its definition (src/cuda/persistent_schedule.h):
 * for benchmark-like and random batches, the chunk size and task count that plan_tiles_kernel
 * computes equal those of the tiles' task counts summed here, one tile at a time, and the chunk
 * rule applied to them. (Scores do not depend on the deal, so the cross-backend tests cannot see a
 * wrong count; test_persistent_schedule checks the rule and the deal's arithmetic on the host.) */
#include "cuda/persistent_schedule.h"
#include "gpu_device.h"
#include "internal.h"

#ifdef MSAIDX_WITH_PERSISTENT

/* Up to 3000 requests: the plan takes requests 1024 at a time. */
enum { kRequests = 3000, kTileRows = MSAIDX_PERSISTENT_TILE_ROWS, kPageKeys = 128 };

typedef struct deal_case {
    const char *name;
    int32_t heads, batch_size, q_lens[kRequests], kv_lens[kRequests];
} deal_case;

/* The chunk and task count of a batch by the definition: 256-row tiles of each request, a tile's
 * pages those its last row sees. */
static void expected_deal(const deal_case *c, int32_t num_sms, int32_t *chunk, int32_t *tasks) {
    uint64_t counts[MSAIDX_PERSISTENT_CHUNK_CHOICES] = {0}, total_pages = 0;
    int64_t tiles = 0;
    for (int b = 0; b < c->batch_size; ++b) {
        const int64_t rows = (int64_t)c->q_lens[b] * c->heads;
        for (int64_t row = 0; row < rows; row += kTileRows, ++tiles) {
            const int64_t last_row = (row + kTileRows < rows ? row + kTileRows : rows) - 1;
            const int64_t pages =
                (c->kv_lens[b] - c->q_lens[b] + last_row / c->heads) / kPageKeys + 1;
            total_pages += (uint64_t)pages;
            for (int i = 0; i < MSAIDX_PERSISTENT_CHUNK_CHOICES; ++i)
                counts[i] += (uint64_t)((pages + i) / (i + 1));
        }
    }
    *chunk = msaidx_persistent_chunk_pages(counts, total_pages, tiles, num_sms);
    *tasks = (int32_t)counts[*chunk - 1];
}

static void check_deal(const deal_case *c, cudaStream_t stream) {
    int32_t max_q = 0, max_kv = 0, tokens = 0, pages = 0;
    for (int b = 0; b < c->batch_size; ++b) {
        max_q = c->q_lens[b] > max_q ? c->q_lens[b] : max_q;
        max_kv = c->kv_lens[b] > max_kv ? c->kv_lens[b] : max_kv;
        tokens += c->q_lens[b];
        pages += (c->kv_lens[b] + kPageKeys - 1) / kPageKeys;
    }
    const int32_t pitch = (max_kv + kPageKeys - 1) / kPageKeys;
    /* Metadata: cu_seqlens_q, seq_lens, then each request's pages in turn. */
    const size_t ints = (size_t)2 * c->batch_size + 1 + (size_t)c->batch_size * pitch;
    int32_t *host = calloc(ints, sizeof(int32_t));
    if (!host) {
        CHECK(false, "out of memory");
        return;
    }
    int32_t *cu = host, *seq = host + c->batch_size + 1, *table = seq + c->batch_size;
    for (int b = 0, next = 0; b < c->batch_size; ++b) {
        cu[b + 1] = cu[b] + c->q_lens[b];
        seq[b] = c->kv_lens[b];
        for (int32_t p = 0; p < (c->kv_lens[b] + kPageKeys - 1) / kPageKeys; ++p)
            table[(size_t)b * pitch + p] = next++;
    }
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = c->heads;
    config.dtype = MSAIDX_DTYPE_E4M3;
    config.backend = MSAIDX_BACKEND_PERSISTENT;
    config.device = 0;
    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = c->batch_size;
    desc.num_tokens = tokens;
    desc.max_q_len = max_q;
    desc.max_seq_len = max_kv;
    desc.num_pages = pages;
    desc.bt_stride = pitch;
    desc.page_stride = kPageKeys * 128;
    desc.pitch = pitch;
    msaidx_context *context = NULL;
    msaidx_plan *plan = NULL;
    int32_t *metadata = NULL;
    void *workspace = NULL;
    size_t workspace_bytes = 0;
    int32_t chunk = 0, tasks = 0, want_chunk = 0, want_tasks = 0;
    CUDA_CHECK(cudaMalloc((void **)&metadata, ints * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(metadata, host, ints * sizeof(int32_t), cudaMemcpyHostToDevice));
    const bool planned = msaidx_context_create(&context, &config) == MSAIDX_SUCCESS &&
                         msaidx_plan_create(&plan, context, &desc) == MSAIDX_SUCCESS &&
                         msaidx_plan_workspace_size(plan, &workspace_bytes) == MSAIDX_SUCCESS &&
                         cudaMalloc(&workspace, workspace_bytes) == cudaSuccess &&
                         msaidx_plan_batch(plan, metadata, metadata + c->batch_size + 1,
                                           metadata + 2 * c->batch_size + 1, workspace,
                                           workspace_bytes, stream) == MSAIDX_SUCCESS &&
                         msaidx_persistent_deal(plan, stream, &chunk, &tasks) == MSAIDX_SUCCESS;
    CHECK(planned, "%s: %s", c->name, msaidx_last_error());
    if (planned) {
        expected_deal(c, context->num_sms, &want_chunk, &want_tasks);
        CHECK(chunk == want_chunk && tasks == want_tasks,
              "%s: the device dealt %d tasks of %d pages, the definition %d of %d", c->name, tasks,
              chunk, want_tasks, want_chunk);
    }
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    CUDA_CHECK(cudaFree(workspace));
    CUDA_CHECK(cudaFree(metadata));
    free(host);
}

int main(void) {
    if (!gpu_available()) return 77;
    {
        msaidx_config config;
        msaidx_config_init(&config);
        config.backend = MSAIDX_BACKEND_PERSISTENT;
        config.device = 0;
        msaidx_context *context = NULL;
        if (msaidx_context_create(&context, &config) != MSAIDX_SUCCESS) {
            printf("persistent backend not admitted here (%s): skipped\n", msaidx_last_error());
            return 77;
        }
        msaidx_context_destroy(context);
    }
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    static const deal_case shapes[] = {
        {"q128_kv1024k_h1", 1, 1, {128}, {1 << 20}},
        {"q128_kv1024k_h2", 2, 1, {128}, {1 << 20}},
        {"q8k_kv8k_h1", 1, 1, {8192}, {8192}},
        {"q8k_kv8k_h4", 4, 1, {8192}, {8192}},
        {"q8k_kv1024k_h4", 4, 1, {8192}, {1 << 20}},
        {"q256k_kv256k_h4 (4096 tiles of one request)", 4, 1, {1 << 18}, {1 << 18}},
        {"b8_q512_kv8.5k_h2",
         2,
         8,
         {512, 512, 512, 512, 512, 512, 512, 512},
         {8704, 8704, 8704, 8704, 8704, 8704, 8704, 8704}},
        {"b16_q128_mixed_h2",
         2,
         16,
         {128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128},
         {4096, 8192, 16384, 32768, 65536, 131072, 262144, 4096, 8192, 16384, 32768, 65536, 131072,
          262144, 524288, 1048576}},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i) check_deal(&shapes[i], stream);
    for (int i = 0; i < 60; ++i) {
        deal_case c = {"random ragged batch",
                       1 << harness_int(&rng, 0, 2),
                       (int32_t)harness_int(&rng, 1, 16),
                       {0},
                       {0}};
        for (int b = 0; b < c.batch_size; ++b) {
            c.q_lens[b] = (int32_t)harness_int(&rng, 1, i % 3 ? 3000 : 200);
            c.kv_lens[b] = c.q_lens[b] + (int32_t)harness_int(&rng, 0, i % 2 ? 300000 : 20000);
        }
        c.q_lens[0] = c.q_lens[0] > 9 ? c.q_lens[0] : 9; /* not a decode-only batch */
        check_deal(&c, stream);
    }
    static deal_case many; /* several blocks of requests, each context its own */
    for (int i = 0; i < 10; ++i) {
        many = (deal_case){"random batch of 1025-3000 requests",
                           1 << harness_int(&rng, 0, 2),
                           (int32_t)harness_int(&rng, 1025, kRequests),
                           {0},
                           {0}};
        for (int b = 0; b < many.batch_size; ++b) {
            many.q_lens[b] = (int32_t)harness_int(&rng, 1, 40);
            many.kv_lens[b] = many.q_lens[b] + (int32_t)harness_int(&rng, 0, 20000);
        }
        many.q_lens[0] = 9;
        check_deal(&many, stream);
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_persistent_deal");
}

#else
#include <stdio.h>
int main(void) {
    printf("built without the persistent backend: skipped\n");
    return 77;
}
#endif
