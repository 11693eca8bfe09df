#include "backend_cases.h"

#include "cpu/cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void bc_poison(float *scores, size_t count) {
    const uint32_t bits = BC_POISON_BITS;
    for (size_t i = 0; i < count; ++i) memcpy(&scores[i], &bits, sizeof bits);
}

bool bc_is_poison(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits == BC_POISON_BITS;
}

double bc_e4m3_value(uint8_t code) {
    const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
    if (exponent == 15 && mantissa == 7) return NAN;
    const double magnitude =
        exponent == 0 ? ldexp(mantissa, -9) : ldexp(8 + mantissa, exponent - 7 - 3);
    return sign ? -magnitude : magnitude;
}

double bc_bf16_value(uint16_t bits) {
    const int sign = bits >> 15, exponent = (bits >> 7) & 255, mantissa = bits & 127;
    double magnitude;
    if (exponent == 255)
        magnitude = mantissa ? NAN : INFINITY;
    else if (exponent == 0)
        magnitude = ldexp(mantissa, -133);
    else
        magnitude = ldexp(128 + mantissa, exponent - 127 - 7);
    return sign ? -magnitude : magnitude;
}

double bc_elem_value(msaidx_dtype dtype, const void *base, size_t index) {
    if (dtype == MSAIDX_DTYPE_BF16) return bc_bf16_value(((const uint16_t *)base)[index]);
    return bc_e4m3_value(((const uint8_t *)base)[index]);
}

static size_t elem_bytes(msaidx_dtype dtype) { return dtype == MSAIDX_DTYPE_BF16 ? 2 : 1; }

static void *track(bc_batch *batch, void *pointer) {
    for (int i = 0; i < 8; ++i)
        if (!batch->allocations[i]) {
            batch->allocations[i] = pointer;
            return pointer;
        }
    abort(); /* test bug: too many buffers */
}

static void *aligned_zeroed(bc_batch *batch, size_t bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64 + 64;
    void *pointer = aligned_alloc(64, rounded);
    if (!pointer) {
        fprintf(stderr, "out of memory (%zu bytes)\n", rounded);
        exit(2);
    }
    memset(pointer, 0, rounded);
    return track(batch, pointer);
}

/* int32 array whose address is 4 mod 16: the API promises 4-byte alignment only. */
static int32_t *misaligned_ints(bc_batch *batch, size_t count) {
    return (int32_t *)aligned_zeroed(batch, sizeof(int32_t) * (count + 4)) + 1;
}

static void store_elem(msaidx_dtype dtype, void *base, size_t index, float value) {
    if (dtype == MSAIDX_DTYPE_BF16)
        msaidx_bf16_from_float(&value, (uint16_t *)base + index, 1);
    else
        msaidx_e4m3_from_float(&value, (uint8_t *)base + index, 1);
}

/* A value a correct backend never reads: NaN in E4M3 / BF16. */
static void store_nan(msaidx_dtype dtype, void *base, size_t index) {
    if (dtype == MSAIDX_DTYPE_BF16)
        ((uint16_t *)base)[index] = 0x7FC1;
    else
        ((uint8_t *)base)[index] = 0x7F;
}

/* E4M3- and BF16-exact constants; q = 1 turns them into strictly ordered exact scores. */
static const float distinct_values[] = {1,  2,  3,  4,  5,  6,  7,  8,  9,   10,  11,  12, 13, 14,
                                        15, 16, 18, 20, 22, 24, 26, 28, 30,  32,  36,  40, 44, 48,
                                        52, 56, 60, 64, 72, 80, 88, 96, 104, 112, 120, 128};
#define NUM_DISTINCT ((int32_t)(sizeof distinct_values / sizeof distinct_values[0]))

static void shuffle(int32_t *values, int32_t n, harness_rng *rng) {
    for (int32_t i = n - 1; i > 0; --i) {
        int32_t j = (int32_t)harness_int(rng, 0, i), swap = values[i];
        values[i] = values[j];
        values[j] = swap;
    }
}

static int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

/*
 * NaN inputs (README "NaN in the inputs"): per request, one element of the first token's head-0
 * query (every dot of that row is NaN: the whole row scores -inf), one element of key 0 (that key
 * drops out of page 0's max), and one element of every key of page 1 (the page scores -inf; it
 * is whole for rows past it and the causal page for rows inside it).
 */
static void plant_nans(bc_batch *batch, harness_rng *rng) {
    const bc_spec *spec = &batch->spec;
    const int32_t H = spec->num_heads, D = spec->head_dim, P = spec->page_size;
    const size_t page_elems = (size_t)batch->desc.page_stride / elem_bytes(spec->dtype);
    for (int32_t b = 0; b < spec->batch_size; ++b) {
        const int32_t first = batch->cu_seqlens_q[b], pages = ceil_div(batch->seq_lens[b], P);
        const int32_t *row = batch->block_table + (size_t)b * batch->desc.bt_stride;
        if (spec->q_lens[b] > 0)
            store_nan(spec->dtype, batch->q,
                      (size_t)first * H * D + (size_t)harness_int(rng, 0, D - 1));
        if (pages > 0)
            store_nan(spec->dtype, batch->k_cache,
                      (size_t)row[0] * page_elems + (size_t)harness_int(rng, 0, D - 1));
        for (int32_t j = 0; pages > 1 && j < P && P + j < batch->seq_lens[b]; ++j)
            store_nan(spec->dtype, batch->k_cache,
                      (size_t)row[1] * page_elems + (size_t)j * D +
                          (size_t)harness_int(rng, 0, D - 1));
    }
}

/*
 * Subnormal inputs (BF16): products of a subnormal with a value near 2^124 reach 2^-9 .. 2^-2,
 * far above the exact tolerance, so a scorer that flushes subnormals to zero fails. Request 0's
 * queries hold one in dimension 0 (every key of its pages 2^124 there); the other requests' keys
 * hold one in dimension 1 on every third page (zero there on the others, queries 2^124), so a
 * scorer meets them part way through a row.
 */
static void plant_subnormals(bc_batch *batch, harness_rng *rng) {
    const bc_spec *spec = &batch->spec;
    const int32_t H = spec->num_heads, D = spec->head_dim, P = spec->page_size;
    const size_t page_elems = (size_t)batch->desc.page_stride / elem_bytes(spec->dtype);
    uint16_t *q = batch->q, *k = batch->k_cache;
    const uint16_t big = 0x7D80; /* 2^124 */
    for (int32_t b = 0; b < spec->batch_size; ++b) {
        const int32_t d = b == 0 ? 0 : 1, seq = batch->seq_lens[b];
        for (int32_t t = batch->cu_seqlens_q[b]; t < batch->cu_seqlens_q[b + 1]; ++t)
            for (int32_t h = 0; h < H; ++h) {
                const uint16_t sign = harness_int(rng, 0, 1) ? 0x8000 : 0;
                q[((size_t)t * H + h) * D + d] =
                    sign | (b == 0 ? (uint16_t)harness_int(rng, 1, 0x7F) : big);
            }
        for (int32_t p = 0; p * P < seq; ++p) {
            const size_t base =
                (size_t)batch->block_table[(size_t)b * batch->desc.bt_stride + p] * page_elems;
            for (int32_t j = 0; j < P && p * P + j < seq; ++j) {
                const uint16_t sign = harness_int(rng, 0, 1) ? 0x8000 : 0;
                const uint16_t value = b == 0       ? big
                                       : p % 3 == 1 ? (uint16_t)harness_int(rng, 1, 0x7F)
                                                    : 0;
                k[base + (size_t)j * D + d] = sign | value;
            }
        }
    }
}

