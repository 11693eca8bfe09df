/*
 * A fuzzer of the public C API on the cpu backend, as a caller would misuse it: random configs,
 * batch descriptors and metadata (valid and broken; some batches one rank of a context-parallel
 * batch), NULL and misaligned pointers, metadata rewritten after planning, top-k of hostile
 * scores into contiguous or strided rows, candidates and their context-parallel merge (ranks'
 * candidates or hostile ones), index preparation (strides, page layout, cos/sin table or theta,
 * positions and slots in the data), and the conversions at odd addresses. Every buffer is allocated
 * to exactly the bytes a call may touch, so AddressSanitizer stops any overrun.
 *
 * An oracle written from the header and SPEC.md (not from src/) predicts each call's outcome. A
 * finding is: a valid call rejected, an invalid call accepted, a rejection whose message names
 * none of the bad arguments, a score outside SPEC section 3's exact tolerance against an FP64
 * brute force, a cell p >= nvp written, a top-k, candidate or merged row unlike the full-sort
 * oracle's (on the library's own scores, or on those the ranks' candidates came from), or an
 * entry between strided rows written.
 *
 * Two drivers share one scenario, run_scenario():
 *  - libFuzzer (clang, -DMSAIDX_FUZZ_LIBFUZZER): the input bytes drive every choice; a finding
 *    aborts so libFuzzer keeps the input.
 *  - standalone (any compiler): scenario i of seed s draws its choices from splitmix64(s, i);
 *    `fuzz_api --seconds N [--seed S] [--only I]`, prints its counts, exits 1 on any finding.
 */
#include "backend_cases.h"
#include "cp_oracle.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- choices: from the fuzzer's bytes, or from a PRNG ---------------------------------- */

typedef struct source {
    const uint8_t *data; /* NULL: draw from rng */
    size_t size, pos;
    uint64_t rng;
} source;

static uint64_t splitmix(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t draw(source *s) {
    if (!s->data) return (uint32_t)(splitmix(&s->rng) >> 32);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = v << 8 | (s->pos < s->size ? s->data[s->pos++] : 0);
    return v;
}
/* Uniform in [lo, hi] (hi - lo < 2^32). Fuzzer bytes: one per choice of at most 256 values, so
 * short inputs already reach deep into a scenario. */
static int64_t pick(source *s, int64_t lo, int64_t hi) {
    const uint64_t range = (uint64_t)(hi - lo + 1);
    if (s->data && range <= 256)
        return lo + (int64_t)((s->pos < s->size ? s->data[s->pos++] : 0) % range);
    return lo + (int64_t)(draw(s) % range);
}
static bool chance(source *s, int percent) { return pick(s, 0, 99) < percent; }

/* Edge values that break int arithmetic or bounds. */
static int32_t hostile_int(source *s) {
    static const int32_t values[] = {
        INT32_MIN, -(1 << 30), -5,   -1,   0,    1,      2,       15,      16,      17,
        64,        65,         1023, 1024, 1025, 100000, 1 << 28, 1 << 29, 1 << 30, INT32_MAX - 1,
        INT32_MAX};
    return values[pick(s, 0, (int64_t)(sizeof values / sizeof values[0]) - 1)];
}

/* ---- counts and findings ---------------------------------------------------------------- */

static struct {
    uint64_t scenarios, calls, accepted, rejected, cells, topk_rows, conversions;
    uint64_t findings;
} counts;
static bool abort_on_finding;
static uint64_t current_seed, current_index;

/* Counts a finding and prints the first 20 with the line that replays them. */
static void finding(const char *format, ...) __attribute__((format(printf, 1, 2)));
static void finding(const char *format, ...) {
    ++counts.findings;
    if (counts.findings <= 20) {
        va_list args;
        va_start(args, format);
        fprintf(stderr,
                "FINDING (replay: fuzz_api --seed %" PRIu64 " --only %" PRIu64 "): ", current_seed,
                current_index);
        vfprintf(stderr, format, args);
        fputc('\n', stderr);
        va_end(args);
    }
    if (abort_on_finding) abort();
}

/* Judges one call against the oracle: `bad_names` lists, '|'-separated, what the oracle found
 * bad ("" when it predicts acceptance). `refusal` is the status a rejection must have. */
static bool judged(msaidx_status got, const char *bad_names, msaidx_status refusal,
                   const char *call) {
    ++counts.calls;
    const bool predicted_ok = bad_names[0] == '\0';
    if (got == MSAIDX_SUCCESS) {
        ++counts.accepted;
        if (!predicted_ok) finding("%s: accepted, but the oracle found bad: %s", call, bad_names);
        return true;
    }
    ++counts.rejected;
    const char *message = msaidx_last_error();
    if (predicted_ok) {
        finding("%s: rejected a valid call with %s: %s", call, msaidx_status_string(got), message);
        return false;
    }
    if (got != refusal)
        finding("%s: returned %s, want %s (%s)", call, msaidx_status_string(got),
                msaidx_status_string(refusal), message);
    /* The message names one of the bad arguments. */
    bool named = false;
    char names[512];
    snprintf(names, sizeof names, "%s", bad_names);
    for (char *name = strtok(names, "|"); name && !named; name = strtok(NULL, "|"))
        named = strstr(message, name) != NULL;
    if (!named) finding("%s: message \"%s\" names none of: %s", call, message, bad_names);
    return false;
}

static void add_bad(char *list, size_t size, const char *name) {
    const size_t used = strlen(list);
    snprintf(list + used, size - used, "%s%s", used ? "|" : "", name);
}
#define BAD(list, name) add_bad(list, sizeof list, name)

/* ---- exactly sized buffers ---------------------------------------------------------------- */

/* `bytes` at an address with the given alignment; ASan guards the byte after the last. */
static void *exact_alloc(size_t bytes, size_t alignment) {
    void *p = NULL;
    if (posix_memalign(&p, alignment < sizeof(void *) ? sizeof(void *) : alignment,
                       bytes ? bytes : 1))
        return NULL;
    return p;
}

/* A pointer the API must refuse, or the good one. kind: 0 good, 1 NULL, 2 misaligned. */
static const void *maybe_bad_pointer(const void *good, int kind, size_t offset) {
    if (kind == 1) return NULL;
    if (kind == 2) return (const char *)good + offset; /* rejected before any access */
    return good;
}

/* ---- the oracle -------------------------------------------------------------------------- */

static int32_t max_threads(void) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const long bound = cores > 0 ? 4 * cores : 4;
    return bound < 1024 ? (int32_t)bound : 1024;
}

static void config_oracle(const msaidx_config *c, char *bad, size_t size) {
    bad[0] = '\0';
    if (c->struct_size != sizeof *c) {
        add_bad(bad, size, "config.struct_size");
        return; /* nothing else may be read */
    }
    if (c->head_dim < 16 || c->head_dim > 256 || c->head_dim % 16)
        add_bad(bad, size, "config.head_dim");
    if (c->page_size < 16 || c->page_size > 512 || c->page_size % 16)
        add_bad(bad, size, "config.page_size");
    if (c->num_heads < 1 || c->num_heads > 16) add_bad(bad, size, "config.num_heads");
    if (c->topk < 1 || c->topk > 64) add_bad(bad, size, "config.topk");
    if (c->init_blocks < 0) add_bad(bad, size, "config.init_blocks");
    if (c->local_blocks < 0) add_bad(bad, size, "config.local_blocks");
    if (c->init_blocks >= 0 && c->local_blocks >= 0 &&
        (int64_t)c->init_blocks + c->local_blocks > c->topk)
        add_bad(bad, size, "config.init_blocks");
    if (c->dtype != MSAIDX_DTYPE_E4M3 && c->dtype != MSAIDX_DTYPE_BF16)
        add_bad(bad, size, "config.dtype");
    if ((int)c->backend < 0 || (int)c->backend > 4) add_bad(bad, size, "config.backend");
    if (c->device < -1) add_bad(bad, size, "config.device");
    if (c->num_threads < 0 || c->num_threads > max_threads())
        add_bad(bad, size, "config.num_threads");
    if (c->precision != MSAIDX_PRECISION_DEFAULT && c->precision != MSAIDX_PRECISION_EXACT)
        add_bad(bad, size, "config.precision");
    if (c->fast_accumulation < -1 || c->fast_accumulation > 1 ||
        (c->fast_accumulation == 1 && c->precision == MSAIDX_PRECISION_EXACT))
        add_bad(bad, size, "config.fast_accumulation");
}

static int64_t pages_of(int64_t tokens, int32_t page_size) {
    return (tokens + page_size - 1) / page_size;
}

static void desc_oracle(const msaidx_config *c, const msaidx_batch_desc *d, char *bad,
                        size_t size) {
    bad[0] = '\0';
    if (d->struct_size != sizeof *d) {
        add_bad(bad, size, "desc.struct_size");
        return;
    }
    if (d->batch_size < 0) add_bad(bad, size, "desc.batch_size");
    if (d->num_tokens < 0) add_bad(bad, size, "desc.num_tokens");
    if (d->max_q_len < 0 || d->max_q_len > d->num_tokens) add_bad(bad, size, "desc.max_q_len");
    if (d->max_seq_len < 0) add_bad(bad, size, "desc.max_seq_len");
    if (d->num_pages < 1) add_bad(bad, size, "desc.num_pages");
    /* Context parallel: a rank's rows and columns hold ceil(pages / world) pages. */
    if (d->cp_world < 0) add_bad(bad, size, "desc.cp_world");
    const int64_t world = d->cp_world > 1 ? d->cp_world : 1;
    if (d->cp_rank < 0 || d->cp_rank >= world) add_bad(bad, size, "desc.cp_rank");
    if (d->cp_layout != MSAIDX_CP_INTERLEAVED && d->cp_layout != MSAIDX_CP_CONTIGUOUS)
        add_bad(bad, size, "desc.cp_layout");
    const int64_t max_pages =
        d->max_seq_len >= 0 ? (pages_of(d->max_seq_len, c->page_size) + world - 1) / world : 0;
    if (d->bt_stride < 1 || d->bt_stride < max_pages) add_bad(bad, size, "desc.bt_stride");
    if (d->pitch < 1 || d->pitch < max_pages) add_bad(bad, size, "desc.pitch");
    const int64_t elem = c->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    if (d->page_stride < (int64_t)c->page_size * c->head_dim * elem || d->page_stride % 16)
        add_bad(bad, size, "desc.page_stride");
}

/* Context parallel: the desc's layout, world and rank for cp_oracle.h's reading of
 * msaidx_cp_layout (an unsharded desc is world 1, whose one rank owns every page). */
#define DESC_SHARD(d)                                                                              \
    (d)->cp_layout, ((d)->cp_world > 1 ? (d)->cp_world : 1), ((d)->cp_world > 1 ? (d)->cp_rank : 0)

/* Host metadata rules (SPEC section 2 and the header's plan_batch; a sharded row's visible entries
 * are the rank's own pages); desc NULL: num_valid_pages, which has no desc bounds and reads no
 * block table. */
static void metadata_oracle(const msaidx_config *c, const msaidx_batch_desc *d, int32_t B,
                            int32_t T, const int32_t *cu, const int32_t *seq, const int32_t *table,
                            char *bad, size_t size) {
    bad[0] = '\0';
    if (cu[0] != 0) add_bad(bad, size, "cu_seqlens_q");
    for (int32_t b = 0; b < B; ++b) {
        const int64_t q_len = (int64_t)cu[b + 1] - cu[b];
        if (q_len < 0 || cu[b + 1] > T) add_bad(bad, size, "cu_seqlens_q");
        if (seq[b] < 0 || q_len > seq[b]) add_bad(bad, size, "seq_lens");
        if (d && q_len > d->max_q_len) add_bad(bad, size, "cu_seqlens_q");
        if (d && seq[b] > d->max_seq_len) add_bad(bad, size, "seq_lens");
        if (d && table && q_len > 0 && seq[b] >= 0 && seq[b] <= d->max_seq_len) {
            const int64_t P = pages_of(seq[b], c->page_size);
            for (int64_t p = 0; p < owned_below(DESC_SHARD(d), (int32_t)P, (int32_t)P); ++p) {
                const int32_t page = table[(size_t)b * d->bt_stride + p];
                if (page < 0 || page >= d->num_pages) add_bad(bad, size, "block_table");
            }
        }
    }
}

