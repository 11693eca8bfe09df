/* msaidx_index_prepare: argument validation shared by the backends, then the host or device pass.
 * The preparation does not depend on the scoring backend, only on where the memory lives. */
#include "internal.h"

#include <math.h>
#include <string.h>

#define PREPARE_HEAD_DIM 128

void msaidx_index_prepare_args_init(msaidx_index_prepare_args *args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->struct_size = sizeof *args;
    args->cos_sin_format = MSAIDX_COS_SIN_FP32;
    args->eps = 1e-6f;
}

/* A token stride (elements) that keeps 16-byte rows aligned and whose last row, at
 * (num_tokens - 1) * stride, stays far from int64 overflow. */
static msaidx_status check_token_stride(int64_t stride, int64_t row_elements, int32_t num_tokens,
                                        const char *name) {
    if (stride < row_elements || stride % 8)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "args.%s = %lld elements: must be a multiple of 8 and >= %lld", name,
                           (long long)stride, (long long)row_elements);
    if (stride > (INT64_MAX / 4) / num_tokens)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "args.%s = %lld elements: %d tokens of it overflow a 64-bit offset",
                           name, (long long)stride, num_tokens);
    return MSAIDX_SUCCESS;
}

static msaidx_status check_args(const msaidx_config *c, const msaidx_index_prepare_args *a) {
    MSAIDX_CHECK(MSAIDX_CHECK_STRUCT_SIZE("args", a, msaidx_index_prepare_args));
    if (c->head_dim != PREPARE_HEAD_DIM)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "context: config.head_dim = %d, index preparation needs 128 (RoPE on "
                           "dims [0, 64))",
                           c->head_dim);
    if (a->num_tokens < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "args.num_tokens = %d: negative",
                           a->num_tokens);
    if (!isfinite(a->eps) || a->eps < 0.0f)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "args.eps = %g: must be finite and >= 0",
                           (double)a->eps);
    const bool theta = a->cos_sin_format == MSAIDX_COS_SIN_THETA;
    if (a->cos_sin_format != MSAIDX_COS_SIN_FP32 && a->cos_sin_format != MSAIDX_COS_SIN_BF16 &&
        !theta)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "args.cos_sin_format = %d: not an msaidx_cos_sin_format",
                           (int)a->cos_sin_format);
    if (theta) {
        if (!isfinite(a->rope_theta) || a->rope_theta < 1.0)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.rope_theta = %g: must be finite and >= 1 with "
                               "MSAIDX_COS_SIN_THETA",
                               a->rope_theta);
        if (a->cos_sin_cache)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.cos_sin_cache: must be NULL with MSAIDX_COS_SIN_THETA (the "
                               "call computes the angles from args.rope_theta)");
        if (a->max_position < 1 || a->max_position > MSAIDX_ROPE_THETA_MAX_POSITION)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.max_position = %lld: must be in [1, %d] with "
                               "MSAIDX_COS_SIN_THETA (MSAIDX_ROPE_THETA_MAX_POSITION)",
                               (long long)a->max_position, MSAIDX_ROPE_THETA_MAX_POSITION);
    } else {
        /* Rows of 64 FP32 entries: a position's byte offset must fit in 64 bits. */
        const int64_t max_rows = INT64_MAX / (64 * (int64_t)sizeof(float));
        if (a->max_position < 1 || a->max_position > max_rows)
            return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                               "args.max_position = %lld: must be in [1, %lld] (rows of "
                               "cos_sin_cache, 64 entries each, within a 64-bit byte offset)",
                               (long long)a->max_position, (long long)max_rows);
    }
    MSAIDX_CHECK(msaidx_check_page_geometry("args", a->num_pages, a->page_stride,
                                            (int64_t)c->page_size * PREPARE_HEAD_DIM *
                                                msaidx_elem_size(c->dtype)));
    if (a->error_word) MSAIDX_CHECK(msaidx_check_pointer(a->error_word, 4, "args.error_word"));
    if (a->num_tokens == 0) return MSAIDX_SUCCESS; /* empty tensors may carry NULL pointers */

    MSAIDX_CHECK(msaidx_check_pointer(a->q_in, 16, "args.q_in"));
    MSAIDX_CHECK(check_token_stride(a->q_in_token_stride, (int64_t)c->num_heads * PREPARE_HEAD_DIM,
                                    a->num_tokens, "q_in_token_stride"));
    MSAIDX_CHECK(msaidx_check_pointer(a->k_in, 16, "args.k_in"));
    MSAIDX_CHECK(check_token_stride(a->k_in_token_stride, PREPARE_HEAD_DIM, a->num_tokens,
                                    "k_in_token_stride"));
    MSAIDX_CHECK(msaidx_check_pointer(a->positions, 8, "args.positions"));
    MSAIDX_CHECK(msaidx_check_pointer(a->q_norm_weight, 16, "args.q_norm_weight"));
    MSAIDX_CHECK(msaidx_check_pointer(a->k_norm_weight, 16, "args.k_norm_weight"));
    if (!theta) MSAIDX_CHECK(msaidx_check_pointer(a->cos_sin_cache, 16, "args.cos_sin_cache"));
    MSAIDX_CHECK(msaidx_check_pointer(a->slot_mapping, 8, "args.slot_mapping"));
    MSAIDX_CHECK(msaidx_check_pointer(a->k_cache, 16, "args.k_cache"));
    MSAIDX_CHECK(msaidx_check_pointer(a->q_out, 16, "args.q_out"));
    /* The outputs apart from each other and from the positions and slots, which index memory. */
    const size_t T = (size_t)a->num_tokens;
    const msaidx_span written[3] = {
        {"args.q_out", a->q_out,
         T * (size_t)c->num_heads * PREPARE_HEAD_DIM * (size_t)msaidx_elem_size(c->dtype)},
        {"args.k_cache", a->k_cache, (size_t)a->num_pages * (size_t)a->page_stride},
        {"args.error_word", a->error_word, sizeof(uint32_t)},
    };
    const msaidx_span indices[2] = {{"args.positions", a->positions, sizeof(int64_t) * T},
                                    {"args.slot_mapping", a->slot_mapping, sizeof(int64_t) * T}};
    for (int i = 0; i < 3; ++i) {
        for (int j = i + 1; j < 3; ++j)
            MSAIDX_CHECK(msaidx_check_disjoint(written[i].name, written[i].pointer,
                                               written[i].bytes, written[j].name,
                                               written[j].pointer, written[j].bytes));
        for (int j = 0; j < 2; ++j)
            MSAIDX_CHECK(msaidx_check_disjoint(written[i].name, written[i].pointer,
                                               written[i].bytes, indices[j].name,
                                               indices[j].pointer, indices[j].bytes));
    }
    return MSAIDX_SUCCESS;
}

void msaidx_rope_turns(double theta, uint64_t turns[MSAIDX_ROPE_PAIRS]) {
    const double two_pi = 6.283185307179586476925;
    for (int i = 0; i < MSAIDX_ROPE_PAIRS; ++i) /* < 2^64 / (2 pi) < 2^62 for theta >= 1 */
        turns[i] =
            (uint64_t)llround(ldexp(pow(theta, -(double)i / MSAIDX_ROPE_PAIRS) / two_pi, 64));
}

msaidx_status msaidx_index_prepare(const msaidx_context *context,
                                   const msaidx_index_prepare_args *args, void *stream) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (!args) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "args: NULL pointer");
    MSAIDX_CHECK(check_args(&context->config, args));
    if (args->num_tokens == 0) return MSAIDX_SUCCESS;
#ifdef MSAIDX_WITH_CUDA
    if (context->ops->on_device) {
        msaidx_device_scope scope;
        MSAIDX_CHECK(msaidx_device_enter(context, &scope));
        return msaidx_device_leave(&scope, msaidx_cuda_index_prepare(context, args, stream));
    }
#endif
    (void)stream;
    return msaidx_cpu_index_prepare(context, args);
}
