/* Harness-neutral A/B of two builds of libmsaidx: both libraries loaded into one process
 * (dlopen, RTLD_LOCAL), the same inputs, metadata and L2 flush, and their persistent scorers timed
 * alternately (A B, then B A, ...) within each shape, so clocks, power state and the timing code
 * are shared and neither build owns the cooler GPU. Also checks that both write the same scores,
 * bit for bit. Compares any two builds whose API keeps the prefixes it uses: msaidx_config up to
 * fast_accumulation and msaidx_batch_desc up to pitch (unchanged since 0.1).
 *
 * It uses the CUDA driver API only: a CUDA runtime in the executable would take the place of the
 * runtime each library links statically when the dynamic linker binds the library's own calls.
 *
 * Usage: msaidx_ab LIB_A LIB_B [--shapes FILE] [--dtype e4m3|bf16] [--precision fp8|exact]
 *                  [--repeat N] [--only NAME,NAME...] [--json FILE]
 * Prints per shape the median time of A and B, B / A, and whether the scores are equal. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "msaidx.h"

enum { kHeadDim = 128, kPageKeys = 128, kMaxRequests = 64 };

typedef struct {
    void (*config_init)(msaidx_config *);
    msaidx_status (*context_create)(msaidx_context **, const msaidx_config *);
    msaidx_status (*context_destroy)(msaidx_context *);
    void (*batch_desc_init)(msaidx_batch_desc *);
    msaidx_status (*plan_create)(msaidx_plan **, msaidx_context *, const msaidx_batch_desc *);
    msaidx_status (*plan_destroy)(msaidx_plan *);
    msaidx_status (*plan_workspace_size)(const msaidx_plan *, size_t *);
    msaidx_status (*plan_batch)(msaidx_plan *, const int32_t *, const int32_t *, const int32_t *,
                                void *, size_t, void *);
    msaidx_status (*prefill_scores)(const msaidx_plan *, const void *, const void *, float *,
                                    void *);
    const char *(*last_error)(void);
    const char *path;
} library;

/* One build's plan of the current shape. */
typedef struct {
    msaidx_context *context;
    msaidx_plan *plan;
    CUdeviceptr workspace, scores;
} side;

typedef struct {
    char name[64];
    int heads, requests;
    int32_t q_lens[kMaxRequests], kv_lens[kMaxRequests];
} shape;

static bool cu_ok(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return true;
    const char *text = NULL;
    cuGetErrorString(r, &text);
    fprintf(stderr, "msaidx_ab: %s: %s\n", what, text ? text : "unknown CUDA error");
    return false;
}

static bool lib_ok(const library *lib, msaidx_status s, const char *what) {
    if (s == MSAIDX_SUCCESS) return true;
    fprintf(stderr, "msaidx_ab: %s: %s: %s\n", lib->path, what, lib->last_error());
    return false;
}

static bool load_library(const char *path, library *lib) {
    /* A name without a slash would be looked up on the library path, not in this directory. */
    char local[4096];
    const bool bare = !strchr(path, '/');
    if (bare && snprintf(local, sizeof local, "./%s", path) >= (int)sizeof local) return false;
    void *handle = dlopen(bare ? local : path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "msaidx_ab: %s\n", dlerror());
        return false;
    }
    lib->path = path;
#define SYMBOL(field, name)                                                                        \
    if (!(*(void **)&lib->field = dlsym(handle, name))) {                                          \
        fprintf(stderr, "msaidx_ab: %s has no %s\n", path, name);                                  \
        return false;                                                                              \
    }
    SYMBOL(config_init, "msaidx_config_init")
    SYMBOL(context_create, "msaidx_context_create")
    SYMBOL(context_destroy, "msaidx_context_destroy")
    SYMBOL(batch_desc_init, "msaidx_batch_desc_init")
    SYMBOL(plan_create, "msaidx_plan_create")
    SYMBOL(plan_destroy, "msaidx_plan_destroy")
    SYMBOL(plan_workspace_size, "msaidx_plan_workspace_size")
    SYMBOL(plan_batch, "msaidx_plan_batch")
    SYMBOL(prefill_scores, "msaidx_prefill_scores")
    SYMBOL(last_error, "msaidx_last_error")
