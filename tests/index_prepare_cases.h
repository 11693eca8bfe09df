/* Index Q/K preparation cases shared by tests/test_index_prepare.c (cpu) and
 * tests/gpu_index_prepare.c: a random case builder (fused-projection slices, distinct slots with
 * -1 and bad ones, padded pages, poisoned outputs; FP32 and BF16 tables and theta), an FP64
 * evaluation of SPEC.md section 11
 * written from the spec alone, and the judge: each element is the FP64 value's rounding to the
 * output format, one step away only where the FP32 evaluation's error reaches the boundary
 * between the two (ip_judge_vector). */
#ifndef MSAIDX_TEST_INDEX_PREPARE_CASES_H
#define MSAIDX_TEST_INDEX_PREPARE_CASES_H

#include "backend_cases.h"
#include "convert_oracle.h"
#include "harness.h"
#include "msaidx.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { IP_DIM = 128, IP_PAGE = 128, IP_POISON = 0xA5, IP_GUARD_BYTES = 4096 };

/* Where a case's angles come from: each table dtype, and theta. */
enum { IP_ROTATIONS = 3 };
static const msaidx_cos_sin_format ip_rotation[IP_ROTATIONS] = {
    MSAIDX_COS_SIN_FP32, MSAIDX_COS_SIN_BF16, MSAIDX_COS_SIN_THETA};

typedef struct ip_spec {
    msaidx_dtype dtype;
    int32_t num_heads, num_tokens, num_pages;
    msaidx_cos_sin_format table; /* or MSAIDX_COS_SIN_THETA: no table */
    bool fused;      /* q_in and k_in are slices of one [T, W] projection (else dense buffers) */
    bool saturate;   /* norm weights large enough that |y| exceeds 448 */
    bool bad_tokens; /* some positions and slots outside their ranges */
} ip_spec;

/* Host buffers of one case. Output buffers hold the poison plus IP_GUARD_BYTES past their end. */
typedef struct ip_case {
    ip_spec spec;
    int64_t q_stride, k_stride; /* elements */
    uint16_t *q_in, *k_in;      /* into `input` */
    uint16_t *input;
    size_t input_elems;
    int64_t *positions, *slots;
    _Alignas(16) uint16_t q_weight[IP_DIM];
    _Alignas(16) uint16_t k_weight[IP_DIM];
    void *cos_sin; /* NULL with MSAIDX_COS_SIN_THETA */
    double rope_theta;
    int64_t max_position;
    size_t cos_sin_bytes;
    int64_t page_stride;
    size_t q_out_bytes, k_cache_bytes; /* without the guard */
    uint32_t expected_bits;            /* MSAIDX_BAD_PREPARE_* the case must report */
    int32_t first_bad;                 /* lowest bad token, -1 if none */
} ip_case;

static inline size_t ip_elem(const ip_case *c) {
    return c->spec.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
}

static inline void *ip_alloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) exit(2);
    return p;
}

static inline uint16_t ip_bf16_of(double v) { return bf16_oracle((float)v); }

