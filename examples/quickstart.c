/* The README's C example: plan, score and select one small batch on the cpu backend. */
#include <msaidx.h>
#include <stdio.h>
#include <stdlib.h>

/* One prefill request: 3 new tokens after a 300-token prefix, H = 4, E4M3, host memory. */
int main(void) {
    msaidx_config config;
    msaidx_config_init(&config);        /* D 128, page 128, H 4, top-16, local 1, E4M3 */
    config.device = MSAIDX_DEVICE_HOST; /* or a CUDA ordinal: then auto = persistent/dense */
    msaidx_context *ctx;
    if (msaidx_context_create(&ctx, &config) != MSAIDX_SUCCESS) {
        fprintf(stderr, "%s\n", msaidx_last_error());
        return 1;
    }
    const int32_t T = 3, H = 4, D = 128, pages = 3;
    int32_t cu_seqlens_q[2] = {0, T}, seq_lens[1] = {303}, block_table[3] = {2, 0, 1};

    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = 1;
    desc.num_tokens = T;
    desc.max_q_len = T;
    desc.max_seq_len = 303;
    desc.num_pages = pages;
    desc.bt_stride = 3;
    desc.page_stride = 128 * D; /* bytes: one E4M3 page */
    desc.pitch = 3;             /* >= ceil(max_seq_len / 128) */

    msaidx_plan *plan;
    size_t ws_bytes;
    msaidx_plan_create(&plan, ctx, &desc); /* once per batch shape */
    msaidx_plan_workspace_size(plan, &ws_bytes);
    void *workspace = aligned_alloc(256, (ws_bytes + 255) / 256 * 256);

    uint8_t *q = aligned_alloc(16, (size_t)T * H * D),
            *k = aligned_alloc(16, (size_t)pages * 128 * D);
    float one = 0.5f; /* fill with something: E4M3 codes of 0.5 */
    uint8_t code;
    msaidx_e4m3_from_float(&one, &code, 1);
    for (int i = 0; i < T * H * D; ++i) q[i] = code;
    for (int i = 0; i < pages * 128 * D; ++i) k[i] = code;
    float *scores = malloc(sizeof(float) * T * H * desc.pitch);
    int32_t *selected = malloc(sizeof(int32_t) * T * H * config.topk);

    msaidx_status s = msaidx_plan_batch(plan, cu_seqlens_q, seq_lens, block_table, workspace,
                                        ws_bytes, NULL);                          /* per batch */
    if (s == MSAIDX_SUCCESS) s = msaidx_prefill_scores(plan, q, k, scores, NULL); /* per layer */
    const int32_t *nvp;
    if (s == MSAIDX_SUCCESS) s = msaidx_plan_nvp(plan, &nvp);
    if (s == MSAIDX_SUCCESS)
        s = msaidx_topk_select(ctx, scores, desc.pitch, nvp, T, selected, NULL);
    if (s != MSAIDX_SUCCESS)
        fprintf(stderr, "%s: %s\n", msaidx_status_string(s), msaidx_last_error());
    else
        printf("token 0 head 0: %d pages, S[0] = %g, selected %d %d %d\n", nvp[0], scores[0],
               selected[0], selected[1], selected[2]);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(ctx);
    free(q);
    free(k);
    free(scores);
    free(selected);
    free(workspace);
    return s != MSAIDX_SUCCESS;
}
