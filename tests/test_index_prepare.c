/* msaidx_index_prepare on the cpu backend: every H in {1, 2, 4}, both cache dtypes, FP32 and BF16
 * cos/sin tables, fused (strided) and dense inputs, saturating weights, -1 and bad slots, bad
 * positions, against the FP64 evaluation of SPEC.md section 11; then argument validation. */
#include "index_prepare_cases.h"

#include <stdio.h>

static void run_case(const ip_spec *spec, harness_rng *rng, ip_tally *tally) {
    ip_case c;
    ip_build(&c, spec, rng);
    msaidx_context *context = ip_context(&c, MSAIDX_DEVICE_HOST);
    uint8_t *q_out, *k_cache;
    ip_poisoned(&c, &q_out, &k_cache);
    uint32_t error_word = 0;
    const msaidx_index_prepare_args args =
        ip_args(&c, c.input, c.positions, c.slots, c.q_weight, c.k_weight, c.cos_sin, q_out,
                k_cache, &error_word);
    const msaidx_status status = msaidx_index_prepare(context, &args, NULL);
    if (c.first_bad < 0) {
        CHECK_OK(status);
    } else {
        CHECK(status == MSAIDX_ERROR_INVALID_ARGUMENT, "bad tokens: status %s",
              msaidx_status_string(status));
        char first[64];
        const bool position_bad =
            c.positions[c.first_bad] < 0 || c.positions[c.first_bad] >= c.max_position;
        snprintf(first, sizeof first, "%s[%d]", position_bad ? "positions" : "slot_mapping",
                 c.first_bad);
        CHECK(strstr(msaidx_last_error(), first), "message '%s' does not name %s",
              msaidx_last_error(), first);
    }
    CHECK(error_word == c.expected_bits, "error word 0x%x, expected 0x%x", error_word,
          c.expected_bits);
    ip_judge(&c, q_out, k_cache, tally);
    free(q_out);
    free(k_cache);
    msaidx_context_destroy(context);
    ip_release(&c);
}

static void cases(harness_rng *rng) {
    ip_tally tally = {0};
    const int32_t heads[] = {1, 2, 4};
    for (int h = 0; h < 3; ++h)
        for (int dtype = 0; dtype < 2; ++dtype)
            for (int table = 0; table < 2; ++table)
                for (int variant = 0; variant < 8; ++variant) {
                    const ip_spec spec = {
                        .dtype = dtype ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                        .num_heads = heads[h],
                        .num_tokens = (int32_t)harness_int(rng, 1, 200),
                        .num_pages = (int32_t)harness_int(rng, 1, 3),
                        .table = table ? MSAIDX_COS_SIN_BF16 : MSAIDX_COS_SIN_FP32,
                        .fused = variant & 1,
                        .saturate = variant & 2,
                        .bad_tokens = variant & 4,
                    };
                    run_case(&spec, rng, &tally);
                }
    ip_tally_print("cpu vs FP64", &tally);
    CHECK(tally.wrong == 0, "%ld elements beyond one step", tally.wrong);
    CHECK(tally.saturated > 0, "no case saturated");
}

/* The call on `args` fails with `status` and a message naming `name`. */
static void expect_failure(const msaidx_context *context, const msaidx_index_prepare_args *args,
                           msaidx_status status, const char *name) {
    const msaidx_status got = msaidx_index_prepare(context, args, NULL);
    CHECK(got == status, "%s: status %s, expected %s", name, msaidx_status_string(got),
          msaidx_status_string(status));
    CHECK(strstr(msaidx_last_error(), name), "message '%s' does not name %s", msaidx_last_error(),
          name);
}

