/* The top-k of a fused call's long row by one warp from the chunk maxima its scorer kept
 * (msaidx_cuda_chunk_maxima: per row, the maximum over each task's chunk of pages): the exact
 * slots-th largest maximum bounds every chosen page from below, so only the chunks that reach it
 * are read. Built on the selection of topk_select.cuh; one translation unit includes it.
 */
#ifndef MSAIDX_TOPK_CHUNKED_CUH
#define MSAIDX_TOPK_CHUNKED_CUH

#include "topk_select.cuh"

namespace {

constexpr int kChunkKeys = MSAIDX_TOPK_CHUNK_KEYS_PER_LANE;
constexpr int kChunkLoads = MSAIDX_TOPK_CHUNK_LOADS_PER_LANE;

/* Lane l's chunk maxima of a fused call's row, chunks l + 32 i (msaidx_cuda_chunk_maxima): read
 * with the row's nvp, before it says which of them count (cells past the row's chunks lie within
 * the maxima pitch; select_chunked_row drops them). */
struct ChunkKeys {
    int32_t chunk_pages;
    float maxima[kChunkKeys];
};
__device__ __forceinline__ void load_chunk_keys(const msaidx_cuda_chunk_maxima &chunks, int64_t row,
                                                int lane, ChunkKeys &keys) {
    keys.chunk_pages = *chunks.chunk_pages;
    const float *maxima = chunks.maxima + row * chunks.pitch;
#pragma unroll
    for (int i = 0; i < kChunkKeys; ++i) {
        const int32_t j = i * 32 + lane;
        keys.maxima[i] = j < chunks.pitch ? maxima[j] : NAN;
    }
}

/* The page of item w of select_chunked_row's reads: the listed chunks' pages, then the row's
 * partial chunks at its ends, [lo, j0 * c) and [j1 * c, hi); -1 past them. */
__device__ __forceinline__ int32_t chunk_item_page(const int32_t *listed_chunks, int32_t w,
                                                   int32_t listed_pages, int32_t c, int32_t lo,
                                                   int32_t head, int32_t j1, int32_t work) {
    if (w < listed_pages) {
        const int32_t k = w / c;
        return listed_chunks[k] * c + (w - k * c);
    }
    const int32_t e = w - listed_pages;
    return w >= work ? -1 : e < head ? lo + e : j1 * c + (e - head);
}

/* A long row of a fused call by one warp from its chunk maxima (load_chunk_keys), so that a CTA
 * has a row in flight per warp where the plain path reads a long row with the whole CTA: the
 * exact slots-th largest of the maxima of the chunks inside the candidates [lo, hi) (the pure
 * chunks [j0, j1)) by a bitwise search is a threshold that slots different pages reach, so no
 * page below it is chosen; only the chunks whose maximum reaches it, and the partial chunks at the
 * row's ends, are read, and their pages that reach it ranked. On real scores that is the maxima
 * and about slots chunks instead of the whole row. Returns false, writing nothing, where the
 * deal's chunks are short, the row has few chunks or too many, or the chunks or candidates that
 * reach the threshold overflow their buffers (massive ties): the plain path then takes the row. */
__device__ __forceinline__ bool select_chunked_row(const TopkArgs &a, const ChunkKeys &chunk_keys,
                                                   int64_t row, int32_t n,
                                                   SelectShared<kWarpGather> &sh, int lane) {
    const int32_t c = chunk_keys.chunk_pages;
    const int32_t slots = a.topk - a.init_blocks - a.local_blocks;
    if (c < MSAIDX_PERSISTENT_MAXIMA_MIN_CHUNK || slots > 32) return false;
    const int32_t lo = a.init_blocks, hi = n - a.local_blocks;
    const int32_t j0 = (lo + c - 1) / c, j1 = hi / c;
    if (j1 - j0 < MSAIDX_TOPK_CHUNKED_MIN_CHUNKS_PER_SLOT * slots || j1 > 32 * kChunkKeys)
        return false;
    uint32_t keys[kChunkKeys];
#pragma unroll
    for (int i = 0; i < kChunkKeys; ++i) {
        const int32_t j = i * 32 + lane;
        keys[i] = j >= j0 && j < j1 ? sortable_key(chunk_keys.maxima[i]) : 0u;
    }
    uint32_t threshold = 0; /* the largest key that slots chunk keys reach */
    for (int bit = 31; bit >= 0; --bit) {
        const uint32_t candidate = threshold | (1u << bit);
        uint32_t at_least = 0;
#pragma unroll
        for (int i = 0; i < kChunkKeys; ++i) at_least += keys[i] >= candidate;
        if (__reduce_add_sync(kFullMask, at_least) >= (uint32_t)slots) threshold = candidate;
    }
    if (threshold <= kMinusInfinityKey) return false; /* every page would be a candidate */
    const uint32_t below = (1u << lane) - 1u;
    int32_t listed = 0;
#pragma unroll
    for (int i = 0; i < kChunkKeys; ++i) {
        const bool reaches = keys[i] >= threshold;
        const uint32_t reached = __ballot_sync(kFullMask, reaches);
        const int32_t place = listed + __popc(reached & below);
        if (reaches && place < kChunkList) sh.chunks[place] = i * 32 + lane;
        listed += __popc(reached);
    }
    if (listed > kChunkList) return false;
    __syncwarp();
    /* kChunkLoads loads in flight a lane; the pages that reach the threshold are gathered by
     * ballots (their page ids computed again: holding them would spill). */
    const float *scores = a.scores + row * a.pitch;
    const int32_t listed_pages = listed * c, head = j0 * c - lo;
    const int32_t work = listed_pages + head + (hi - j1 * c);
    const float score_threshold = key_score(threshold);
    int32_t total = 0;
    for (int32_t first = 0; first < work; first += kChunkLoads * 32) {
        float value[kChunkLoads];
#pragma unroll
        for (int u = 0; u < kChunkLoads; ++u) {
            const int32_t page = chunk_item_page(sh.chunks, first + u * 32 + lane, listed_pages, c,
                                                 lo, head, j1, work);
            value[u] = page >= 0 ? scores[page] : NAN;
        }
#pragma unroll
        for (int u = 0; u < kChunkLoads; ++u) {
            const bool reaches = value[u] >= score_threshold; /* false for NaN */
            const uint32_t reached = __ballot_sync(kFullMask, reaches);
            const int32_t place = total + __popc(reached & below);
            if (reaches && place < kWarpGather)
                sh.candidates[place] =
                    rank_key(value[u], chunk_item_page(sh.chunks, first + u * 32 + lane,
                                                       listed_pages, c, lo, head, j1, work));
            total += __popc(reached);
        }
    }
    if (total > kWarpGather) return false;
    int32_t lo_out = 0, count = 0;
    prepare_row(a, row, n, &lo_out, &count, lane, 32); /* the forced pages */
    rank_candidates<WarpGroup>(sh, total, slots, lane);
    write_ascending<WarpGroup>(sh, slots, row_out(a, row) + a.init_blocks, lane);
    return true;
}

} // namespace

#endif
