/* msaidx_topk_select_strided on the cpu backend: rows written at caller strides (the transpose of
 * an [H, T, k] buffer, a column window of a wider buffer) equal msaidx_topk_select's dense rows,
 * nothing outside the rows is touched, and overlapping or negative strides are refused;
 * msaidx_topk_select_bounded selects the same rows under the batch's longest row and refuses a
 * bound outside [1, pitch] or below a row. */
#include "backend_cases.h"
#include "harness.h"

#include <msaidx.h>

#include <stdlib.h>
#include <string.h>

#define SENTINEL (-7)

static void check_case(const bc_topk_case *tc, msaidx_context *context, int round) {
    const msaidx_config *c = &tc->config;
    const int32_t T = tc->num_tokens, H = c->num_heads, k = c->topk;
    const size_t count = (size_t)T * H * k;
    int32_t *want = malloc(count * sizeof *want);
    CHECK_OK(msaidx_topk_select(context, tc->scores, tc->pitch, tc->nvp, T, want, NULL));

    /* Layouts: [H, T, k] transposed; [T, H, k + 3] with the rows at column 2. */
    const int64_t wide = k + 3;
    const struct {
        const char *name;
        size_t elements;
        int64_t offset, stride_t, stride_h;
    } layouts[] = {
        {"transposed [H, T, k]", count, 0, k, (int64_t)T * k},
        {"column window of [T, H, k + 3]", (size_t)T * H * wide, 2, H * wide, wide},
    };
    for (int l = 0; l < 2; ++l) {
        int32_t *buffer = malloc(layouts[l].elements * sizeof *buffer);
        for (size_t i = 0; i < layouts[l].elements; ++i) buffer[i] = SENTINEL;
        CHECK_OK(msaidx_topk_select_strided(context, tc->scores, tc->pitch, tc->nvp, T,
                                            buffer + layouts[l].offset, layouts[l].stride_t,
                                            layouts[l].stride_h, NULL));
        char *written = calloc(layouts[l].elements, 1);
        long wrong = 0;
        for (int32_t t = 0; t < T; ++t)
            for (int32_t h = 0; h < H; ++h) {
                const int64_t row =
                    layouts[l].offset + t * layouts[l].stride_t + h * layouts[l].stride_h;
                wrong +=
                    memcmp(buffer + row, want + ((int64_t)t * H + h) * k, k * sizeof(int32_t)) != 0;
                memset(written + row, 1, (size_t)k);
            }
        long touched = 0;
        for (size_t i = 0; i < layouts[l].elements; ++i)
            touched += !written[i] && buffer[i] != SENTINEL;
        CHECK(wrong == 0, "round %d, %s: %ld rows differ from msaidx_topk_select", round,
              layouts[l].name, wrong);
        CHECK(touched == 0, "round %d, %s: %ld entries outside the rows written", round,
              layouts[l].name, touched);
        free(written);
        free(buffer);
    }
    /* Bounded by the batch's longest row: the same rows. */
    int32_t longest = 1;
    for (int32_t t = 0; t < T; ++t) longest = tc->nvp[t] > longest ? tc->nvp[t] : longest;
    int32_t *bounded = malloc(count * sizeof *bounded);
    CHECK_OK(msaidx_topk_select_bounded(context, tc->scores, tc->pitch, longest, tc->nvp, T,
                                        bounded, (int64_t)H * k, k, NULL));
    CHECK(memcmp(bounded, want, count * sizeof *want) == 0,
          "round %d: msaidx_topk_select_bounded (max_nvp %d) differs from msaidx_topk_select",
          round, longest);
    free(bounded);
    free(want);
}

static void check_refusals(void) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.backend = MSAIDX_BACKEND_CPU;
    config.num_heads = 2;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    float scores[3 * 2 * 4] = {0};
    int32_t nvp[3] = {4, 4, 4}, out[3 * 2 * 16 * 2];
    const struct {
        int64_t stride_t, stride_h;
    } bad[] = {{32, 8}, {16, 16}, {-32, 16}, {32, -16}, {16, 40}};
    for (int i = 0; i < 5; ++i) {
        const msaidx_status status = msaidx_topk_select_strided(
            context, scores, 4, nvp, 3, out + 48, bad[i].stride_t, bad[i].stride_h, NULL);
        CHECK(status == MSAIDX_ERROR_INVALID_ARGUMENT && strstr(msaidx_last_error(), "out_stride"),
              "strides (%lld, %lld): status %d, \"%s\"", (long long)bad[i].stride_t,
              (long long)bad[i].stride_h, status, msaidx_last_error());
    }
    /* [H, T, k] transposed is valid; with one token the token stride never steps. */
    CHECK_OK(msaidx_topk_select_strided(context, scores, 4, nvp, 3, out, 16, 48, NULL));
    CHECK_OK(msaidx_topk_select_strided(context, scores, 4, nvp, 1, out, 0, 16, NULL));
    /* max_nvp outside [1, pitch], and a row above it on the cpu backend, refused by name. */
    const int32_t bad_bounds[] = {0, 5};
    for (int i = 0; i < 2; ++i)
        CHECK(msaidx_topk_select_bounded(context, scores, 4, bad_bounds[i], nvp, 3, out, 32, 16,
                                         NULL) == MSAIDX_ERROR_INVALID_ARGUMENT &&
                  strstr(msaidx_last_error(), "max_nvp"),
              "max_nvp = %d: \"%s\"", bad_bounds[i], msaidx_last_error());
    CHECK(msaidx_topk_select_bounded(context, scores, 4, 3, nvp, 3, out, 32, 16, NULL) ==
                  MSAIDX_ERROR_INVALID_ARGUMENT &&
              strstr(msaidx_last_error(), "nvp[0] = 4") && strstr(msaidx_last_error(), "max_nvp"),
          "nvp above max_nvp: \"%s\"", msaidx_last_error());
    /* No token, no row: the transpose of an empty [H, 0, k] buffer has a head stride of 0. */
    out[0] = -7;
    CHECK_OK(msaidx_topk_select_strided(context, scores, 4, nvp, 0, out, 16, 0, NULL));
    CHECK(out[0] == -7, "an empty batch wrote its output");
    msaidx_context_destroy(context);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    for (int round = 0; round < 12; ++round) {
        bc_topk_case tc;
        bc_topk_case_make(&tc, &rng, round, 1, 300, 1, 40);
        tc.config.backend = MSAIDX_BACKEND_CPU;
        msaidx_context *context = NULL;
        CHECK_OK(msaidx_context_create(&context, &tc.config));
        if (context) check_case(&tc, context, round);
        msaidx_context_destroy(context);
        bc_topk_case_free(&tc);
    }
    check_refusals();
    return harness_finish("test_topk_strided");
}
