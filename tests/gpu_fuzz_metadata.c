/* Random device metadata, good and hostile, through every CUDA backend, both accumulation
 * settings, prefill and decode, and top-k, on the batch and on one rank of it sharded for context
 * parallel (SPEC.md section 12: scores, top-k and candidates); run under compute-sanitizer
 * memcheck by bench/h200_run.sh. Per random batch and backend:
 *  - valid metadata: plan_check succeeds; unsharded, scores within tolerance of the scalar
 *    reference and top-k equal to the cpu top-k of the same scores (a rank's scores are
 *    gpu_context_parallel's to compare);
 *  - hostile metadata at plan time: the calls succeed, plan_check reports SUCCESS or
 *    BAD_METADATA, nothing is written past the outputs;
 *  - metadata planned valid, then overwritten on the device with hostile values before the
 *    scores and top-k run (allowed between graph replays): the calls succeed and nothing is
 *    written past the outputs.
 * Out-of-bounds reads and writes inside the buffers are memcheck's to find. */
#include "backend_cases.h"
#include "cp_oracle.h"
#include "cpu/cpu.h"
#include "gpu_device.h"

#ifdef MSAIDX_WITH_CUDA

static int32_t hostile_value(harness_rng *rng) {
    static const int32_t values[] = {INT32_MIN, -(1 << 30), -5,      -1,      0,
                                     1,         1 << 28,    1 << 29, 1 << 30, INT32_MAX};
    return values[harness_int(rng, 0, (int64_t)(sizeof values / sizeof values[0]) - 1)];
}

/* Overwrites random entries of the batch's host metadata with hostile values. */
static void make_hostile(bc_batch *batch, harness_rng *rng) {
    const int32_t B = batch->desc.batch_size;
    const size_t entries = (size_t)B * batch->desc.bt_stride;
    const int rounds = (int)harness_int(rng, 1, 6);
    for (int i = 0; i < rounds; ++i) {
        switch (harness_int(rng, 0, 3)) {
        case 0: batch->cu_seqlens_q[harness_int(rng, 0, B)] = hostile_value(rng); break;
        case 1: batch->cu_seqlens_q[B] = 1 << 29; break;
        case 2:
            if (B > 0) batch->seq_lens[harness_int(rng, 0, B - 1)] = hostile_value(rng);
            break;
        default:
            for (size_t e = 0; e < entries; ++e)
                if (harness_int(rng, 0, 1))
                    batch->block_table[e] = harness_int(rng, 0, 1) ? 1 << 28 : -5;
            break;
        }
    }
}

typedef struct saved_metadata {
    int32_t *ints;
    size_t cu_count, seq_count, table_count;
} saved_metadata;

static void save_metadata(const bc_batch *batch, saved_metadata *s) {
    s->cu_count = (size_t)batch->desc.batch_size + 1;
    s->seq_count = (size_t)batch->desc.batch_size;
    s->table_count = (size_t)batch->desc.batch_size * batch->desc.bt_stride;
    s->ints = malloc(sizeof(int32_t) * (s->cu_count + s->seq_count + s->table_count));
    if (!s->ints) exit(2);
    memcpy(s->ints, batch->cu_seqlens_q, sizeof(int32_t) * s->cu_count);
    memcpy(s->ints + s->cu_count, batch->seq_lens, sizeof(int32_t) * s->seq_count);
    memcpy(s->ints + s->cu_count + s->seq_count, batch->block_table,
           sizeof(int32_t) * s->table_count);
}

static void restore_metadata(bc_batch *batch, const saved_metadata *s) {
    memcpy(batch->cu_seqlens_q, s->ints, sizeof(int32_t) * s->cu_count);
    memcpy(batch->seq_lens, s->ints + s->cu_count, sizeof(int32_t) * s->seq_count);
    memcpy(batch->block_table, s->ints + s->cu_count + s->seq_count,
           sizeof(int32_t) * s->table_count);
}

enum { VALID, HOSTILE_AT_PLAN, HOSTILE_AFTER_PLAN, NUM_MODES };

/* One mode on one session; `ref` NULL: no score comparison (the sharded rank's columns). */
static const char *const mode_names[NUM_MODES] = {"valid", "hostile at plan", "hostile after plan"};