bc_batch *bc_build(const bc_spec *spec, harness_rng *rng) {
    bc_batch *batch = calloc(1, sizeof *batch);
    if (!batch) exit(2);
    batch->spec = *spec;
    const int32_t B = spec->batch_size, H = spec->num_heads, D = spec->head_dim,
                  P = spec->page_size;
    const msaidx_dtype dtype = spec->dtype;
    const size_t elem = elem_bytes(dtype);

    msaidx_config *c = &batch->config;
    msaidx_config_init(c);
    c->head_dim = D;
    c->page_size = P;
    c->num_heads = H;
    c->topk = spec->topk;
    c->init_blocks = spec->init_blocks;
    c->local_blocks = spec->local_blocks;
    c->dtype = dtype;
    c->precision = spec->fp8_accumulation ? MSAIDX_PRECISION_DEFAULT : MSAIDX_PRECISION_EXACT;

    int32_t used_tokens = 0, max_q = 0, max_seq = 0, logical_pages = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t seq = spec->prefixes[b] + spec->q_lens[b];
        used_tokens += spec->q_lens[b];
        if (spec->q_lens[b] > max_q) max_q = spec->q_lens[b];
        if (seq > max_seq) max_seq = seq;
        logical_pages += ceil_div(seq, P);
    }
    const int32_t T = used_tokens + spec->pad_tokens;
    msaidx_batch_desc *d = &batch->desc;
    msaidx_batch_desc_init(d);
    d->batch_size = B;
    d->num_tokens = T;
    d->max_q_len = max_q + (int32_t)harness_int(rng, 0, T - max_q);
    d->max_seq_len = max_seq + (int32_t)harness_int(rng, 0, 3);
    const int32_t max_pages = ceil_div(d->max_seq_len, P);
    d->num_pages = logical_pages + spec->extra_pages > 0 ? logical_pages + spec->extra_pages : 1;
    d->bt_stride = (max_pages > 0 ? max_pages : 1) + (int32_t)harness_int(rng, 0, 3);
    d->page_stride = (int64_t)P * D * (int64_t)elem + spec->page_pad_bytes;
    d->pitch = (max_pages > 0 ? max_pages : 1) + spec->pitch_extra;

    batch->cu_seqlens_q = misaligned_ints(batch, (size_t)B + 1);
    batch->seq_lens = misaligned_ints(batch, (size_t)(B > 0 ? B : 1));
    batch->block_table = misaligned_ints(batch, (size_t)(B > 0 ? B : 1) * d->bt_stride);
    batch->nvp = misaligned_ints(batch, (size_t)(T > 0 ? T : 1));
    batch->checked = aligned_zeroed(batch, (size_t)(T > 0 ? T : 1));
    for (int32_t b = 0; b < B; ++b) {
        batch->cu_seqlens_q[b + 1] = batch->cu_seqlens_q[b] + spec->q_lens[b];
        batch->seq_lens[b] = spec->prefixes[b] + spec->q_lens[b];
    }

    /* Scattered, unordered physical pages; entries past a request's pages are garbage. */
    int32_t *physical = malloc(sizeof(int32_t) * (size_t)d->num_pages);
    if (!physical) exit(2);
    for (int32_t i = 0; i < d->num_pages; ++i) physical[i] = i;
    shuffle(physical, d->num_pages, rng);
    int32_t next_physical = 0;
    for (int32_t b = 0; b < B; ++b) {
        int32_t *row = batch->block_table + (size_t)b * d->bt_stride;
        const int32_t pages = ceil_div(batch->seq_lens[b], P);
        for (int32_t p = 0; p < d->bt_stride; ++p)
            row[p] = p < pages ? physical[next_physical++]
                               : (harness_int(rng, 0, 1) ? -1 - p : d->num_pages + p);
    }

    batch->q_bytes = (size_t)(T > 0 ? T : 1) * H * D * elem;
    batch->k_bytes = (size_t)d->num_pages * (size_t)d->page_stride;
    batch->q = aligned_zeroed(batch, batch->q_bytes);
    batch->k_cache = aligned_zeroed(batch, batch->k_bytes);

    /* Pad bytes and unused pages hold NaN: reading them shows up in the scores. */
    const size_t page_elems = (size_t)d->page_stride / elem;
    for (size_t i = 0; i < batch->k_bytes / elem; ++i) store_nan(dtype, batch->k_cache, i);
    for (size_t i = 0; i < (size_t)T * H * D; ++i)
        store_elem(dtype, batch->q, i, spec->distinct ? 1.0f : (float)harness_normal(rng));
    for (int32_t b = 0; b < B; ++b) {
        const int32_t seq = batch->seq_lens[b], pages = ceil_div(seq, P);
        int32_t order[NUM_DISTINCT];
        for (int32_t i = 0; i < NUM_DISTINCT; ++i) order[i] = i;
        shuffle(order, NUM_DISTINCT, rng);
        for (int32_t p = 0; p < pages; ++p) {
            const size_t base =
                (size_t)batch->block_table[(size_t)b * d->bt_stride + p] * page_elems;
            const double scale = harness_uniform(rng, 0.25, 3.0);
            for (int32_t j = 0; j < P; ++j) {
                for (int32_t e = 0; e < D; ++e) {
                    const size_t at = base + (size_t)j * D + e;
                    if (p * P + j >= seq) /* past the context: large, so a missing mask wins */
                        store_elem(dtype, batch->k_cache, at,
                                   harness_int(rng, 0, 1) ? 448.0f : -448.0f);
                    else if (spec->distinct)
                        store_elem(dtype, batch->k_cache, at,
                                   distinct_values[order[p % NUM_DISTINCT]]);
                    else
                        store_elem(dtype, batch->k_cache, at, (float)(scale * harness_normal(rng)));
                }
            }
        }
    }
    free(physical);
    if (spec->nan_inputs) plant_nans(batch, rng);
    if (spec->subnormal_inputs && dtype == MSAIDX_DTYPE_BF16) plant_subnormals(batch, rng);

    /* nvp from SPEC.md section 2, and which tokens get their scores compared. */
    for (int32_t t = 0; t < T; ++t) batch->nvp[t] = 0;
    int32_t real = 0;
    for (int32_t b = 0; b < B; ++b)
        for (int32_t i = 0; i < spec->q_lens[b]; ++i) {
            const int32_t pos = batch->seq_lens[b] - spec->q_lens[b] + i;
            batch->nvp[batch->cu_seqlens_q[b] + i] = pos / P + 1;
            ++real;
        }
    if (spec->sample_tokens <= 0) {
        for (int32_t t = 0; t < used_tokens; ++t) batch->checked[t] = true;
    } else {
        for (int32_t b = 0; b < B; ++b)
            if (spec->q_lens[b] > 0) {
                batch->checked[batch->cu_seqlens_q[b]] = true;
                batch->checked[batch->cu_seqlens_q[b + 1] - 1] = true;
            }
        for (int32_t i = 0; i < spec->sample_tokens && real > 0; ++i)
            batch->checked[harness_int(rng, 0, used_tokens - 1)] = true;
    }
    return batch;
}

void bc_free(bc_batch *batch) {
    if (!batch) return;
    for (int i = 0; i < 8; ++i) free(batch->allocations[i]);
    free(batch);
}

size_t bc_score_count(const bc_batch *batch) {
    return (size_t)batch->desc.num_tokens * batch->config.num_heads * batch->desc.pitch;
}

