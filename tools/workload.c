/* Workloads shared by run, bench and check: shapes, batch generation, FP64 reference, host exec. */
#include "tool.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

bool tool_ok(msaidx_status status, const char *what) {
    if (status == MSAIDX_SUCCESS) return true;
    fprintf(stderr, "msaidx: %s: %s: %s\n", what, msaidx_status_string(status),
            msaidx_last_error());
    return false;
}

double tool_now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec * 1e-6;
}

bool tool_parse_int(const char *text, const char *option, long lo, long hi, long *value) {
    char *end = NULL;
    errno = 0;
    long parsed = text ? strtol(text, &end, 10) : 0;
    if (!text || errno || end == text || *end || parsed < lo || parsed > hi) {
        fprintf(stderr, "msaidx: %s = '%s': expected an integer in [%ld, %ld]\n", option,
                text ? text : "", lo, hi);
        return false;
    }
    *value = parsed;
    return true;
}

bool tool_parse_list(const char *text, const char *option, int32_t **values, int *count) {
    *values = NULL;
    *count = 0;
    if (!text || !*text) {
        fprintf(stderr, "msaidx: %s: empty list\n", option);
        return false;
    }
    int capacity = 1;
    for (const char *c = text; *c; ++c) capacity += *c == ',';
    int32_t *parsed = malloc(sizeof(int32_t) * (size_t)capacity);
    if (!parsed) return false;
    const char *cursor = text;
    for (int i = 0; i < capacity; ++i) {
        char *end = NULL;
        errno = 0;
        long v = strtol(cursor, &end, 10);
        if (errno || end == cursor || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "msaidx: %s = '%s': expected non-negative integers separated by ','\n",
                    option, text);
            free(parsed);
            return false;
        }
        parsed[i] = (int32_t)v;
        cursor = end + (*end == ',');
    }
    *values = parsed;
    *count = capacity;
    return true;
}

bool tool_parse_backend(const char *text, msaidx_backend *backend) {
    for (int b = MSAIDX_BACKEND_AUTO; b <= MSAIDX_BACKEND_PERSISTENT; ++b)
        if (!strcmp(text, msaidx_backend_name((msaidx_backend)b))) {
            *backend = (msaidx_backend)b;
            return true;
        }
    fprintf(stderr, "msaidx: backend '%s': expected auto, cpu, dense, split or persistent\n", text);
    return false;
}