static void run_mode(const gpu_session *session, bc_batch *batch, const saved_metadata *valid,
                     const float *ref, int mode, bool decode, cudaStream_t stream, harness_rng *rng,
                     const char *label) {
    const int32_t T = batch->desc.num_tokens;
    const size_t cells = bc_score_count(batch);
    const size_t picks = (size_t)T * batch->config.num_heads * batch->config.topk;
    float *got = malloc(sizeof(float) * (cells + 1));
    int32_t *topk = malloc(sizeof(int32_t) * (picks + 1)),
            *want = malloc(sizeof(int32_t) * (picks + 1));
    int32_t *nvp = malloc(sizeof(int32_t) * ((size_t)T + 1));
    if (!got || !topk || !want || !nvp) exit(2);
    char name[200];
    snprintf(name, sizeof name, "%s, %s, %s", label, mode_names[mode],
             decode ? "decode" : "prefill");

    restore_metadata(batch, valid);
    if (mode == HOSTILE_AT_PLAN) make_hostile(batch, rng);
    gpu_batch device;
    gpu_upload(&device, batch);
    gpu_outputs outputs;
    gpu_outputs_create(&outputs, batch);
    gpu_outputs_poison(&outputs);

    msaidx_status status;
    if (mode == HOSTILE_AFTER_PLAN) {
        status = msaidx_plan_batch(session->plan, device.cu_seqlens_q, device.seq_lens,
                                   device.block_table, session->workspace, session->workspace_bytes,
                                   stream);
        CHECK(status == MSAIDX_SUCCESS, "%s: plan_batch: %s", name, msaidx_last_error());
        CUDA_CHECK(cudaStreamSynchronize(stream)); /* the plan has read the valid metadata */
        make_hostile(batch, rng);
        gpu_upload_meta(&device, batch);
        const int32_t *plan_nvp = NULL;
        if (status == MSAIDX_SUCCESS)
            status = decode ? msaidx_decode_scores(session->plan, device.q, device.k_cache,
                                                   outputs.scores, stream)
                            : msaidx_prefill_scores(session->plan, device.q, device.k_cache,
                                                    outputs.scores, stream);
        if (status == MSAIDX_SUCCESS) status = msaidx_plan_nvp(session->plan, &plan_nvp);
        if (status == MSAIDX_SUCCESS)
            status = msaidx_topk_select(session->context, outputs.scores, batch->desc.pitch,
                                        plan_nvp, T, outputs.topk, stream);
    } else {
        status = gpu_enqueue(session, &device, batch, &outputs, decode, stream);
    }
    /* A sharded plan's candidates too (global pages, into the top-k buffer and a guarded one). */
    float *candidate_scores = NULL;
    const bool sharded = batch->desc.cp_world > 1;
    if (sharded) {
        CUDA_CHECK(cudaMalloc((void **)&candidate_scores, sizeof(float) * (picks + GPU_GUARD)));
        CUDA_CHECK(
            cudaMemsetAsync(candidate_scores, 0xFF, sizeof(float) * (picks + GPU_GUARD), stream));
        msaidx_topk_args args;
        msaidx_topk_args_init(&args);
        args.topk = batch->config.topk;
        if (status == MSAIDX_SUCCESS)
            status = msaidx_prefill_topk_candidates(session->plan, device.q, device.k_cache, &args,
                                                    outputs.scores, candidate_scores, outputs.topk,
                                                    stream);
    }
    CHECK(status == MSAIDX_SUCCESS, "%s: %s", name, msaidx_last_error());
    const msaidx_status checked = msaidx_plan_check(session->plan, stream);
    if (mode == VALID)
        CHECK(checked == MSAIDX_SUCCESS, "%s: plan_check: %s", name, msaidx_last_error());
    else
        CHECK(checked == MSAIDX_SUCCESS || checked == MSAIDX_ERROR_BAD_METADATA,
              "%s: plan_check returned %s", name, msaidx_status_string(checked));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGetLastError());
    const long guard = gpu_outputs_fetch(&outputs, got, topk);
    CHECK(guard == 0, "%s: %ld writes past the score / top-k buffers", name, guard);
    if (sharded) {
        uint32_t tail[GPU_GUARD];
        CUDA_CHECK(cudaMemcpy(tail, candidate_scores + picks, sizeof tail, cudaMemcpyDeviceToHost));
        long written = 0;
        for (int i = 0; i < GPU_GUARD; ++i) written += tail[i] != 0xFFFFFFFFu;
        CHECK(written == 0, "%s: %ld writes past the candidate scores", name, written);
        CUDA_CHECK(cudaFree(candidate_scores));
    }

    if (mode == VALID && ref) {
        bc_compare_scores(batch, got, ref, name);
        gpu_fetch_nvp(session, batch, nvp);
        CHECK(memcmp(nvp, batch->nvp, sizeof(int32_t) * (size_t)T) == 0, "%s: nvp differs", name);
        /* Top-k is exact given the scores, whatever their accumulation. */
        msaidx_cpu_topk_reference(&batch->config, got, batch->desc.pitch, batch->nvp, T, want);
        CHECK(memcmp(topk, want, sizeof(int32_t) * picks) == 0,
              "%s: top-k differs from the cpu top-k of the same scores", name);
    }
    gpu_outputs_release(&outputs);
    gpu_release(&device);
    restore_metadata(batch, valid);
    free(got);
    free(topk);
    free(want);
    free(nvp);
}

/* `batch` seen by one rank of W (either layout): its desc's cp fields and the rank's block table
 * (entry i = the i-th page it owns), sharing everything else with `batch`. *table is the table to
 * free. */