/* ---- independent scoring reference ------------------------------------------------------- */

typedef struct batch {
    msaidx_config config;
    msaidx_batch_desc desc;
    int32_t *cu, *seq, *table; /* exactly [B+1], [B], [B * bt_stride] */
    uint8_t *q, *k;            /* exactly T*H*D and (num_pages-1)*page_stride + P*D elements */
    size_t q_bytes, k_bytes;
    int32_t *nvp; /* [T], the oracle's */
} batch;

/* bc_elem_value through a table of the 256 E4M3 values (the brute force's inner loop). */
static double element(msaidx_dtype dtype, const void *base, size_t index) {
    static double e4m3[256];
    static bool filled;
    if (!filled) {
        for (int code = 0; code < 256; ++code) e4m3[code] = bc_e4m3_value((uint8_t)code);
        filled = true;
    }
    if (dtype == MSAIDX_DTYPE_BF16) return bc_elem_value(dtype, base, index);
    return e4m3[((const uint8_t *)base)[index]];
}

/* The oracle's nvp of valid metadata. */
/* The request token t belongs to in the batch as planned, -1 for padding. */
static int32_t request_of(const batch *x, int32_t t) {
    for (int32_t b = 0; b < x->desc.batch_size; ++b)
        if (t >= x->cu[b] && t < x->cu[b + 1]) return b;
    return -1;
}

/* Visible pages of every token: the global count, or (own_pages) the pages among them that the
 * desc's rank owns (a sharded plan's nvp). */
static void oracle_nvp(const batch *x, const int32_t *cu, const int32_t *seq, bool own_pages,
                       int32_t *nvp) {
    const int32_t B = x->desc.batch_size, P = x->config.page_size;
    for (int32_t t = 0; t < x->desc.num_tokens; ++t) nvp[t] = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t q_len = cu[b + 1] - cu[b];
        for (int32_t i = 0; i < q_len; ++i) {
            const int32_t visible = (seq[b] - q_len + i) / P + 1;
            nvp[cu[b] + i] =
                own_pages ? owned_below(DESC_SHARD(&x->desc), (int32_t)pages_of(seq[b], P), visible)
                          : visible;
        }
    }
}

/* scores [T, H, pitch] against FP64: |S - ref| <= 2e-4 max(1, |ref|) + 2^-16 A (SPEC section 3),
 * A the largest sum_d |q_d k_d| over the page's visible keys; cells p >= nvp still poison. Column p
 * of a sharded plan is the rank's p-th own page.
 * x's metadata is the metadata as planned. */
static void check_scores(const batch *x, const float *scores, const char *label) {
    const int32_t *cu = x->cu, *seq = x->seq, *table = x->table;
    const msaidx_config *c = &x->config;
    const msaidx_batch_desc *d = &x->desc;
    const int32_t H = c->num_heads, D = c->head_dim, P = c->page_size;
    long bad = 0;
    for (int32_t t = 0; t < d->num_tokens; ++t) {
        int32_t b = -1;
        for (int32_t r = 0; r < d->batch_size; ++r)
            if (t >= cu[r] && t < cu[r + 1]) b = r;
        const int32_t nvp = x->nvp[t];
        const int32_t pos = b >= 0 ? seq[b] - (cu[b + 1] - cu[b]) + (t - cu[b]) : -1;
        for (int32_t h = 0; h < H; ++h) {
            const float *row = scores + ((size_t)t * H + h) * d->pitch;
            for (int32_t p = nvp; p < d->pitch; ++p)
                if (!bc_is_poison(row[p]) && !bad++)
                    finding("%s: t=%d h=%d p=%d >= nvp %d written (%g)", label, t, h, p, nvp,
                            row[p]);
            double q_row[256];
            for (int32_t e = 0; e < D; ++e)
                q_row[e] = element(c->dtype, x->q, ((size_t)t * H + h) * D + (size_t)e);
            for (int32_t p = 0; p < nvp; ++p) {
                const char *page = (const char *)x->k +
                                   (size_t)table[(size_t)b * d->bt_stride + p] * d->page_stride;
                const int64_t global = global_page(DESC_SHARD(d), (int32_t)pages_of(seq[b], P), p);
                double best = -INFINITY, largest_abs = 0.0;
                for (int32_t j = 0; j < P && global * P + j <= pos; ++j) {
                    double dot = 0.0, abs_sum = 0.0;
                    for (int32_t e = 0; e < D; ++e) {
                        const double product =
                            q_row[e] * element(c->dtype, page, (size_t)j * D + (size_t)e);
                        dot += product;
                        abs_sum += fabs(product);
                    }
                    if (dot > best) best = dot;
                    if (abs_sum > largest_abs) largest_abs = abs_sum;
                }
                ++counts.cells;
                const double bound = bc_exact_bound(best, largest_abs);
                if (!(fabs((double)row[p] - best) <= bound) && !bad++)
                    finding("%s: t=%d h=%d p=%d: got %.9g, FP64 %.9g, bound %.3g (%s, D %d, "
                            "page %d)",
                            label, t, h, p, row[p], best, bound,
                            c->dtype == MSAIDX_DTYPE_BF16 ? "bf16" : "e4m3", D, P);
            }
        }
    }
}

/* msaidx_topk_select (contiguous rows, no bound), msaidx_topk_select_strided (strided rows), or
 * msaidx_topk_select_bounded by *max_nvp when max_nvp is not NULL. */
static msaidx_status select_topk(const msaidx_context *context, const msaidx_config *c,
                                 const float *scores, int32_t pitch, const int32_t *max_nvp,
                                 const int32_t *nvp, int32_t T, int32_t *out, int64_t stride_t,
                                 int64_t stride_h) {
    const bool contiguous = stride_t == (int64_t)c->num_heads * c->topk && stride_h == c->topk;
    if (max_nvp)
        return msaidx_topk_select_bounded(context, scores, pitch, *max_nvp, nvp, T, out, stride_t,
                                          stride_h, NULL);
    if (contiguous) return msaidx_topk_select(context, scores, pitch, nvp, T, out, NULL);
    return msaidx_topk_select_strided(context, scores, pitch, nvp, T, out, stride_t, stride_h,
                                      NULL);
}

#define OUT_POISON (INT32_MIN + 7)

/* Rows of T x H x K entries written at `strides` into out[span] (poisoned before the call): each
 * equal to want's row (contiguous), every entry between rows still poison. */
static void check_strided_rows(const int32_t *out, size_t span, int64_t stride_t, int64_t stride_h,
                               int32_t T, int32_t H, int32_t K, const int32_t *want,
                               const char *label) {
    bool *in_row = calloc(span ? span : 1, sizeof(bool));
    if (!in_row) exit(2);
    for (int32_t t = 0; t < T; ++t)
        for (int32_t h = 0; h < H; ++h) {
            const int64_t at = (int64_t)t * stride_t + (int64_t)h * stride_h;
            ++counts.topk_rows;
            if (memcmp(out + at, want + ((size_t)t * H + h) * K, sizeof(int32_t) * (size_t)K))
                finding("%s: row (%d, %d) differs from the oracle's (first %d vs %d)", label, t, h,
                        out[at], want[((size_t)t * H + h) * K]);
            for (int32_t k = 0; k < K; ++k) in_row[at + k] = true;
        }
    for (size_t i = 0; i < span; ++i)
        if (!in_row[i] && out[i] != OUT_POISON) {
            finding("%s: entry %zu between the rows was written", label, i);
            break;
        }
    free(in_row);
}

/* Top-k of the library's own scores (through select_topk, rows at the given strides): exactly
 * the full-sort oracle's rows, nothing written between them. */
static void check_topk(const msaidx_context *context, const msaidx_config *c, const float *scores,
                       int32_t pitch, const int32_t *max_nvp, const int32_t *nvp, int32_t T,
                       int64_t stride_t, int64_t stride_h, size_t span, const char *label) {
    const size_t picks = (size_t)T * c->num_heads * c->topk;
    int32_t *out = exact_alloc(sizeof(int32_t) * span, 4);
    int32_t *want = malloc(sizeof(int32_t) * (picks ? picks : 1));
    if (!out || !want) exit(2);
    for (size_t i = 0; i < span; ++i) out[i] = OUT_POISON;
    if (judged(select_topk(context, c, scores, pitch, max_nvp, nvp, T, out, stride_t, stride_h), "",
               MSAIDX_ERROR_INVALID_ARGUMENT, label)) {
        bc_topk_oracle(c, scores, pitch, nvp, T, want);
        check_strided_rows(out, span, stride_t, stride_h, T, c->num_heads, c->topk, want, label);
    }
    free(out);
    free(want);
}

/* check_topk with contiguous rows. */
static void check_topk_contiguous(const msaidx_context *context, const msaidx_config *c,
                                  const float *scores, int32_t pitch, const int32_t *nvp, int32_t T,
                                  const char *label) {
    check_topk(context, c, scores, pitch, NULL, nvp, T, (int64_t)c->num_heads * c->topk, c->topk,
               (size_t)T * c->num_heads * c->topk, label);
}

/* The header's rule for rows of `length` entries at t * stride_t + h * stride_h: strides >= 0
 * and, when there are rows, the last row's end a 64-bit byte offset and no two rows overlapping
 * (of the dimensions of extent > 1, the smaller stride >= length and the other >= the smaller
 * one times its extent). */
static bool row_strides_ok(int64_t stride_t, int64_t stride_h, int32_t T, int32_t H,
                           int32_t length) {
    if (stride_t < 0 || stride_h < 0) return false;
    if (T == 0 || H == 0) return true; /* no rows */
    const bool steps_t = T > 1, steps_h = H > 1;
    const long double end = (long double)(steps_t ? T - 1 : 0) * stride_t +
                            (long double)(steps_h ? H - 1 : 0) * stride_h + length;
    if (end > (long double)(INT64_MAX / 4)) return false;
    if (!steps_t && !steps_h) return true;
    if (steps_t != steps_h) return (steps_t ? stride_t : stride_h) >= length;
    const bool h_inner = stride_h <= stride_t;
    const int64_t inner = h_inner ? stride_h : stride_t, outer = h_inner ? stride_t : stride_h;
    return inner >= length && (long double)outer >= (long double)inner * (h_inner ? H : T);
}

/* Output strides (int32 elements) of T x H rows of K entries as callers lay them out: contiguous,
 * the transpose of [H, T, K], rows padded apart, or anything small, negative or past 64 bits.
 * Returns the entries the rows span; 0 when the oracle rejects the strides (named in `bad`). */