#undef SYMBOL
    return true;
}

static int parse_list(char *text, int32_t *values) {
    int n = 0;
    /* cu_seqlens_q holds requests + 1 entries in its kMaxRequests slots */
    for (char *item = strtok(text, ","); item && n < kMaxRequests - 1; item = strtok(NULL, ","))
        values[n++] = (int32_t)strtol(item, NULL, 10);
    return n;
}

/* The bench's shapes file: name, H, comma-separated q_lens, comma-separated kv_lens. */
static int load_shapes(const char *path, shape *shapes, int capacity) {
    FILE *file = fopen(path, "r");
    if (!file) {
        fprintf(stderr, "msaidx_ab: cannot open %s\n", path);
        return -1;
    }
    char line[8192], q[4096], kv[4096];
    int n = 0;
    while (n < capacity && fgets(line, sizeof line, file)) {
        shape *s = &shapes[n];
        if (line[0] == '#' || sscanf(line, "%63s %d %4095s %4095s", s->name, &s->heads, q, kv) != 4)
            continue;
        s->requests = parse_list(q, s->q_lens);
        if (parse_list(kv, s->kv_lens) != s->requests) continue;
        ++n;
    }
    fclose(file);
    return n;
}

static uint64_t next_random(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random finite values of moderate magnitude: E4M3 bytes of any sign, exponent field 4-10 and
 * mantissa; or BF16 of any sign, exponent field 124-130 and mantissa. */
static bool fill_inputs(CUdeviceptr dst, size_t bytes, bool bf16, uint64_t seed) {
    uint8_t *host = malloc(bytes);
    if (!host) return false;
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t r = next_random(&seed);
        if (bf16) {
            for (size_t j = 0; j < 8 && i + j + 1 < bytes; j += 2, r >>= 16) {
                const uint16_t value =
                    (uint16_t)((r & 0x807F) | (uint16_t)((124 + (r >> 7) % 7) << 7));
                host[i + j] = (uint8_t)value;
                host[i + j + 1] = (uint8_t)(value >> 8);
            }
        } else {
            for (size_t j = 0; j < 8 && i + j < bytes; ++j, r >>= 8)
                host[i + j] = (uint8_t)((r & 0x87) | (uint8_t)((4 + (r >> 3) % 7) << 3));
        }
    }
    const bool ok = cu_ok(cuMemcpyHtoD(dst, host, bytes), "copy inputs");
    free(host);
    return ok;
}