static int32_t request_of(const bc_batch *batch, int32_t token) {
    for (int32_t b = 0; b < batch->desc.batch_size; ++b)
        if (token < batch->cu_seqlens_q[b + 1]) return b;
    return -1;
}

bc_batch *bc_sample(const bc_batch *full) {
    const msaidx_batch_desc *fd = &full->desc;
    const int32_t H = full->config.num_heads, D = full->config.head_dim;
    const size_t row_bytes = (size_t)H * D * elem_bytes(full->config.dtype);
    int32_t n = 0;
    for (int32_t t = 0; t < fd->num_tokens; ++t) n += full->checked[t];

    bc_batch *sub = calloc(1, sizeof *sub);
    if (!sub) exit(2);
    sub->spec = full->spec;
    sub->spec.sample_tokens = 0;
    sub->spec.large = false;
    sub->config = full->config;
    sub->desc = *fd;
    sub->desc.batch_size = n;
    sub->desc.num_tokens = n;
    sub->desc.max_q_len = n > 0 ? 1 : 0;
    sub->cu_seqlens_q = misaligned_ints(sub, (size_t)n + 1);
    sub->seq_lens = misaligned_ints(sub, (size_t)(n > 0 ? n : 1));
    sub->block_table = misaligned_ints(sub, (size_t)(n > 0 ? n : 1) * fd->bt_stride);
    sub->nvp = misaligned_ints(sub, (size_t)(n > 0 ? n : 1));
    sub->checked = aligned_zeroed(sub, (size_t)(n > 0 ? n : 1));
    sub->sample_map = misaligned_ints(sub, (size_t)(n > 0 ? n : 1));
    sub->q_bytes = (size_t)(n > 0 ? n : 1) * row_bytes;
    sub->q = aligned_zeroed(sub, sub->q_bytes);
    sub->k_cache = full->k_cache; /* shared, not owned */
    sub->k_bytes = full->k_bytes;
    int32_t i = 0;
    for (int32_t t = 0; t < fd->num_tokens; ++t) {
        if (!full->checked[t]) continue;
        const int32_t b = request_of(full, t);
        const int32_t q_len = full->cu_seqlens_q[b + 1] - full->cu_seqlens_q[b];
        const int32_t pos = full->seq_lens[b] - q_len + (t - full->cu_seqlens_q[b]);
        sub->cu_seqlens_q[i + 1] = i + 1;
        sub->seq_lens[i] = pos + 1;
        memcpy(sub->block_table + (size_t)i * fd->bt_stride,
               full->block_table + (size_t)b * fd->bt_stride, sizeof(int32_t) * fd->bt_stride);
        memcpy((char *)sub->q + (size_t)i * row_bytes,
               (const char *)full->q + (size_t)t * row_bytes, row_bytes);
        sub->nvp[i] = full->nvp[t];
        sub->checked[i] = true;
        sub->sample_map[i] = t;
        ++i;
    }
    return sub;
}

/* Exact values of every code, from bc_e4m3_value / bc_bf16_value: the brute force's decoder. */
static const double *value_table(msaidx_dtype dtype) {
    static double e4m3[256], *bf16;
    static bool ready;
    if (!ready) {
        bf16 = malloc(sizeof(double) * 65536);
        if (!bf16) exit(2);
        for (int i = 0; i < 256; ++i) e4m3[i] = bc_e4m3_value((uint8_t)i);
        for (int i = 0; i < 65536; ++i) bf16[i] = bc_bf16_value((uint16_t)i);
        ready = true;
    }
    return dtype == MSAIDX_DTYPE_BF16 ? bf16 : e4m3;
}

static double table_value(const double *table, msaidx_dtype dtype, const void *base, size_t i) {
    return dtype == MSAIDX_DTYPE_BF16 ? table[((const uint16_t *)base)[i]]
                                      : table[((const uint8_t *)base)[i]];
}

/* Per page the max over visible keys of the dot, or of sum_d |q_d * k_d| when `absolute`. */
static void brute_row(const bc_batch *batch, int32_t token, int32_t head, bool absolute,
                      double *pages_out) {
    const int32_t b = request_of(batch, token);
    const int32_t H = batch->config.num_heads, D = batch->config.head_dim,
                  P = batch->config.page_size;
    const msaidx_dtype dtype = batch->config.dtype;
    const double *table = value_table(dtype);
    const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
    const int32_t pos = batch->seq_lens[b] - q_len + (token - batch->cu_seqlens_q[b]);
    const size_t page_elems = (size_t)batch->desc.page_stride / elem_bytes(dtype);
    double q[256];
    for (int32_t e = 0; e < D; ++e) {
        q[e] = table_value(table, dtype, batch->q, ((size_t)token * H + head) * D + e);
        if (absolute) q[e] = fabs(q[e]);
    }
    for (int32_t page = 0; page <= pos / P; ++page) {
        const int32_t physical = batch->block_table[(size_t)b * batch->desc.bt_stride + page];
        double best = -INFINITY;
        for (int32_t j = 0; j < P && page * P + j <= pos; ++j) {
            const size_t k_base = (size_t)physical * page_elems + (size_t)j * D;
            double dot = 0.0;
            for (int32_t e = 0; e < D; ++e) {
                const double k = table_value(table, dtype, batch->k_cache, k_base + e);
                dot += q[e] * (absolute ? fabs(k) : k);
            }
            if (dot > best) best = dot;
        }
        pages_out[page] = best;
    }
}

void bc_brute_row(const bc_batch *batch, int32_t token, int32_t head, double *pages_out) {
    brute_row(batch, token, head, false, pages_out);
}

void bc_brute_abs_row(const bc_batch *batch, int32_t token, int32_t head, double *pages_out) {
    brute_row(batch, token, head, true, pages_out);
}

static void brute_scores(const bc_batch *batch, bool absolute, float *scores) {
    const int32_t H = batch->config.num_heads, pitch = batch->desc.pitch;
    double *row = malloc(sizeof(double) * (size_t)pitch);
    if (!row) exit(2);
    for (int32_t t = 0; t < batch->desc.num_tokens; ++t) {
        if (!batch->checked[t]) continue;
        for (int32_t h = 0; h < H; ++h) {
            brute_row(batch, t, h, absolute, row);
            for (int32_t p = 0; p < batch->nvp[t]; ++p)
                scores[((size_t)t * H + h) * pitch + p] = (float)row[p];
        }
    }
    free(row);
}

void bc_brute_scores(const bc_batch *batch, float *scores) { brute_scores(batch, false, scores); }

void bc_brute_abs_scores(const bc_batch *batch, float *abs_scores) {
    brute_scores(batch, true, abs_scores);
}

double bc_exact_bound(double ref, double largest_abs_dot) {
    return 2e-4 * fmax(1.0, fabs(ref)) + 0x1p-16 * largest_abs_dot;
}

static void scalar_reference(const bc_batch *batch, float *scores) {
    const msaidx_cpu_batch cpu = {
        .config = &batch->config,
        .desc = &batch->desc,
        .cu_seqlens_q = batch->cu_seqlens_q,
        .seq_lens = batch->seq_lens,
        .block_table = batch->block_table,
        .q = batch->q,
        .k_cache = batch->k_cache,
        .scores = scores,
    };
    msaidx_cpu_scores_reference(&cpu);
}