static size_t pick_row_strides(source *s, int32_t T, int32_t H, int32_t K, int64_t *stride_t,
                               int64_t *stride_h, char *bad, size_t size) {
    switch (pick(s, 0, 9)) {
    case 0: *stride_t = K, *stride_h = (int64_t)T * K; break; /* [H, T, K] */
    case 1:
    case 2:
        *stride_h = K + pick(s, 0, 3);
        *stride_t = (int64_t)H * *stride_h + pick(s, 0, 3);
        break;
    case 3: { /* each near a boundary of the rule */
        const int64_t near[] = {0,
                                K - 1,
                                K,
                                K + 1,
                                (int64_t)H * K - 1,
                                (int64_t)H * K,
                                (int64_t)T * K - 1,
                                (int64_t)T * K,
                                pick(s, -2, 2 * K)};
        *stride_t = near[pick(s, 0, 8)];
        *stride_h = near[pick(s, 0, 8)];
        break;
    }
    case 4: *stride_t = chance(s, 50) ? -1 : INT64_MAX / 2, *stride_h = K; break;
    default: *stride_h = K, *stride_t = (int64_t)H * K; break;
    }
    if (!row_strides_ok(*stride_t, *stride_h, T, H, K)) {
        add_bad(bad, size, "out_stride");
        return 0;
    }
    if (T == 0 || H == 0) return 0;
    return (size_t)((T > 1 ? (T - 1) * *stride_t : 0) + (H > 1 ? (H - 1) * *stride_h : 0) + K);
}

/* pick_row_strides for msaidx_topk_args, where out_stride_t = out_stride_h = 0 means contiguous
 * rather than rows on top of each other. */
static size_t pick_args_strides(source *s, int32_t T, int32_t H, int32_t K, int64_t *stride_t,
                                int64_t *stride_h, char *bad, size_t size) {
    for (;;) {
        char verdict[64] = "";
        const size_t span =
            pick_row_strides(s, T, H, K, stride_t, stride_h, verdict, sizeof verdict);
        if (*stride_t == 0 && *stride_h == 0) continue;
        if (verdict[0]) add_bad(bad, size, verdict);
        return span;
    }
}

/* Row (t, h) of K entries at t * stride_t + h * stride_h of `strided`, contiguous in `rows`. */
static void gather_rows(const int32_t *strided, int64_t stride_t, int64_t stride_h, int32_t T,
                        int32_t H, int32_t K, int32_t *rows) {
    for (int32_t t = 0; t < T; ++t)
        for (int32_t h = 0; h < H; ++h)
            memcpy(rows + ((size_t)t * H + h) * K, strided + t * stride_t + h * stride_h,
                   sizeof(int32_t) * (size_t)K);
}

/* ---- generation -------------------------------------------------------------------------- */

static void random_config(source *s, msaidx_config *c) {
    msaidx_config_init(c);
    c->backend = chance(s, 50) ? MSAIDX_BACKEND_CPU : MSAIDX_BACKEND_AUTO;
    c->head_dim = 16 * (int32_t)(chance(s, 70) ? pick(s, 1, 8) : pick(s, 1, 16));
    static const int32_t page_sizes[] = {16, 32, 48, 64, 128, 128, 256, 512};
    c->page_size = page_sizes[pick(s, 0, 7)];
    c->num_heads = (int32_t)(chance(s, 85) ? pick(s, 1, 4) : pick(s, 1, 16));
    c->topk = (int32_t)(chance(s, 60) ? pick(s, 1, 8) : pick(s, 1, 64));
    c->init_blocks = (int32_t)pick(s, 0, c->topk);
    c->local_blocks = (int32_t)pick(s, 0, c->topk - c->init_blocks);
    c->dtype = chance(s, 60) ? MSAIDX_DTYPE_E4M3 : MSAIDX_DTYPE_BF16;
    c->num_threads = (int32_t)pick(s, 0, 2);
    c->fast_accumulation = (int32_t)pick(s, -1, 1);
    c->precision = chance(s, 50) ? MSAIDX_PRECISION_DEFAULT : MSAIDX_PRECISION_EXACT;
    const int mutations = chance(s, 75) ? 0 : (int)pick(s, 1, 2);
    for (int m = 0; m < mutations; ++m) {
        const int32_t v = hostile_int(s);
        switch (pick(s, 0, 13)) {
        case 0: c->struct_size = chance(s, 50) ? 0 : sizeof *c + 8; break;
        case 1: c->head_dim = v; break;
        case 2: c->page_size = v; break;
        case 3: c->num_heads = v; break;
        case 4: c->topk = v; break;
        case 5: c->init_blocks = v; break;
        case 6: c->local_blocks = v; break;
        case 7: c->dtype = (msaidx_dtype)v; break;
        case 8: c->backend = (msaidx_backend)(chance(s, 50) ? v : (int32_t)pick(s, 2, 4)); break;
        case 9: c->device = chance(s, 50) ? v : -2; break;
        case 10: c->num_threads = v; break;
        case 11: c->fast_accumulation = v; break;
        case 12: c->precision = (msaidx_precision)v; break;
        default: /* init + local just above topk, or overflowing */
            c->init_blocks = chance(s, 50) ? INT32_MAX : c->topk;
            c->local_blocks = 1;
            break;
        }
    }
}

/* Valid metadata and a desc that admits it, at a cost a sanitized brute force affords. */
static void random_batch(source *s, batch *x) {
    const msaidx_config *c = &x->config;
    const int32_t P = c->page_size;
    const int32_t B = (int32_t)pick(s, 0, 4);
    int32_t q_lens[4], seq[4], T_used = 0, max_q = 0, max_seq = 0;
    const int64_t budget = 3000000; /* multiply-adds of the brute force */
    for (int32_t b = 0; b < B; ++b) {
        q_lens[b] = (int32_t)(chance(s, 40) ? pick(s, 0, 2) : pick(s, 0, 24));
        seq[b] = q_lens[b] + (int32_t)(chance(s, 30) ? pick(s, 0, 3) : pick(s, 0, 5 * P));
        while ((int64_t)q_lens[b] * c->num_heads * c->head_dim * (seq[b] + 1) > budget / 4)
            seq[b] = q_lens[b] + (seq[b] - q_lens[b]) / 2, q_lens[b] = (q_lens[b] + 1) / 2;
        if (seq[b] < q_lens[b]) seq[b] = q_lens[b];
        T_used += q_lens[b];
        if (q_lens[b] > max_q) max_q = q_lens[b];
        if (seq[b] > max_seq) max_seq = seq[b];
    }
    msaidx_batch_desc *d = &x->desc;
    msaidx_batch_desc_init(d);
    d->batch_size = B;
    d->num_tokens = T_used + (int32_t)pick(s, 0, 3);
    d->max_q_len = max_q + (int32_t)pick(s, 0, 2);
    if (d->max_q_len > d->num_tokens) d->max_q_len = d->num_tokens;
    d->max_seq_len = max_seq + (int32_t)pick(s, 0, P);
    if (chance(s, 25)) { /* one rank of a context-parallel batch */
        d->cp_world = (int32_t)pick(s, 2, 4);
        d->cp_rank = (int32_t)pick(s, 0, d->cp_world - 1);
        d->cp_layout = chance(s, 50) ? MSAIDX_CP_INTERLEAVED : MSAIDX_CP_CONTIGUOUS;
    }
    const int32_t W = d->cp_world > 1 ? d->cp_world : 1;
    const int32_t max_pages = (int32_t)((pages_of(d->max_seq_len, P) + W - 1) / W);
    int32_t owned[4], used_pages = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t pages = (int32_t)pages_of(seq[b], P);
        owned[b] = owned_below(DESC_SHARD(d), pages, pages);
        used_pages += owned[b];
    }
    d->num_pages = used_pages + (int32_t)pick(s, 1, 3);
    d->bt_stride = (max_pages > 0 ? max_pages : 1) + (int32_t)pick(s, 0, 2);
    d->pitch = (max_pages > 0 ? max_pages : 1) + (int32_t)pick(s, 0, 2);
    const int64_t elem = c->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    d->page_stride = (int64_t)P * c->head_dim * elem + 16 * pick(s, 0, 2);

    x->cu = exact_alloc(sizeof(int32_t) * ((size_t)B + 1), 4);
    x->seq = exact_alloc(sizeof(int32_t) * ((size_t)B ? (size_t)B : 1), 4);
    x->table = exact_alloc(sizeof(int32_t) * (size_t)B * (size_t)d->bt_stride, 4);
    if (!x->cu || !x->seq || !x->table) exit(2);
    x->cu[0] = 0;
    for (int32_t b = 0; b < B; ++b) {
        x->cu[b + 1] = x->cu[b] + q_lens[b];
        x->seq[b] = seq[b];
    }
    /* Pages dealt out at random; entries past a request's (own) pages hostile (they are
     * ignored). */
    int32_t *order = malloc(sizeof(int32_t) * (size_t)d->num_pages);
    if (!order) exit(2);
    for (int32_t i = 0; i < d->num_pages; ++i) order[i] = i;
    for (int32_t i = d->num_pages - 1; i > 0; --i) {
        const int32_t j = (int32_t)pick(s, 0, i), v = order[i];
        order[i] = order[j];
        order[j] = v;
    }
    int32_t next = 0;
    for (int32_t b = 0; b < B; ++b)
        for (int32_t p = 0; p < d->bt_stride; ++p)
            x->table[(size_t)b * d->bt_stride + p] = p < owned[b] ? order[next++] : hostile_int(s);
    free(order);

    const size_t H = (size_t)c->num_heads, D = (size_t)c->head_dim;
    x->q_bytes = (size_t)d->num_tokens * H * D * (size_t)elem;
    x->k_bytes = (size_t)(d->num_pages - 1) * (size_t)d->page_stride + (size_t)P * D * (size_t)elem;
    x->q = exact_alloc(x->q_bytes, 16);
    x->k = exact_alloc(x->k_bytes, 16);
    if (!x->q || !x->k) exit(2);
    /* Finite values: E4M3 codes but its NaNs; BF16 of exponents 2^-8 .. 2^8. Sometimes large
     * values that cancel, where the tolerance's 2^-16 A term matters. Sometimes (BF16) the even
     * dimensions pair a subnormal with 2^116 .. 2^124, on the query or the key side: products of
     * 2^-17 .. 2^-2 that a scorer flushing subnormals to zero loses. */
    const bool cancelling = chance(s, 20);
    const bool subnormal_pairs = elem == 2 && chance(s, 10), subnormal_queries = chance(s, 50);
    for (size_t i = 0; i < x->q_bytes + x->k_bytes; i += (size_t)elem) {
        const bool is_q = i < x->q_bytes;
        uint8_t *at = is_q ? x->q + i : x->k + (i - x->q_bytes);
        const uint32_t r = draw(s);
        const size_t dim = (is_q ? i : (i - x->q_bytes) % (size_t)d->page_stride) / 2 % D;
        if (elem == 1) {
            uint8_t code = (uint8_t)(r & 0xFF);
            if ((code & 0x7F) == 0x7F) code ^= 1;
            if (cancelling) code = (uint8_t)((code & 0x80) | 0x70 | (code & 7));
            *at = code;
        } else if (subnormal_pairs && dim % 2 == 0) {
            const uint16_t sign = (uint16_t)((r & 1) << 15), mantissa = (uint16_t)((r >> 1) & 0x7F);
            const uint16_t bits =
                is_q == subnormal_queries
                    ? (uint16_t)(sign | (mantissa ? mantissa : 1))
                    : (uint16_t)(sign | (uint16_t)(243 + (r >> 8) % 9) << 7 | mantissa);
            memcpy(at, &bits, 2);
        } else {
            const uint16_t exponent =
                (uint16_t)(cancelling ? 135 + (r >> 8) % 4 : 119 + (r >> 8) % 17);
            const uint16_t bits = (uint16_t)(((r & 1) << 15) | (exponent << 7) | ((r >> 1) & 0x7F));
            memcpy(at, &bits, 2);
        }
    }
    x->nvp = malloc(sizeof(int32_t) * ((size_t)d->num_tokens + 1));
    if (!x->nvp) exit(2);
    oracle_nvp(x, x->cu, x->seq, true, x->nvp);
}

static void free_batch(batch *x) {
    free(x->cu);
    free(x->seq);
    free(x->table);
    free(x->q);
    free(x->k);
    free(x->nvp);
}