static void validation(harness_rng *rng) {
    const ip_spec spec = {.dtype = MSAIDX_DTYPE_E4M3,
                          .num_heads = 2,
                          .num_tokens = 8,
                          .num_pages = 1,
                          .table = MSAIDX_COS_SIN_FP32,
                          .fused = true};
    ip_case c;
    ip_build(&c, &spec, rng);
    msaidx_context *context = ip_context(&c, MSAIDX_DEVICE_HOST);
    uint8_t *q_out, *k_cache;
    ip_poisoned(&c, &q_out, &k_cache);
    const msaidx_index_prepare_args good = ip_args(&c, c.input, c.positions, c.slots, c.q_weight,
                                                   c.k_weight, c.cos_sin, q_out, k_cache, NULL);
    CHECK_OK(msaidx_index_prepare(context, &good, NULL));

    expect_failure(NULL, &good, MSAIDX_ERROR_INVALID_ARGUMENT, "context");
    expect_failure(context, NULL, MSAIDX_ERROR_INVALID_ARGUMENT, "args");
    msaidx_index_prepare_args a;
#define EXPECT(field_change, name)                                                                 \
    do {                                                                                           \
        a = good;                                                                                  \
        field_change;                                                                              \
        expect_failure(context, &a, MSAIDX_ERROR_INVALID_ARGUMENT, name);                          \
    } while (0)
    EXPECT(a.struct_size = 8, "args.struct_size");
    EXPECT(a.num_tokens = -1, "args.num_tokens");
    EXPECT(a.eps = NAN, "args.eps");
    EXPECT(a.eps = -1.0f, "args.eps");
    EXPECT(a.cos_sin_format = (msaidx_cos_sin_format)7, "args.cos_sin_format");
    EXPECT(a.max_position = 0, "args.max_position");
    EXPECT(a.num_pages = 0, "args.num_pages");
    EXPECT(a.page_stride = 128 * 128 - 16, "args.page_stride");
    EXPECT(a.page_stride += 8, "args.page_stride");
    EXPECT(a.page_stride = INT64_MAX / 2 / 16 * 16; a.num_pages = 3, "args.page_stride");
    EXPECT(a.error_word = (uint32_t *)((char *)q_out + 2), "args.error_word");
    EXPECT(a.q_in = NULL, "args.q_in");
    EXPECT(a.q_in = (const char *)a.q_in + 2, "args.q_in");
    EXPECT(a.q_in_token_stride = 2 * 128 - 8, "args.q_in_token_stride");
    EXPECT(a.q_in_token_stride += 4, "args.q_in_token_stride");
    EXPECT(a.q_in_token_stride = INT64_MAX / 8 / 8 * 8, "args.q_in_token_stride");
    EXPECT(a.k_in = NULL, "args.k_in");
    EXPECT(a.k_in_token_stride = 120, "args.k_in_token_stride");
    EXPECT(a.positions = (const int64_t *)((const char *)a.positions + 4), "args.positions");
    EXPECT(a.q_norm_weight = NULL, "args.q_norm_weight");
    EXPECT(a.k_norm_weight = (const char *)a.k_norm_weight + 2, "args.k_norm_weight");
    EXPECT(a.cos_sin_cache = NULL, "args.cos_sin_cache");
    EXPECT(a.slot_mapping = NULL, "args.slot_mapping");
    EXPECT(a.k_cache = k_cache + 8, "args.k_cache");
    EXPECT(a.q_out = NULL, "args.q_out");
#undef EXPECT

    /* A context whose head_dim is not 128 cannot prepare (RoPE on [0, 64) of 128). */
    msaidx_config config;
    msaidx_config_init(&config);
    config.head_dim = 64;
    config.num_heads = 2;
    msaidx_context *narrow = NULL;
    CHECK_OK(msaidx_context_create(&narrow, &config));
    expect_failure(narrow, &good, MSAIDX_ERROR_NOT_SUPPORTED, "head_dim");
    msaidx_context_destroy(narrow);

    /* No tokens: nothing is read or written, the data pointers may be NULL. */
    msaidx_index_prepare_args empty;
    msaidx_index_prepare_args_init(&empty);
    empty.max_position = 1;
    empty.num_pages = 1;
    empty.page_stride = 128 * 128;
    CHECK_OK(msaidx_index_prepare(context, &empty, NULL));

    free(q_out);
    free(k_cache);
    msaidx_context_destroy(context);
    ip_release(&c);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    cases(&rng);
    validation(&rng);
    return harness_finish("test_index_prepare");
}
