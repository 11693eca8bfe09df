/* Workloads shared by run, bench and check: seeded random numbers, shapes files and the batches
 * generated from them (metadata over a shuffled paged cache, RMS-normalised Q and K). */
#include "tool.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- random numbers ---- */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

tool_rng tool_rng_make(uint64_t seed, uint64_t stream) {
    uint64_t mix = seed ^ (stream * 0xD1B54A32D192ED03ull);
    tool_rng rng = {splitmix64(&mix)};
    return rng;
}

uint64_t tool_rng_next(tool_rng *rng) { return splitmix64(&rng->state); }

double tool_rng_uniform(tool_rng *rng) { return (double)(tool_rng_next(rng) >> 11) * 0x1.0p-53; }

double tool_rng_normal(tool_rng *rng) {
    double u = tool_rng_uniform(rng), v = tool_rng_uniform(rng);
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

uint64_t tool_seed_from_clock(void) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t state = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    return splitmix64(&state) & 0xFFFFFFFFFFFFull; /* short enough to retype with --seed */
}

/* ---- shapes ---- */

bool tool_load_shapes(const char *path, tool_shape **shapes, int *count) {
    *shapes = NULL;
    *count = 0;
    FILE *file = fopen(path, "r");
    if (!file) {
        fprintf(stderr, "msaidx: cannot open shapes file %s: %s\n", path, strerror(errno));
        return false;
    }
    char *line = NULL; /* getline: a line of any length (a shape of many requests is long) */
    size_t line_size = 0;
    int capacity = 0, line_number = 0;
    bool ok = true;
    while (ok && getline(&line, &line_size, file) >= 0) {
        ++line_number;
        if (line[0] == '#' || line[0] == '\n' || line[0] == '\r') continue;
        char *save = NULL;
        char *name = strtok_r(line, "\t\r\n", &save);
        char *heads = strtok_r(NULL, "\t\r\n", &save);
        char *q_text = strtok_r(NULL, "\t\r\n", &save);
        char *kv_text = strtok_r(NULL, "\t\r\n", &save);
        if (!name || !heads || !q_text || !kv_text) {
            fprintf(stderr, "msaidx: %s:%d: expected 4 tab-separated columns\n", path, line_number);
            ok = false;
            break;
        }
        if (*count == capacity) {
            capacity = capacity ? capacity * 2 : 64;
            tool_shape *grown = realloc(*shapes, sizeof(tool_shape) * (size_t)capacity);
            if (!grown) {
                ok = false;
                break;
            }
            *shapes = grown;
        }
        tool_shape *s = &(*shapes)[*count];
        memset(s, 0, sizeof *s);
        if (strlen(name) >= sizeof s->name) {
            fprintf(stderr, "msaidx: %s:%d: shape name of %zu characters; at most %zu\n", path,
                    line_number, strlen(name), sizeof s->name - 1);
            ok = false;
            break;
        }
        snprintf(s->name, sizeof s->name, "%s", name);
        long h = 0;
        int nq = 0, nkv = 0;
        ok = tool_parse_int(heads, "H", 1, 16, &h) &&
             tool_parse_list(q_text, "q_lens", &s->q_lens, &nq) &&
             tool_parse_list(kv_text, "kv_lens", &s->kv_lens, &nkv);
        ++*count; /* owns its lists now, freed below on failure */
        s->heads = (int)h;
        s->num_requests = nq;
        if (ok && nq != nkv) {
            fprintf(stderr, "msaidx: %s:%d: %d q_lens but %d kv_lens\n", path, line_number, nq,
                    nkv);
            ok = false;
        }
        for (int b = 0; ok && b < nq; ++b)
            if (s->q_lens[b] > s->kv_lens[b]) {
                fprintf(stderr, "msaidx: %s:%d: request %d has q_len %d > kv_len %d\n", path,
                        line_number, b, s->q_lens[b], s->kv_lens[b]);
                ok = false;
            }
        if (!ok) fprintf(stderr, "msaidx: %s:%d: bad shape line\n", path, line_number);
    }
    free(line);
    fclose(file);
    if (!ok || *count == 0) {
        if (ok) fprintf(stderr, "msaidx: %s: no shapes\n", path);
        tool_free_shapes(*shapes, *count);
        *shapes = NULL;
        *count = 0;
        return false;
    }
    return true;
}

void tool_free_shapes(tool_shape *shapes, int count) {
    for (int i = 0; i < count; ++i) {
        free(shapes[i].q_lens);
        free(shapes[i].kv_lens);
    }
    free(shapes);
}

int64_t tool_visible_pairs(const int32_t *q_lens, const int32_t *kv_lens, int num_requests) {
    int64_t pairs = 0;
    for (int b = 0; b < num_requests; ++b) {
        const int64_t q = q_lens[b], prefix = (int64_t)kv_lens[b] - q_lens[b];
        pairs += q * prefix + q * (q + 1) / 2; /* sum over i < q of (prefix + i + 1) */
    }
    return pairs;
}

