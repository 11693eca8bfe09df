/* Fast cpu scorer: a GEMM with a max epilogue. Work items are (request, token tile, page range);
 * each decodes its query tile once, packs every key panel of its pages once into a transposed
 * layout (floats, or bf16 pairs for the AVX512-BF16 kernel), and runs a register-blocked SIMD
 * kernel (chosen at run time) over the tile. */
#include "score_fast.h"
#include "../convert.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Query rows per tile: enough rows that packing a key panel costs little next to scoring it. */
#define TILE_ROWS 192
/* Keys per work item: enough to reuse the decoded query tile, few enough to balance threads. */
#define ITEM_KEYS 1024

static const msaidx_fast_kernels *selected;
static pthread_once_t select_once = PTHREAD_ONCE_INIT;

/* The best SIMD level this CPU runs, lowered (never raised) by
 * MSAIDX_CPU_SIMD=avx512|avx2|scalar ("avx512": without the BF16 dot product). */
static void select_kernels(void) {
    const msaidx_fast_kernels *avx512 = NULL, *avx2 = NULL;
    selected = &msaidx_fast_scalar;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        selected = avx2 = &msaidx_fast_avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
        selected = avx512 = &msaidx_fast_avx512;
    if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi"))
        selected = &msaidx_fast_avx512_bf16;
#endif
    const char *forced = getenv("MSAIDX_CPU_SIMD");
    const msaidx_fast_kernels *cap = NULL;
    if (forced && strcmp(forced, "scalar") == 0) cap = &msaidx_fast_scalar;
    if (forced && strcmp(forced, "avx2") == 0) cap = avx2 ? avx2 : &msaidx_fast_scalar;
    if (forced && strcmp(forced, "avx512") == 0)
        cap = avx512 ? avx512 : avx2 ? avx2 : &msaidx_fast_scalar;
    if (cap) selected = cap;
}

static const msaidx_fast_kernels *kernels(void) {
    pthread_once(&select_once, select_kernels);
    return selected;
}

const char *msaidx_cpu_simd_name(void) { return kernels()->name; }

/* Consecutive tokens of one request; its work items are page ranges numbered from first_item. */
typedef struct token_tile {
    int32_t request;
    int32_t first_token; /* within the request */
    int32_t num_tokens;
    int32_t pages_per_item;
    int64_t first_item;
} token_tile;

/* Everything an item needs to know about its request and tile. */
typedef struct item_geometry {
    int64_t first_row; /* scores / q row of the tile's first token, head 0 */
    int32_t rows;      /* tokens * H */
    int32_t first_pos; /* position of the tile's first token */
    int32_t last_pos;
    int32_t first_page, end_page; /* global logical pages */
    const int32_t *pages;         /* the request's block-table row: the rank's pages */
    msaidx_page_shard shard;
    int32_t request_pages;
} item_geometry;

static item_geometry geometry(const msaidx_cpu_batch *batch, const token_tile *tile, int64_t item) {
    const int32_t b = tile->request, H = batch->config->num_heads, P = batch->config->page_size;
    const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
    item_geometry g;
    g.first_row = (int64_t)(batch->cu_seqlens_q[b] + tile->first_token) * H;
    g.rows = tile->num_tokens * H;
    g.first_pos = batch->seq_lens[b] - q_len + tile->first_token;
    g.last_pos = g.first_pos + tile->num_tokens - 1;
    g.first_page = (int32_t)(item - tile->first_item) * tile->pages_per_item;
    g.end_page = g.first_page + tile->pages_per_item;
    if (g.end_page > g.last_pos / P + 1) g.end_page = g.last_pos / P + 1;
    g.pages = batch->block_table + (size_t)b * batch->desc->bt_stride;
    g.shard = msaidx_shard_of(batch->desc);
    g.request_pages = msaidx_request_pages(batch->seq_lens[b], P);
    return g;
}

/* Per-thread scratch: the decoded query tile, one packed key panel, per-row max and key limit. */
typedef struct scratch {
    float *q_tile;
    float *panel;
    float *row_max;
    int32_t *limit;
} scratch;

