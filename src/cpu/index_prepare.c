/* Index Q/K preparation on the host (SPEC.md section 11): RMSNorm, partial NeoX RoPE, cast,
 * paged key insert. The FP32 operations are those of the CUDA kernel in the same order (fused
 * multiply-adds where it fuses, the sum of squares in its lane order), so the two agree bitwise. */
#include "cpu.h"

#include "../convert.h"
#include "../rope_theta.h"

#include <math.h>

enum {
    HEAD_DIM = 128,
    ROTARY_HALF = 32, /* NeoX pairs (d, d + 32) for d < 32: dims [0, 64) rotate */
    LANES = 8,        /* the CUDA kernel's lanes per vector */
    LANE_PAIRS = 4,   /* lane q: the pairs of dims [4 q, 4 q + 4) */
    PASS_FIRST = 64,  /* and the pass-through dims [64 + 8 q, 64 + 8 q + 8) */
    LANE_PASS = 8
};

/* The functions below are inlined into prepare_vector_plain and rope_row_plain and, where x86
 * builds lack -mfma, into clones for CPUs with FMA: without it every fmaf is a call into libm
 * (about 2.5x the time of a whole call at T = 4096, H = 4 on a 2-core Zen 5), with it an
 * instruction in vectorized loops. Both round each fused multiply-add once, so the clones agree
 * bitwise. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__FMA__)
#define PREPARE_FMA_CLONE 1
#endif
#define PREPARE_INLINE static inline __attribute__((always_inline))

/* sum_d x[d]^2 as the CUDA kernel sums it: per lane, its 16 dims (first half, second half,
 * pass-through) in order as fused multiply-adds, then the 8 lanes pairwise. */
PREPARE_INLINE float sum_of_squares(const float *x) {
    float partial[LANES];
    for (int lane = 0; lane < LANES; ++lane) {
        const float *first = x + LANE_PAIRS * lane, *second = first + ROTARY_HALF;
        const float *pass = x + PASS_FIRST + LANE_PASS * lane;
        float sum = 0.0f;
        for (int i = 0; i < LANE_PAIRS; ++i) sum = fmaf(first[i], first[i], sum);
        for (int i = 0; i < LANE_PAIRS; ++i) sum = fmaf(second[i], second[i], sum);
        for (int i = 0; i < LANE_PASS; ++i) sum = fmaf(pass[i], pass[i], sum);
        partial[lane] = sum;
    }
    for (int width = 1; width < LANES; width *= 2)
        for (int lane = 0; lane < LANES; lane += 2 * width)
            partial[lane] = partial[lane] + partial[lane + width];
    return partial[0];
}

/* One 128-wide vector: BF16 in -> normalised, rotated FP32 out. y = u (1 + w) is u + u w in one
 * rounding, u = x / rms. */
PREPARE_INLINE void prepare_vector(const uint16_t *in, const float *weight, const float *cos_sin,
                                   float eps, float *out) {
    float x[HEAD_DIM], y[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) x[d] = msaidx_bf16_decode(in[d]);
    const float inverse_rms = 1.0f / sqrtf(fmaf(sum_of_squares(x), 1.0f / HEAD_DIM, eps));
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float u = x[d] * inverse_rms;
        y[d] = fmaf(u, weight[d], u);
    }
    const float *cos = cos_sin, *sin = cos_sin + ROTARY_HALF;
    for (int d = 0; d < ROTARY_HALF; ++d) {
        const float first = y[d], second = y[d + ROTARY_HALF];
        out[d] = fmaf(first, cos[d], -(second * sin[d]));
        out[d + ROTARY_HALF] = fmaf(second, cos[d], first * sin[d]);
    }
    for (int d = 2 * ROTARY_HALF; d < HEAD_DIM; ++d) out[d] = y[d];
}

typedef void (*prepare_vector_fn)(const uint16_t *in, const float *weight, const float *cos_sin,
                                  float eps, float *out);

static void prepare_vector_plain(const uint16_t *in, const float *weight, const float *cos_sin,
                                 float eps, float *out) {
    prepare_vector(in, weight, cos_sin, eps, out);
}

#ifdef PREPARE_FMA_CLONE
__attribute__((target("fma"))) static void prepare_vector_fma(const uint16_t *in,
                                                              const float *weight,
                                                              const float *cos_sin, float eps,
                                                              float *out) {
    prepare_vector(in, weight, cos_sin, eps, out);
}
#endif

/* MSAIDX_COS_SIN_THETA: a position's [cos(32) | sin(32)] as the CUDA kernel computes them. */
PREPARE_INLINE void rope_row(const uint64_t *turns, uint32_t position, float *cos_sin) {
    for (int d = 0; d < ROTARY_HALF; ++d)
        msaidx_rope_cos_sin(turns[d], position, &cos_sin[d], &cos_sin[ROTARY_HALF + d]);
}

typedef void (*rope_row_fn)(const uint64_t *turns, uint32_t position, float *cos_sin);

static void rope_row_plain(const uint64_t *turns, uint32_t position, float *cos_sin) {
    rope_row(turns, position, cos_sin);
}

#ifdef PREPARE_FMA_CLONE
__attribute__((target("fma"))) static void rope_row_fma(const uint64_t *turns, uint32_t position,
                                                        float *cos_sin) {
    rope_row(turns, position, cos_sin);
}
#endif

#ifdef PREPARE_FMA_CLONE
static bool cpu_has_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("fma");
}
#endif

