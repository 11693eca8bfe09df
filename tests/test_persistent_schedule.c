/* The persistent backend's schedule (src/cuda/persistent_schedule.h), on the host: the chunk size
 * is the cheapest of its choices, and the deal (segments + tile order, built here the way the
 * device plan defines them) hands out every page chunk of every tile exactly once, as real tasks,
 * the same number (+-1) to every CTA, one chunk row after another. */
#include "cuda/persistent_schedule.h"
#include "harness.h"

#include <stdbool.h>
#include <stdlib.h>

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void task_counts(const int32_t *pages, int64_t num_tiles,
                        uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES], uint64_t *total) {
    *total = 0;
    for (int c = 0; c < MSAIDX_PERSISTENT_CHUNK_CHOICES; ++c) tasks[c] = 0;
    for (int64_t t = 0; t < num_tiles; ++t) {
        *total += (uint64_t)pages[t];
        for (int c = 0; c < MSAIDX_PERSISTENT_CHUNK_CHOICES; ++c)
            tasks[c] += (uint64_t)ceil_div(pages[t], c + 1);
    }
}

static uint64_t cost_of(const uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES], int c,
                        int32_t num_sms) {
    return (uint64_t)ceil_div((int64_t)tasks[c], num_sms) *
           (4 * ((uint64_t)c + 1) + MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS);
}

/* The chunk is a choice of least cost, the largest such, a power of two unless another size is
 * cheaper by the margin, on random batches of tiles. */
static void chunk_is_cheapest(harness_rng *rng) {
    static const int32_t sms[] = {1, 78, 132, 144};
    static int32_t pages[2000];
    int bad = 0, other_sizes = 0;
    for (int i = 0; i < 3000; ++i) {
        const int64_t tiles = harness_int(rng, 1, 2000);
        const int64_t longest = i % 2 ? 8193 : 300;
        for (int64_t t = 0; t < tiles; ++t) pages[t] = (int32_t)harness_int(rng, 1, longest);
        uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES], total;
        task_counts(pages, tiles, tasks, &total);
        const int32_t num_sms = sms[i % 4];
        const int32_t got = msaidx_persistent_chunk_pages(tasks, total, tiles, num_sms);
        int best = MSAIDX_PERSISTENT_CHUNK_CHOICES - 1, best_power = best;
        for (int c = best - 1; c >= 0; --c) {
            if (cost_of(tasks, c, num_sms) < cost_of(tasks, best, num_sms)) best = c;
            if ((c & (c + 1)) == 0 &&
                cost_of(tasks, c, num_sms) < cost_of(tasks, best_power, num_sms))
                best_power = c;
        }
        if (100 * cost_of(tasks, best, num_sms) >
            (100 - MSAIDX_PERSISTENT_ODD_CHUNK_MIN_SAVING_PERCENT) *
                cost_of(tasks, best_power, num_sms))
            best = best_power;
        other_sizes += (got & (got - 1)) != 0;
        if (got != best + 1 && ++bad <= 5)
            CHECK(false, "tiles %lld, sms %d, pages %llu: chunk %d, the cheapest is %d",
                  (long long)tiles, num_sms, (unsigned long long)total, got, best + 1);
    }
    CHECK(bad == 0, "%d random batches got a chunk that is not the cheapest", bad);
    CHECK(other_sizes > 0 && other_sizes < 3000,
          "%d of 3000 random batches got a size that is not a power of two", other_sizes);
    /* Past 2^31 tasks even at 64 pages: longer chunks, fewer than 2^31 tasks. */
    uint64_t huge[MSAIDX_PERSISTENT_CHUNK_CHOICES];
    for (int c = 0; c < MSAIDX_PERSISTENT_CHUNK_CHOICES; ++c)
        huge[c] = c + 1 < MSAIDX_PERSISTENT_MAX_CHUNK_PAGES ? UINT64_MAX : (uint64_t)1 << 32;
    const uint64_t huge_pages = (uint64_t)1 << 38;
    const int32_t chunk = msaidx_persistent_chunk_pages(huge, huge_pages, 1 << 20, 132);
    CHECK(chunk > MSAIDX_PERSISTENT_MAX_CHUNK_PAGES &&
              huge_pages / (uint64_t)chunk + (1 << 20) <= INT32_MAX,
          "2^38 pages: chunk %d", chunk);
}

/* The chunk of a batch of causal requests in 256-row tiles (q_len tokens at the end of kv_len). */
static int32_t chunk_of_batch(int num_requests, const int32_t *q_lens, const int32_t *kv_lens,
                              int heads, int32_t num_sms) {
    int32_t pages[4096];
    int64_t tiles = 0;
    for (int b = 0; b < num_requests; ++b)
        for (int64_t row = 0; row < (int64_t)q_lens[b] * heads; row += 256) {
            const int64_t last_row =
                row + 255 < (int64_t)q_lens[b] * heads ? row + 255 : (int64_t)q_lens[b] * heads - 1;
            pages[tiles++] = (int32_t)((kv_lens[b] - q_lens[b] + last_row / heads) / 128 + 1);
        }
    uint64_t tasks[MSAIDX_PERSISTENT_CHUNK_CHOICES], total;
    task_counts(pages, tiles, tasks, &total);
    return msaidx_persistent_chunk_pages(tasks, total, tiles, num_sms);
}

static void chunk_is(int32_t q_len, int32_t kv_len, int heads, int32_t want, const char *shape) {
    const int32_t got = chunk_of_batch(1, &q_len, &kv_len, heads, 132);
    CHECK(got == want, "%s: chunk %d, want %d", shape, got, want);
}