bool tool_parse_dtype(const char *text, msaidx_dtype *dtype) {
    if (!strcmp(text, "e4m3") || !strcmp(text, "fp8")) {
        *dtype = MSAIDX_DTYPE_E4M3;
        return true;
    }
    if (!strcmp(text, "bf16")) {
        *dtype = MSAIDX_DTYPE_BF16;
        return true;
    }
    fprintf(stderr, "msaidx: dtype '%s': expected e4m3 or bf16\n", text);
    return false;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double tool_median(double *values, int count) {
    if (count <= 0) return 0.0;
    qsort(values, (size_t)count, sizeof *values, compare_doubles);
    return count % 2 ? values[count / 2] : 0.5 * (values[count / 2 - 1] + values[count / 2]);
}

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
    size_t line_size = 1 << 16;
    char *line = malloc(line_size);
    int capacity = 0, line_number = 0;
    bool ok = line != NULL;
    while (ok && fgets(line, (int)line_size, file)) {
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
    for (int b = 0; b < num_requests; ++b)
        pages += ((int64_t)kv_lens[b] + TOOL_PAGE - 1) / TOOL_PAGE;
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

/* aligned_alloc wants a size that is a multiple of the alignment. */
static size_t round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

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
    const int32_t max_pages = (max_kv + TOOL_PAGE - 1) / TOOL_PAGE;
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
        const int32_t pages = (kv_lens[b] + TOOL_PAGE - 1) / TOOL_PAGE;
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
    batch->q = aligned_alloc(256, round256(batch->q_bytes ? batch->q_bytes : 1));
    batch->k_cache = aligned_alloc(256, round256(batch->k_bytes));
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

int tool_request_of(const tool_batch *batch, int32_t t) {
    int lo = 0, hi = batch->desc.batch_size - 1;
    while (lo < hi) { /* last b with cu[b] <= t */
        int mid = (lo + hi + 1) / 2;
        if (batch->cu_seqlens_q[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Keys of one physical page as floats: decoded from the stored cache, or the unquantized rows. */
typedef const float *(*page_keys_fn)(const tool_batch *batch, const float *unquantized,
                                     int32_t page, int32_t keys, float *scratch);

static const float *stored_page_keys(const tool_batch *batch, const float *unquantized,
                                     int32_t page, int32_t keys, float *scratch) {
    (void)unquantized;
    tool_load(batch->dtype,
              (const char *)batch->k_cache + (size_t)page * (size_t)batch->desc.page_stride,
              scratch, (size_t)keys * TOOL_HEAD_DIM);
    return scratch;
}

static const float *float_page_keys(const tool_batch *batch, const float *unquantized, int32_t page,
                                    int32_t keys, float *scratch) {
    (void)batch;
    (void)keys;
    (void)scratch;
    return unquantized + (size_t)page * TOOL_PAGE * TOOL_HEAD_DIM;
}

static void reference_scores(const tool_batch *batch, int32_t t, const float *q,
                             page_keys_fn page_keys, const float *unquantized, double *ref,
                             double *abs_dots) {
    const msaidx_batch_desc *d = &batch->desc;
    const int b = tool_request_of(batch, t);
    const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
    const int32_t pos = batch->seq_lens[b] - q_len + (t - batch->cu_seqlens_q[b]);
    const int32_t nvp = pos / TOOL_PAGE + 1;
    const int32_t *pages = batch->block_table + (size_t)b * d->bt_stride;
    float scratch[TOOL_PAGE * TOOL_HEAD_DIM];
    for (int32_t p = 0; p < nvp; ++p) {
        const int32_t keys_in_page =
            pos - p * TOOL_PAGE + 1 < TOOL_PAGE ? pos - p * TOOL_PAGE + 1 : TOOL_PAGE;
        const float *keys = page_keys(batch, unquantized, pages[p], keys_in_page, scratch);
        for (int h = 0; h < batch->heads; ++h) {
            const float *qh = q + h * TOOL_HEAD_DIM;
            double best = -INFINITY, largest_abs = 0.0;
            for (int32_t j = 0; j < keys_in_page; ++j) {
                const float *k = keys + j * TOOL_HEAD_DIM;
                double dot = 0.0, abs_dot = 0.0;
                for (int e = 0; e < TOOL_HEAD_DIM; ++e) {
                    const double product = (double)qh[e] * (double)k[e];
                    dot += product;
                    abs_dot += fabs(product);
                }
                if (dot > best) best = dot;
                if (abs_dot > largest_abs) largest_abs = abs_dot;
            }
            ref[(size_t)h * nvp + p] = best;
            if (abs_dots) abs_dots[(size_t)h * nvp + p] = largest_abs;
        }
    }
}

void tool_reference_token(const tool_batch *batch, int32_t t, double *ref, double *abs_dots) {
    const size_t elem = batch->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    float q[16 * TOOL_HEAD_DIM];
    tool_load(batch->dtype,
              (const char *)batch->q + (size_t)t * batch->heads * TOOL_HEAD_DIM * elem, q,
              (size_t)batch->heads * TOOL_HEAD_DIM);
    reference_scores(batch, t, q, stored_page_keys, NULL, ref, abs_dots);
}

void tool_reference_token_float(const tool_batch *batch, int32_t t, const float *q_rows,
                                const float *k_rows, double *ref) {
    reference_scores(batch, t, q_rows + (size_t)t * batch->heads * TOOL_HEAD_DIM, float_page_keys,
                     k_rows, ref, NULL);
}

void tool_topk_row(const float *row, int32_t nvp, int topk, int init_blocks, int local_blocks,
                   int32_t *out) {
    for (int i = 0; i < topk; ++i) out[i] = -1;
    if (nvp <= 0) return;
    if (nvp <= topk) {
        for (int32_t p = 0; p < nvp; ++p) out[p] = p;
        return;
    }
    /* Forced blocks first, then repeatedly the best remaining page (NaN as -inf, ties to the
     * lower id); then sort ascending. O(nvp * topk), plenty for sampled rows. */
    int n = 0;
    for (int32_t p = 0; p < init_blocks; ++p) out[n++] = p;
    for (int32_t p = nvp - local_blocks; p < nvp; ++p) out[n++] = p;
    while (n < topk) {
        int32_t best = -1;
        float best_score = 0.0f;
        for (int32_t p = init_blocks; p < nvp - local_blocks; ++p) {
            bool taken = false;
            for (int i = 0; i < n && !taken; ++i) taken = out[i] == p;
            if (taken) continue;
            const float s = isnan(row[p]) ? -INFINITY : row[p];
            if (best < 0 || s > best_score) {
                best = p;
                best_score = s;
            }
        }
        out[n++] = best;
    }
    for (int i = 1; i < topk; ++i)
        for (int j = i; j > 0 && out[j - 1] > out[j]; --j) {
            int32_t swap = out[j];
            out[j] = out[j - 1];
            out[j - 1] = swap;
        }
}

/* ---- host exec ---- */

static double host_marks[TOOL_MARKS];

static bool host_alloc(void **pointer, size_t bytes) {
    *pointer = aligned_alloc(256, round256(bytes ? bytes : 1));
    if (!*pointer) fprintf(stderr, "msaidx: out of host memory (%zu bytes)\n", bytes);
    return *pointer != NULL;
}
static void host_release(void *pointer) { free(pointer); }
static bool host_copy(void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
    return true;
}
static bool host_poison(void *dst, size_t bytes) {
    memset(dst, 0xFF, bytes);
    return true;
}
static bool host_sync(void) { return true; }
static bool host_mark(int slot) {
    host_marks[slot] = tool_now_ms();
    return true;
}
static double host_elapsed(int from, int to) { return host_marks[to] - host_marks[from]; }
static bool host_flush(void) { return true; }

const tool_exec *tool_host_exec(void) {
    static const tool_exec host = {
        .name = "host",
        .device = MSAIDX_DEVICE_HOST,
        .stream = NULL,
        .alloc = host_alloc,
        .release = host_release,
        .upload = host_copy,
        .download = host_copy,
        .poison = host_poison,
        .sync = host_sync,
        .mark = host_mark,
        .elapsed_ms = host_elapsed,
        .flush_cache = host_flush,
    };
    return &host;
}

const tool_exec *tool_pick_gpu(void) {
#ifdef MSAIDX_WITH_CUDA
    if (tool_gpu_count() > 0) return tool_gpu_exec();
#endif
    return NULL;
}

void tool_no_gpu_reason(char *text, size_t size) {
    /* The library's own admission check says it best (no driver, no device, no CUDA build). */
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = 0;
    if (msaidx_backend_supported(MSAIDX_BACKEND_DENSE, &config) == MSAIDX_SUCCESS)
        snprintf(text, size, "a CUDA device is usable");
    else
        snprintf(text, size, "%s", msaidx_last_error());
}

bool tool_parse_precision(const char *text, msaidx_precision *precision) {
    if (!strcmp(text, "default"))
        *precision = MSAIDX_PRECISION_DEFAULT;
    else if (!strcmp(text, "exact"))
        *precision = MSAIDX_PRECISION_EXACT;
    else {
        fprintf(stderr, "msaidx: --precision %s: expected default or exact\n", text);
        return false;
    }
    return true;
}

const char *tool_precision_name(msaidx_precision precision) {
    return precision == MSAIDX_PRECISION_EXACT ? "exact" : "default";
}

bool tool_fp8_bound(const tool_batch *batch, msaidx_precision precision) {
    return batch->dtype == MSAIDX_DTYPE_E4M3 && precision == MSAIDX_PRECISION_DEFAULT;
}

void tool_compare_token(const tool_batch *batch, int32_t t, const float *scores,
                        msaidx_precision precision, double *scratch, tool_accuracy *acc) {
    const int H = batch->heads;
    const int32_t nvp = batch->nvp[t], pitch = batch->desc.pitch;
    double *ref = scratch, *abs_dots = scratch + (size_t)H * nvp;
    const bool fp8 = tool_fp8_bound(batch, precision);
    tool_reference_token(batch, t, ref, abs_dots);
    for (int h = 0; h < H; ++h) {
        const float *row = scores + ((size_t)t * H + h) * (size_t)pitch;
        for (int32_t p = 0; p < nvp; ++p) {
            const double expected = ref[(size_t)h * nvp + p];
            const double error = fabs((double)row[p] - expected);
            const double relative = error / fmax(1.0, fabs(expected));
            const double largest_abs_dot = abs_dots[(size_t)h * nvp + p];
            double bound =
                TOOL_SCORE_TOLERANCE * fmax(1.0, fabs(expected)) + 0x1p-16 * largest_abs_dot;
            if (fp8) bound += MSAIDX_FP8_ACCUMULATION_DOT_BOUND * largest_abs_dot;
            ++acc->cells;
            if (isnan(row[p]) || !(error <= bound)) ++acc->bad_cells;
            if (isnan(row[p])) {
                acc->max_rel_error = acc->max_bound_ratio = INFINITY;
            } else {
                acc->max_rel_error = fmax(acc->max_rel_error, relative);
                acc->max_bound_ratio = fmax(acc->max_bound_ratio, error / bound);
            }
        }
        for (int32_t p = nvp; p < pitch; ++p) {
            uint32_t bits;
            memcpy(&bits, &row[p], sizeof bits);
            if (bits != 0xFFFFFFFFu) ++acc->written_past_nvp; /* the poison must survive */
        }
    }
}