/* Breaks one desc field (the oracle decides whether it stayed valid). */
static void mutate_desc(source *s, msaidx_batch_desc *d) {
    const int32_t v = hostile_int(s);
    switch (pick(s, 0, 10)) {
    case 0: d->struct_size = chance(s, 50) ? 0 : sizeof *d - 4; break;
    case 1: d->batch_size = v; break;
    case 2: d->num_tokens = v; break;
    case 3: d->max_q_len = chance(s, 50) ? v : d->num_tokens + 1; break;
    case 4: d->max_seq_len = v; break;
    case 5: d->num_pages = v; break;
    case 6: d->bt_stride = chance(s, 50) ? v : d->bt_stride - 1; break;
    case 7: d->pitch = chance(s, 50) ? v : d->pitch - 1; break;
    case 8: d->page_stride = chance(s, 50) ? (int64_t)v : d->page_stride - 8; break;
    case 9:
        d->cp_world = chance(s, 50) ? v : (int32_t)pick(s, 0, 5);
        d->cp_rank = chance(s, 50) ? hostile_int(s) : (int32_t)pick(s, 0, 5);
        d->cp_layout = chance(s, 80) ? (int32_t)pick(s, 0, 1) : hostile_int(s);
        break;
    default: d->max_seq_len = v, d->bt_stride = v, d->pitch = v; break;
    }
}

/* Breaks the metadata in one of the ways SPEC.md names (or leaves it valid by chance). */
static void mutate_metadata(source *s, const batch *x, int32_t *cu, int32_t *seq, int32_t *table) {
    const int32_t B = x->desc.batch_size;
    if (B == 0) {
        cu[0] = chance(s, 50) ? hostile_int(s) : 0;
        return;
    }
    const int32_t b = (int32_t)pick(s, 0, B - 1);
    switch (pick(s, 0, 6)) {
    case 0: cu[0] = hostile_int(s); break;
    case 1: cu[b + 1] = hostile_int(s); break;
    case 2: cu[B] = x->desc.num_tokens + (int32_t)pick(s, 1, 3); break;
    case 3: seq[b] = hostile_int(s); break;
    case 4: seq[b] = cu[b + 1] - cu[b] - 1; break;
    case 5: seq[b] = x->desc.max_seq_len + 1; break;
    default: {
        if (!table) break;
        const size_t at = (size_t)b * x->desc.bt_stride + (size_t)pick(s, 0, x->desc.bt_stride - 1);
        table[at] = chance(s, 50) ? hostile_int(s) : x->desc.num_pages;
        break;
    }
    }
}

/* ---- scenarios ----------------------------------------------------------------------------- */

static void fuzz_conversions(source *s) {
    const size_t n = (size_t)pick(s, 0, 40), offset = (size_t)pick(s, 0, 3);
    uint8_t *codes = exact_alloc(n + offset, 1), *wide = exact_alloc(4 * n + offset, 1);
    if (!codes || !wide) exit(2);
    for (size_t i = 0; i < n; ++i) codes[offset + i] = (uint8_t)draw(s);
    float *floats = (float *)(void *)(wide + offset); /* any byte address is allowed */
    msaidx_e4m3_to_float(codes + offset, floats, n);
    for (size_t i = 0; i < n; ++i) {
        float got;
        memcpy(&got, wide + offset + 4 * i, 4);
        const double want = bc_e4m3_value(codes[offset + i]);
        if (!(got == want || (isnan(got) && isnan(want))))
            finding("e4m3_to_float(0x%02x) = %g, want %g", codes[offset + i], got, want);
    }
    uint8_t *back = exact_alloc(n ? n : 1, 1);
    if (!back) exit(2);
    msaidx_e4m3_from_float(floats, back, n);
    for (size_t i = 0; i < n; ++i)
        if ((codes[offset + i] & 0x7F) != 0x7F && back[i] != codes[offset + i] &&
            !(codes[offset + i] == 0x80 && back[i] == 0x80))
            finding("e4m3 round trip of 0x%02x gave 0x%02x", codes[offset + i], back[i]);
    /* BF16 at odd addresses both ways. */
    uint8_t *halves = exact_alloc(2 * n + offset, 1);
    if (!halves) exit(2);
    for (size_t i = 0; i < 2 * n; ++i) halves[offset + i] = (uint8_t)draw(s);
    msaidx_bf16_to_float((const uint16_t *)(const void *)(halves + offset), floats, n);
    msaidx_bf16_from_float(floats, (uint16_t *)(void *)(halves + offset), n);
    for (size_t i = 0; i < n; ++i) {
        float got;
        memcpy(&got, wide + offset + 4 * i, 4);
        uint16_t bits;
        memcpy(&bits, halves + offset + 2 * i, 2);
        if (!isnan(got) && bc_bf16_value(bits) != (double)got)
            finding("bf16 round trip of %g gave 0x%04x", got, bits);
    }
    counts.conversions += 4;
    free(halves);
    free(back);
    free(codes);
    free(wide);
}

/* Top-k of hostile scores and nvp (NaN, infinities, ties, nvp <= 0 or > pitch), a third of the
 * calls bounded by a max_nvp that may be out of [1, pitch] or below a row's nvp, a third into
 * strided rows (transposed, padded apart, or strides the API must refuse). */
static void fuzz_topk(source *s, const msaidx_context *context, const msaidx_config *c) {
    const int32_t T = (int32_t)pick(s, 0, 6), pitch = (int32_t)pick(s, 1, 80);
    const int32_t H = c->num_heads, K = c->topk;
    const size_t cells = (size_t)T * H * pitch;
    float *scores = exact_alloc(sizeof(float) * cells, 4);
    int32_t *nvp = exact_alloc(sizeof(int32_t) * (size_t)T, 4);
    if (!scores || !nvp) exit(2);
    static const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, 1.0f};
    for (size_t i = 0; i < cells; ++i)
        scores[i] = chance(s, 20) ? specials[pick(s, 0, 6)] : (float)pick(s, -3, 3);
    char bad[256] = "";
    const bool bounded = chance(s, 33);
    const int32_t max_nvp = (int32_t)(chance(s, 10) ? hostile_int(s) : pick(s, 1, pitch));
    if (bounded && (max_nvp < 1 || max_nvp > pitch)) BAD(bad, "max_nvp");
    const int32_t row_bound = bounded && max_nvp >= 1 && max_nvp <= pitch ? max_nvp : pitch;
    for (int32_t t = 0; t < T; ++t) {
        nvp[t] = (int32_t)(chance(s, 10) ? hostile_int(s) : pick(s, -1, pitch));
        if (nvp[t] > row_bound && !strstr(bad, "nvp")) BAD(bad, "nvp");
    }
    int64_t stride_t = (int64_t)H * K, stride_h = K;
    size_t span = (size_t)T * H * K;
    if (chance(s, 33)) span = pick_row_strides(s, T, H, K, &stride_t, &stride_h, bad, sizeof bad);
    const bool null_out = T > 0 && chance(s, 5);
    if (null_out) BAD(bad, "out");
    if (bad[0]) { /* rows of a call refused for its nvp may have been written */
        const size_t rows = (size_t)T * H * K;
        int32_t *out = exact_alloc(sizeof(int32_t) * (span > rows ? span : rows), 4);
        if (!out) exit(2);
        judged(select_topk(context, c, scores, pitch, bounded ? &max_nvp : NULL, nvp, T,
                           null_out ? NULL : out, stride_t, stride_h),
               bad, MSAIDX_ERROR_INVALID_ARGUMENT, "topk_select (bad)");
        free(out);
    } else {
        check_topk(context, c, scores, pitch, bounded ? &max_nvp : NULL, nvp, T, stride_t, stride_h,
                   span, "topk_select");
    }
    free(scores);
    free(nvp);
}

/* Rank r's candidates of the pages it owns, as msaidx_prefill_topk_candidates makes them: per row
 * its best min(K, owned) pages by SPEC section 4's order (no forced pages), ascending, each with
 * its score (NaN as -inf, or as it is: the merge must take it as -inf either way), then -1 /
 * -inf. The oracle's top-k of the rank's own pages. */
static void rank_candidates(const msaidx_config *c, const float *scores, int32_t pitch,
                            const int32_t *nvp, int32_t T, const int32_t *owner, int32_t rank,
                            bool nan_as_is, float *cand_scores, int32_t *cand_pages) {
    const int32_t H = c->num_heads, K = c->topk;
    msaidx_config plain = *c;
    plain.init_blocks = plain.local_blocks = 0;
    float *local = malloc(sizeof(float) * ((size_t)T * H * pitch + 1));
    int32_t *local_nvp = malloc(sizeof(int32_t) * ((size_t)T + 1));
    int32_t *global = malloc(sizeof(int32_t) * ((size_t)T * pitch + 1));
    int32_t *picks = malloc(sizeof(int32_t) * ((size_t)T * H * K + 1));
    if (!local || !local_nvp || !global || !picks) exit(2);
    for (int32_t t = 0; t < T; ++t) {
        int32_t n = 0;
        for (int32_t p = 0; p < nvp[t]; ++p)
            if (owner[(size_t)t * pitch + p] == rank) global[(size_t)t * pitch + n++] = p;
        local_nvp[t] = n;
        for (int32_t h = 0; h < H; ++h)
            for (int32_t i = 0; i < n; ++i)
                local[((size_t)t * H + h) * pitch + i] =
                    scores[((size_t)t * H + h) * pitch + global[(size_t)t * pitch + i]];
    }
    bc_topk_oracle(&plain, local, pitch, local_nvp, T, picks);
    for (size_t row = 0; row < (size_t)T * H; ++row)
        for (int32_t k = 0; k < K; ++k) {
            const int32_t i = picks[row * K + k];
            const float v = i >= 0 ? local[row * pitch + i] : -INFINITY;
            cand_pages[row * K + k] = i >= 0 ? global[(row / H) * pitch + i] : -1;
            cand_scores[row * K + k] = isnan(v) && !nan_as_is ? -INFINITY : v;
        }
    free(local);
    free(local_nvp);
    free(global);
    free(picks);
}

/* msaidx_merge_candidates (SPEC.md section 12) as a careless caller makes it: world size, rank
 * stride, top-k arguments and output strides valid or not, NULL and misaligned pointers, merges in
 * place over rank 0's pages. Candidates come either from ranks owning random shares of each row's
 * pages (then the merge is exactly the oracle's top-k of the whole row) or hostile (pages outside
 * the row, repeated or -1, any scores, any nvp: then each row must still be the forced pages and
 * distinct candidate pages, ascending, -1 padded), over exactly sized buffers. */