static prepare_vector_fn select_prepare_vector(void) {
#ifdef PREPARE_FMA_CLONE
    if (cpu_has_fma()) return prepare_vector_fma;
#endif
    return prepare_vector_plain;
}

static rope_row_fn select_rope_row(void) {
#ifdef PREPARE_FMA_CLONE
    if (cpu_has_fma()) return rope_row_fma;
#endif
    return rope_row_plain;
}

static void store_vector(msaidx_dtype dtype, const float *values, void *dst) {
    if (dtype == MSAIDX_DTYPE_E4M3) {
        uint8_t *codes = dst;
        for (int d = 0; d < HEAD_DIM; ++d) codes[d] = msaidx_e4m3_encode(values[d]);
    } else {
        uint16_t *bits = dst;
        for (int d = 0; d < HEAD_DIM; ++d) bits[d] = msaidx_bf16_encode(values[d]);
    }
}

static bool position_ok(const msaidx_index_prepare_args *a, int32_t t) {
    return a->positions[t] >= 0 && a->positions[t] < a->max_position;
}

static bool slot_ok(int64_t slot, int64_t num_slots) { return slot >= -1 && slot < num_slots; }

msaidx_status msaidx_cpu_index_prepare(const msaidx_context *context,
                                       const msaidx_index_prepare_args *a) {
    const msaidx_config *config = &context->config;
    const int32_t num_heads = config->num_heads;
    const int32_t elem = msaidx_elem_size(config->dtype);
    const int64_t num_slots = (int64_t)a->num_pages * config->page_size;

    /* Bad tokens first, in order, so the message names the first one. */
    int32_t first_bad = -1, bad_tokens = 0;
    uint32_t bad_bits = 0;
    for (int32_t t = 0; t < a->num_tokens; ++t) {
        uint32_t bits = 0;
        if (!position_ok(a, t)) bits |= MSAIDX_BAD_PREPARE_POSITION;
        if (!slot_ok(a->slot_mapping[t], num_slots)) bits |= MSAIDX_BAD_PREPARE_SLOT;
        if (!bits) continue;
        if (first_bad < 0) first_bad = t;
        ++bad_tokens;
        bad_bits |= bits;
    }

    const bool theta = a->cos_sin_format == MSAIDX_COS_SIN_THETA;
    uint64_t turns[MSAIDX_ROPE_PAIRS];
    if (theta) msaidx_rope_turns(a->rope_theta, turns);
    const prepare_vector_fn prepare = select_prepare_vector();
    const rope_row_fn rope = select_rope_row();
    float q_weight[HEAD_DIM], k_weight[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) {
        q_weight[d] = msaidx_bf16_decode(((const uint16_t *)a->q_norm_weight)[d]);
        k_weight[d] = msaidx_bf16_decode(((const uint16_t *)a->k_norm_weight)[d]);
    }

#ifdef _OPENMP
#pragma omp parallel for schedule(static)                                                          \
    num_threads(msaidx_cpu_threads(config)) if (a->num_tokens >= 64)
#endif
    for (int32_t t = 0; t < a->num_tokens; ++t) {
        const int64_t position = a->positions[t]; /* read once: checked and used */
        if (position < 0 || position >= a->max_position) continue;
        float cos_sin[2 * ROTARY_HALF], values[HEAD_DIM];
        const size_t row = (size_t)position * 2 * ROTARY_HALF;
        if (theta)
            rope(turns, (uint32_t)position, cos_sin);
        else
            for (int d = 0; d < 2 * ROTARY_HALF; ++d)
                cos_sin[d] =
                    a->cos_sin_format == MSAIDX_COS_SIN_FP32
                        ? ((const float *)a->cos_sin_cache)[row + d]
                        : msaidx_bf16_decode(((const uint16_t *)a->cos_sin_cache)[row + d]);
        const uint16_t *q_in = (const uint16_t *)a->q_in + (size_t)t * a->q_in_token_stride;
        for (int32_t h = 0; h < num_heads; ++h) {
            prepare(q_in + (size_t)h * HEAD_DIM, q_weight, cos_sin, a->eps, values);
            store_vector(config->dtype, values,
                         (char *)a->q_out + ((size_t)t * num_heads + h) * HEAD_DIM * elem);
        }
        const int64_t slot = a->slot_mapping[t];
        if (slot < 0 || slot >= num_slots) continue; /* -1: no key to insert; others reported */
        const uint16_t *k_in = (const uint16_t *)a->k_in + (size_t)t * a->k_in_token_stride;
        prepare(k_in, k_weight, cos_sin, a->eps, values);
        const int64_t page = slot / config->page_size, offset = slot % config->page_size;
        store_vector(config->dtype, values,
                     (char *)a->k_cache + page * a->page_stride + offset * HEAD_DIM * elem);
    }

    if (!bad_bits) return MSAIDX_SUCCESS;
    if (a->error_word) *a->error_word |= bad_bits;
    if (!position_ok(a, first_bad))
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "positions[%d] = %lld: outside [0, args.max_position = %lld); the token "
                           "was skipped (%d bad token(s) in all, the good ones were written)",
                           first_bad, (long long)a->positions[first_bad],
                           (long long)a->max_position, bad_tokens);
    return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                       "slot_mapping[%d] = %lld: outside the cache's [0, %lld) slots and not -1; "
                       "its key was not written (%d bad token(s) in all, the good ones were "
                       "written)",
                       first_bad, (long long)a->slot_mapping[first_bad], (long long)num_slots,
                       bad_tokens);
}
