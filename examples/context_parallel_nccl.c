/* Context parallel from C with NCCL (docs/context_parallel.md): one process drives every visible
 * GPU as one rank (W = the device count, at most 8). Each rank holds only its pages of every
 * request (interleaved: page j on rank j mod W), scores them and keeps its top-16 candidates per
 * row; one ncclAllGather of the packed candidates and msaidx_merge_candidates give every rank the
 * selection one GPU makes over the whole cache, which the example checks bitwise. The library does
 * not link NCCL: the engine owns the communicator and the collective, as here.
 *
 * Build: cmake -DMSAIDX_NCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so*> (torch's wheel has
 * one: python3 -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"); then
 * ./build/context_parallel_nccl. Exit status 0: every rank's selection equals one GPU's; 77: no
 * CUDA device. */
#include <cuda_runtime.h>
#include <msaidx.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANKS 8
enum { H = 4, D = 128, PAGE = 128, TOPK = 16, B = 3 };

#define CHECK(ok, what)                                                                            \
    do {                                                                                           \
        if (!(ok)) {                                                                               \
            fprintf(stderr, "%s failed (line %d)\n", what, __LINE__);                              \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CUDA(call) CHECK((call) == cudaSuccess, #call)
#define NCCL(call) CHECK((call) == ncclSuccess, #call)
#define MSAIDX(call)                                                                               \
    do {                                                                                           \
        if ((call) != MSAIDX_SUCCESS) {                                                            \
            fprintf(stderr, "%s: %s\n", #call, msaidx_last_error());                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void *device_copy(const void *host, size_t bytes) {
    void *dev = NULL;
    CUDA(cudaMalloc(&dev, bytes ? bytes : 1));
    if (bytes) CUDA(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    return dev;
}

/* One rank's (or the single GPU's) context, plan and metadata: `world` 0 is the unsharded batch. */
typedef struct rank_state {
    msaidx_context *context;
    msaidx_plan *plan;
    cudaStream_t stream;
    void *q, *k_cache, *workspace, *topk_workspace;
    int32_t *cu_seqlens_q, *seq_lens, *block_table, *nvp, *out;
    float *send, *gathered; /* [2, T, H, TOPK] candidates (scores, page bits); W of them gathered */
} rank_state;

/* Rank `rank` of `world` (world 0: one GPU holding every page) on `device`: its key pages copied
 * from the global cache, its block table listing them in ascending logical order. */
static void open_rank(rank_state *s, int device, int world, int rank, const int32_t *q_lens,
                      const int32_t *seq_lens, int32_t T, const uint8_t *q, const uint8_t *keys,
                      const int32_t *first_page) {
    CUDA(cudaSetDevice(device));
    CUDA(cudaStreamCreate(&s->stream));
    msaidx_config config;
    msaidx_config_init(&config); /* H 4, E4M3, top-16, local 1; auto = persistent on an H100/H200 */
    config.device = device;
    MSAIDX(msaidx_context_create(&s->context, &config));

    const int w = world > 1 ? world : 1;
    int32_t cu[B + 1] = {0}, max_pages = 0, owned_total = 0;
    for (int b = 0; b < B; ++b) {
        cu[b + 1] = cu[b] + q_lens[b];
        const int32_t pages = (seq_lens[b] + PAGE - 1) / PAGE;
        max_pages = pages > max_pages ? pages : max_pages;
        owned_total += (pages - rank + w - 1) / w;
    }
    const int32_t stride = (max_pages + w - 1) / w; /* pages a rank owns of the longest request */
    int32_t *table = calloc((size_t)B * stride, sizeof(int32_t));
    uint8_t *own = malloc((size_t)(owned_total ? owned_total : 1) * PAGE * D);
    CHECK(table && own, "host allocation");
    int32_t next = 0; /* physical pages of this rank, in order */
    for (int b = 0; b < B; ++b)
        for (int32_t g = rank, i = 0; g < (seq_lens[b] + PAGE - 1) / PAGE; g += w, ++i) {
            memcpy(own + (size_t)next * PAGE * D, keys + (size_t)(first_page[b] + g) * PAGE * D,
                   (size_t)PAGE * D);
            table[b * stride + i] = next++;
        }

    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = B;
    desc.num_tokens = T;
    desc.max_q_len = T;
    desc.max_seq_len = 0;
    for (int b = 0; b < B; ++b)
        desc.max_seq_len = seq_lens[b] > desc.max_seq_len ? seq_lens[b] : desc.max_seq_len;
    desc.num_pages = next ? next : 1;
    desc.bt_stride = stride;
    desc.page_stride = (int64_t)PAGE * D;
    desc.pitch = stride;
    desc.cp_world = world;
    desc.cp_rank = world > 1 ? rank : 0;
    desc.cp_layout = MSAIDX_CP_INTERLEAVED;
    MSAIDX(msaidx_plan_create(&s->plan, s->context, &desc));

    size_t ws = 0, topk_ws = 0;
    MSAIDX(msaidx_plan_workspace_size(s->plan, &ws));
    MSAIDX(msaidx_prefill_topk_workspace_size(s->plan, 0, &topk_ws));
    CUDA(cudaMalloc(&s->workspace, ws));
    CUDA(cudaMalloc(&s->topk_workspace, topk_ws ? topk_ws : 1));
    s->q = device_copy(q, (size_t)T * H * D);
    s->k_cache = device_copy(own, (size_t)next * PAGE * D);
    s->cu_seqlens_q = device_copy(cu, sizeof cu);
    s->seq_lens = device_copy(seq_lens, sizeof(int32_t) * B);
    s->block_table = device_copy(table, sizeof(int32_t) * B * stride);
    const size_t picks = (size_t)T * H * TOPK;
    CUDA(cudaMalloc((void **)&s->nvp, sizeof(int32_t) * T));
    CUDA(cudaMalloc((void **)&s->out, sizeof(int32_t) * picks));
    CUDA(cudaMalloc((void **)&s->send, 2 * sizeof(float) * picks));
    CUDA(cudaMalloc((void **)&s->gathered, 2 * sizeof(float) * picks * w));
    MSAIDX(msaidx_plan_batch(s->plan, s->cu_seqlens_q, s->seq_lens, s->block_table, s->workspace,
                             ws, s->stream));
    free(table);
    free(own);
}

static void close_rank(rank_state *s) {
    msaidx_plan_destroy(s->plan);
    msaidx_context_destroy(s->context);
    void *buffers[] = {
        s->q,           s->k_cache, s->workspace, s->topk_workspace, s->cu_seqlens_q, s->seq_lens,
        s->block_table, s->nvp,     s->out,       s->send,           s->gathered};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) cudaFree(buffers[i]);
    cudaStreamDestroy(s->stream);
}

static msaidx_topk_args topk_args(const rank_state *s) {
    msaidx_topk_args args;
    msaidx_topk_args_init(&args); /* top-16, init 0, local 1 */
    args.workspace = s->topk_workspace;
    CHECK(msaidx_prefill_topk_workspace_size(s->plan, 0, &args.workspace_bytes) == MSAIDX_SUCCESS,
          "workspace size");
    return args;
}

int main(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    const int world = devices < MAX_RANKS ? devices : MAX_RANKS;

    /* A ragged batch: a 1000-token prefill chunk at 40K context, a 300-token one at 9K, and one
     * decode token at 70K; random E4M3 queries and keys. */
    const int32_t q_lens[B] = {1000, 300, 1}, seq_lens[B] = {40000, 9000, 70000};
    int32_t T = 0, first_page[B], total_pages = 0;
    for (int b = 0; b < B; ++b) {
        T += q_lens[b];
        first_page[b] = total_pages;
        total_pages += (seq_lens[b] + PAGE - 1) / PAGE;
    }
    const size_t q_values = (size_t)T * H * D, k_values = (size_t)total_pages * PAGE * D;
    float *values = malloc(sizeof(float) * (q_values > k_values ? q_values : k_values));
    uint8_t *q = malloc(q_values), *keys = malloc(k_values);
    CHECK(values && q && keys, "host allocation");
    srand(1);
    for (size_t i = 0; i < q_values; ++i) values[i] = (float)rand() / RAND_MAX * 4.0f - 2.0f;
    msaidx_e4m3_from_float(values, q, q_values);
    for (size_t i = 0; i < k_values; ++i) values[i] = (float)rand() / RAND_MAX * 4.0f - 2.0f;
    msaidx_e4m3_from_float(values, keys, k_values);
    free(values);

    /* The reference: one GPU, every page. */
    rank_state single;
    open_rank(&single, 0, 0, 0, q_lens, seq_lens, T, q, keys, first_page);
    msaidx_topk_args args = topk_args(&single);
    MSAIDX(msaidx_prefill_topk(single.plan, single.q, single.k_cache, &args, NULL, single.out,
                               single.stream));
    const size_t picks = (size_t)T * H * TOPK;
    int32_t *expected = malloc(sizeof(int32_t) * picks), *got = malloc(sizeof(int32_t) * picks);
    CHECK(expected && got, "host allocation");
    CUDA(cudaMemcpyAsync(expected, single.out, sizeof(int32_t) * picks, cudaMemcpyDeviceToHost,
                         single.stream));
    CUDA(cudaStreamSynchronize(single.stream));
    close_rank(&single);

    /* W ranks, one NCCL communicator each, created together by this one process. */
    rank_state ranks[MAX_RANKS];
    ncclComm_t comms[MAX_RANKS];
    int device_list[MAX_RANKS];
    for (int r = 0; r < world; ++r) device_list[r] = r;
    NCCL(ncclCommInitAll(comms, world, device_list));
    for (int r = 0; r < world; ++r) {
        open_rank(&ranks[r], r, world, r, q_lens, seq_lens, T, q, keys, first_page);
        rank_state *s = &ranks[r];
        args = topk_args(s);
        /* The rank's candidates, packed: scores, then the global page ids' bits. */
        MSAIDX(msaidx_prefill_topk_candidates(s->plan, s->q, s->k_cache, &args, NULL, s->send,
                                              (int32_t *)(s->send + picks), s->stream));
        /* The merge's nvp: the GLOBAL visible pages of each token. */
        MSAIDX(msaidx_num_valid_pages(s->context, s->cu_seqlens_q, s->seq_lens, B, T, s->nvp,
                                      s->stream));
    }
    NCCL(ncclGroupStart());
    for (int r = 0; r < world; ++r)
        NCCL(ncclAllGather(ranks[r].send, ranks[r].gathered, 2 * picks, ncclFloat32, comms[r],
                           ranks[r].stream));
    NCCL(ncclGroupEnd());

    int failures = 0;
    for (int r = 0; r < world; ++r) {
        rank_state *s = &ranks[r];
        CUDA(cudaSetDevice(r));
        args = topk_args(s);
        MSAIDX(msaidx_merge_candidates(s->context, &args, world, T, s->nvp, s->gathered,
                                       (const int32_t *)(s->gathered + picks), (int64_t)(2 * picks),
                                       s->out, s->stream));
        CUDA(cudaMemcpyAsync(got, s->out, sizeof(int32_t) * picks, cudaMemcpyDeviceToHost,
                             s->stream));
        CUDA(cudaStreamSynchronize(s->stream));
        size_t differ = 0;
        for (size_t row = 0; row < picks / TOPK; ++row)
            differ += memcmp(got + row * TOPK, expected + row * TOPK, sizeof(int32_t) * TOPK) != 0;
        printf("rank %d of %d: %zu of %zu rows differ from one GPU's selection\n", r, world, differ,
               picks / TOPK);
        failures += differ != 0;
    }
    for (int r = 0; r < world; ++r) {
        CUDA(cudaSetDevice(r));
        close_rank(&ranks[r]);
        ncclCommDestroy(comms[r]);
    }
    free(expected);
    free(got);
    free(q);
    free(keys);
    return failures != 0;
}
