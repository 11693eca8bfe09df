/* msaidx_index_prepare on the cpu backend: every H in {1, 2, 4}, both cache dtypes, FP32 and BF16
 * cos/sin tables and theta (angles computed in the call), fused (strided) and dense inputs,
 * saturating weights, -1 and bad slots, bad positions, against the FP64 evaluation of SPEC.md
 * section 11; then argument validation. */
#include "index_prepare_cases.h"
#include "internal.h"
#include "rope_theta.h"

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
            for (int table = 0; table < IP_ROTATIONS; ++table)
                for (int variant = 0; variant < 8; ++variant) {
                    const ip_spec spec = {
                        .dtype = dtype ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                        .num_heads = heads[h],
                        .num_tokens = (int32_t)harness_int(rng, 1, 200),
                        .num_pages = (int32_t)harness_int(rng, 1, 3),
                        .table = ip_rotation[table],
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
    /* Without a table: theta >= 1 and finite, no table pointer, positions below 2^24. */
    msaidx_index_prepare_args theta = good;
    theta.cos_sin_format = MSAIDX_COS_SIN_THETA;
    theta.cos_sin_cache = NULL;
    theta.rope_theta = 5e6;
    theta.max_position = MSAIDX_ROPE_THETA_MAX_POSITION;
    CHECK_OK(msaidx_index_prepare(context, &theta, NULL));
    a = theta;
    a.rope_theta = 0.5;
    expect_failure(context, &a, MSAIDX_ERROR_INVALID_ARGUMENT, "args.rope_theta");
    a.rope_theta = INFINITY;
    expect_failure(context, &a, MSAIDX_ERROR_INVALID_ARGUMENT, "args.rope_theta");
    a = theta;
    a.cos_sin_cache = c.cos_sin;
    expect_failure(context, &a, MSAIDX_ERROR_INVALID_ARGUMENT, "args.cos_sin_cache");
    a = theta;
    a.max_position = MSAIDX_ROPE_THETA_MAX_POSITION + 1;
    expect_failure(context, &a, MSAIDX_ERROR_INVALID_ARGUMENT, "args.max_position");
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

/* The cos and sin computed from theta (src/rope_theta.h) against FP64 over spread turns, the
 * quarter-turn boundaries and positions up to 2^24 at MiniMax-M3's frequencies: the bound that
 * msaidx.h states, 1.5 FP32 ulps (ulp of the exact value), and 1e-7 absolute. */
static void rope_theta_accuracy(harness_rng *rng) {
    double worst_ulps = 0.0, worst_absolute = 0.0;
    uint64_t turns[MSAIDX_ROPE_PAIRS];
    msaidx_rope_turns(5e6, turns);
    for (long k = 0; k < 600000; ++k) {
        uint64_t turn;
        double exact[2];
        if (k < 200000) { /* a turn anywhere, or next to a quarter; 53 bits, exact in FP64 */
            turn = harness_next(rng);
            if (k % 2) turn = (turn >> 62 << 62) + (uint64_t)harness_int(rng, -(1 << 20), 1 << 20);
            turn = turn >> 11 << 11;
            /* cos and sin of quarter * pi / 2 + r, r = the rest of the turn in radians (exact
             * in FP64 up to the product with pi / 2): no reduction of a large FP64 angle. */
            const unsigned quarter = (unsigned)((turn + ((uint64_t)1 << 61)) >> 62) & 3;
            const double r = ldexp((double)(int64_t)(turn << 2), -64) * 1.5707963267948966;
            const double c = cos(r), s = sin(r);
            const double cos_of[4] = {c, -s, -c, s}, sin_of[4] = {s, c, -s, -c};
            exact[0] = cos_of[quarter];
            exact[1] = sin_of[quarter];
        } else {
            const int pair = (int)(k % MSAIDX_ROPE_PAIRS);
            const uint32_t position =
                (uint32_t)harness_int(rng, 0, MSAIDX_ROPE_THETA_MAX_POSITION - 1);
            turn = turns[pair] * position;
            const double angle = (double)position * pow(5e6, -2.0 * pair / 64.0);
            exact[0] = cos(angle);
            exact[1] = sin(angle);
        }
        float got[2];
        msaidx_rope_cos_sin_of_turn(turn, &got[0], &got[1]);
        for (int i = 0; i < 2; ++i) {
            const double error = fabs(got[i] - exact[i]);
            if (error > worst_absolute) worst_absolute = error;
            /* In ulps on spread turns only: a position's FP64 angle carries its own rounding. */
            if (k < 200000 && exact[i] != 0.0) {
                const double ulp = ldexp(1.0, ilogb(exact[i]) - 23);
                if (error / ulp > worst_ulps) worst_ulps = error / ulp;
            } else if (k < 200000) {
                CHECK(got[i] == 0.0f, "turn %llu: %.9g for an exact 0", (unsigned long long)turn,
                      (double)got[i]);
            }
        }
    }
    printf("rope theta: worst %.2f FP32 ulps, %.3g absolute\n", worst_ulps, worst_absolute);
    CHECK(worst_ulps <= 1.5, "cos/sin from theta: %.2f ulps", worst_ulps);
    CHECK(worst_absolute <= 1e-7, "cos/sin from theta: %.3g absolute", worst_absolute);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    rope_theta_accuracy(&rng);
    cases(&rng);
    validation(&rng);
    return harness_finish("test_index_prepare");
}