static bc_batch shard_of(const bc_batch *batch, harness_rng *rng, int32_t **table) {
    bc_batch rank = *batch;
    msaidx_batch_desc *d = &rank.desc;
    const int32_t P = batch->config.page_size, B = d->batch_size;
    d->cp_world = (int32_t)harness_int(rng, 2, 4);
    d->cp_rank = (int32_t)harness_int(rng, 0, d->cp_world - 1);
    d->cp_layout = harness_int(rng, 0, 1) ? MSAIDX_CP_INTERLEAVED : MSAIDX_CP_CONTIGUOUS;
    const int32_t local_max = ceil_div(ceil_div(d->max_seq_len, P), d->cp_world);
    d->bt_stride = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    d->pitch = (local_max > 0 ? local_max : 1) + (int32_t)harness_int(rng, 0, 2);
    *table = malloc(sizeof(int32_t) * ((size_t)(B > 0 ? B : 1) * d->bt_stride));
    if (!*table) exit(2);
    for (int32_t b = 0; b < B; ++b) {
        const int32_t pages = ceil_div(batch->seq_lens[b], P);
        for (int32_t i = 0; i < d->bt_stride; ++i) {
            const int32_t global = global_page(d->cp_layout, d->cp_world, d->cp_rank, pages, i);
            (*table)[(size_t)b * d->bt_stride + i] =
                global >= 0 ? batch->block_table[(size_t)b * batch->desc.bt_stride + global] : -7;
        }
    }
    rank.block_table = *table;
    return rank;
}

int main(void) {
    if (!gpu_available()) return 77;
    harness_rng rng = {harness_seed()};
    const char *rounds_env = getenv("MSAIDX_TEST_ROUNDS"); /* shorter under compute-sanitizer */
    const int rounds = rounds_env ? atoi(rounds_env) : 12;
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bool admitted[GPU_NUM_BACKENDS];
    for (int i = 0; i < GPU_NUM_BACKENDS; ++i)
        admitted[i] = gpu_backend_admitted(gpu_backend_at(i));
    long runs = 0;
    for (int round = 0; round < rounds; ++round) {
        bc_spec spec;
        bc_random_spec(&spec, &rng, true);
        bc_batch *batch = bc_build(&spec, &rng);
        float *ref = malloc(sizeof(float) * (bc_score_count(batch) + 1));
        if (!ref) exit(2);
        bc_poison(ref, bc_score_count(batch));
        bc_reference_scores(batch, ref);
        saved_metadata valid;
        save_metadata(batch, &valid);
        for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
            if (!admitted[i]) continue;
            for (int fast = 0; fast < 2; ++fast) {
                batch->config.precision = fast ? MSAIDX_PRECISION_DEFAULT : MSAIDX_PRECISION_EXACT;
                gpu_session session;
                const msaidx_status status = gpu_session_create(&session, batch, gpu_backend_at(i));
                if (status == MSAIDX_SUCCESS) {
                    char label[96];
                    snprintf(label, sizeof label, "round %d %s%s", round,
                             msaidx_backend_name(gpu_backend_at(i)), fast ? " fast" : "");
                    for (int mode = 0; mode < NUM_MODES; ++mode, ++runs)
                        run_mode(&session, batch, &valid, ref, mode, (round + mode) % 2 == 1,
                                 stream, &rng, label);
                } else {
                    CHECK(status == MSAIDX_ERROR_NOT_SUPPORTED, "round %d %s: %s", round,
                          msaidx_backend_name(gpu_backend_at(i)), msaidx_last_error());
                }
                gpu_session_release(&session);
            }
        }
        batch->config.precision = MSAIDX_PRECISION_EXACT;
        /* One rank of the batch sharded: valid metadata must plan clean, hostile metadata at or
         * after the plan must be reported or contained. */
        int32_t *rank_table = NULL;
        bc_batch rank = shard_of(batch, &rng, &rank_table);
        saved_metadata rank_valid;
        save_metadata(&rank, &rank_valid);
        for (int i = 0; i < GPU_NUM_BACKENDS; ++i) {
            if (!admitted[i]) continue;
            gpu_session session;
            const msaidx_status status = gpu_session_create(&session, &rank, gpu_backend_at(i));
            if (status == MSAIDX_SUCCESS) {
                char label[128];
                snprintf(
                    label, sizeof label, "round %d %s, rank %d of %d (%s)", round,
                    msaidx_backend_name(gpu_backend_at(i)), rank.desc.cp_rank, rank.desc.cp_world,
                    rank.desc.cp_layout == MSAIDX_CP_INTERLEAVED ? "interleaved" : "contiguous");
                for (int mode = 0; mode < NUM_MODES; ++mode, ++runs)
                    run_mode(&session, &rank, &rank_valid, NULL, mode, (round + mode) % 2 == 0,
                             stream, &rng, label);
            } else {
                CHECK(status == MSAIDX_ERROR_NOT_SUPPORTED, "round %d %s sharded: %s", round,
                      msaidx_backend_name(gpu_backend_at(i)), msaidx_last_error());
            }
            gpu_session_release(&session);
        }
        free(rank_valid.ints);
        free(rank_table);
        free(valid.ints);
        free(ref);
        bc_free(batch);
    }
    printf("gpu_fuzz_metadata: %d random batches, %ld runs\n", rounds, runs);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return harness_finish("gpu_fuzz_metadata");
}

#else

int main(void) { return 77; }

#endif