static void fuzz_merge(source *s, const msaidx_context *context, const msaidx_config *c) {
    const int32_t H = c->num_heads;
    const int32_t T = (int32_t)pick(s, 0, 5), W = (int32_t)pick(s, 1, 4);
    const int32_t pitch = (int32_t)pick(s, 1, 70);
    char bad[256] = "";
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = c->topk;
    args.init_blocks = c->init_blocks;
    args.local_blocks = c->local_blocks;
    if (chance(s, 5)) {
        args.struct_size = (size_t)pick(s, 0, 2 * sizeof args);
        if (args.struct_size != sizeof args) BAD(bad, "args.struct_size");
    }
    if (chance(s, 8)) {
        args.topk = (int32_t)pick(s, -1, 66);
        args.init_blocks = (int32_t)pick(s, -1, 3);
        args.local_blocks = (int32_t)pick(s, -1, 3);
    }
    const bool topk_ok = args.topk >= 1 && args.topk <= 64;
    if (!topk_ok) BAD(bad, "args.topk");
    if (args.init_blocks < 0) BAD(bad, "args.init_blocks");
    if (args.local_blocks < 0) BAD(bad, "args.local_blocks");
    if (topk_ok && args.init_blocks >= 0 && args.local_blocks >= 0 &&
        args.init_blocks + args.local_blocks > args.topk)
        BAD(bad, "args.init_blocks + args.local_blocks");
    const int32_t K = topk_ok ? args.topk : c->topk;
    static const int32_t no_world[] = {INT32_MIN, -1, 0};
    const int32_t world = chance(s, 5) ? no_world[pick(s, 0, 2)] : W;
    if (world < 1) BAD(bad, "world_size");
    const size_t rank_rows = (size_t)T * H * K;
    int64_t rank_stride = (int64_t)rank_rows + (chance(s, 30) ? pick(s, 1, 5) : 0);
    if (chance(s, 5)) {
        rank_stride = chance(s, 50) ? (int64_t)rank_rows - pick(s, 1, 3) : INT64_MAX / 4;
        if (rank_stride < 0 || (size_t)rank_stride < rank_rows)
            BAD(bad, "rank_stride");
        else if (world > 1)
            BAD(bad, "rank_stride"); /* W x stride past memory */
    }
    int64_t stride_t = 0, stride_h = 0;
    size_t span = rank_rows;
    if (chance(s, 30)) span = pick_args_strides(s, T, H, K, &stride_t, &stride_h, bad, sizeof bad);
    const bool contiguous =
        (stride_t == 0 && stride_h == 0) || (stride_t == (int64_t)H * K && stride_h == K);
    args.out_stride_t = stride_t;
    args.out_stride_h = stride_h;
    if (contiguous) stride_t = (int64_t)H * K, stride_h = K;

    /* Global scores [T, H, pitch]: small integers (ties), NaN and infinities. */
    const size_t cells = (size_t)T * H * pitch;
    float *scores = malloc(sizeof(float) * (cells + 1));
    int32_t *owner = malloc(sizeof(int32_t) * ((size_t)T * pitch + 1));
    int32_t *nvp = exact_alloc(sizeof(int32_t) * (size_t)T, 4);
    if (!scores || !owner || !nvp) exit(2);
    static const float specials[] = {NAN, INFINITY, -INFINITY, -0.0f};
    for (size_t i = 0; i < cells; ++i)
        scores[i] = chance(s, 25) ? specials[pick(s, 0, 3)] : (float)pick(s, -4, 4);
    const bool hostile = chance(s, 25), nan_as_is = chance(s, 30);
    for (int32_t t = 0; t < T; ++t) {
        nvp[t] = (int32_t)(hostile && chance(s, 20) ? hostile_int(s) : pick(s, 0, pitch));
        for (int32_t p = 0; p < pitch; ++p)
            owner[(size_t)t * pitch + p] = (int32_t)pick(s, 0, W - 1);
    }
    const int64_t used_stride = rank_stride >= (int64_t)rank_rows && rank_stride <= (1 << 20)
                                    ? rank_stride
                                    : (int64_t)rank_rows;
    const size_t gathered = (size_t)used_stride * (size_t)(W - 1) + rank_rows;
    float *cand_scores = exact_alloc(sizeof(float) * gathered, 4);
    int32_t *cand_pages = exact_alloc(sizeof(int32_t) * gathered, 4);
    if (!cand_scores || !cand_pages) exit(2);
    for (size_t i = 0; i < gathered; ++i) {
        cand_scores[i] = NAN; /* the gaps between ranks: never read */
        cand_pages[i] = OUT_POISON;
    }
    msaidx_config selected = *c;
    selected.topk = K;
    selected.init_blocks = args.init_blocks >= 0 ? args.init_blocks : 0;
    selected.local_blocks = args.local_blocks >= 0 ? args.local_blocks : 0;
    for (int32_t r = 0; r < W; ++r) {
        float *rank_scores = cand_scores + (size_t)r * used_stride;
        int32_t *rank_pages = cand_pages + (size_t)r * used_stride;
        if (!hostile) {
            rank_candidates(&selected, scores, pitch, nvp, T, owner, r, nan_as_is, rank_scores,
                            rank_pages);
            continue;
        }
        for (size_t i = 0; i < rank_rows; ++i) {
            rank_scores[i] = chance(s, 10) ? specials[pick(s, 0, 3)] : (float)pick(s, -4, 4);
            rank_pages[i] = (int32_t)(chance(s, 10) ? hostile_int(s) : pick(s, -1, pitch + 2));
        }
    }
    const int kinds[4] = {
        chance(s, 4) ? (int)pick(s, 1, 2) : 0, chance(s, 4) ? (int)pick(s, 1, 2) : 0,
        chance(s, 4) ? (int)pick(s, 1, 2) : 0, chance(s, 4) ? (int)pick(s, 1, 2) : 0};
    const bool active = T > 0; /* pointers are checked only with rows to merge */
    if (active && kinds[0]) BAD(bad, "nvp");
    if (active && kinds[1]) BAD(bad, "candidate_scores");
    if (active && kinds[2]) BAD(bad, "candidate_pages");
    if (active && kinds[3]) BAD(bad, "out");
    const bool in_place = contiguous && !kinds[2] && !kinds[3] && chance(s, 25);
    int32_t *out = in_place ? cand_pages : exact_alloc(sizeof(int32_t) * (span ? span : 1), 4);
    if (!out) exit(2);
    if (!in_place)
        for (size_t i = 0; i < span; ++i) out[i] = OUT_POISON;
    /* Rank 0's rows, kept for the in-place check (the merge overwrites them). */
    int32_t *rank0 = malloc(sizeof(int32_t) * (rank_rows + 1));
    if (!rank0) exit(2);
    memcpy(rank0, cand_pages, sizeof(int32_t) * rank_rows);
    const msaidx_status status = msaidx_merge_candidates(
        context, &args, world, T, maybe_bad_pointer(nvp, kinds[0], (size_t)pick(s, 1, 3)),
        maybe_bad_pointer(cand_scores, kinds[1], (size_t)pick(s, 1, 3)),
        maybe_bad_pointer(cand_pages, kinds[2], (size_t)pick(s, 1, 3)), rank_stride,
        (int32_t *)maybe_bad_pointer(out, kinds[3], (size_t)pick(s, 1, 3)), NULL);
    if (judged(status, bad, MSAIDX_ERROR_INVALID_ARGUMENT, "merge_candidates") && active) {
        int32_t *got = malloc(sizeof(int32_t) * (rank_rows + 1));
        if (!got) exit(2);
        gather_rows(out, stride_t, stride_h, T, H, K, got);
        if (!hostile) {
            int32_t *want = malloc(sizeof(int32_t) * (rank_rows + 1));
            if (!want) exit(2);
            bc_topk_oracle(&selected, scores, pitch, nvp, T, want);
            if (in_place) {
                for (size_t i = 0; i < rank_rows; ++i) counts.topk_rows += i % K == 0;
                if (memcmp(got, want, sizeof(int32_t) * rank_rows))
                    finding("merge_candidates in place: differs from the oracle's top-k");
            } else {
                check_strided_rows(out, span, stride_t, stride_h, T, H, K, want,
                                   "merge_candidates");
            }
            free(want);
        } else {
            /* Forced pages, then as many distinct offered pages between them as fit (ascending),
             * then -1. */
            for (size_t row = 0; row < rank_rows / K; ++row) {
                ++counts.topk_rows;
                const int32_t n = nvp[row / H], *o = got + row * K;
                bool ok = true;
                int32_t k = 0;
                if (n <= K) {
                    for (; k < K; ++k) ok = ok && o[k] == (k < n ? k : -1);
                } else {
                    const int32_t lo = selected.init_blocks, hi = n - selected.local_blocks;
                    /* The distinct pages the ranks offer inside [lo, hi). */
                    int32_t offered[4 * 64], num_offered = 0;
                    for (int32_t r = 0; r < W; ++r)
                        for (int32_t i = 0; i < K; ++i) {
                            const int32_t p =
                                (r == 0 ? rank0
                                        : cand_pages + (size_t)r * used_stride)[row * K + i];
                            bool seen = p < lo || p >= hi;
                            for (int32_t j = 0; j < num_offered && !seen; ++j)
                                seen = offered[j] == p;
                            if (!seen) offered[num_offered++] = p;
                        }
                    const int32_t slots = K - selected.init_blocks - selected.local_blocks;
                    const int32_t middle = num_offered < slots ? num_offered : slots;
                    for (; k < lo; ++k) ok = ok && o[k] == k;
                    for (; k < lo + middle; ++k) {
                        bool was_offered = false;
                        for (int32_t j = 0; j < num_offered; ++j) was_offered |= offered[j] == o[k];
                        ok = ok && was_offered && (k == lo || o[k] > o[k - 1]);
                    }
                    for (int32_t p = hi; p < n; ++p, ++k) ok = ok && o[k] == p;
                    for (; k < K; ++k) ok = ok && o[k] == -1;
                }
                if (!ok) {
                    finding(
                        "merge_candidates (hostile candidates): row %zu is not the forced pages "
                        "and the most distinct offered pages that fit, ascending (nvp %d)",
                        row, n);
                    break;
                }
            }
        }
        free(got);
    }
    if (!in_place) free(out);
    free(rank0);
    free(scores);
    free(owner);
    free(nvp);
    free(cand_scores);
    free(cand_pages);
}

/* msaidx_index_prepare (SPEC.md section 11) as a careless caller makes it: strides, page
 * layout, table or theta, eps, pointers, and positions and slots in the data, each valid or
 * not. Valid calls run over exactly sized buffers whose poison must survive outside the rows
 * the call may write: q_out rows of tokens with a bad position, cache slots no good key maps
 * to. */
