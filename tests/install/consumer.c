/* A parent project's use of msaidx through the installed or vendored package: the public header
 * and the shared library only. Scores one request of 2 tokens against 3 pages on the cpu backend
 * and checks the top-2 of the last token. */
#include <msaidx.h>

#include <stdio.h>
#include <string.h>

#define HEAD_DIM 16
#define PAGE 16
#define PAGES 3

static int fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, msaidx_last_error());
    return 1;
}

int main(void) {
    printf("msaidx %s\n", MSAIDX_VERSION_STRING);
    msaidx_config config;
    msaidx_config_init(&config);
    config.head_dim = HEAD_DIM;
    config.page_size = PAGE;
    config.num_heads = 1;
    config.topk = 2;
    config.backend = MSAIDX_BACKEND_CPU;
    msaidx_context *context = NULL;
    if (msaidx_context_create(&context, &config) != MSAIDX_SUCCESS) return fail("context");

    /* Keys of page p are all p + 1 (as E4M3), queries all 1: page scores 16, 32, 48. */
    float key_values[PAGES * PAGE * HEAD_DIM], query_values[2 * HEAD_DIM];
    for (int i = 0; i < PAGES * PAGE * HEAD_DIM; ++i)
        key_values[i] = (float)(i / (PAGE * HEAD_DIM) + 1);
    for (int i = 0; i < 2 * HEAD_DIM; ++i) query_values[i] = 1.0f;
    _Alignas(16) uint8_t k_cache[PAGES * PAGE * HEAD_DIM];
    _Alignas(16) uint8_t q[2 * HEAD_DIM];
    msaidx_e4m3_from_float(key_values, k_cache, sizeof k_cache);
    msaidx_e4m3_from_float(query_values, q, sizeof q);

    const int32_t cu_seqlens_q[2] = {0, 2}, seq_lens[1] = {PAGES * PAGE},
                  block_table[PAGES] = {0, 1, 2};
    msaidx_batch_desc desc;
    msaidx_batch_desc_init(&desc);
    desc.batch_size = 1;
    desc.num_tokens = 2;
    desc.max_q_len = 2;
    desc.max_seq_len = PAGES * PAGE;
    desc.num_pages = PAGES;
    desc.bt_stride = PAGES;
    desc.page_stride = PAGE * HEAD_DIM;
    desc.pitch = PAGES;
    msaidx_plan *plan = NULL;
    if (msaidx_plan_create(&plan, context, &desc) != MSAIDX_SUCCESS) return fail("plan");
    size_t bytes = 0;
    msaidx_plan_workspace_size(plan, &bytes);
    static _Alignas(16) unsigned char workspace[1 << 16];
    if (bytes > sizeof workspace) return fail("workspace size");
    float scores[2 * PAGES];
    const int32_t *nvp = NULL;
    int32_t top[2 * 2];
    if (msaidx_plan_batch(plan, cu_seqlens_q, seq_lens, block_table, workspace, bytes, NULL) ||
        msaidx_prefill_scores(plan, q, k_cache, scores, NULL) || msaidx_plan_nvp(plan, &nvp) ||
        msaidx_topk_select(context, scores, PAGES, nvp, 2, top, NULL))
        return fail("run");
    printf("S[1] = %g %g %g, selected %d %d\n", scores[3], scores[4], scores[5], top[2], top[3]);
    msaidx_plan_destroy(plan);
    msaidx_context_destroy(context);
    return scores[5] == 48.0f && top[2] == 1 && top[3] == 2 ? 0 : 1;
}
