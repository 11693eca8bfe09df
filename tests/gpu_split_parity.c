/* SPEC.md section 7/9: split scores are bitwise identical to dense (every cell written by
 * exactly one split), on the split parity cases, both dtypes; sampled rows also checked
 * against the cpu scalar reference. */
#include "backend_cases.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

typedef struct parity_case {
    int32_t batch_size, q_lens[2], kv_lens[2], num_heads;
} parity_case;

static const parity_case cases[] = {
    {1, {172}, {65836}, 1},
    {1, {1024}, {33000}, 1},
    {2, {300, 200}, {20300, 9000}, 2},
    {2, {96, 64}, {12000, 2720}, 4},
};

static void scores_of(msaidx_backend backend, const bc_batch *batch, const gpu_batch *device,
                      bool decode, cudaStream_t stream, float *scores) {
    gpu_session session;
    const msaidx_status status = gpu_session_create(&session, batch, backend);
    CHECK(status == MSAIDX_SUCCESS, "%s: %s", msaidx_backend_name(backend), msaidx_last_error());
    if (status != MSAIDX_SUCCESS) {
        bc_poison(scores, bc_score_count(batch));
        gpu_session_release(&session);
        return;
    }
    gpu_outputs outputs;
    gpu_outputs_create(&outputs, batch);
    gpu_outputs_poison(&outputs);
    CHECK_OK(gpu_enqueue(&session, device, batch, &outputs, decode, stream));
    CHECK_OK(msaidx_plan_check(session.plan, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const long guard = gpu_outputs_fetch(&outputs, scores, NULL);
    CHECK(guard == 0, "%s %s: writes past the buffers", msaidx_backend_name(backend),
          batch->spec.name);
    gpu_outputs_release(&outputs);
    gpu_session_release(&session);
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i)
        for (int bf16 = 0; bf16 < 2; ++bf16) {
            const parity_case *c = &cases[i];
            bc_spec spec;
            memset(&spec, 0, sizeof spec);
            spec.name = "split-parity";
            spec.dtype = bf16 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
            spec.num_heads = c->num_heads;
            spec.head_dim = 128;
            spec.page_size = 128;
            spec.topk = 16;
            spec.local_blocks = 1;
            spec.batch_size = c->batch_size;
            for (int32_t b = 0; b < c->batch_size; ++b) {
                spec.q_lens[b] = c->q_lens[b];
                spec.prefixes[b] = c->kv_lens[b] - c->q_lens[b];
            }
            spec.sample_tokens = 16;
            spec.page_pad_bytes = 16 * (int32_t)harness_int(&rng, 0, 2);
            bc_batch *batch = bc_build(&spec, &rng);
            gpu_batch device;
            gpu_upload(&device, batch);
            const size_t cells = bc_score_count(batch);
            float *dense = malloc(sizeof(float) * cells), *split = malloc(sizeof(float) * cells);
            float *ref = malloc(sizeof(float) * cells), *decode = malloc(sizeof(float) * cells);
            if (!dense || !split || !ref || !decode) exit(2);
            scores_of(MSAIDX_BACKEND_DENSE, batch, &device, false, stream, dense);
            scores_of(MSAIDX_BACKEND_SPLIT, batch, &device, false, stream, split);
            scores_of(MSAIDX_BACKEND_DENSE, batch, &device, true, stream, decode);
            long differ = 0, decode_differ = 0;
            for (size_t k = 0; k < cells; ++k) {
                differ += memcmp(&dense[k], &split[k], sizeof(float)) != 0;
                decode_differ += memcmp(&dense[k], &decode[k], sizeof(float)) != 0;
            }
            char label[96];
            snprintf(label, sizeof label, "case %zu (%s H=%d)", i, bf16 ? "bf16" : "e4m3",
                     c->num_heads);
            CHECK(differ == 0, "%s: split differs bitwise from dense in %ld of %zu cells", label,
                  differ, cells);
            /* Informational: decode is only held to the tolerance, checked in gpu_backends. */
            printf("%s: split vs dense %ld cells differ, decode vs dense %ld\n", label, differ,
                   decode_differ);
            bc_poison(ref, cells);
            bc_reference_scores(batch, ref);
            bc_compare_scores(batch, dense, ref, label);
            free(dense);
            free(split);
            free(ref);
            free(decode);
            gpu_release(&device);
            bc_free(batch);
        }
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_split_parity");
}

#else

int main(void) { return 77; }

#endif