static inline void ip_build(ip_case *c, const ip_spec *spec, harness_rng *rng) {
    memset(c, 0, sizeof *c);
    c->spec = *spec;
    const int32_t T = spec->num_tokens, H = spec->num_heads;
    /* A fused projection row: [q heads | k | 64 more columns], as engines slice it. */
    const int64_t width = (int64_t)H * IP_DIM + IP_DIM + 64;
    c->q_stride = spec->fused ? width : (int64_t)H * IP_DIM;
    c->k_stride = spec->fused ? width : IP_DIM;
    const size_t q_elems = (size_t)T * c->q_stride, k_elems = (size_t)T * c->k_stride;
    c->input_elems = spec->fused ? q_elems : q_elems + k_elems;
    c->input = ip_alloc(sizeof(uint16_t) * (c->input_elems + 8));
    c->q_in = c->input;
    c->k_in = spec->fused ? c->input + (size_t)H * IP_DIM : c->input + q_elems;
    /* Per-vector scales spread the magnitudes; a few vectors are all zero (eps matters). */
    for (size_t i = 0; i < c->input_elems; i += IP_DIM) {
        const double scale = harness_int(rng, 0, 40) == 0 ? 0.0 : exp(harness_uniform(rng, -6, 6));
        for (size_t d = 0; d < IP_DIM && i + d < c->input_elems; ++d)
            c->input[i + d] = ip_bf16_of(scale * harness_normal(rng));
    }
    for (int d = 0; d < IP_DIM; ++d) {
        const double big = spec->saturate ? harness_uniform(rng, 300, 600) : 0.0;
        c->q_weight[d] = ip_bf16_of(big + 0.5 * harness_normal(rng));
        c->k_weight[d] = ip_bf16_of(big + 0.5 * harness_normal(rng));
    }

    /* MiniMax-M3's table: theta 5e6, inverse frequencies theta^(-2i/64), [cos | sin]. Without a
     * table, any theta and positions up to the largest admitted. */
    const bool theta = spec->table == MSAIDX_COS_SIN_THETA;
    c->rope_theta = theta && harness_int(rng, 0, 1) ? exp(harness_uniform(rng, 0.0, 18.0)) : 5e6;
    c->max_position =
        theta && harness_int(rng, 0, 1)
            ? harness_int(rng, MSAIDX_ROPE_THETA_MAX_POSITION / 2, MSAIDX_ROPE_THETA_MAX_POSITION)
            : harness_int(rng, 1, 4096);
    const size_t table_elems = theta ? 0 : (size_t)c->max_position * 64;
    c->cos_sin_bytes = table_elems * (spec->table == MSAIDX_COS_SIN_FP32 ? 4 : 2);
    c->cos_sin = theta ? NULL : ip_alloc(c->cos_sin_bytes);
    double inverse_frequency[32];
    for (int i = 0; i < 32; ++i) inverse_frequency[i] = pow(5e6, -2.0 * i / 64.0);
    for (int64_t p = 0; p < (theta ? 0 : c->max_position); ++p)
        for (int i = 0; i < 32; ++i) {
            const double angle = (double)p * inverse_frequency[i];
            const size_t at = (size_t)p * 64 + i;
            if (spec->table == MSAIDX_COS_SIN_FP32) {
                ((float *)c->cos_sin)[at] = (float)cos(angle);
                ((float *)c->cos_sin)[at + 32] = (float)sin(angle);
            } else {
                ((uint16_t *)c->cos_sin)[at] = ip_bf16_of(cos(angle));
                ((uint16_t *)c->cos_sin)[at + 32] = ip_bf16_of(sin(angle));
            }
        }

    /* Distinct slots (a shuffled prefix of the cache), some -1; bad ones when asked. */
    const int64_t num_slots = (int64_t)spec->num_pages * IP_PAGE;
    int64_t *order = malloc(sizeof(int64_t) * (size_t)num_slots);
    c->positions = malloc(sizeof(int64_t) * (size_t)(T > 0 ? T : 1));
    c->slots = malloc(sizeof(int64_t) * (size_t)(T > 0 ? T : 1));
    if (!order || !c->positions || !c->slots) exit(2);
    for (int64_t s = 0; s < num_slots; ++s) order[s] = s;
    for (int64_t s = num_slots - 1; s > 0; --s) {
        const int64_t j = harness_int(rng, 0, s), kept = order[s];
        order[s] = order[j];
        order[j] = kept;
    }
    c->first_bad = -1;
    for (int32_t t = 0; t < T; ++t) {
        c->positions[t] = harness_int(rng, 0, c->max_position - 1);
        c->slots[t] = t < num_slots && harness_int(rng, 0, 9) ? order[t] : -1;
        if (spec->bad_tokens && harness_int(rng, 0, 15) == 0) {
            const int kind = (int)harness_int(rng, 0, 3);
            if (kind == 0)
                c->positions[t] = c->max_position + harness_int(rng, 0, 3);
            else if (kind == 1)
                c->positions[t] = -harness_int(rng, 1, 1000);
            else if (kind == 2)
                c->slots[t] = num_slots + harness_int(rng, 0, 1000);
            else
                c->slots[t] = -harness_int(rng, 2, INT64_MAX / 2);
            c->expected_bits |= kind < 2 ? MSAIDX_BAD_PREPARE_POSITION : MSAIDX_BAD_PREPARE_SLOT;
            if (c->first_bad < 0) c->first_bad = t;
        }
    }
    free(order);

    c->page_stride = (int64_t)IP_PAGE * IP_DIM * (int64_t)ip_elem(c) + 16 * harness_int(rng, 0, 3);
    c->q_out_bytes = (size_t)T * H * IP_DIM * ip_elem(c);
    c->k_cache_bytes = (size_t)spec->num_pages * (size_t)c->page_stride;
}