static void score_item(const msaidx_cpu_batch *batch, const msaidx_fast_kernels *k,
                       const item_geometry *g, const scratch *s) {
    const msaidx_config *c = batch->config;
    const int32_t D = c->head_dim, P = c->page_size, H = c->num_heads;
    const size_t elem = (size_t)msaidx_elem_size(c->dtype), pitch = (size_t)batch->desc->pitch;
    const char *q = (const char *)batch->q + (size_t)g->first_row * D * elem;
    /* Data a kernel set refuses moves the rest of the item to its fallback, query tile first. */
    if (!k->decode_q(c->dtype, q, g->rows, D, s->q_tile)) {
        k = k->fallback;
        k->decode_q(c->dtype, q, g->rows, D, s->q_tile);
    }
    for (int32_t p = g->first_page; p < g->end_page; ++p) {
        const int32_t column = msaidx_shard_local(g->shard, g->request_pages, p);
        if (column < 0) continue; /* another rank's page */
        const int32_t base = p * P;
        /* Tokens before position `base` do not see this page; the rest form a suffix of rows. */
        const int32_t first_seeing = base > g->first_pos ? base - g->first_pos : 0;
        const int32_t keys = g->last_pos - base + 1 < P ? g->last_pos - base + 1 : P;
        const char *page =
            (const char *)batch->k_cache + (size_t)g->pages[column] * batch->desc->page_stride;
        for (int32_t r = first_seeing * H; r < g->rows; ++r) s->row_max[r] = -INFINITY;
        /* Items of few rows (decode) score straight from the stored keys where the kernel set
         * can, and fetch their next page while scoring one: pages are scattered, so the hardware
         * prefetcher starts each one cold, and scoring a page with few rows takes about as long
         * as reading it. Longer tiles score a page far longer than it takes to read. */
        const char *next_page = NULL;
        if (g->rows <= MSAIDX_FEW_ROWS && p + 1 < g->end_page) {
            const int32_t next = msaidx_shard_local(g->shard, g->request_pages, p + 1);
            if (next >= 0)
                next_page = (const char *)batch->k_cache +
                            (size_t)g->pages[next] * batch->desc->page_stride;
        }
        const size_t page_bytes = (size_t)P * D * elem;
        bool scored = false;
        if (g->rows <= MSAIDX_FEW_ROWS && k->keys_max) {
            const size_t r0 = (size_t)first_seeing * H;
            for (size_t r = r0; r < (size_t)g->rows; ++r)
                s->limit[r] = g->first_pos + (int32_t)r / H - base + 1;
            scored = k->keys_max(c->dtype, page, D, (keys + 15) / 16 * 16, s->q_tile + r0 * D,
                                 g->rows - (int32_t)r0, s->limit + r0, s->row_max + r0, next_page,
                                 page_bytes);
            if (!scored) {
                k = k->fallback;
                k->decode_q(c->dtype, q, g->rows, D, s->q_tile);
            }
        }
        if (!scored && next_page)
            for (size_t b = 0; b < page_bytes; b += 64)
                __builtin_prefetch(next_page + b, 0, 2); /* into L2 */
        for (int32_t k0 = 0; k0 < keys && !scored; k0 += MSAIDX_PANEL_KEYS) {
            const int32_t rest = (keys - k0 + 15) / 16 * 16; /* <= P - k0: stays in the page */
            const int32_t width = rest < MSAIDX_PANEL_KEYS ? rest : MSAIDX_PANEL_KEYS;
            const char *keys_at = page + (size_t)k0 * D * elem;
            if (!k->pack_panel(c->dtype, keys_at, D, width, s->panel)) {
                k = k->fallback;
                k->decode_q(c->dtype, q, g->rows, D, s->q_tile);
                k->pack_panel(c->dtype, keys_at, D, width, s->panel);
            }
            const int32_t first_token = base + k0 > g->first_pos ? base + k0 - g->first_pos : 0;
            for (int32_t r = first_token * H; r < g->rows; ++r)
                s->limit[r] = g->first_pos + r / H - (base + k0) + 1;
            const size_t r0 = (size_t)first_token * H;
            k->panel_max(s->q_tile + r0 * D, g->rows - (int32_t)r0, D, s->panel, width,
                         s->limit + r0, s->row_max + r0);
        }
        for (int32_t r = first_seeing * H; r < g->rows; ++r)
            batch->scores[((size_t)g->first_row + r) * pitch + column] = s->row_max[r];
    }
}

static float decode_one(msaidx_dtype dtype, const void *src, size_t index) {
    return dtype == MSAIDX_DTYPE_BF16 ? msaidx_bf16_decode(((const uint16_t *)src)[index])
                                      : msaidx_e4m3_decode(((const uint8_t *)src)[index]);
}