void bc_reference_scores(const bc_batch *batch, float *scores) {
    if (batch->spec.sample_tokens <= 0) {
        scalar_reference(batch, scores);
        return;
    }
    bc_batch *sub = bc_sample(batch);
    const size_t row = (size_t)batch->desc.pitch, H = (size_t)batch->config.num_heads;
    float *sub_scores = malloc(sizeof(float) * (bc_score_count(sub) + 1));
    if (!sub_scores) exit(2);
    bc_poison(sub_scores, bc_score_count(sub));
    scalar_reference(sub, sub_scores);
    for (int32_t i = 0; i < sub->desc.num_tokens; ++i)
        for (size_t h = 0; h < H; ++h)
            memcpy(scores + ((size_t)sub->sample_map[i] * H + h) * row,
                   sub_scores + ((size_t)i * H + h) * row, sizeof(float) * (size_t)sub->nvp[i]);
    free(sub_scores);
    bc_free(sub);
}

long bc_compare_scores(const bc_batch *batch, const float *got, const float *ref,
                       const char *label) {
    const int32_t T = batch->desc.num_tokens, H = batch->config.num_heads;
    const int32_t pitch = batch->desc.pitch;
    const bool fast = msaidx_fp8_accumulation(&batch->config);
    long out_of_tolerance = 0, unwritten = 0, overwritten = 0, ref_missing = 0;
    double worst = 0.0;
    char first_bad[200] = "", first_unwritten[160] = "", first_overwritten[160] = "";
    /* A of each page: with fast accumulation for every row; else only for a row with a cell
     * beyond 2e-4 * max(1, |ref|), where large products may have cancelled. */
    double *abs_dots = malloc(sizeof(double) * (size_t)(pitch > 0 ? pitch : 1));
    if (!abs_dots) exit(2);
    for (int32_t t = 0; t < T; ++t)
        for (int32_t h = 0; h < H; ++h) {
            const size_t row = ((size_t)t * H + h) * pitch;
            const int32_t n = batch->nvp[t];
            bool have_abs_dots = fast && batch->checked[t];
            if (have_abs_dots) bc_brute_abs_row(batch, t, h, abs_dots);
            for (int32_t p = 0; p < pitch; ++p) {
                const float g = got[row + p];
                if (p >= n) {
                    if (!bc_is_poison(g) && !overwritten++)
                        snprintf(first_overwritten, sizeof first_overwritten,
                                 "t=%d h=%d p=%d (nvp %d): %g", t, h, p, n, g);
                    continue;
                }
                if (bc_is_poison(g)) {
                    if (!unwritten++)
                        snprintf(first_unwritten, sizeof first_unwritten, "t=%d h=%d p=%d (nvp %d)",
                                 t, h, p, n);
                    continue;
                }
                if (!batch->checked[t]) continue;
                const float r = ref[row + p];
                if (bc_is_poison(r)) {
                    ++ref_missing;
                    continue;
                }
                /* Equal cells pass whatever the bound: -inf (a page without a non-NaN dot) - -inf
                 * is NaN, and so is A when the inputs hold NaN. */
                if (g == r) continue;
                /* An infinite cell must be matched exactly: its bound is infinite too. */
                if (isinf(r) || isinf(g)) {
                    if (!out_of_tolerance++)
                        snprintf(first_bad, sizeof first_bad,
                                 "t=%d h=%d p=%d: got %.9g, reference %.9g", t, h, p, g, r);
                    worst = INFINITY;
                    continue;
                }
                const double err = fabs((double)g - (double)r);
                if (!have_abs_dots && !(err <= bc_exact_bound(r, 0.0))) {
                    bc_brute_abs_row(batch, t, h, abs_dots);
                    have_abs_dots = true;
                }
                double bound = bc_exact_bound(r, have_abs_dots ? abs_dots[p] : 0.0);
                if (fast) bound += MSAIDX_FP8_ACCUMULATION_DOT_BOUND * abs_dots[p];
                if (isnan(err) || err / bound > worst) worst = isnan(err) ? INFINITY : err / bound;
                if (!(err <= bound) && !out_of_tolerance++)
                    snprintf(first_bad, sizeof first_bad,
                             "t=%d h=%d p=%d: got %.9g, reference %.9g, bound %.3g", t, h, p, g, r,
                             bound);
            }
        }
    free(abs_dots);
    const char *name = batch->spec.name;
    CHECK(ref_missing == 0, "%s %s: %ld reference cells missing", label, name, ref_missing);
    CHECK(out_of_tolerance == 0, "%s %s: %ld cells out of tolerance (worst %.3g x bound); first %s",
          label, name, out_of_tolerance, worst, first_bad);
    CHECK(unwritten == 0, "%s %s: %ld visible cells not written; first %s", label, name, unwritten,
          first_unwritten);
    CHECK(overwritten == 0, "%s %s: %ld cells p >= nvp written; first %s", label, name, overwritten,
          first_overwritten);
    return out_of_tolerance + unwritten + overwritten + ref_missing;
}

typedef struct ranked_page {
    float value;
    int32_t page;
} ranked_page;

static int compare_ranked(const void *a, const void *b) {
    const ranked_page *x = a, *y = b;
    const float vx = isnan(x->value) ? -INFINITY : x->value;
    const float vy = isnan(y->value) ? -INFINITY : y->value;
    if (vx != vy) return vx > vy ? -1 : 1;
    return (x->page > y->page) - (x->page < y->page);
}