static int compare_doubles(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *values, int n) {
    qsort(values, (size_t)n, sizeof *values, compare_doubles);
    return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

typedef struct {
    const char *shapes, *dtype, *precision, *only, *json;
    int repeat;
} options;

static bool is_bf16(const options *o) { return !strcmp(o->dtype, "bf16"); }

static bool selected(const options *o, const char *name) {
    if (!o->only) return true;
    const size_t length = strlen(name);
    for (const char *p = o->only; (p = strstr(p, name)); p += length)
        if ((p == o->only || p[-1] == ',') && (p[length] == ',' || p[length] == '\0')) return true;
    return false;
}

/* Plans the shape on one build: context, plan, workspace, planned batch, poisoned scores. */
static bool open_side(const library *lib, const options *o, const shape *s, int32_t num_pages,
                      int32_t max_q, int32_t max_kv, int32_t pitch, CUdeviceptr metadata,
                      size_t score_bytes, side *out) {
    union {
        msaidx_config config;
        unsigned char room[512]; /* a newer build's config may be larger than this header's */
    } c;
    union {
        msaidx_batch_desc desc;
        unsigned char room[512];
    } d;
    memset(&c, 0, sizeof c);
    memset(&d, 0, sizeof d);
    lib->config_init(&c.config);
    c.config.num_heads = s->heads;
    c.config.dtype = is_bf16(o) ? MSAIDX_DTYPE_BF16 : MSAIDX_DTYPE_E4M3;
    c.config.backend = MSAIDX_BACKEND_PERSISTENT;
    c.config.device = 0;
    c.config.fast_accumulation = strcmp(o->precision, "exact") ? 1 : 0;
    lib->batch_desc_init(&d.desc);
    int32_t tokens = 0;
    for (int b = 0; b < s->requests; ++b) tokens += s->q_lens[b];
    d.desc.batch_size = s->requests;
    d.desc.num_tokens = tokens;
    d.desc.max_q_len = max_q;
    d.desc.max_seq_len = max_kv;
    d.desc.num_pages = num_pages;
    d.desc.bt_stride = pitch;
    d.desc.page_stride = kPageKeys * kHeadDim * (is_bf16(o) ? 2 : 1);
    d.desc.pitch = pitch;
    size_t workspace_bytes = 0;
    const CUdeviceptr cu_seqlens = metadata, seq_lens = metadata + 4 * kMaxRequests,
                      block_table = metadata + 8 * kMaxRequests;
    return lib_ok(lib, lib->context_create(&out->context, &c.config), "context") &&
           lib_ok(lib, lib->plan_create(&out->plan, out->context, &d.desc), "plan") &&
           lib_ok(lib, lib->plan_workspace_size(out->plan, &workspace_bytes), "workspace size") &&
           cu_ok(cuMemAlloc(&out->workspace, workspace_bytes ? workspace_bytes : 16),
                 "workspace") &&
           cu_ok(cuMemAlloc(&out->scores, score_bytes), "scores") &&
           cu_ok(cuMemsetD8(out->scores, 0xff, score_bytes), "poison scores") &&
           lib_ok(lib,
                  lib->plan_batch(out->plan, (const int32_t *)cu_seqlens, (const int32_t *)seq_lens,
                                  (const int32_t *)block_table, (void *)out->workspace,
                                  workspace_bytes, NULL),
                  "plan_batch");
}

static void close_side(const library *lib, side *s) {
    lib->plan_destroy(s->plan);
    lib->context_destroy(s->context);
    if (s->workspace) cuMemFree(s->workspace);
    if (s->scores) cuMemFree(s->scores);
    memset(s, 0, sizeof *s);
}

/* Whole score buffers, poisoned alike before the first call: equal bytes mean equal scores in
 * every written cell and no write outside them. */
static bool same_scores(CUdeviceptr a, CUdeviceptr b, size_t bytes, bool *equal) {
    enum { kChunk = 64 << 20 };
    uint8_t *x = malloc(kChunk), *y = malloc(kChunk);
    bool ok = x && y;
    *equal = true;
    for (size_t at = 0; ok && *equal && at < bytes; at += kChunk) {
        const size_t n = bytes - at < kChunk ? bytes - at : kChunk;
        ok = cu_ok(cuMemcpyDtoH(x, a + at, n), "read scores") &&
             cu_ok(cuMemcpyDtoH(y, b + at, n), "read scores");
        *equal = ok && !memcmp(x, y, n);
    }
    free(x);
    free(y);
    return ok;
}

static bool run_shape(const library lib[2], const options *o, const shape *s, CUdeviceptr flush,
                      size_t flush_bytes, CUevent events[2], FILE *json, bool *first_row,
                      double *ratio, bool *equal_out) {
    int32_t tokens = 0, num_pages = 0, max_q = 0, max_kv = 0;
    for (int b = 0; b < s->requests; ++b) {
        tokens += s->q_lens[b];
        num_pages += (s->kv_lens[b] + kPageKeys - 1) / kPageKeys;
        max_q = s->q_lens[b] > max_q ? s->q_lens[b] : max_q;
        max_kv = s->kv_lens[b] > max_kv ? s->kv_lens[b] : max_kv;
    }
    const int32_t pitch = (max_kv + kPageKeys - 1) / kPageKeys;
    /* Metadata: cu_seqlens_q, seq_lens, then the block table of a shuffled cache. */
    const size_t metadata_bytes = 8 * kMaxRequests + 4 * (size_t)s->requests * pitch;
    int32_t *metadata = calloc(1, metadata_bytes), *order = malloc(4 * (size_t)num_pages);
    if (!metadata || !order) return false;
    uint64_t seed = 0x5EED;
    for (int32_t i = 0; i < num_pages; ++i) order[i] = i;
    for (int32_t i = num_pages - 1; i > 0; --i) {
        const int32_t j = (int32_t)(next_random(&seed) % (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int b = 0, next = 0; b < s->requests; ++b) {
        metadata[b + 1] = metadata[b] + s->q_lens[b];
        metadata[kMaxRequests + b] = s->kv_lens[b];
        const int32_t pages = (s->kv_lens[b] + kPageKeys - 1) / kPageKeys;
        for (int32_t p = 0; p < pitch; ++p)
            metadata[2 * kMaxRequests + b * pitch + p] = p < pages ? order[next++] : -1;
    }
    free(order);
    const size_t elem = is_bf16(o) ? 2 : 1, q_bytes = (size_t)tokens * s->heads * kHeadDim * elem,
                 k_bytes = (size_t)num_pages * kPageKeys * kHeadDim * elem,
                 score_bytes = (size_t)tokens * s->heads * pitch * sizeof(float);
    CUdeviceptr meta = 0, q = 0, k = 0;
    side sides[2] = {{0}};
    double *times = calloc(2 * (size_t)o->repeat, sizeof(double));
    bool ok = times && cu_ok(cuMemAlloc(&meta, metadata_bytes), "metadata") &&
              cu_ok(cuMemcpyHtoD(meta, metadata, metadata_bytes), "copy metadata") &&
              cu_ok(cuMemAlloc(&q, q_bytes), "q") && cu_ok(cuMemAlloc(&k, k_bytes), "k cache") &&
              fill_inputs(q, q_bytes, is_bf16(o), 1) && fill_inputs(k, k_bytes, is_bf16(o), 2);
    free(metadata);
    for (int i = 0; ok && i < 2; ++i)
        ok =
            open_side(&lib[i], o, s, num_pages, max_q, max_kv, pitch, meta, score_bytes, &sides[i]);
    for (int i = 0; ok && i < 2; ++i) /* warm-up, and the scores compared below */
        ok = lib_ok(&lib[i],
                    lib[i].prefill_scores(sides[i].plan, (const void *)q, (const void *)k,
                                          (float *)sides[i].scores, NULL),
                    "prefill_scores");
    bool equal = false;
    ok = ok && cu_ok(cuCtxSynchronize(), "warm-up") &&
         same_scores(sides[0].scores, sides[1].scores, score_bytes, &equal);
    for (int r = 0; ok && r < o->repeat; ++r) {
        for (int turn = 0; ok && turn < 2; ++turn) {
            const int i = r % 2 ? 1 - turn : turn; /* A B, B A, A B, ... */
            float ms = 0.f;
            ok = cu_ok(cuMemsetD8Async(flush, (unsigned char)r, flush_bytes, NULL), "flush") &&
                 cu_ok(cuEventRecord(events[0], NULL), "event") &&
                 lib_ok(&lib[i],
                        lib[i].prefill_scores(sides[i].plan, (const void *)q, (const void *)k,
                                              (float *)sides[i].scores, NULL),
                        "prefill_scores") &&
                 cu_ok(cuEventRecord(events[1], NULL), "event") &&
                 cu_ok(cuEventSynchronize(events[1]), "sync") &&
                 cu_ok(cuEventElapsedTime(&ms, events[0], events[1]), "elapsed");
            times[i * o->repeat + r] = 1e3 * ms;
        }
    }
    if (ok) {
        const double a = median(times, o->repeat), b = median(times + o->repeat, o->repeat);
        printf("%-22s %10.2f %10.2f %7.3f %s\n", s->name, a, b, b / a,
               equal ? "equal" : "SCORES DIFFER");
        if (json)
            fprintf(
                json,
                "%s\n    {\"name\": \"%s\", \"a_us\": %.3f, \"b_us\": %.3f, \"b_over_a\": %.4f, "
                "\"scores_equal\": %s}",
                *first_row ? "" : ",", s->name, a, b, b / a, equal ? "true" : "false");
        *first_row = false;
        *ratio = b / a;
        *equal_out = equal;
    }
    for (int i = 0; i < 2; ++i) close_side(&lib[i], &sides[i]);
    if (meta) cuMemFree(meta);
    if (q) cuMemFree(q);
    if (k) cuMemFree(k);
    free(times);
    return ok;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: msaidx_ab LIB_A LIB_B [--shapes FILE] [--dtype e4m3|bf16] "
                        "[--precision fp8|exact] [--repeat N] [--only NAME,...] [--json FILE]\n");
        return 2;
    }
    options o = {"bench/shapes/prefill78.tsv", "e4m3", "fp8", NULL, NULL, 20};
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--shapes"))
            o.shapes = argv[i + 1];
        else if (!strcmp(argv[i], "--dtype"))
            o.dtype = argv[i + 1];
        else if (!strcmp(argv[i], "--precision"))
            o.precision = argv[i + 1];
        else if (!strcmp(argv[i], "--repeat"))
            o.repeat = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--only"))
            o.only = argv[i + 1];
        else if (!strcmp(argv[i], "--json"))
            o.json = argv[i + 1];
        else {
            fprintf(stderr, "msaidx_ab: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (o.repeat < 1 || (strcmp(o.precision, "fp8") && strcmp(o.precision, "exact")) ||
        (strcmp(o.dtype, "e4m3") && strcmp(o.dtype, "bf16"))) {
        fprintf(stderr,
                "msaidx_ab: --repeat >= 1, --precision fp8 or exact, --dtype e4m3 or bf16\n");
        return 2;
    }
    library lib[2];
    static shape shapes[256];
    const int count = load_shapes(o.shapes, shapes, 256);
    CUdevice device;
    CUcontext context;
    int l2_bytes = 0;
    CUdeviceptr flush = 0;
    CUevent events[2];
    if (count < 0 || !load_library(argv[1], &lib[0]) || !load_library(argv[2], &lib[1]) ||
        !cu_ok(cuInit(0), "cuInit") || !cu_ok(cuDeviceGet(&device, 0), "device") ||
        !cu_ok(cuDevicePrimaryCtxRetain(&context, device), "primary context") ||
        !cu_ok(cuCtxSetCurrent(context), "set context") ||
        !cu_ok(cuDeviceGetAttribute(&l2_bytes, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, device), "L2") ||
        !cu_ok(cuMemAlloc(&flush, 2 * (size_t)l2_bytes), "flush buffer") ||
        !cu_ok(cuEventCreate(&events[0], CU_EVENT_DEFAULT), "event") ||
        !cu_ok(cuEventCreate(&events[1], CU_EVENT_DEFAULT), "event"))
        return 1;
    FILE *json = o.json ? fopen(o.json, "w") : NULL;
    if (o.json && !json) {
        fprintf(stderr, "msaidx_ab: cannot write %s\n", o.json);
        return 1;
    }
    if (json)
        fprintf(json,
                "{\n  \"a\": \"%s\",\n  \"b\": \"%s\",\n  \"dtype\": \"%s\",\n"
                "  \"precision\": \"%s\",\n  \"repeat\": %d,\n  \"flush\": \"memset\",\n"
                "  \"shapes\": [",
                argv[1], argv[2], o.dtype, o.precision, o.repeat);
    printf("# A = %s\n# B = %s\n# %s %s, median of %d alternating runs each, L2 flushed by a "
           "memset\n%-22s %10s %10s %7s\n",
           argv[1], argv[2], o.dtype, o.precision, o.repeat, "shape", "A us", "B us", "B/A");
    bool ok = true, first_row = true;
    double log_sum = 0.0, worst = 0.0;
    int measured = 0, over = 0, differ = 0;
    const char *worst_name = "";
    for (int i = 0; ok && i < count; ++i) {
        if (!selected(&o, shapes[i].name)) continue;
        double ratio = 1.0;
        bool equal = false;
        ok = run_shape(lib, &o, &shapes[i], flush, 2 * (size_t)l2_bytes, events, json, &first_row,
                       &ratio, &equal);
        if (!ok) break;
        ++measured;
        log_sum += log(ratio);
        over += ratio > 1.05;
        differ += !equal;
        if (ratio > worst) {
            worst = ratio;
            worst_name = shapes[i].name;
        }
    }
    if (measured)
        printf("# %d shapes: B/A geomean %.3f, worst %s %.3f, above 1.05: %d, scores differ: %d\n",
               measured, exp(log_sum / measured), worst_name, worst, over, differ);
    if (json) {
        fprintf(json, "\n  ]\n}\n");
        ok = !fclose(json) && ok;
    }
    return ok && measured > 0 ? 0 : 1;
}
