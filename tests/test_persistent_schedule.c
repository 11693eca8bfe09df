/* The persistent backend's schedule (src/cuda/persistent_schedule.h), on the host: the deal of
 * tasks to CTAs covers every page chunk of every tile exactly once and gives a CTA tiles of more
 * than one residue, and the chunk size follows its rules on the shapes where each rule decides and
 * on random batches. */
#include "cuda/persistent_schedule.h"
#include "harness.h"

#include <stdbool.h>
#include <stdlib.h>

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static uint32_t gcd(uint32_t a, uint32_t b) {
    while (b) {
        const uint32_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* Tasks 0 .. num_tiles * max_chunks - 1 hit each (tile, chunk row) slot exactly once, so every page
 * chunk of every tile is scored once. */
static void deal_covers_each_slot_once(uint32_t num_tiles, uint32_t max_chunks) {
    const uint32_t slots = num_tiles * max_chunks;
    unsigned char *seen = calloc(slots, 1);
    if (!seen) {
        CHECK(false, "out of memory");
        return;
    }
    bool each_once = true;
    for (uint32_t k = 0; k < slots; ++k) {
        const uint32_t tile = msaidx_persistent_task_tile(k, num_tiles);
        if (tile >= num_tiles || seen[(size_t)tile * max_chunks + k / num_tiles]++) each_once = false;
    }
    CHECK(each_once, "num_tiles %u, max_chunks %u: a slot dealt twice or a tile out of range", num_tiles,
          max_chunks);
    free(seen);
}

/* How many CTAs of `grid` (CTA c runs tasks c, c + grid, ...) see tiles of one residue modulo
 * gcd(grid, num_tiles) only. */
static int confined_ctas(uint32_t num_tiles, uint32_t max_chunks, uint32_t grid) {
    const uint32_t slots = num_tiles * max_chunks, residues = gcd(grid, num_tiles);
    int confined = 0;
    for (uint32_t c = 0; c < grid && c < slots; ++c) {
        const uint32_t first = msaidx_persistent_task_tile(c, num_tiles) % residues;
        bool more = false;
        for (uint32_t k = c + grid; k < slots; k += grid) more |= msaidx_persistent_task_tile(k, num_tiles) % residues != first;
        confined += !more;
    }
    return confined;
}

static void chunk_is(uint64_t total_pages, int64_t num_tiles, int32_t longest, int32_t num_sms, int32_t want,
                     const char *shape) {
    const int32_t got = msaidx_persistent_chunk_pages(total_pages, num_tiles, longest, num_sms);
    CHECK(got == want, "%s: chunk %d, want %d", shape, got, want);
}

/* The rules, checked against their own statement on random batches. */
static void chunk_rules(harness_rng *rng) {
    static const int32_t sms[] = {1, 78, 132, 144};
    int bad = 0;
    for (int i = 0; i < 200000; ++i) {
        const int64_t tiles = harness_int(rng, 1, i % 10 ? 5000 : 1 << 24);
        const int32_t longest = (int32_t)harness_int(rng, 1, 8193);
        const uint64_t total = (uint64_t)harness_int(rng, longest, tiles * longest);
        const int32_t num_sms = sms[i % 4];
        const int64_t c = msaidx_persistent_chunk_pages(total, tiles, longest, num_sms);
        const int64_t slots = tiles * ceil_div(longest, c);
        const int64_t by_load = ceil_div((int64_t)total, (int64_t)num_sms * MSAIDX_PERSISTENT_TASKS_PER_SM);
        bool ok = c >= 1 && slots <= INT32_MAX;
        if (slots <= INT32_MAX / 2 || c <= MSAIDX_PERSISTENT_MAX_CHUNK_PAGES) { /* not doubled for 2^31 */
            if (by_load >= MSAIDX_PERSISTENT_MIN_CHUNK_PAGES)
                ok = ok && c == (by_load < MSAIDX_PERSISTENT_MAX_CHUNK_PAGES ? by_load : MSAIDX_PERSISTENT_MAX_CHUNK_PAGES);
            else if (c < MSAIDX_PERSISTENT_MIN_CHUNK_PAGES) /* one wave, and the smallest chunk that is */
                ok = ok && slots <= num_sms && (c == 1 || tiles * ceil_div(longest, c - 1) > num_sms);
            else
                ok = ok && c == MSAIDX_PERSISTENT_MIN_CHUNK_PAGES &&
                     tiles * ceil_div(longest, MSAIDX_PERSISTENT_MIN_CHUNK_PAGES - 1) > num_sms;
        }
        if (!ok && ++bad <= 5)
            CHECK(false, "tiles %lld, longest %d, total %llu, sms %d: chunk %lld", (long long)tiles, longest,
                  (unsigned long long)total, num_sms, (long long)c);
    }
    CHECK(bad == 0, "%d random batches break a chunk rule", bad);
}

int main(void) {
    harness_rng rng = {harness_seed()};

    static const uint32_t tiles_and_rows[][2] = {{1, 8192}, {16, 410}, {36, 100}, {32, 16}, {132, 64}, {7, 3}};
    for (size_t i = 0; i < sizeof tiles_and_rows / sizeof tiles_and_rows[0]; ++i)
        deal_covers_each_slot_once(tiles_and_rows[i][0], tiles_and_rows[i][1]);
    for (int i = 0; i < 200; ++i)
        deal_covers_each_slot_once((uint32_t)harness_int(&rng, 1, 300), (uint32_t)harness_int(&rng, 1, 300));
    /* b16_q128_mixed_h1 on 132 CTAs: without the skew, CTA c saw only the tiles = c mod 4. */
    CHECK(confined_ctas(16, 410, 132) == 0, "b16_q128_mixed_h1: %d CTAs see one residue of 4",
          confined_ctas(16, 410, 132));

    /* The H200's 132 SMs on 78-shape batches (tiles of 256 rows). */
    chunk_is(8192, 1, 8192, 132, 8, "q128_kv1024k_h1: ~8 tasks per SM");
    chunk_is(20416, 16, 8192, 132, 20, "b16_q128_mixed_h1");
    chunk_is(1048576, 128, 8192, 132, 64, "q8k_kv1024k_h4: the maximum");
    chunk_is(64, 1, 64, 132, 1, "q128_kv8k_h1: one wave of 1-page tasks");
    chunk_is(128, 2, 64, 132, 1, "q128_kv8k_h4");
    chunk_is(136, 16, 16, 132, 2, "fresh_q2k_h2: 2 pages fit one wave");
    chunk_is(272, 32, 16, 132, 4, "fresh_q2k_h4: 3 pages would need 192 slots");
    chunk_is(456, 8, 64, 132, 4, "q2k_kv8k_h1: the minimum");
    chunk_is(396, 132, 3, 132, 3, "132 tiles of 3 pages: exactly one wave of 3-page tasks");
    chunk_is((uint64_t)8193 << 24, (int64_t)1 << 24, 8193, 132, 128, "2^24 tiles: doubled to stay below 2^31 tasks");
    chunk_rules(&rng);
    return harness_finish("test_persistent_schedule");
}