static int compare_int(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void bc_topk_oracle(const msaidx_config *c, const float *scores, int32_t pitch, const int32_t *nvp,
                    int32_t num_tokens, int32_t *out) {
    const int32_t H = c->num_heads, K = c->topk;
    ranked_page *candidates = malloc(sizeof(ranked_page) * (size_t)(pitch > 0 ? pitch : 1));
    int32_t *chosen = malloc(sizeof(int32_t) * (size_t)K);
    if (!candidates || !chosen) exit(2);
    for (int64_t row = 0; row < (int64_t)num_tokens * H; ++row) {
        const int32_t n = nvp[row / H];
        int32_t *o = out + row * K;
        for (int32_t k = 0; k < K; ++k) o[k] = -1;
        if (n <= 0) continue;
        if (n <= K) {
            for (int32_t k = 0; k < n; ++k) o[k] = k;
            continue;
        }
        int32_t count = 0, m = 0;
        for (int32_t p = 0; p < c->init_blocks; ++p) chosen[count++] = p;
        for (int32_t p = n - c->local_blocks; p < n; ++p) chosen[count++] = p;
        for (int32_t p = c->init_blocks; p < n - c->local_blocks; ++p)
            candidates[m++] = (ranked_page){scores[row * pitch + p], p};
        qsort(candidates, (size_t)m, sizeof *candidates, compare_ranked);
        for (int32_t i = 0; count < K; ++i) chosen[count++] = candidates[i].page;
        qsort(chosen, (size_t)K, sizeof *chosen, compare_int);
        memcpy(o, chosen, sizeof(int32_t) * (size_t)K);
    }
    free(candidates);
    free(chosen);
}

long bc_check_topk_shape(const msaidx_config *c, const int32_t *nvp, int32_t num_tokens,
                         const int32_t *out, const char *label) {
    const int32_t H = c->num_heads, K = c->topk;
    long bad = 0;
    int64_t first_bad = -1;
    for (int64_t row = 0; row < (int64_t)num_tokens * H; ++row) {
        const int32_t n = nvp[row / H];
        const int32_t *o = out + row * K;
        const int32_t valid = n <= 0 ? 0 : (n < K ? n : K);
        bool ok = true;
        for (int32_t k = 0; k < K; ++k) {
            if (k < valid)
                ok = ok && o[k] >= 0 && o[k] < n && (k == 0 || o[k] > o[k - 1]);
            else
                ok = ok && o[k] == -1;
        }
        if (n > K) {
            for (int32_t p = 0; p < c->init_blocks; ++p) ok = ok && o[p] == p;
            for (int32_t i = 0; i < c->local_blocks; ++i)
                ok = ok && o[K - c->local_blocks + i] == n - c->local_blocks + i;
        }
        if (!ok) {
            if (first_bad < 0) first_bad = row;
            ++bad;
        }
    }
    CHECK(bad == 0, "%s: %ld top-k rows malformed (first row %lld, nvp %d)", label, bad,
          (long long)first_bad, first_bad >= 0 ? nvp[first_bad / H] : 0);
    return bad;
}

/* A score distribution for top-k: mode 0 plain normals; 1 adds ties, NaN of both signs,
 * infinities, signed zeros and subnormals; 2 also makes half the cells one tied value. */
static float random_score(harness_rng *rng, int mode) {
    switch (harness_int(rng, 0, mode == 0 ? 0 : 11)) {
    case 0: return (float)harness_normal(rng);
    case 1: return (float)harness_int(rng, -2, 2);
    case 2: return NAN;
    case 3: return -INFINITY;
    case 4: return INFINITY;
    case 5: return -NAN;
    case 6: return harness_int(rng, 0, 1) ? 0.0f : -0.0f;
    case 7: return (float)harness_int(rng, -3, 3) * 0x1p-140f; /* subnormal, and ties */
    default: return mode == 2 ? 0.5f : (float)harness_uniform(rng, -4, 4);
    }
}

/* Mode 3: the large scores sit on 15 of every 32 consecutive pages, rising with the residue.
 * A selection that bounds the answer by per-thread maxima of interleaved pages then keeps
 * hundreds of candidates: this reaches the GPU top-k's exact fallback. */
static float strided_score(harness_rng *rng, int32_t page) {
    const int32_t residue = page % 32;
    return residue < 15 ? (float)(residue * 1000 + page / 32) : (float)harness_normal(rng);
}

void bc_topk_case_make(bc_topk_case *tc, harness_rng *rng, int round, int32_t min_pitch,
                       int32_t max_pitch, int32_t min_tokens, int32_t max_tokens) {
    static const int32_t topks[] = {1, 16, 64};
    msaidx_config *c = &tc->config;
    msaidx_config_init(c);
    /* H = 1, 2, 4, and every 8th round 3 (which the persistent backend does not admit) */
    c->num_heads = round % 8 == 5 ? 3 : (int32_t)(1 << harness_int(rng, 0, 2));
    c->topk = topks[round % 3];
    do {
        c->init_blocks = (int32_t)harness_int(rng, 0, 2);
        c->local_blocks = (int32_t)harness_int(rng, 0, 2);
    } while (c->init_blocks + c->local_blocks > c->topk);
    const int32_t H = c->num_heads, T = (int32_t)harness_int(rng, min_tokens, max_tokens);
    int32_t pitch = (int32_t)harness_int(rng, min_pitch, max_pitch);
    if (round % 2)
        pitch = (pitch + 3) / 4 * 4; /* rows 16-byte aligned: the CUDA top-k's float4 path */
    const int mode = (int)harness_int(rng, 0, 3);
    tc->num_tokens = T;
    tc->pitch = pitch;
    tc->nvp = malloc(sizeof(int32_t) * (size_t)T);
    tc->scores = malloc(sizeof(float) * (size_t)T * H * pitch);
    if (!tc->nvp || !tc->scores) exit(2);
    for (int32_t t = 0; t < T; ++t) {
        static const int32_t edges[] = {0, -1, -5, 1, 2, 15, 16, 17, 63, 64, 65, 1024, 1025};
        const int32_t edge = edges[harness_int(rng, 0, 12)];
        const int32_t n = harness_int(rng, 0, 1) ? edge : (int32_t)harness_int(rng, -2, pitch);
        tc->nvp[t] = n > pitch ? pitch : n;
    }
    for (size_t i = 0; i < (size_t)T * H * pitch; ++i) {
        const int32_t t = (int32_t)(i / ((size_t)H * pitch)), p = (int32_t)(i % (size_t)pitch);
        /* Past nvp: the best possible values, which top-k must never read. */
        if (p >= tc->nvp[t])
            tc->scores[i] = INFINITY;
        else if (mode == 3)
            tc->scores[i] = strided_score(rng, p);
        else
            tc->scores[i] = random_score(rng, mode);
    }
}

void bc_topk_case_free(bc_topk_case *tc) {
    free(tc->nvp);
    free(tc->scores);
}

/* --- the cases ------------------------------------------------------------------------- */

static void base_spec(bc_spec *s, const char *name, msaidx_dtype dtype, int32_t H) {
    memset(s, 0, sizeof *s);
    s->name = name;
    s->dtype = dtype;
    s->num_heads = H;
    s->head_dim = 128;
    s->page_size = 128;
    s->topk = 16;
    s->init_blocks = 0;
    s->local_blocks = 1;
}

static void set_requests(bc_spec *s, int32_t B, const int32_t *q_lens, const int32_t *prefixes) {
    s->batch_size = B;
    for (int32_t b = 0; b < B; ++b) {
        s->q_lens[b] = q_lens[b];
        s->prefixes[b] = prefixes[b];
    }
}

/* Decode-shaped: q_len 1..8, contexts up to max_context. */
static void decode_requests(bc_spec *s, int32_t B, int32_t max_context, harness_rng *rng) {
    s->batch_size = B;
    for (int32_t b = 0; b < B; ++b) {
        s->q_lens[b] = (int32_t)harness_int(rng, 1, 8);
        s->prefixes[b] = (int32_t)harness_int(rng, 0, max_context);
    }
}

static void random_layout(bc_spec *s, harness_rng *rng) {
    s->pad_tokens = (int32_t)harness_int(rng, 0, 5);
    s->page_pad_bytes = 16 * (int32_t)harness_int(rng, 0, 1) * (int32_t)harness_int(rng, 1, 4);
    s->extra_pages = (int32_t)harness_int(rng, 0, 3);
    s->pitch_extra = (int32_t)harness_int(rng, 0, 3);
}

static void random_selection(bc_spec *s, harness_rng *rng) {
    static const int32_t topks[] = {1, 16, 64};
    s->topk = topks[harness_int(rng, 0, 2)];
    do {
        s->init_blocks = (int32_t)harness_int(rng, 0, 2);
        s->local_blocks = (int32_t)harness_int(rng, 0, 2);
    } while (s->init_blocks + s->local_blocks > s->topk);
}

enum { NUM_FIXED = 24 };

int bc_num_fixed_specs(void) { return NUM_FIXED; }

void bc_fixed_spec(int index, bc_spec *s, harness_rng *rng) {
    static const int32_t distinct_q[] = {1, 2, 4}, distinct_prefix[] = {5119, 4226, 2633};
    static const int32_t boundary_q[] = {127, 128, 129, 1, 1, 256};
    static const int32_t boundary_prefix[] = {0, 1, 127, 128, 255, 384};
    static const int32_t mixed_q[] = {300, 1, 700, 2049}, mixed_prefix[] = {0, 1000, 130, 5000};
    static const int32_t long_q[] = {16384}, long_prefix[] = {512};
    static const int32_t far_q[] = {513, 2}, far_prefix[] = {200000 - 513, 131071 - 2};
    static const int32_t mix_q[] = {1, 1, 64, 96};
    static const int32_t mix_prefix[] = {2305 - 1, 2561 - 1, 2624 - 64, 2720 - 96};
    static const int32_t long_decode_q[] = {1, 4}, long_decode_prefix[] = {131072, 70000};
    static const int32_t nan_q[] = {300, 40, 1}, nan_prefix[] = {200, 600, 1000};
    static const int32_t subnormal_q[] = {200, 300, 1}, subnormal_prefix[] = {900, 1500, 2000};
    switch (index) {
    case 0:
    case 1:
    case 2: {
        static const char *names[] = {"distinct-e4m3-h1", "distinct-bf16-h2", "distinct-e4m3-h4"};
        base_spec(s, names[index], index == 1 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                  index == 0 ? 1 : index * 2);
        set_requests(s, 3, distinct_q, distinct_prefix);
        s->distinct = true;
        if (index == 1) {
            s->init_blocks = 2;
            s->local_blocks = 2;
        }
        if (index == 2) {
            s->topk = 1;
            s->local_blocks = 0;
        }
        break;
    }
    case 3:
        base_spec(s, "page-boundaries-e4m3-h4", MSAIDX_DTYPE_E4M3, 4);
        set_requests(s, 6, boundary_q, boundary_prefix);
        break;
    case 4:
        base_spec(s, "page-boundaries-bf16-h1", MSAIDX_DTYPE_BF16, 1);
        set_requests(s, 6, boundary_q, boundary_prefix);
        break;
    case 5:
        base_spec(s, "mixed-prefixes-e4m3-h1", MSAIDX_DTYPE_E4M3, 1);
        set_requests(s, 4, mixed_q, mixed_prefix);
        break;
    case 6:
        base_spec(s, "mixed-prefixes-bf16-h4", MSAIDX_DTYPE_BF16, 4);
        set_requests(s, 4, mixed_q, mixed_prefix);
        s->sample_tokens = 48;
        s->large = true;
        break;
    case 7:
    case 8:
        base_spec(s, index == 7 ? "forty-requests-e4m3-h4" : "forty-requests-bf16-h2",
                  index == 7 ? MSAIDX_DTYPE_E4M3 : MSAIDX_DTYPE_BF16, index == 7 ? 4 : 2);
        s->batch_size = 40;
        for (int32_t b = 0; b < 40; ++b) {
            s->q_lens[b] = (int32_t)harness_int(rng, 0, 48);
            s->prefixes[b] = (int32_t)harness_int(rng, 0, 2500);
        }
        break;
    case 9:
        base_spec(s, "q16384-after-512-e4m3-h1", MSAIDX_DTYPE_E4M3, 1);
        set_requests(s, 1, long_q, long_prefix);
        s->sample_tokens = 24;
        s->large = true;
        break;
    case 10:
        base_spec(s, "long-prefixes-e4m3-h1", MSAIDX_DTYPE_E4M3, 1);
        set_requests(s, 2, far_q, far_prefix);
        s->sample_tokens = 12;
        s->large = true;
        break;
    case 11:
        base_spec(s, "q16384-after-512-bf16-h4", MSAIDX_DTYPE_BF16, 4);
        set_requests(s, 1, long_q, long_prefix);
        s->sample_tokens = 16;
        s->large = true;
        break;
    case 12:
        base_spec(s, "long-prefixes-bf16-h2", MSAIDX_DTYPE_BF16, 2);
        set_requests(s, 2, far_q, far_prefix);
        s->sample_tokens = 8;
        s->large = true;
        break;
    case 13:
    case 14:
        base_spec(s, index == 13 ? "decode-first-mix-e4m3-h4" : "decode-first-mix-bf16-h4",
                  index == 13 ? MSAIDX_DTYPE_E4M3 : MSAIDX_DTYPE_BF16, 4);
        set_requests(s, 4, mix_q, mix_prefix);
        break;
    case 15:
    case 16:
        base_spec(s, index == 15 ? "decode-batch-e4m3-h4" : "decode-batch-bf16-h2",
                  index == 15 ? MSAIDX_DTYPE_E4M3 : MSAIDX_DTYPE_BF16, index == 15 ? 4 : 2);
        decode_requests(s, 8, 9000, rng);
        s->decode = true;
        break;
    case 17:
        base_spec(s, "decode-long-context-e4m3-h4", MSAIDX_DTYPE_E4M3, 4);
        set_requests(s, 2, long_decode_q, long_decode_prefix);
        s->decode = true;
        break;
    case 18:
        base_spec(s, "decode-padded-e4m3-h1", MSAIDX_DTYPE_E4M3, 1);
        decode_requests(s, 5, 3000, rng);
        s->decode = true;
        s->pad_tokens = 7;
        break;
    case 20:
    case 21:
    case 22: {
        static const char *names[] = {"nan-inputs-e4m3-h4", "nan-inputs-bf16-h2",
                                      "nan-inputs-decode-e4m3-h1"};
        base_spec(s, names[index - 20], index == 21 ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
                  index == 20   ? 4
                  : index == 21 ? 2
                                : 1);
        set_requests(s, 3, nan_q, nan_prefix);
        s->nan_inputs = true;
        if (index == 22) {
            decode_requests(s, 6, 3000, rng);
            s->decode = true;
        }
        break;
    }
    case 23:
        base_spec(s, "subnormal-inputs-bf16-h2", MSAIDX_DTYPE_BF16, 2);
        set_requests(s, 3, subnormal_q, subnormal_prefix);
        s->subnormal_inputs = true;
        break;
    default:
        base_spec(s, "sixteen-heads-e4m3", MSAIDX_DTYPE_E4M3, 16);
        decode_requests(s, 3, 1500, rng);
        s->q_lens[1] = 40;
        break;
    }
    if (!s->distinct)
        random_layout(s, rng);
    else
        s->page_pad_bytes = 16 * (int32_t)harness_int(rng, 0, 2);
}

void bc_random_spec(bc_spec *s, harness_rng *rng, bool device_shapes) {
    static const int32_t heads[] = {1, 2, 4};
    base_spec(s, "random", harness_int(rng, 0, 1) ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3,
              heads[harness_int(rng, 0, 2)]);
    if (!device_shapes) {
        s->head_dim = 16 * (int32_t)harness_int(rng, 1, 16);
        s->page_size = 16 * (int32_t)harness_int(rng, 1, 32);
    }
    random_selection(s, rng);
    s->batch_size = (int32_t)harness_int(rng, 1, 6);
    const int32_t max_prefix = harness_int(rng, 0, 3) ? 900 : 2500;
    for (int32_t b = 0; b < s->batch_size; ++b) {
        s->q_lens[b] = harness_int(rng, 0, 9) ? (int32_t)harness_int(rng, 1, 40) : 0;
        s->prefixes[b] = (int32_t)harness_int(rng, 0, max_prefix);
        /* Now and then a longer chunk: several query tiles of a request. */
        if (s->head_dim * s->num_heads <= 256 && harness_int(rng, 0, 7) == 0) {
            s->q_lens[b] = (int32_t)harness_int(rng, 41, 260);
            s->prefixes[b] = (int32_t)harness_int(rng, 0, 900);
        }
    }
    random_layout(s, rng);
    s->decode = harness_int(rng, 0, 3) == 0;
}

long bc_check_nan_semantics(const bc_batch *batch, const float *got, const char *what) {
    const int32_t H = batch->config.num_heads, pitch = batch->desc.pitch;
    long not_minus_inf = 0, nan_cells = 0;
    for (int32_t b = 0; b < batch->spec.batch_size; ++b)
        for (int32_t t = batch->cu_seqlens_q[b]; t < batch->cu_seqlens_q[b + 1]; ++t)
            for (int32_t h = 0; h < H; ++h) {
                const float *row = got + ((size_t)t * H + h) * pitch;
                for (int32_t p = 0; p < batch->nvp[t]; ++p) {
                    nan_cells += isnan(row[p]);
                    const bool nan_row = t == batch->cu_seqlens_q[b] && h == 0;
                    if ((nan_row || p == 1) && !(isinf(row[p]) && row[p] < 0)) ++not_minus_inf;
                }
            }
    CHECK(nan_cells == 0, "%s: %ld visible cells are NaN (NaN dots must drop out of the page max)",
          what, nan_cells);
    CHECK(not_minus_inf == 0, "%s: %ld cells without a non-NaN dot are not -inf", what,
          not_minus_inf);
    return nan_cells + not_minus_inf;
}

/* --- the cross-backend run ------------------------------------------------------------- */

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

bool bc_must_admit(msaidx_backend backend, bool sm90a, const msaidx_config *config) {
    const bool device_shape = config->head_dim == 128 && config->page_size == 128;
    switch (backend) {
    case MSAIDX_BACKEND_CPU: return true;
    case MSAIDX_BACKEND_DENSE:
    case MSAIDX_BACKEND_SPLIT: return device_shape;
    case MSAIDX_BACKEND_PERSISTENT:
        return device_shape && sm90a &&
               (config->num_heads == 1 || config->num_heads == 2 || config->num_heads == 4);
    default: return false;
    }
}

static void run_case(const char *label, const bc_spec *spec, bc_runner run, void *user,
                     const bc_options *options, harness_rng *rng) {
    const double start = now_seconds();
    bc_batch *batch = bc_build(spec, rng);
    const int32_t T = batch->desc.num_tokens, H = batch->config.num_heads;
    const size_t cells = bc_score_count(batch) + 1;
    const size_t picks = (size_t)T * H * batch->config.topk + 1;
    float *ref = malloc(sizeof(float) * cells), *got = malloc(sizeof(float) * cells);
    int32_t *nvp = malloc(sizeof(int32_t) * ((size_t)T + 1));
    int32_t *topk = malloc(sizeof(int32_t) * picks), *expect = malloc(sizeof(int32_t) * picks);
    if (!ref || !got || !nvp || !topk || !expect) exit(2);
    bc_poison(ref, cells);
    bc_poison(got, cells);
    for (int32_t t = 0; t < T; ++t) nvp[t] = -12345;
    for (size_t i = 0; i < picks; ++i) topk[i] = -12345;

    char what[160];
    snprintf(what, sizeof what, "%s %s (%s H=%d D=%d page=%d T=%d topk=%d/%d/%d%s)", label,
             spec->name, spec->dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", H,
             batch->config.head_dim, batch->config.page_size, T, batch->config.topk,
             batch->config.init_blocks, batch->config.local_blocks, spec->decode ? " decode" : "");
    const msaidx_status status = run(user, batch, got, nvp, topk);
    if (status == MSAIDX_ERROR_NOT_SUPPORTED) {
        CHECK(!bc_must_admit(options->backend, options->sm90a, &batch->config),
              "%s: refused, though documented as admitted: %s", what, msaidx_last_error());
        printf("  skip %s: %s\n", what, msaidx_last_error());
    } else {
        CHECK(status == MSAIDX_SUCCESS, "%s: %s: %s", what, msaidx_status_string(status),
              msaidx_last_error());
        bc_reference_scores(batch, ref);
        long bad = bc_compare_scores(batch, got, ref, label);
        if (spec->nan_inputs) bad += bc_check_nan_semantics(batch, got, what);
        long bad_nvp = 0;
        for (int32_t t = 0; t < T; ++t) bad_nvp += nvp[t] != batch->nvp[t];
        CHECK(bad_nvp == 0, "%s: %ld nvp entries differ from the test's", what, bad_nvp);
        bad += bc_check_topk_shape(&batch->config, batch->nvp, T, topk, what);
        /* The backend's top-k must equal the cpu top-k of the very same scores. */
        msaidx_cpu_topk_reference(&batch->config, got, batch->desc.pitch, batch->nvp, T, expect);
        long differ = 0;
        for (size_t i = 0; i + 1 < picks; ++i) differ += topk[i] != expect[i];
        CHECK(differ == 0, "%s: top-k differs from the cpu top-k of its own scores in %ld slots",
              what, differ);
        if (spec->distinct) {
            bc_topk_oracle(&batch->config, ref, batch->desc.pitch, batch->nvp, T, expect);
            differ = 0;
            for (size_t i = 0; i + 1 < picks; ++i) differ += topk[i] != expect[i];
            CHECK(differ == 0, "%s: top-k differs from the exact top-k in %ld slots", what, differ);
        }
        printf("  %s %s: %.2f s\n", bad + bad_nvp + differ ? "FAIL" : "ok", what,
               now_seconds() - start);
    }
    free(ref);
    free(got);
    free(nvp);
    free(topk);
    free(expect);
    bc_free(batch);
}

double bc_spec_macs(const bc_spec *s) {
    double macs = 0;
    for (int32_t b = 0; b < s->batch_size; ++b)
        macs += (double)s->q_lens[b] * (s->prefixes[b] + 0.5 * s->q_lens[b]);
    return macs * s->head_dim * s->num_heads;
}

void bc_run_backend(const char *label, bc_runner run, void *user, const bc_options *options,
                    harness_rng *rng) {
    for (int i = 0; i < bc_num_fixed_specs(); ++i) {
        bc_spec spec;
        bc_fixed_spec(i, &spec, rng);
        if (spec.large && !options->run_large) {
            printf("  skip %s %s: large case (run_large off)\n", label, spec.name);
            continue;
        }
        if (options->sample_above_macs > 0 && spec.sample_tokens <= 0 && !spec.distinct &&
            bc_spec_macs(&spec) > options->sample_above_macs)
            spec.sample_tokens = 32;
        spec.fp8_accumulation = options->fp8_accumulation;
        run_case(label, &spec, run, user, options, rng);
    }
    for (int i = 0; i < options->random_cases; ++i) {
        bc_spec spec;
        bc_random_spec(&spec, rng, options->device_shapes);
        spec.fp8_accumulation = options->fp8_accumulation;
        run_case(label, &spec, run, user, options, rng);
    }
}

/* --- one plan shared by threads -------------------------------------------------------- */

void bc_layer_q(const bc_batch *batch, int layer, void *q) {
    memcpy(q, batch->q, batch->q_bytes);
    if (layer == 0) return;
    const size_t elem = batch->spec.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    harness_rng rng = {0x51A7ED0000ull + (uint64_t)layer};
    uint8_t *bytes = q;
    for (size_t i = 0; i < batch->q_bytes / elem; ++i)
        if (harness_next(&rng) & 1) bytes[i * elem + elem - 1] ^= 0x80; /* little-endian sign */
}

msaidx_status bc_layer_calls(const msaidx_context *context, const msaidx_plan *plan,
                             const bc_batch *batch, const void *q, const void *k_cache,
                             float *scores, int32_t *topk, int32_t *fused, void *fused_workspace,
                             size_t fused_bytes, void *stream) {
    msaidx_status status = batch->spec.decode
                               ? msaidx_decode_scores(plan, q, k_cache, scores, stream)
                               : msaidx_prefill_scores(plan, q, k_cache, scores, stream);
    const int32_t *nvp = NULL;
    if (status == MSAIDX_SUCCESS) status = msaidx_plan_nvp(plan, &nvp);
    if (status == MSAIDX_SUCCESS)
        status = msaidx_topk_select(context, scores, batch->desc.pitch, nvp, batch->desc.num_tokens,
                                    topk, stream);
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = batch->config.topk;
    args.init_blocks = batch->config.init_blocks;
    args.local_blocks = batch->config.local_blocks;
    args.workspace = fused_workspace;
    args.workspace_bytes = fused_bytes;
    if (status == MSAIDX_SUCCESS)
        status = msaidx_prefill_topk(plan, q, k_cache, &args, NULL, fused, stream);
    return status;
}

/* A layer's outputs in host memory, each followed by BC_GUARD poisoned cells. */
enum { BC_GUARD = 16 };
typedef struct layer_outputs {
    float *scores;
    int32_t *topk, *fused;
    size_t cells, picks;
} layer_outputs;

static layer_outputs layer_outputs_alloc(const bc_batch *batch) {
    layer_outputs o = {.cells = bc_score_count(batch),
                       .picks = (size_t)batch->desc.num_tokens * batch->config.num_heads *
                                batch->config.topk};
    o.scores = malloc(sizeof(float) * (o.cells + BC_GUARD));
    o.topk = malloc(sizeof(int32_t) * (o.picks + BC_GUARD));
    o.fused = malloc(sizeof(int32_t) * (o.picks + BC_GUARD));
    if (!o.scores || !o.topk || !o.fused) exit(2);
    return o;
}

static void layer_outputs_poison(const layer_outputs *o) {
    bc_poison(o->scores, o->cells + BC_GUARD);
    memset(o->topk, 0x5A, sizeof(int32_t) * (o->picks + BC_GUARD));
    memset(o->fused, 0x5A, sizeof(int32_t) * (o->picks + BC_GUARD));
}

static long layer_outputs_guard_hits(const layer_outputs *o) {
    long hits = 0;
    for (size_t i = 0; i < BC_GUARD; ++i)
        hits += !bc_is_poison(o->scores[o->cells + i]) + (o->topk[o->picks + i] != 0x5A5A5A5A) +
                (o->fused[o->picks + i] != 0x5A5A5A5A);
    return hits;
}

static void layer_outputs_free(layer_outputs *o) {
    free(o->scores);
    free(o->topk);
    free(o->fused);
}

/* Poisons `o`, runs layer `layer` into it, counts the guard cells it changed. */
static msaidx_status run_layer(bc_layer_runner run, void *user, int worker, int layer,
                               const layer_outputs *o, long *guard_hits) {
    layer_outputs_poison(o);
    const msaidx_status status = run(user, worker, layer, o->scores, o->topk, o->fused, guard_hits);
    *guard_hits += layer_outputs_guard_hits(o);
    return status;
}

typedef struct shared_worker {
    bc_layer_runner run;
    void *user;
    int index, rounds, layers;
    layer_outputs *outputs; /* [rounds] */
    msaidx_status status;
    long guard_hits;
} shared_worker;

/* Worker w's round r runs layer (w + r) % layers: the workers run different layers at once. */
static int shared_layer(int worker, int round, int layers) { return (worker + round) % layers; }

static void *shared_worker_main(void *arg) {
    shared_worker *w = arg;
    for (int r = 0; r < w->rounds && w->status == MSAIDX_SUCCESS; ++r) {
        w->status = run_layer(w->run, w->user, w->index, shared_layer(w->index, r, w->layers),
                              &w->outputs[r], &w->guard_hits);
    }
    return NULL;
}

void bc_check_shared_plan(const char *label, const bc_batch *batch, bc_layer_runner run, void *user,
                          int workers, int rounds, int layers) {
    const int32_t T = batch->desc.num_tokens;
    const size_t cells = bc_score_count(batch),
                 picks = (size_t)T * batch->config.num_heads * batch->config.topk;
    layer_outputs *serial = malloc(sizeof *serial * (size_t)layers);
    if (!serial) exit(2);
    long guard_hits = 0;
    for (int l = 0; l < layers; ++l) {
        serial[l] = layer_outputs_alloc(batch);
        const msaidx_status status = run_layer(run, user, 0, l, &serial[l], &guard_hits);
        CHECK(status == MSAIDX_SUCCESS, "%s %s: serial layer %d: %s: %s", label, batch->spec.name,
              l, msaidx_status_string(status), msaidx_last_error());
        if (status != MSAIDX_SUCCESS) {
            for (int i = 0; i <= l; ++i) layer_outputs_free(&serial[i]);
            free(serial);
            return;
        }
        if (!batch->spec.decode)
            CHECK(memcmp(serial[l].fused, serial[l].topk, sizeof(int32_t) * picks) == 0,
                  "%s %s: layer %d: prefill_topk differs from topk_select of its scores", label,
                  batch->spec.name, l);
    }
    /* The serial runs themselves are right: layer 0 against the brute force and the oracle. */
    float *brute = malloc(sizeof(float) * (cells + 1));
    int32_t *oracle = malloc(sizeof(int32_t) * (picks + 1));
    if (!brute || !oracle) exit(2);
    bc_poison(brute, cells);
    bc_brute_scores(batch, brute);
    bc_compare_scores(batch, serial[0].scores, brute, label);
    bc_topk_oracle(&batch->config, serial[0].scores, batch->desc.pitch, batch->nvp, T, oracle);
    CHECK(memcmp(oracle, serial[0].topk, sizeof(int32_t) * picks) == 0,
          "%s %s: layer 0's top-k differs from the oracle's on its scores", label,
          batch->spec.name);
    free(brute);
    free(oracle);

    shared_worker *w = calloc((size_t)workers, sizeof *w);
    pthread_t *threads = malloc(sizeof *threads * (size_t)workers);
    if (!w || !threads) exit(2);
    for (int i = 0; i < workers; ++i) {
        w[i] = (shared_worker){run, user, i, rounds, layers, NULL, MSAIDX_SUCCESS, 0};
        w[i].outputs = malloc(sizeof(layer_outputs) * (size_t)rounds);
        if (!w[i].outputs) exit(2);
        for (int r = 0; r < rounds; ++r) w[i].outputs[r] = layer_outputs_alloc(batch);
    }
    for (int i = 0; i < workers; ++i)
        CHECK(pthread_create(&threads[i], NULL, shared_worker_main, &w[i]) == 0, "pthread_create");
    for (int i = 0; i < workers; ++i) pthread_join(threads[i], NULL);
    long differ = 0;
    for (int i = 0; i < workers; ++i) {
        CHECK(w[i].status == MSAIDX_SUCCESS, "%s %s: worker %d: %s", label, batch->spec.name, i,
              msaidx_status_string(w[i].status));
        guard_hits += w[i].guard_hits;
        for (int r = 0; r < rounds && w[i].status == MSAIDX_SUCCESS; ++r) {
            const layer_outputs *got = &w[i].outputs[r],
                                *want = &serial[shared_layer(i, r, layers)];
            for (size_t c = 0; c < cells; ++c)
                differ += memcmp(&got->scores[c], &want->scores[c], sizeof(float)) != 0;
            for (size_t k = 0; k < picks; ++k)
                differ += (got->topk[k] != want->topk[k]) + (got->fused[k] != want->fused[k]);
        }
        for (int r = 0; r < rounds; ++r) layer_outputs_free(&w[i].outputs[r]);
        free(w[i].outputs);
    }
    CHECK(differ == 0, "%s %s: %ld cells of concurrent layers differ from the serial runs", label,
          batch->spec.name, differ);
    CHECK(guard_hits == 0, "%s %s: %ld writes past the outputs", label, batch->spec.name,
          guard_hits);
    for (int l = 0; l < layers; ++l) layer_outputs_free(&serial[l]);
    free(serial);
    free(w);
    free(threads);
}