/* The deal of per-tile chunk counts `chunks` on `grid` CTAs. */
static void deal_is_balanced(const int32_t *chunks, int32_t num_tiles, int32_t grid) {
    int32_t max_chunks = 0;
    for (int32_t t = 0; t < num_tiles; ++t)
        max_chunks = chunks[t] > max_chunks ? chunks[t] : max_chunks;
    /* order: tiles by chunk count, most first; width of row r: the tiles with more than r chunks.
     */
    int32_t *order = malloc(sizeof(int32_t) * (size_t)num_tiles);
    msaidx_persistent_segment *segments =
        malloc(sizeof(msaidx_persistent_segment) * ((size_t)max_chunks + 1));
    int64_t *seen = calloc((size_t)num_tiles * (size_t)max_chunks, sizeof(int64_t));
    int32_t *per_cta = calloc((size_t)grid, sizeof(int32_t));
    if (!order || !segments || !seen || !per_cta) {
        CHECK(false, "out of memory");
        free(order), free(segments), free(seen), free(per_cta);
        return;
    }
    int32_t placed = 0;
    for (int32_t count = max_chunks; count >= 1; --count)
        for (int32_t t = 0; t < num_tiles; ++t)
            if (chunks[t] == count) order[placed++] = t;
    int32_t num_segments = 0, tasks = 0, previous_width = -1;
    for (int32_t r = 0; r < max_chunks; ++r) {
        int32_t width = 0;
        for (int32_t t = 0; t < num_tiles; ++t) width += chunks[t] > r;
        if (width != previous_width)
            segments[num_segments++] = (msaidx_persistent_segment){tasks, r, width, 0};
        previous_width = width;
        tasks += width;
    }
    segments[num_segments] = (msaidx_persistent_segment){tasks, max_chunks, 0, 0};

    bool in_range = true, rows_in_order = true;
    for (int32_t cta = 0; cta < grid; ++cta) {
        int32_t cursor = 0, last_row = -1;
        for (int32_t k = cta; k < tasks; k += grid) {
            int32_t row, position;
            msaidx_persistent_locate(segments, &cursor, k, &row, &position);
            if (position < 0 || position >= num_tiles || row < 0 ||
                row >= chunks[order[position]]) {
                in_range = false;
                continue;
            }
            rows_in_order &= row >= last_row;
            last_row = row;
            seen[(size_t)order[position] * (size_t)max_chunks + (size_t)row]++;
            per_cta[cta]++;
        }
    }
    bool each_once = true;
    for (int32_t t = 0; t < num_tiles; ++t)
        for (int32_t r = 0; r < max_chunks; ++r)
            each_once &= seen[(size_t)t * (size_t)max_chunks + r] == (r < chunks[t]);
    int32_t fewest = per_cta[0], most = per_cta[0];
    for (int32_t cta = 1; cta < grid; ++cta) {
        fewest = per_cta[cta] < fewest ? per_cta[cta] : fewest;
        most = per_cta[cta] > most ? per_cta[cta] : most;
    }
    CHECK(in_range, "%d tiles on %d CTAs: a task outside its tile's chunks", num_tiles, grid);
    CHECK(each_once, "%d tiles on %d CTAs: a chunk dealt twice or never", num_tiles, grid);
    CHECK(most - fewest <= 1, "%d tiles on %d CTAs: CTAs get %d to %d tasks", num_tiles, grid,
          fewest, most);
    CHECK(rows_in_order, "%d tiles on %d CTAs: a CTA goes back to an earlier chunk row", num_tiles,
          grid);
    free(order), free(segments), free(seen), free(per_cta);
}

int main(void) {
    harness_rng rng = {harness_seed()};

    chunk_is_cheapest(&rng);
    /* The H200's 132 SMs on 78-shape batches. */
    chunk_is(128, 1 << 20, 1, 64, "q128_kv1024k_h1: 128 tasks of 64 pages (63 saves 1.5 %)");
    chunk_is(128, 8192, 1, 1, "q128_kv8k_h1: 64 one-page tasks");
    chunk_is(128, 32768, 1, 2, "q128_kv32k_h1: 128 two-page tasks");
    chunk_is(8192, 1 << 20, 4, 64, "q8k_kv1024k_h4: the longest chunk");
    chunk_is(8192, 8192, 1, 9, "q8k_kv8k_h1: one wave of 9-page tasks, not four of 2");
    {
        const int32_t q[] = {128, 128, 128, 128}, kv[] = {4096, 65536, 262144, 1 << 20};
        CHECK(chunk_of_batch(4, q, kv, 1, 132) >= 4,
              "a ragged batch takes chunks of several pages");
    }

    /* b16_q128_mixed-like ragged counts, causal self-attention, and random batches. */
    const int32_t ragged[] = {1,   2,   4,   8,    16,   32,   64,   128,
                              128, 256, 512, 1024, 2048, 4096, 8192, 8192};
    deal_is_balanced(ragged, 16, 132);
    int32_t causal[64];
    for (int t = 0; t < 64; ++t) causal[t] = 2 * t + 2;
    deal_is_balanced(causal, 64, 132);
    deal_is_balanced(causal, 1, 132);
    deal_is_balanced(causal, 64, 1);
    for (int i = 0; i < 300; ++i) {
        int32_t chunks[300];
        const int32_t tiles = (int32_t)harness_int(&rng, 1, 300);
        for (int32_t t = 0; t < tiles; ++t)
            chunks[t] = (int32_t)harness_int(&rng, 1, i % 3 ? 40 : 400);
        deal_is_balanced(chunks, tiles, (int32_t)harness_int(&rng, 1, 200));
    }
    return harness_finish("test_persistent_schedule");
}