static inline void ip_release(ip_case *c) {
    free(c->input);
    free(c->positions);
    free(c->slots);
    free(c->cos_sin);
    memset(c, 0, sizeof *c);
}

/* Output buffers (poisoned, with a guard) in host memory. */
static inline void ip_poisoned(const ip_case *c, uint8_t **q_out, uint8_t **k_cache) {
    *q_out = ip_alloc(c->q_out_bytes + IP_GUARD_BYTES);
    *k_cache = ip_alloc(c->k_cache_bytes + IP_GUARD_BYTES);
    memset(*q_out, IP_POISON, c->q_out_bytes + IP_GUARD_BYTES);
    memset(*k_cache, IP_POISON, c->k_cache_bytes + IP_GUARD_BYTES);
}

/* The arguments over buffers at the given addresses (host or device copies of the case). */
static inline msaidx_index_prepare_args ip_args(const ip_case *c, const uint16_t *input,
                                                const int64_t *positions, const int64_t *slots,
                                                const uint16_t *q_weight, const uint16_t *k_weight,
                                                const void *cos_sin, void *q_out, void *k_cache,
                                                uint32_t *error_word) {
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    a.num_tokens = c->spec.num_tokens;
    a.q_in = input + (c->q_in - c->input);
    a.q_in_token_stride = c->q_stride;
    a.k_in = input + (c->k_in - c->input);
    a.k_in_token_stride = c->k_stride;
    a.positions = positions;
    a.q_norm_weight = q_weight;
    a.k_norm_weight = k_weight;
    a.cos_sin_cache = c->spec.table == MSAIDX_COS_SIN_THETA ? NULL : cos_sin;
    a.cos_sin_format = c->spec.table;
    a.rope_theta = c->rope_theta;
    a.max_position = c->max_position;
    a.slot_mapping = slots;
    a.k_cache = k_cache;
    a.page_stride = c->page_stride;
    a.num_pages = c->spec.num_pages;
    a.q_out = q_out;
    a.error_word = error_word;
    return a;
}

static inline msaidx_context *ip_context(const ip_case *c, int32_t device) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = c->spec.num_heads;
    config.dtype = c->spec.dtype;
    config.device = device;
    msaidx_context *context = NULL;
    if (msaidx_context_create(&context, &config) != MSAIDX_SUCCESS) {
        fprintf(stderr, "context: %s\n", msaidx_last_error());
        exit(1);
    }
    return context;
}

/* SPEC section 11 steps 1-3 in FP64 for one vector; magnitude[d] is the sum of the magnitudes of
 * the terms that make out[d] (what FP32 rounding errors scale with). */
static inline void ip_reference(const ip_case *c, const uint16_t *in, const uint16_t *weight,
                                int64_t position, double *out, double *magnitude) {
    double x[IP_DIM], y[IP_DIM], squares = 0.0;
    for (int d = 0; d < IP_DIM; ++d) {
        x[d] = bc_bf16_value(in[d]);
        squares += x[d] * x[d];
    }
    const double inverse_rms = 1.0 / sqrt(squares / IP_DIM + (double)1e-6f);
    for (int d = 0; d < IP_DIM; ++d) y[d] = x[d] * inverse_rms * (1.0 + bc_bf16_value(weight[d]));
    for (int d = 0; d < 32; ++d) {
        const size_t at = (size_t)position * 64 + d;
        const bool fp32 = c->spec.table == MSAIDX_COS_SIN_FP32;
        double cs, sn;
        if (c->spec.table == MSAIDX_COS_SIN_THETA) {
            const double angle = (double)position * pow(c->rope_theta, -2.0 * d / 64.0);
            cs = cos(angle);
            sn = sin(angle);
        } else {
            cs = fp32 ? ((const float *)c->cos_sin)[at]
                      : bc_bf16_value(((const uint16_t *)c->cos_sin)[at]);
            sn = fp32 ? ((const float *)c->cos_sin)[at + 32]
                      : bc_bf16_value(((const uint16_t *)c->cos_sin)[at + 32]);
        }
        out[d] = y[d] * cs - y[d + 32] * sn;
        out[d + 32] = y[d + 32] * cs + y[d] * sn;
        magnitude[d] = fabs(y[d] * cs) + fabs(y[d + 32] * sn);
        magnitude[d + 32] = fabs(y[d + 32] * cs) + fabs(y[d] * sn);
    }
    for (int d = 64; d < IP_DIM; ++d) {
        out[d] = y[d];
        magnitude[d] = fabs(y[d]);
    }
}