/* Needs no scratch: what a thread runs when its scratch allocation failed. */
static void score_item_unbuffered(const msaidx_cpu_batch *batch, const item_geometry *g) {
    const msaidx_config *c = batch->config;
    const int32_t D = c->head_dim, P = c->page_size, H = c->num_heads;
    const size_t elem = (size_t)msaidx_elem_size(c->dtype), pitch = (size_t)batch->desc->pitch;
    for (int32_t p = g->first_page; p < g->end_page; ++p) {
        const int32_t column = msaidx_shard_local(g->shard, g->request_pages, p);
        if (column < 0) continue; /* another rank's page */
        const char *page =
            (const char *)batch->k_cache + (size_t)g->pages[column] * batch->desc->page_stride;
        for (int32_t r = 0; r < g->rows; ++r) {
            const int32_t pos = g->first_pos + r / H;
            if (pos < p * P) continue;
            const char *q_row = (const char *)batch->q + ((size_t)g->first_row + r) * D * elem;
            float best = -INFINITY;
            for (int32_t j = 0; j < P && p * P + j <= pos; ++j) {
                const char *key = page + (size_t)j * D * elem;
                float dot = 0.0f;
                for (int32_t e = 0; e < D; ++e)
                    dot += decode_one(c->dtype, q_row, (size_t)e) *
                           decode_one(c->dtype, key, (size_t)e);
                if (dot > best) best = dot;
            }
            batch->scores[((size_t)g->first_row + r) * pitch + column] = best;
        }
    }
}

/* Fills tiles (NULL: only counts them); returns the number of tiles, *num_items the items. */
static int32_t plan_tiles(const msaidx_cpu_batch *batch, token_tile *tiles, int64_t *num_items) {
    const int32_t H = batch->config->num_heads, P = batch->config->page_size;
    const int32_t tile_tokens = TILE_ROWS / H;
    const int32_t pages_per_item = ITEM_KEYS / P > 1 ? ITEM_KEYS / P : 1;
    int32_t n = 0;
    int64_t items = 0;
    for (int32_t b = 0; b < batch->desc->batch_size; ++b) {
        const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
        for (int32_t first = 0, tokens; first < q_len; first += tokens) { /* never past q_len */
            tokens = q_len - first < tile_tokens ? q_len - first : tile_tokens;
            const int32_t last_pos = batch->seq_lens[b] - q_len + first + tokens - 1;
            const int32_t pages = last_pos / P + 1;
            if (tiles) tiles[n] = (token_tile){b, first, tokens, pages_per_item, items};
            ++n;
            items += (pages + pages_per_item - 1) / pages_per_item;
        }
    }
    *num_items = items;
    return n;
}

/* The tile owning `item`: the last one whose first_item is <= item. */
static const token_tile *find_tile(const token_tile *tiles, int32_t num_tiles, int64_t item) {
    int32_t lo = 0, hi = num_tiles - 1;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        if (tiles[mid].first_item <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return &tiles[lo];
}

static void score_without_tiles(const msaidx_cpu_batch *batch);

void msaidx_cpu_scores_fast(const msaidx_cpu_batch *batch) {
    const msaidx_fast_kernels *k = kernels();
    const int32_t D = batch->config->head_dim;
    int64_t num_items = 0;
    const int32_t num_tiles = plan_tiles(batch, NULL, &num_items);
    if (num_tiles == 0) return;
    token_tile *tiles = malloc(sizeof(token_tile) * (size_t)num_tiles);
    if (!tiles) {
        score_without_tiles(batch);
        return;
    }
    plan_tiles(batch, tiles, &num_items);
    const size_t q_bytes = sizeof(float) * TILE_ROWS * (size_t)D;
    const size_t panel_bytes = sizeof(float) * MSAIDX_PANEL_KEYS * (size_t)D;
    const size_t row_bytes = msaidx_align_up(sizeof(float) * TILE_ROWS, 64);
    const size_t scratch_bytes = q_bytes + panel_bytes + 2 * row_bytes;
#pragma omp parallel num_threads(msaidx_cpu_threads(batch->config))
    {
        char *memory = aligned_alloc(64, scratch_bytes);
        const scratch s = {
            .q_tile = (float *)memory,
            .panel = memory ? (float *)(memory + q_bytes) : NULL,
            .row_max = memory ? (float *)(memory + q_bytes + panel_bytes) : NULL,
            .limit = memory ? (int32_t *)(memory + q_bytes + panel_bytes + row_bytes) : NULL,
        };
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const token_tile *tile = find_tile(tiles, num_tiles, item);
            const item_geometry g = geometry(batch, tile, item);
            if (memory)
                score_item(batch, k, &g, &s);
            else
                score_item_unbuffered(batch, &g);
        }
        free(memory);
    }
    free(tiles);
}

/* No memory even for the tile list: one request per iteration, every page, no scratch. */
static void score_without_tiles(const msaidx_cpu_batch *batch) {
    const int32_t P = batch->config->page_size;
#pragma omp parallel for schedule(dynamic, 1) num_threads(msaidx_cpu_threads(batch->config))
    for (int32_t b = 0; b < batch->desc->batch_size; ++b) {
        const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
        if (q_len == 0) continue;
        const token_tile whole = {b, 0, q_len, (batch->seq_lens[b] - 1) / P + 1, 0};
        const item_geometry g = geometry(batch, &whole, 0);
        score_item_unbuffered(batch, &g);
    }
}