int64_t tool_total_pages(const int32_t *kv_lens, int num_requests) {
    int64_t pages = 0;
    for (int b = 0; b < num_requests; ++b) pages += tool_pages_of(kv_lens[b]);
    return pages;
}

int64_t tool_total_tokens(const int32_t *q_lens, int num_requests) {
    int64_t tokens = 0;
    for (int b = 0; b < num_requests; ++b) tokens += q_lens[b];
    return tokens;
}

double tool_gflop(int heads, int64_t pairs) {
    return 2.0 * TOOL_HEAD_DIM * heads * (double)pairs * 1e-9;
}

/* ---- batches ---- */

void tool_batch_free(tool_batch *batch) {
    free(batch->cu_seqlens_q);
    free(batch->seq_lens);
    free(batch->block_table);
    free(batch->nvp);
    free(batch->q);
    free(batch->k_cache);
    memset(batch, 0, sizeof *batch);
}

bool tool_batch_layout(tool_batch *batch, int heads, msaidx_dtype dtype, const int32_t *q_lens,
                       const int32_t *kv_lens, int num_requests, int32_t num_pages,
                       int64_t page_stride, int32_t pitch, uint64_t seed) {
    free(batch->cu_seqlens_q);
    free(batch->seq_lens);
    free(batch->block_table);
    free(batch->nvp);
    batch->cu_seqlens_q = batch->seq_lens = batch->block_table = batch->nvp = NULL;
    batch->heads = heads;
    batch->dtype = dtype;
    const int64_t tokens = tool_total_tokens(q_lens, num_requests);
    const int64_t pages_needed = tool_total_pages(kv_lens, num_requests);
    int32_t max_q = 0, max_kv = 0;
    for (int b = 0; b < num_requests; ++b) {
        if (q_lens[b] > max_q) max_q = q_lens[b];
        if (kv_lens[b] > max_kv) max_kv = kv_lens[b];
    }
    const int32_t max_pages = tool_pages_of(max_kv);
    if (tokens > INT32_MAX || pages_needed > INT32_MAX) {
        fprintf(stderr, "msaidx: batch too large (%lld tokens, %lld pages)\n", (long long)tokens,
                (long long)pages_needed);
        return false;
    }
    if (num_pages == 0) num_pages = (int32_t)(pages_needed > 0 ? pages_needed : 1);
    if (num_pages < pages_needed) {
        fprintf(stderr, "msaidx: the cache has %d pages, the batch needs %lld\n", num_pages,
                (long long)pages_needed);
        return false;
    }
    msaidx_batch_desc_init(&batch->desc);
    msaidx_batch_desc *d = &batch->desc;
    d->batch_size = num_requests;
    d->num_tokens = (int32_t)tokens;
    d->max_q_len = max_q;
    d->max_seq_len = max_kv;
    d->num_pages = num_pages;
    d->bt_stride = max_pages > 0 ? max_pages : 1;
    d->page_stride =
        page_stride ? page_stride
                    : (int64_t)TOOL_PAGE * TOOL_HEAD_DIM * (dtype == MSAIDX_DTYPE_BF16 ? 2 : 1);
    d->pitch = pitch ? pitch : d->bt_stride;

    batch->cu_seqlens_q = malloc(sizeof(int32_t) * (size_t)(num_requests + 1));
    batch->seq_lens = malloc(sizeof(int32_t) * (size_t)(num_requests > 0 ? num_requests : 1));
    batch->block_table = malloc(sizeof(int32_t) * (size_t)d->bt_stride *
                                (size_t)(num_requests > 0 ? num_requests : 1));
    batch->nvp = malloc(sizeof(int32_t) * (size_t)(tokens > 0 ? tokens : 1));
    int32_t *order = malloc(sizeof(int32_t) * (size_t)num_pages);
    if (!batch->cu_seqlens_q || !batch->seq_lens || !batch->block_table || !batch->nvp || !order) {
        free(order);
        fprintf(stderr, "msaidx: out of host memory for the batch metadata\n");
        return false;
    }
    /* A shuffled cache: each request's logical pages land on scattered, unordered physical pages.
     */
    tool_rng rng = tool_rng_make(seed, 0x7AB1E);
    for (int32_t i = 0; i < num_pages; ++i) order[i] = i;
    for (int32_t i = num_pages - 1; i > 0; --i) {
        int32_t j = (int32_t)(tool_rng_next(&rng) % (uint64_t)(i + 1));
        int32_t swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    int64_t next_page = 0;
    batch->cu_seqlens_q[0] = 0;
    for (int b = 0; b < num_requests; ++b) {
        batch->cu_seqlens_q[b + 1] = batch->cu_seqlens_q[b] + q_lens[b];
        batch->seq_lens[b] = kv_lens[b];
        int32_t *row = batch->block_table + (size_t)b * d->bt_stride;
        const int32_t pages = tool_pages_of(kv_lens[b]);
        for (int32_t p = 0; p < d->bt_stride; ++p)
            row[p] = p < pages ? order[next_page++] : -1; /* past the last page: ignored */
        for (int32_t i = 0; i < q_lens[b]; ++i)
            batch->nvp[batch->cu_seqlens_q[b] + i] = (kv_lens[b] - q_lens[b] + i) / TOOL_PAGE + 1;
    }
    free(order);
    return true;
}

void tool_store(msaidx_dtype dtype, const float *src, void *dst, size_t n) {
    if (dtype == MSAIDX_DTYPE_BF16)
        msaidx_bf16_from_float(src, dst, n);
    else
        msaidx_e4m3_from_float(src, dst, n);
}

void tool_load(msaidx_dtype dtype, const void *src, float *dst, size_t n) {
    if (dtype == MSAIDX_DTYPE_BF16)
        msaidx_bf16_to_float(src, dst, n);
    else
        msaidx_e4m3_to_float(src, dst, n);
}

void tool_gaussian_rows(float *dst, int64_t rows, uint64_t seed, uint64_t first_stream) {
    for (int64_t r = 0; r < rows; ++r) {
        tool_rng rng = tool_rng_make(seed, first_stream + (uint64_t)r);
        float *x = dst + r * TOOL_HEAD_DIM;
        double sum_sq = 0.0;
        for (int e = 0; e < TOOL_HEAD_DIM; ++e) {
            x[e] = (float)tool_rng_normal(&rng);
            sum_sq += (double)x[e] * x[e];
        }
        const float inv_rms = (float)(1.0 / sqrt(sum_sq / TOOL_HEAD_DIM + 1e-6));
        for (int e = 0; e < TOOL_HEAD_DIM; ++e) x[e] *= inv_rms;
    }
}

/* Rows [first, first + rows) of one stored tensor; streams keep Q and K independent. */
static void fill_rows(msaidx_dtype dtype, void *dst, int64_t rows, uint64_t seed,
                      uint64_t stream_base, bool progress, const char *what) {
    const size_t elem = dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    const int64_t chunk = 4096;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    int64_t done = 0;
    double last_print = tool_now_ms();
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * TOOL_HEAD_DIM * (size_t)chunk);
#pragma omp for schedule(dynamic)
        for (int64_t c = 0; c < chunks; ++c) {
            if (!scratch) continue;
            const int64_t first = c * chunk, n = rows - first < chunk ? rows - first : chunk;
            tool_gaussian_rows(scratch, n, seed, stream_base + (uint64_t)first);
            tool_store(dtype, scratch, (char *)dst + (size_t)first * TOOL_HEAD_DIM * elem,
                       (size_t)n * TOOL_HEAD_DIM);
            if (progress) {
#pragma omp critical
                {
                    done += n;
                    if (tool_now_ms() - last_print > 2000.0) {
                        last_print = tool_now_ms();
                        fprintf(stderr, "  generating %s: %lld / %lld rows\n", what,
                                (long long)done, (long long)rows);
                    }
                }
            }
        }
        free(scratch);
    }
}