static void fuzz_index_prepare(source *s, const msaidx_config *base) {
    msaidx_config c = *base;
    if (chance(s, 85)) c.head_dim = 128;
    msaidx_context *context = NULL;
    if (msaidx_context_create(&context, &c) != MSAIDX_SUCCESS) {
        finding("index_prepare: context_create refused a valid config: %s", msaidx_last_error());
        return;
    }
    const int32_t H = c.num_heads, page_size = c.page_size;
    const int64_t elem = c.dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    msaidx_index_prepare_args a;
    msaidx_index_prepare_args_init(&a);
    char bad[512] = "";
    msaidx_status refusal = MSAIDX_ERROR_INVALID_ARGUMENT;

    /* Bad values only where a count is hostile: a valid one is the size of the buffers. */
    a.num_tokens = (int32_t)(chance(s, 5) ? (chance(s, 50) ? INT32_MIN : -1) : pick(s, 0, 24));
    const int32_t T = a.num_tokens > 0 ? a.num_tokens : 0;
    a.q_in_token_stride = (int64_t)H * 128 + 8 * pick(s, 0, 2);
    a.k_in_token_stride = 128 + 8 * pick(s, 0, 2);
    a.eps = chance(s, 5) ? (chance(s, 50) ? NAN : -1.0f) : 1e-6f;
    const int format =
        chance(s, 5) ? (int)pick(s, 3, 4) * (chance(s, 50) ? 1 : -1) : (int)pick(s, 0, 2);
    a.cos_sin_format = (msaidx_cos_sin_format)format;
    const bool theta = format == MSAIDX_COS_SIN_THETA, table = format == 0 || format == 1;
    static const double thetas[] = {5e6, 1e4, 1.0, 1e300, 0.5, 0.0, -5e6, NAN, INFINITY};
    a.rope_theta = thetas[chance(s, 85) ? pick(s, 0, 3) : pick(s, 0, 8)];
    a.max_position = chance(s, 90)   ? pick(s, 1, 40)
                     : chance(s, 50) ? (theta ? MSAIDX_ROPE_THETA_MAX_POSITION + pick(s, -1, 1) : 0)
                                     : (chance(s, 50) ? INT64_MAX : -1);
    a.num_pages = (int32_t)(chance(s, 5) ? (chance(s, 50) ? INT32_MIN : 0) : pick(s, 1, 3));
    const int64_t min_stride = (int64_t)page_size * 128 * elem;
    a.page_stride = min_stride + 16 * pick(s, 0, 2);
    switch (chance(s, 15) ? pick(s, 0, 7) : -1) {
    case 0:
        a.q_in_token_stride = chance(s, 50) ? (int64_t)H * 128 - 8 : (int64_t)H * 128 + 4;
        break;
    case 1: a.k_in_token_stride = chance(s, 50) ? 120 : 132; break;
    case 2: a.q_in_token_stride = INT64_MAX / 16 * 8; break;
    case 3: a.page_stride = chance(s, 50) ? min_stride - 16 : min_stride + 8; break;
    case 4: a.page_stride = INT64_MAX / 32 * 16, a.num_pages = 3; break; /* overflows */
    case 5: a.struct_size = chance(s, 50) ? 0 : sizeof a - 8; break;
    default: break;
    }

    /* The oracle: the header's rules, in no particular order (a refusal names one of them). */
    if (a.struct_size != sizeof a) BAD(bad, "args.struct_size");
    if (!bad[0] && c.head_dim != 128) {
        BAD(bad, "head_dim");
        refusal = MSAIDX_ERROR_NOT_SUPPORTED;
    }
    if (a.num_tokens < 0) BAD(bad, "args.num_tokens");
    if (!(a.eps >= 0.0f) || isinf(a.eps)) BAD(bad, "args.eps");
    if (!theta && !table) BAD(bad, "args.cos_sin_format");
    if (theta && !(isfinite(a.rope_theta) && a.rope_theta >= 1.0)) BAD(bad, "args.rope_theta");
    const int64_t max_rows = theta ? MSAIDX_ROPE_THETA_MAX_POSITION : INT64_MAX / 256;
    if (a.max_position < 1 || a.max_position > max_rows) BAD(bad, "args.max_position");
    if (a.num_pages < 1) BAD(bad, "args.num_pages");
    if (a.page_stride < min_stride || a.page_stride % 16)
        BAD(bad, "args.page_stride");
    else if (a.num_pages >= 1 && a.page_stride > INT64_MAX / a.num_pages)
        BAD(bad, "args.page_stride");
    const bool layout_ok = !bad[0];
    const bool q_stride_ok = a.q_in_token_stride >= (int64_t)H * 128 &&
                             a.q_in_token_stride % 8 == 0 && a.q_in_token_stride < (1 << 20);
    const bool k_stride_ok = a.k_in_token_stride >= 128 && a.k_in_token_stride % 8 == 0;
    if (a.num_tokens > 0 && !q_stride_ok) BAD(bad, "q_in_token_stride");
    if (a.num_tokens > 0 && !k_stride_ok) BAD(bad, "k_in_token_stride");

    /* Exactly sized buffers (what a valid call may touch; nothing when it must be refused). */
    const int64_t slots = layout_ok ? (int64_t)a.num_pages * page_size : 0;
    const size_t q_bytes =
        T && q_stride_ok ? 2 * (size_t)((T - 1) * a.q_in_token_stride + H * 128) : 0;
    const size_t k_bytes = T && k_stride_ok ? 2 * (size_t)((T - 1) * a.k_in_token_stride + 128) : 0;
    const size_t table_bytes = table && a.max_position >= 1 && a.max_position <= 40
                                   ? (size_t)a.max_position * 64 * (format == 0 ? 4 : 2)
                                   : 0;
    const size_t cache_bytes = slots ? (size_t)a.num_pages * (size_t)a.page_stride : 0;
    const size_t q_out_bytes = (size_t)T * H * 128 * elem;
    uint8_t *q_in = exact_alloc(q_bytes, 16), *k_in = exact_alloc(k_bytes, 16);
    uint8_t *cos_sin = exact_alloc(table_bytes, 16), *k_cache = exact_alloc(cache_bytes, 16);
    uint8_t *q_out = exact_alloc(q_out_bytes, 16);
    int64_t *positions = exact_alloc(8 * (size_t)T, 8),
            *slot_mapping = exact_alloc(8 * (size_t)T, 8);
    uint16_t *weights = exact_alloc(2 * 2 * 128, 16);
    uint32_t *word = exact_alloc(8, 8);
    if (!q_in || !k_in || !cos_sin || !k_cache || !q_out || !positions || !slot_mapping ||
        !weights || !word)
        exit(2);
    for (size_t i = 0; i < q_bytes; ++i) q_in[i] = (uint8_t)pick(s, 0, 255);
    for (size_t i = 0; i < k_bytes; ++i) k_in[i] = (uint8_t)pick(s, 0, 255);
    for (size_t i = 0; i < 256; ++i) weights[i] = (uint16_t)pick(s, 0, 0xFFFF);
    for (size_t i = 0; i < table_bytes; ++i) cos_sin[i] = (uint8_t)pick(s, 0, 255);
    memset(k_cache, 0xA5, cache_bytes);
    memset(q_out, 0xA5, q_out_bytes);
    word[0] = word[1] = 0;

    /* Positions and slots: mostly valid (distinct slots, some -1), a few out of range. */
    int32_t first_bad = -1;
    bool first_bad_position = false;
    static const int64_t wild[] = {INT64_MIN, -1000, -2, INT64_MAX, (int64_t)1 << 40};
    for (int32_t t = 0; t < T; ++t) {
        positions[t] =
            chance(s, 8)
                ? (chance(s, 50) ? wild[pick(s, 0, 4)] : a.max_position)
                : pick(s, 0, a.max_position >= 1 && a.max_position <= 40 ? a.max_position - 1 : 0);
        slot_mapping[t] = t < slots && chance(s, 85) ? t * slots / T : -1;
        if (chance(s, 8)) slot_mapping[t] = chance(s, 50) ? wild[pick(s, 0, 4)] : slots;
        const bool position_bad = positions[t] < 0 || positions[t] >= a.max_position;
        const bool slot_bad = slot_mapping[t] < -1 || slot_mapping[t] >= slots;
        if ((position_bad || slot_bad) && first_bad < 0) {
            first_bad = t;
            first_bad_position = position_bad;
        }
    }

    const int pointer = chance(s, 10) ? (int)pick(s, 0, 9) : -1, kind = (int)pick(s, 1, 2);
    a.q_in = maybe_bad_pointer(q_in, pointer == 0 ? kind : 0, 2);
    a.k_in = maybe_bad_pointer(k_in, pointer == 1 ? kind : 0, 8);
    a.positions = maybe_bad_pointer(positions, pointer == 2 ? kind : 0, 4);
    a.q_norm_weight = maybe_bad_pointer(weights, pointer == 3 ? kind : 0, 2);
    a.k_norm_weight = maybe_bad_pointer(weights + 128, pointer == 4 ? kind : 0, 8);
    a.cos_sin_cache = theta ? (pointer == 5 ? cos_sin : NULL)
                            : maybe_bad_pointer(cos_sin, pointer == 5 ? kind : 0, 4);
    a.slot_mapping = maybe_bad_pointer(slot_mapping, pointer == 6 ? kind : 0, 4);
    a.k_cache = (void *)maybe_bad_pointer(k_cache, pointer == 7 ? kind : 0, 8);
    a.q_out = (void *)maybe_bad_pointer(q_out, pointer == 8 ? kind : 0, 1);
    a.error_word = chance(s, 50) ? NULL : pointer == 9 ? (uint32_t *)((char *)word + 2) : word;
    if (theta && pointer == 5) BAD(bad, "args.cos_sin_cache");
    if (pointer == 9 && a.error_word) BAD(bad, "args.error_word");
    if (a.num_tokens > 0 && pointer >= 0 && pointer <= 8 && !(theta && pointer == 5)) {
        static const char *names[] = {
            "args.q_in",          "args.k_in",          "args.positions",
            "args.q_norm_weight", "args.k_norm_weight", "args.cos_sin_cache",
            "args.slot_mapping",  "args.k_cache",       "args.q_out"};
        BAD(bad, names[pointer]);
    }
    if (!bad[0] && first_bad >= 0) { /* every good token written, then the first bad named */
        char name[64];
        snprintf(name, sizeof name, "%s[%d]", first_bad_position ? "positions" : "slot_mapping",
                 first_bad);
        BAD(bad, name);
    }
    judged(msaidx_index_prepare(context, &a, NULL), bad, refusal, "index_prepare");

    /* What a call that ran may have written: q_out rows of good positions, good keys' slots. */
    if (T && !strstr(bad, "args.") && !strstr(bad, "head_dim") && !strstr(bad, "stride")) {
        uint8_t *expected = exact_alloc(cache_bytes, 16);
        if (!expected) exit(2);
        memcpy(expected, k_cache, cache_bytes);
        for (int32_t t = 0; t < T; ++t) {
            const bool position_ok = positions[t] >= 0 && positions[t] < a.max_position;
            const uint8_t *row = q_out + (size_t)t * H * 128 * elem;
            for (size_t i = 0; !position_ok && i < (size_t)(H * 128 * elem); ++i)
                if (row[i] != 0xA5) {
                    finding("index_prepare: token %d has a bad position but its q_out was written",
                            t);
                    break;
                }
            const int64_t slot = slot_mapping[t];
            if (position_ok && slot >= 0 && slot < slots) /* the key's row may change */
                memset(expected + slot / page_size * a.page_stride + slot % page_size * 128 * elem,
                       0xA5, (size_t)(128 * elem));
        }
        for (size_t i = 0; i < cache_bytes; ++i)
            if (expected[i] != 0xA5) {
                finding("index_prepare: cache byte %zu written outside every good key's slot", i);
                break;
            }
        if (a.error_word && (word[0] != 0) != (first_bad >= 0))
            finding("index_prepare: error word 0x%x with %s bad token", word[0],
                    first_bad >= 0 ? "a" : "no");
        free(expected);
    }
    free(q_in);
    free(k_in);
    free(cos_sin);
    free(k_cache);
    free(q_out);
    free(positions);
    free(slot_mapping);
    free(weights);
    free(word);
    msaidx_context_destroy(context);
}

static void fuzz_num_valid_pages(source *s, const msaidx_context *context, const batch *x) {
    const int32_t B = x->desc.batch_size, T = x->desc.num_tokens;
    int32_t *cu = exact_alloc(sizeof(int32_t) * ((size_t)B + 1), 4);
    int32_t *seq = exact_alloc(sizeof(int32_t) * ((size_t)B ? (size_t)B : 1), 4);
    int32_t *nvp = exact_alloc(sizeof(int32_t) * (size_t)T, 4);
    if (!cu || !seq || !nvp) exit(2);
    memcpy(cu, x->cu, sizeof(int32_t) * ((size_t)B + 1));
    memcpy(seq, x->seq, sizeof(int32_t) * (size_t)B);
    if (chance(s, 40)) mutate_metadata(s, x, cu, seq, NULL);
    char bad[512];
    metadata_oracle(&x->config, NULL, B, T, cu, seq, NULL, bad, sizeof bad);
    if (judged(msaidx_num_valid_pages(context, cu, seq, B, T, nvp, NULL), bad,
               MSAIDX_ERROR_INVALID_ARGUMENT, "num_valid_pages")) {
        int32_t *want = malloc(sizeof(int32_t) * ((size_t)T + 1));
        if (!want) exit(2);
        oracle_nvp(x, cu, seq, false, want);
        if (memcmp(want, nvp, sizeof(int32_t) * (size_t)T))
            finding("num_valid_pages differs from the oracle's");
        free(want);
    }
    free(cu);
    free(seq);
    free(nvp);
}

