/* msaidx_index_prepare on the GPU: the cases of tests/test_index_prepare.c (and larger ones)
 * against the FP64 evaluation and, byte for byte, against the cpu backend; bad slots and positions
 * recorded in the device error word and never written; one call captured in a CUDA graph and
 * replayed. Exits 77 without a device. */
#include "index_prepare_cases.h"

#ifdef MSAIDX_WITH_CUDA
#include "gpu_device.h"

/* Device copies of a case's inputs and poisoned outputs. */
typedef struct ip_device {
    uint16_t *input, *weights;
    int64_t *positions, *slots;
    void *cos_sin;
    uint8_t *q_out, *k_cache;
    uint32_t *error_word;
} ip_device;

static void *upload(const void *host, size_t bytes) {
    void *device = NULL;
    CUDA_CHECK(cudaMalloc(&device, bytes ? bytes : 1));
    if (bytes) CUDA_CHECK(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
    return device;
}

static void device_create(ip_device *g, const ip_case *c) {
    const size_t T = (size_t)c->spec.num_tokens;
    g->input = upload(c->input, sizeof(uint16_t) * c->input_elems);
    uint16_t weights[2 * IP_DIM];
    memcpy(weights, c->q_weight, sizeof c->q_weight);
    memcpy(weights + IP_DIM, c->k_weight, sizeof c->k_weight);
    g->weights = upload(weights, sizeof weights);
    g->positions = upload(c->positions, sizeof(int64_t) * T);
    g->slots = upload(c->slots, sizeof(int64_t) * T);
    g->cos_sin = upload(c->cos_sin, c->cos_sin_bytes);
    CUDA_CHECK(cudaMalloc((void **)&g->q_out, c->q_out_bytes + IP_GUARD_BYTES));
    CUDA_CHECK(cudaMalloc((void **)&g->k_cache, c->k_cache_bytes + IP_GUARD_BYTES));
    CUDA_CHECK(cudaMalloc((void **)&g->error_word, sizeof(uint32_t)));
}

static void device_poison(const ip_device *g, const ip_case *c) {
    CUDA_CHECK(cudaMemset(g->q_out, IP_POISON, c->q_out_bytes + IP_GUARD_BYTES));
    CUDA_CHECK(cudaMemset(g->k_cache, IP_POISON, c->k_cache_bytes + IP_GUARD_BYTES));
    CUDA_CHECK(cudaMemset(g->error_word, 0, sizeof(uint32_t)));
    /* cudaMemset runs on the legacy stream, which the call's non-blocking stream does not wait
     * for: without this the poison can land after the kernel's outputs. */
    CUDA_CHECK(cudaDeviceSynchronize());
}

static void device_release(ip_device *g) {
    CUDA_CHECK(cudaFree(g->input));
    CUDA_CHECK(cudaFree(g->weights));
    CUDA_CHECK(cudaFree(g->positions));
    CUDA_CHECK(cudaFree(g->slots));
    CUDA_CHECK(cudaFree(g->cos_sin));
    CUDA_CHECK(cudaFree(g->q_out));
    CUDA_CHECK(cudaFree(g->k_cache));
    CUDA_CHECK(cudaFree(g->error_word));
}

typedef struct parity {
    long elements, equal;
} parity;

/* Elements (of the output format) of `gpu` equal to `cpu`, over `bytes`. */
static void compare(const uint8_t *gpu, const uint8_t *cpu, size_t bytes, size_t elem, parity *p) {
    for (size_t i = 0; i < bytes; i += elem) {
        ++p->elements;
        p->equal += memcmp(gpu + i, cpu + i, elem) == 0;
    }
}

/* Copies back and checks one run: error word, FP64 judge, bytes against the cpu backend. */
static void check_run(const ip_device *g, const ip_case *c, const uint8_t *cpu_q_out,
                      const uint8_t *cpu_k_cache, ip_tally *tally, parity *p, const char *how) {
    uint8_t *q_out = ip_alloc(c->q_out_bytes + IP_GUARD_BYTES);
    uint8_t *k_cache = ip_alloc(c->k_cache_bytes + IP_GUARD_BYTES);
    uint32_t error_word = 0;
    CUDA_CHECK(
        cudaMemcpy(q_out, g->q_out, c->q_out_bytes + IP_GUARD_BYTES, cudaMemcpyDeviceToHost));
    CUDA_CHECK(
        cudaMemcpy(k_cache, g->k_cache, c->k_cache_bytes + IP_GUARD_BYTES, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&error_word, g->error_word, sizeof error_word, cudaMemcpyDeviceToHost));
    CHECK(error_word == c->expected_bits, "%s: error word 0x%x, expected 0x%x", how, error_word,
          c->expected_bits);
    ip_judge(c, q_out, k_cache, tally);
    const long equal_before = p->equal, elements_before = p->elements;
    compare(q_out, cpu_q_out, c->q_out_bytes + IP_GUARD_BYTES, ip_elem(c), p);
    compare(k_cache, cpu_k_cache, c->k_cache_bytes + IP_GUARD_BYTES, ip_elem(c), p);
    /* The two backends round the same FP32 steps in the same order: byte for byte, every case. */
    CHECK(p->equal - equal_before == p->elements - elements_before,
          "%s: %ld of %ld elements differ from the cpu backend's", how,
          (p->elements - elements_before) - (p->equal - equal_before),
          p->elements - elements_before);
    free(q_out);
    free(k_cache);
}

static void run_case(const ip_spec *spec, bool graph, harness_rng *rng, ip_tally *tally,
                     parity *p) {
    ip_case c;
    ip_build(&c, spec, rng);

    msaidx_context *host = ip_context(&c, MSAIDX_DEVICE_HOST);
    uint8_t *cpu_q_out, *cpu_k_cache;
    ip_poisoned(&c, &cpu_q_out, &cpu_k_cache);
    const msaidx_index_prepare_args host_args =
        ip_args(&c, c.input, c.positions, c.slots, c.q_weight, c.k_weight, c.cos_sin, cpu_q_out,
                cpu_k_cache, NULL);
    const msaidx_status host_status = msaidx_index_prepare(host, &host_args, NULL);
    CHECK(host_status == (c.first_bad < 0 ? MSAIDX_SUCCESS : MSAIDX_ERROR_INVALID_ARGUMENT),
          "cpu: %s", msaidx_last_error());

    msaidx_context *device = ip_context(&c, 0);
    ip_device g;
    device_create(&g, &c);
    device_poison(&g, &c);
    const msaidx_index_prepare_args args =
        ip_args(&c, g.input, g.positions, g.slots, g.weights, g.weights + IP_DIM, g.cos_sin,
                g.q_out, g.k_cache, g.error_word);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CHECK_OK(msaidx_index_prepare(device, &args, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    check_run(&g, &c, cpu_q_out, cpu_k_cache, tally, p, "stream");

    if (graph) { /* the call captured once, replayed on fresh poison */
        device_poison(&g, &c);
        cudaGraph_t captured;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        CHECK_OK(msaidx_index_prepare(device, &args, stream));
        CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
        CUDA_CHECK(cudaGraphInstantiate(&exec, captured, 0));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        check_run(&g, &c, cpu_q_out, cpu_k_cache, tally, p, "graph replay");
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(captured));
    }

    CUDA_CHECK(cudaStreamDestroy(stream));
    device_release(&g);
    msaidx_context_destroy(device);
    msaidx_context_destroy(host);
    free(cpu_q_out);
    free(cpu_k_cache);
    ip_release(&c);
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    ip_tally tally = {0};
    parity p = {0};
    /* Every block shape: rows of 8 lanes (H = 1: a token's query and key in one group; 4 rows a
     * warp), 24, 32 and 40 lanes (whole warps of 4, 1 and 4 rows) and the largest block, H = 16
     * (4 rows of 136 lanes). */
    const int32_t heads[] = {1, 2, 3, 4, 16};
    for (size_t h = 0; h < sizeof heads / sizeof heads[0]; ++h)
        for (int dtype = 0; dtype < 2; ++dtype)
            for (int table = 0; table < IP_ROTATIONS; ++table)
                for (int variant = 0; variant < 8; ++variant) {
                    const ip_spec spec = {
                        .dtype = dtype ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                        .num_heads = heads[h],
                        .num_tokens = (int32_t)harness_int(&rng, 1, 300),
                        .num_pages = (int32_t)harness_int(&rng, 1, 3),
                        .table = ip_rotation[table],
                        .fused = variant & 1,
                        .saturate = variant & 2,
                        .bad_tokens = variant & 4,
                    };
                    run_case(&spec, variant == 5, &rng, &tally, &p);
                }
    /* Batches of several waves of blocks (MSAIDX_TEST_SMALL=1, for memcheck, keeps one: H = 4
     * with theta and bad tokens, where a group of lanes holds all of a token's vectors). */
    const char *small = getenv("MSAIDX_TEST_SMALL");
    const bool is_small = small && small[0] == '1';
    for (int large = is_small ? 4 : 0; large < (is_small ? 5 : 6); ++large) {
        const ip_spec spec = {
            .dtype = large & 1 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
            .num_heads = 4,
            .num_tokens = (int32_t)harness_int(&rng, 4096, 5000),
            .num_pages = 40,
            .table = ip_rotation[large / 2],
            .fused = true,
            .saturate = large == 3 || large == 5,
            .bad_tokens = large == 2 || large == 4,
        };
        run_case(&spec, large == 0 || large == 4, &rng, &tally, &p);
    }
    /* Rows of blocks that walk at least 4 tokens on any device (the kernel issues the next
     * token's loads and the position after it a step ahead, so a step that took a stale cos/sin
     * row or input would show from a row's second token on): 4 steps x rows a block (16 where a
     * group holds all of a token's vectors: H = 1, and H = 2-4 with theta from 4096 tokens; 4
     * at H = 2-4 otherwise) x 8 blocks a SM (at most 7 are resident) x the SMs. Each H with
     * theta, and H = 1-3 with a table. Bad tokens at H = 1 and 2: a bad slot must not keep the
     * token's query from its row. */
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int run = 0; run < 7 && !is_small; ++run) {
        const int32_t h = run < 4 ? run + 1 : run - 3; /* 1-4, then 1-3 again */
        const int rotation = run < 4 ? 2 : h == 3;     /* theta, then FP32 / BF16 tables */
        const int32_t tokens = 4 * (h == 1 || rotation == 2 ? 16 : 4) * 8 * sms;
        const ip_spec spec = {
            .dtype = h & 1 ? MSAIDX_DTYPE_E4M3 : MSAIDX_DTYPE_BF16,
            .num_heads = h,
            .num_tokens = tokens - (int32_t)harness_int(&rng, 0, 100),
            .num_pages = tokens / IP_PAGE + 8,
            .table = ip_rotation[rotation],
            .fused = true,
            .saturate = h == 3,
            .bad_tokens = h <= 2,
        };
        run_case(&spec, run == 0, &rng, &tally, &p);
    }
    ip_tally_print("gpu vs FP64", &tally);
    printf("gpu vs cpu: %ld of %ld output elements (poison and guards included) bitwise equal "
           "(%.4f %%)\n",
           p.equal, p.elements, 100.0 * (double)p.equal / (double)p.elements);
    CHECK(tally.wrong == 0, "%ld elements beyond one step", tally.wrong);
    return harness_finish("gpu_index_prepare");
}

#else
int main(void) {
    printf("built without CUDA: skipped\n");
    return 77;
}
#endif