bool tool_batch_fill(tool_batch *batch, int64_t q_rows, uint64_t seed, bool progress) {
    const msaidx_batch_desc *d = &batch->desc;
    const size_t elem = batch->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    const size_t page_bytes = (size_t)TOOL_PAGE * TOOL_HEAD_DIM * elem;
    free(batch->q);
    free(batch->k_cache);
    batch->q_bytes = (size_t)q_rows * TOOL_HEAD_DIM * elem;
    batch->k_bytes = (size_t)d->num_pages * (size_t)d->page_stride;
    batch->q = aligned_alloc(256, tool_round256(batch->q_bytes ? batch->q_bytes : 1));
    batch->k_cache = aligned_alloc(256, tool_round256(batch->k_bytes));
    if (!batch->q || !batch->k_cache) {
        fprintf(stderr, "msaidx: out of host memory for Q (%zu bytes) and K (%zu bytes)\n",
                batch->q_bytes, batch->k_bytes);
        return false;
    }
    fill_rows(batch->dtype, batch->q, q_rows, seed, 0, progress, "Q");
    if ((size_t)d->page_stride == page_bytes) {
        fill_rows(batch->dtype, batch->k_cache, (int64_t)d->num_pages * TOOL_PAGE, seed,
                  TOOL_K_STREAM, progress, "K");
    } else {
        /* Padded pages: the padding holds garbage that no backend may read into a score. */
        memset(batch->k_cache, 0x7F, batch->k_bytes);
        for (int32_t p = 0; p < d->num_pages; ++p)
            fill_rows(batch->dtype, (char *)batch->k_cache + (size_t)p * (size_t)d->page_stride,
                      TOOL_PAGE, seed, TOOL_K_STREAM + (uint64_t)p * TOOL_PAGE, false, "K");
    }
    return true;
}