/* Signed position of a stored value on its format's number line (NaN: INT32_MIN). */
static inline int32_t ip_ordinal_stored(msaidx_dtype dtype, const uint8_t *at) {
    if (dtype == MSAIDX_DTYPE_E4M3) {
        const uint8_t code = at[0];
        if ((code & 0x7F) == 0x7F) return INT32_MIN;
        return code & 0x80 ? -(int32_t)(code & 0x7F) : (int32_t)(code & 0x7F);
    }
    uint16_t bits;
    memcpy(&bits, at, 2);
    if ((bits & 0x7FFF) > 0x7F80) return INT32_MIN;
    return bits & 0x8000 ? -(int32_t)(bits & 0x7FFF) : (int32_t)(bits & 0x7FFF);
}

static inline double ip_stored_value(msaidx_dtype dtype, const uint8_t *at) {
    if (dtype == MSAIDX_DTYPE_E4M3) return bc_e4m3_value(at[0]);
    uint16_t bits;
    memcpy(&bits, at, 2);
    return bc_bf16_value(bits);
}

/* Ordinal of the FP64 value rounded to the format: RNE, E4M3 saturating to 448. */
static inline int32_t ip_ordinal_rounded(msaidx_dtype dtype, const e4m3_table *table, double v) {
    const double magnitude = fabs(v);
    int32_t position;
    if (dtype == MSAIDX_DTYPE_E4M3) {
        position = magnitude >= 448.0
                       ? 0x7E
                       : e4m3_round_between(table, e4m3_floor_code(table, magnitude), magnitude);
    } else {
        int exponent;
        frexp(magnitude, &exponent); /* magnitude in [2^(e-1), 2^e): BF16 steps of 2^(e-8) */
        const double step = ldexp(1.0, exponent - 8 < -133 ? -133 : exponent - 8);
        const float rounded = (float)(nearbyint(magnitude / step) * step); /* exact in BF16 */
        uint32_t bits;
        memcpy(&bits, &rounded, 4);
        position = (int32_t)(bits >> 16);
    }
    return signbit(v) ? -position : position;
}

/* The value at a signed position of ip_ordinal_stored / ip_ordinal_rounded. */
static inline double ip_ordinal_value(msaidx_dtype dtype, int32_t ordinal) {
    const uint32_t position = (uint32_t)(ordinal < 0 ? -ordinal : ordinal);
    if (dtype == MSAIDX_DTYPE_E4M3)
        return bc_e4m3_value((uint8_t)(position | (ordinal < 0 ? 0x80u : 0u)));
    return bc_bf16_value((uint16_t)(position | (ordinal < 0 ? 0x8000u : 0u)));
}

/* What judging one output vector found. */
typedef struct ip_tally {
    long elements, exact, one_step, fp32_cancellation, wrong;
    long saturated; /* E4M3 elements whose FP64 value exceeds 448 */
} ip_tally;

/* One stored vector against the FP64 reference, whose correct rounding it must be, with two
 * allowances for the FP32 evaluation's own error (2^-20 of the magnitudes of the terms):
 * - one step away only where the FP64 value lies within that error of the rounding boundary
 *   between the two steps (FP32 may land on either side of it);
 * - any distance where the stored value is within that error of the FP64 value: RoPE's
 *   difference of two products can cancel to far below the terms, and there BF16's steps are
 *   finer than the FP32 rounding of the terms. Counted apart. */