/* Runs scores (prefill or decode) with possibly bad pointers; checks valid results. */
static void run_scores(source *s, const msaidx_context *context, const msaidx_plan *plan,
                       const batch *x, bool planned, const char *label) {
    const size_t cells = (size_t)x->desc.num_tokens * x->config.num_heads * x->desc.pitch;
    float *scores = exact_alloc(sizeof(float) * cells, 4);
    if (!scores) exit(2);
    bc_poison(scores, cells);
    char bad[256] = "";
    if (!planned) BAD(bad, "no batch planned");
    const bool empty = x->desc.num_tokens == 0;
    const int q_kind = chance(s, 10) ? (int)pick(s, 1, 2) : 0;
    const int k_kind = chance(s, 10) ? (int)pick(s, 1, 2) : 0;
    const int s_kind = chance(s, 10) ? (int)pick(s, 1, 2) : 0;
    if (planned && !empty) {
        if (q_kind) BAD(bad, "q: |q = ");
        if (k_kind) BAD(bad, "k_cache");
        if (s_kind) BAD(bad, "scores");
    }
    const void *q = maybe_bad_pointer(x->q, q_kind, (size_t)pick(s, 1, 15));
    const void *k = maybe_bad_pointer(x->k, k_kind, (size_t)pick(s, 1, 15));
    float *out = (float *)maybe_bad_pointer(scores, s_kind, (size_t)pick(s, 1, 3));
    const bool decode = chance(s, 50);
    const msaidx_status status = decode ? msaidx_decode_scores(plan, q, k, out, NULL)
                                        : msaidx_prefill_scores(plan, q, k, out, NULL);
    if (judged(status, bad, MSAIDX_ERROR_INVALID_ARGUMENT, label)) {
        if (planned && !empty) check_scores(x, scores, label);
        if (planned)
            check_topk_contiguous(context, &x->config, scores, x->desc.pitch, x->nvp,
                                  x->desc.num_tokens, label);
    }
    free(scores);
}

/* msaidx_prefill_topk_candidates on a planned batch, into rows at random strides and without a
 * score buffer: the pages are the oracle's top-k of `scores` (the plan's) without forced pages,
 * as global pages on a sharded plan, each with its score (NaN as -inf, -inf beside -1), nothing
 * written between rows; merged alone (msaidx_merge_candidates, world 1) they give `selection`,
 * msaidx_prefill_topk's (unsharded plans: a sharded one's selection is the merge of all ranks). */
static void check_candidates(source *s, const msaidx_context *context, const msaidx_plan *plan,
                             const batch *x, const msaidx_topk_args *valid, const float *scores,
                             const int32_t *selection, const char *label) {
    const msaidx_config *c = &x->config;
    const int32_t T = x->desc.num_tokens, H = c->num_heads, K = valid->topk;
    const int32_t pitch = x->desc.pitch;
    msaidx_topk_args args = *valid;
    char bad[128] = "";
    int64_t stride_t = (int64_t)H * K, stride_h = K;
    size_t span = (size_t)T * H * K;
    args.out_stride_t = args.out_stride_h = 0;
    if (chance(s, 40)) {
        span = pick_args_strides(s, T, H, K, &stride_t, &stride_h, bad, sizeof bad);
        args.out_stride_t = stride_t;
        args.out_stride_h = stride_h;
    }
    const int pages_kind = chance(s, 5) ? (int)pick(s, 1, 2) : 0;
    const int scores_kind = chance(s, 5) ? (int)pick(s, 1, 2) : 0;
    if (pages_kind) BAD(bad, "candidate_pages");
    if (scores_kind) BAD(bad, "candidate_scores");
    const size_t allocated = span ? span : 1;
    int32_t *pages = exact_alloc(sizeof(int32_t) * allocated, 4);
    float *values = exact_alloc(sizeof(float) * allocated, 4);
    const size_t rows = (size_t)T * H * K;
    int32_t *want = malloc(sizeof(int32_t) * (rows + 1));
    if (!pages || !values || !want) exit(2);
    for (size_t i = 0; i < span; ++i) {
        pages[i] = OUT_POISON;
        values[i] = NAN;
    }
    const msaidx_status status = msaidx_prefill_topk_candidates(
        plan, x->q, x->k, &args, NULL, (float *)maybe_bad_pointer(values, scores_kind, 2),
        (int32_t *)maybe_bad_pointer(pages, pages_kind, 1), NULL);
    char call[160];
    snprintf(call, sizeof call, "%s: prefill_topk_candidates", label);
    if (judged(status, bad, MSAIDX_ERROR_INVALID_ARGUMENT, call)) {
        msaidx_config plain = *c;
        plain.topk = K;
        plain.init_blocks = plain.local_blocks = 0;
        bc_topk_oracle(&plain, scores, pitch, x->nvp, T, want);
        /* Scores at the columns picked, then the columns as global pages (sharded plans). */
        for (size_t row = 0; row < (size_t)T * H; ++row) {
            const float *got =
                values + (int64_t)(row / H) * stride_t + (int64_t)(row % H) * stride_h;
            const int32_t b = request_of(x, (int32_t)(row / H));
            for (int32_t k = 0; k < K; ++k) {
                int32_t *page = &want[row * K + k];
                const float score = *page >= 0 ? scores[row * pitch + *page] : -INFINITY;
                const float expected = isnan(score) ? -INFINITY : score;
                if (memcmp(&got[k], &expected, sizeof expected)) {
                    finding("%s: row %zu's score %d is %g, want %g", call, row, k, got[k],
                            expected);
                    row = (size_t)T * H;
                    break;
                }
                if (*page >= 0 && b >= 0)
                    *page = global_page(DESC_SHARD(&x->desc),
                                        (int32_t)pages_of(x->seq[b], c->page_size), *page);
            }
        }
        check_strided_rows(pages, span, stride_t, stride_h, T, H, K, want, call);
        if (selection && stride_t == (int64_t)H * K && stride_h == K) {
            /* One rank's candidates merged: the selection itself. */
            int32_t *merged = exact_alloc(sizeof(int32_t) * (rows ? rows : 1), 4);
            if (!merged) exit(2);
            if (judged(msaidx_merge_candidates(context, valid, 1, T, x->nvp, values, pages,
                                               (int64_t)rows, merged, NULL),
                       "", MSAIDX_ERROR_INVALID_ARGUMENT, "merge_candidates (one rank)") &&
                memcmp(merged, selection, sizeof(int32_t) * rows))
                finding("%s: one rank's candidates merged differ from prefill_topk's selection",
                        label);
            free(merged);
        }
    }
    free(pages);
    free(values);
    free(want);
}

/* A sharded plan (desc.cp_world > 1): msaidx_prefill_topk refuses it (its selection is the
 * merge of every rank's candidates), and its candidates carry global pages
 * (check_candidates). */
static void run_sharded_topk(source *s, const msaidx_context *context, const msaidx_plan *plan,
                             const batch *x, bool planned, const char *label) {
    const msaidx_config *c = &x->config;
    const int32_t T = x->desc.num_tokens;
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    args.topk = c->topk;
    args.init_blocks = c->init_blocks;
    args.local_blocks = c->local_blocks;
    const size_t picks = (size_t)T * c->num_heads * c->topk;
    const size_t cells = (size_t)T * c->num_heads * x->desc.pitch;
    int32_t *out = exact_alloc(sizeof(int32_t) * picks, 4);
    float *scores = exact_alloc(sizeof(float) * cells, 4);
    if (!out || !scores) exit(2);
    judged(msaidx_prefill_topk(plan, x->q, x->k, &args, NULL, out, NULL), "context parallel",
           MSAIDX_ERROR_INVALID_ARGUMENT, label);
    if (planned && T > 0) {
        bc_poison(scores, cells);
        size_t area_bytes = 0;
        if (msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes) != MSAIDX_SUCCESS)
            finding("%s: prefill_topk_workspace_size failed: %s", label, msaidx_last_error());
        uint8_t *area = exact_alloc(area_bytes, 16);
        if (!area) exit(2);
        args.workspace = area;
        args.workspace_bytes = area_bytes;
        if (judged(msaidx_prefill_scores(plan, x->q, x->k, scores, NULL), "",
                   MSAIDX_ERROR_INVALID_ARGUMENT, label))
            check_candidates(s, context, plan, x, &args, scores, NULL, label);
        free(area);
    }
    free(out);
    free(scores);
}

/* msaidx_prefill_topk with random, sometimes bad, top-k arguments, buffers and workspace. A
 * valid call with a score buffer must select what the oracle selects from those scores, and
 * one without (its scores in the workspace) the same. */
static void run_prefill_topk(source *s, const msaidx_context *context, const msaidx_plan *plan,
                             const batch *x, bool planned, const char *label) {
    if (x->desc.cp_world > 1) {
        run_sharded_topk(s, context, plan, x, planned, label);
        return;
    }
    const msaidx_config *c = &x->config;
    msaidx_topk_args args;
    msaidx_topk_args_init(&args);
    char bad[256] = "";
    if (chance(s, 5)) {
        args.struct_size = (size_t)pick(s, 0, 2 * sizeof args);
        if (args.struct_size != sizeof args) BAD(bad, "args.struct_size");
    }
    args.topk = chance(s, 85) ? c->topk : (int32_t)pick(s, -2, 70);
    args.init_blocks = chance(s, 85) ? c->init_blocks : (int32_t)pick(s, -1, 4);
    args.local_blocks = chance(s, 85) ? c->local_blocks : (int32_t)pick(s, -1, 4);
    const bool topk_ok = args.topk >= 1 && args.topk <= 64;
    if (!topk_ok) BAD(bad, "args.topk");
    if (args.init_blocks < 0) BAD(bad, "args.init_blocks");
    if (args.local_blocks < 0) BAD(bad, "args.local_blocks");
    if (topk_ok && args.init_blocks >= 0 && args.local_blocks >= 0 &&
        args.init_blocks + args.local_blocks > args.topk)
        BAD(bad, "args.init_blocks + args.local_blocks");
    if (!planned) BAD(bad, "no batch planned");
    const int32_t T = x->desc.num_tokens, K = topk_ok ? args.topk : 1;
    const bool active = planned && T > 0; /* past the checks that need a batch and tokens */
    const size_t cells = (size_t)T * c->num_heads * x->desc.pitch;
    const size_t picks = (size_t)T * c->num_heads * (size_t)K;
    float *scores = exact_alloc(sizeof(float) * cells, 4);
    int32_t *out = exact_alloc(sizeof(int32_t) * picks, 4);
    int32_t *unscored = exact_alloc(sizeof(int32_t) * picks, 4);
    int32_t *want = malloc(sizeof(int32_t) * (picks ? picks : 1));
    if (!scores || !out || !unscored || !want) exit(2);
    bc_poison(scores, cells);
    /* Different poisons: a call that writes nothing cannot match the oracle or the other
     * call.
     */
    for (size_t i = 0; i < picks; ++i) {
        out[i] = -12345;
        unscored[i] = -54321;
    }
    const int out_kind = chance(s, 10) ? (int)pick(s, 1, 2) : 0;
    if (active && out_kind) BAD(bad, "out");
    size_t area_bytes = 0;
    if (planned && msaidx_prefill_topk_workspace_size(plan, 0, &area_bytes) != MSAIDX_SUCCESS)
        finding("%s: prefill_topk_workspace_size failed: %s", label, msaidx_last_error());
    uint8_t *area = exact_alloc(area_bytes, 16);
    if (!area) exit(2);
    int32_t *out_given = (int32_t *)maybe_bad_pointer(out, out_kind, (size_t)pick(s, 1, 3));
    if (judged(msaidx_prefill_topk(plan, x->q, x->k, &args, scores, out_given, NULL), bad,
               MSAIDX_ERROR_INVALID_ARGUMENT, label) &&
        active) {
        msaidx_config selected = *c;
        selected.topk = args.topk;
        selected.init_blocks = args.init_blocks;
        selected.local_blocks = args.local_blocks;
        bc_topk_oracle(&selected, scores, x->desc.pitch, x->nvp, T, want);
        if (memcmp(out, want, sizeof(int32_t) * picks))
            finding("%s: selection differs from the oracle's top-k of its scores", label);
        /* Without a score buffer: a workspace that is NULL, short or right. */
        char workspace_bad[64] = "";
        const int workspace_kind = (int)pick(s, 0, 4);
        args.workspace = workspace_kind == 0 ? NULL : area;
        args.workspace_bytes = workspace_kind == 1 ? area_bytes - 1 : area_bytes;
        if (workspace_kind == 0) BAD(workspace_bad, "args.workspace");
        if (workspace_kind == 1) BAD(workspace_bad, "args.workspace_bytes");
        if (judged(msaidx_prefill_topk(plan, x->q, x->k, &args, NULL, unscored, NULL),
                   workspace_bad, MSAIDX_ERROR_INVALID_ARGUMENT, label) &&
            memcmp(unscored, out, sizeof(int32_t) * picks))
            finding("%s: the selection without a score buffer differs from the one with", label);
        args.workspace = area;
        args.workspace_bytes = area_bytes;
        check_candidates(s, context, plan, x, &args, scores, out, label);
    }
    free(area);
    free(scores);
    free(out);
    free(unscored);
    free(want);
}