static inline void ip_judge_vector(const ip_case *c, const e4m3_table *table, const uint8_t *stored,
                                   const double *ref, const double *magnitude, ip_tally *tally,
                                   const char *what, int32_t t, int32_t h) {
    const msaidx_dtype dtype = c->spec.dtype;
    const size_t elem = ip_elem(c);
    for (int d = 0; d < IP_DIM; ++d) {
        const int32_t got = ip_ordinal_stored(dtype, stored + d * elem);
        const int32_t want = ip_ordinal_rounded(dtype, table, ref[d]);
        ++tally->elements;
        tally->saturated += dtype == MSAIDX_DTYPE_E4M3 && fabs(ref[d]) > 448.0;
        const int64_t distance = got == INT32_MIN ? INT64_MAX : llabs((int64_t)got - want);
        const double fp32_error = ldexp(magnitude[d], -20);
        if (distance == 0)
            ++tally->exact;
        else if (distance == 1 &&
                 fabs(ref[d] - 0.5 * (ip_ordinal_value(dtype, got) +
                                      ip_ordinal_value(dtype, want))) <= fp32_error)
            ++tally->one_step;
        else if (got != INT32_MIN &&
                 fabs(ip_stored_value(dtype, stored + d * elem) - ref[d]) <= fp32_error)
            ++tally->fp32_cancellation;
        else {
            ++tally->wrong;
            CHECK(false, "%s t=%d h=%d d=%d: stored %.9g (ordinal %d), FP64 %.9g (ordinal %d)",
                  what, t, h, d, ip_stored_value(dtype, stored + d * elem), got, ref[d], want);
        }
    }
}

/* Judges every output of a case against FP64, and that nothing else changed: q_out rows of tokens
 * with a bad position, cache slots no good key maps to, page padding and both guards keep the
 * poison. */
static inline void ip_judge(const ip_case *c, const uint8_t *q_out, const uint8_t *k_cache,
                            ip_tally *tally) {
    e4m3_table table;
    e4m3_table_init(&table);
    const int32_t T = c->spec.num_tokens, H = c->spec.num_heads;
    const size_t elem = ip_elem(c), vector_bytes = IP_DIM * elem;
    const int64_t num_slots = (int64_t)c->spec.num_pages * IP_PAGE;
    uint8_t *expected_cache = malloc(c->k_cache_bytes + IP_GUARD_BYTES);
    if (!expected_cache) exit(2);
    memset(expected_cache, IP_POISON, c->k_cache_bytes + IP_GUARD_BYTES);
    double ref[IP_DIM], magnitude[IP_DIM];
    long untouched_wrong = 0;
    for (int32_t t = 0; t < T; ++t) {
        const bool position_ok = c->positions[t] >= 0 && c->positions[t] < c->max_position;
        for (int32_t h = 0; h < H; ++h) {
            const uint8_t *row = q_out + ((size_t)t * H + h) * vector_bytes;
            if (!position_ok) {
                for (size_t i = 0; i < vector_bytes; ++i) untouched_wrong += row[i] != IP_POISON;
                continue;
            }
            ip_reference(c, c->q_in + (size_t)t * c->q_stride + (size_t)h * IP_DIM, c->q_weight,
                         c->positions[t], ref, magnitude);
            ip_judge_vector(c, &table, row, ref, magnitude, tally, "q_out", t, h);
        }
        const int64_t slot = c->slots[t];
        if (!position_ok || slot < 0 || slot >= num_slots) continue;
        const size_t at = (size_t)(slot / IP_PAGE) * (size_t)c->page_stride +
                          (size_t)(slot % IP_PAGE) * vector_bytes;
        ip_reference(c, c->k_in + (size_t)t * c->k_stride, c->k_weight, c->positions[t], ref,
                     magnitude);
        ip_judge_vector(c, &table, k_cache + at, ref, magnitude, tally, "k_cache", t, H);
        memcpy(expected_cache + at, k_cache + at, vector_bytes); /* judged just now */
    }
    for (size_t i = 0; i < IP_GUARD_BYTES; ++i)
        untouched_wrong += q_out[c->q_out_bytes + i] != IP_POISON;
    for (size_t i = 0; i < c->k_cache_bytes + IP_GUARD_BYTES; ++i)
        untouched_wrong += k_cache[i] != expected_cache[i];
    CHECK(untouched_wrong == 0, "%ld bytes outside the written rows and slots changed",
          untouched_wrong);
    free(expected_cache);
}

static inline void ip_tally_print(const char *name, const ip_tally *tally) {
    printf("%s: %ld elements: %ld exact roundings, %ld one step away, %ld within FP32 "
           "cancellation error, %ld wrong (%ld E4M3 elements beyond 448)\n",
           name, tally->elements, tally->exact, tally->one_step, tally->fp32_cancellation,
           tally->wrong, tally->saturated);
}

#endif