/* Hostile values over many entries of planned metadata: what the caller may do to it
 * between graph replays. The cpu backend must use what it planned. */
static void rewrite_hostile(source *s, const batch *x, int32_t *cu, int32_t *seq, int32_t *table) {
    const int32_t B = x->desc.batch_size;
    const size_t entries = (size_t)B * x->desc.bt_stride;
    const int rounds = (int)pick(s, 1, 8);
    for (int i = 0; i < rounds; ++i) {
        switch (pick(s, 0, 2)) {
        case 0: cu[pick(s, 0, B)] = hostile_int(s); break;
        case 1:
            if (B) seq[pick(s, 0, B - 1)] = hostile_int(s);
            break;
        default:
            for (size_t e = 0; e < entries; ++e)
                if (chance(s, 50)) table[e] = hostile_int(s);
            break;
        }
    }
}

static int32_t *copy_ints(const int32_t *from, size_t count) {
    int32_t *to = exact_alloc(sizeof(int32_t) * count, 4);
    if (!to) exit(2);
    memcpy(to, from, sizeof(int32_t) * count);
    return to;
}

static void plan_and_run(source *s, msaidx_context *context, batch *x) {
    const msaidx_config *c = &x->config;
    char bad[512];
    msaidx_plan *plan = NULL;
    /* A broken desc first: judged, then set aside (the buffers are the valid desc's). */
    if (chance(s, 30)) {
        msaidx_batch_desc broken = x->desc;
        mutate_desc(s, &broken);
        desc_oracle(c, &broken, bad, sizeof bad);
        if (judged(msaidx_plan_create(&plan, context, &broken), bad, MSAIDX_ERROR_INVALID_ARGUMENT,
                   "plan_create (mutated desc)")) {
            size_t bytes = 0;
            judged(msaidx_plan_workspace_size(plan, &bytes), "", MSAIDX_ERROR_INVALID_ARGUMENT,
                   "plan_workspace_size");
        } else if (plan) {
            finding("plan_create failed but left *plan = %p", (void *)plan);
        }
        msaidx_plan_destroy(plan);
        plan = NULL;
    }
    desc_oracle(c, &x->desc, bad, sizeof bad);
    if (!judged(msaidx_plan_create(&plan, context, &x->desc), bad, MSAIDX_ERROR_INVALID_ARGUMENT,
                "plan_create"))
        return;
    size_t bytes = 0;
    judged(msaidx_plan_workspace_size(plan, &bytes), "", MSAIDX_ERROR_INVALID_ARGUMENT,
           "plan_workspace_size");
    uint8_t *workspace = exact_alloc(bytes, 16);
    if (!workspace) exit(2);
    if (chance(s, 10)) run_scores(s, context, plan, x, false, "scores before any plan");

    const int32_t B = x->desc.batch_size;
    const size_t table_entries = (size_t)B * x->desc.bt_stride;
    for (int attempt = 0; attempt < 2; ++attempt) {
        int32_t *cu = copy_ints(x->cu, (size_t)B + 1), *seq = copy_ints(x->seq, (size_t)B);
        int32_t *table = copy_ints(x->table, table_entries);
        if (attempt == 0 && chance(s, 35)) mutate_metadata(s, x, cu, seq, table);
        metadata_oracle(c, &x->desc, B, x->desc.num_tokens, cu, seq, table, bad, sizeof bad);
        const int kinds[4] = {
            chance(s, 4) ? (int)pick(s, 1, 2) : 0, chance(s, 4) ? (int)pick(s, 1, 2) : 0,
            chance(s, 4) ? (int)pick(s, 1, 2) : 0, chance(s, 4) ? (int)pick(s, 1, 2) : 0};
        const bool short_workspace = chance(s, 4);
        if (kinds[0]) BAD(bad, "cu_seqlens_q");
        if (kinds[1]) BAD(bad, "seq_lens");
        if (kinds[2]) BAD(bad, "block_table");
        if (kinds[3]) BAD(bad, "workspace");
        if (short_workspace) BAD(bad, "workspace_bytes");
        const bool planned =
            judged(msaidx_plan_batch(
                       plan, maybe_bad_pointer(cu, kinds[0], (size_t)pick(s, 1, 3)),
                       maybe_bad_pointer(seq, kinds[1], (size_t)pick(s, 1, 3)),
                       maybe_bad_pointer(table, kinds[2], (size_t)pick(s, 1, 3)),
                       (void *)maybe_bad_pointer(workspace, kinds[3], (size_t)pick(s, 1, 15)),
                       short_workspace ? bytes - 1 : bytes, NULL),
                   bad, MSAIDX_ERROR_INVALID_ARGUMENT, "plan_batch");
        if (planned) {
            /* What was planned is the reference from now on. */
            memcpy(x->cu, cu, sizeof(int32_t) * ((size_t)B + 1));
            memcpy(x->seq, seq, sizeof(int32_t) * (size_t)B);
            memcpy(x->table, table, sizeof(int32_t) * table_entries);
            oracle_nvp(x, x->cu, x->seq, true, x->nvp);
            const int32_t *nvp = NULL;
            if (judged(msaidx_plan_nvp(plan, &nvp), "", MSAIDX_ERROR_INVALID_ARGUMENT,
                       "plan_nvp") &&
                memcmp(nvp, x->nvp, sizeof(int32_t) * (size_t)x->desc.num_tokens))
                finding("plan_nvp differs from the oracle's nvp");
            judged(msaidx_plan_check(plan, NULL), "", MSAIDX_ERROR_BAD_METADATA, "plan_check");
            const bool rewrite = chance(s, 40);
            if (rewrite) rewrite_hostile(s, x, cu, seq, table);
            run_scores(s, context, plan, x, true,
                       rewrite ? "scores after a hostile rewrite" : "scores");
            if (chance(s, 50)) run_prefill_topk(s, context, plan, x, true, "prefill_topk");
        } else if (chance(s, 30)) {
            run_scores(s, context, plan, x, false, "scores after a failed plan");
            if (chance(s, 30))
                run_prefill_topk(s, context, plan, x, false, "prefill_topk after a failed plan");
        }
        free(cu);
        free(seq);
        free(table);
        if (planned) break;
    }
    free(workspace);
    msaidx_plan_destroy(plan);
}

static void run_scenario(source *s) {
    ++counts.scenarios;
    if (chance(s, 30)) fuzz_conversions(s);
    batch x;
    memset(&x, 0, sizeof x);
    random_config(s, &x.config);
    char bad[512];
    config_oracle(&x.config, bad, sizeof bad);
    const bool on_host = x.config.device == MSAIDX_DEVICE_HOST;
    /* The cpu backend's admission is the same on every build and machine. */
    judged(msaidx_backend_supported(MSAIDX_BACKEND_CPU, &x.config),
           bad[0]    ? bad
           : on_host ? ""
                     : "config.device",
           bad[0] ? MSAIDX_ERROR_INVALID_ARGUMENT : MSAIDX_ERROR_NOT_SUPPORTED,
           "backend_supported(cpu)");
    const bool cpu = on_host && (x.config.backend == MSAIDX_BACKEND_AUTO ||
                                 x.config.backend == MSAIDX_BACKEND_CPU);
    msaidx_context *context = NULL;
    const msaidx_status created = msaidx_context_create(&context, &x.config);
    if (bad[0] || cpu) {
        judged(created, bad, MSAIDX_ERROR_INVALID_ARGUMENT, "context_create");
    } else if (created == MSAIDX_SUCCESS) { /* a CUDA backend on a machine with a GPU */
        msaidx_context_destroy(context);
        return;
    }
    if (created != MSAIDX_SUCCESS) {
        if (context) finding("context_create failed but left *context = %p", (void *)context);
        return;
    }
    msaidx_backend backend = MSAIDX_BACKEND_AUTO;
    if (judged(msaidx_context_backend(context, &backend), "", MSAIDX_ERROR_INVALID_ARGUMENT,
               "context_backend") &&
        backend != MSAIDX_BACKEND_CPU)
        finding("a host context resolved to backend %d", (int)backend);
    random_batch(s, &x);
    if (chance(s, 30)) fuzz_topk(s, context, &x.config);
    if (chance(s, 30)) fuzz_merge(s, context, &x.config);
    if (chance(s, 30)) fuzz_num_valid_pages(s, context, &x);
    if (chance(s, 30)) fuzz_index_prepare(s, &x.config);
    plan_and_run(s, context, &x);
    free_batch(&x);
    msaidx_context_destroy(context);
}

/* ---- drivers
 * ----------------------------------------------------------------------------------
 */

#ifdef MSAIDX_FUZZ_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    abort_on_finding = true;
    source s = {.data = data, .size = size};
    run_scenario(&s);
    return 0;
}
#else
static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    double seconds = 10.0;
    uint64_t seed = (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid();
    int64_t only = -1, iterations = -1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--seconds"))
            seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed"))
            seed = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--only"))
            only = strtoll(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--iterations"))
            iterations = strtoll(argv[i + 1], NULL, 0);
        else {
            fprintf(stderr,
                    "usage: fuzz_api [--seconds N] [--seed S] [--iterations N] [--only I]\n");
            return 2;
        }
    }
    current_seed = seed;
    printf("fuzz_api: seed %" PRIu64 ", %s\n", seed,
           only >= 0         ? "one scenario"
           : iterations >= 0 ? "fixed iterations"
                             : "timed");
    fflush(stdout);
    const double end = now_seconds() + seconds;
    for (uint64_t i = only >= 0 ? (uint64_t)only : 0;; ++i) {
        if (only >= 0 && i != (uint64_t)only) break;
        if (iterations >= 0 && i >= (uint64_t)iterations) break;
        if (only < 0 && iterations < 0 && (i & 15) == 0 && now_seconds() >= end) break;
        current_index = i;
        uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (i + 1));
        source s = {.data = NULL, .rng = splitmix(&state)};
        run_scenario(&s);
    }
    printf("fuzz_api: seed %" PRIu64 ": %" PRIu64 " scenarios, %" PRIu64 " calls (%" PRIu64
           " accepted, %" PRIu64 " rejected), %" PRIu64 " score cells and %" PRIu64
           " top-k rows compared, %" PRIu64 " conversion calls, %" PRIu64 " findings\n",
           seed, counts.scenarios, counts.calls, counts.accepted, counts.rejected, counts.cells,
           counts.topk_rows, counts.conversions, counts.findings);
    return counts.findings ? 1 : 0;
}
#endif
