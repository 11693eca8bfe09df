/* The decode scorer of every CUDA backend: few query rows per request against long contexts,
 * where the time is the time to stream the key pages once.
 *
 * Work division. A request of q_len tokens has rows r = i*H + h; they are cut into row groups of
 * up to 8 * kNTiles rows (kNTiles from the batch bounds: 8, 16 or 32 rows), and a request's work
 * is (row group, logical page) units. The launch grid depends only on the batch description
 * (CUDA graph safe, SPEC section 5): one wave of resident CTAs. On the device each CTA scans
 * the request table (written by the common plan) to count the units of the batch, and each warp
 * takes an equal contiguous run of them, so every SM streams keys whatever the mix of batch
 * sizes and contexts. Every (row, page) cell belongs to exactly one unit, so to one warp.
 *
 * Arithmetic. Keys are the A operand of m16n8k16 mma.sync (16 keys x 16 dims), query rows the B
 * operand (8 rows): E4M3 converted to F16 in registers (exact), BF16 as is, FP32 accumulation,
 * the same per-product arithmetic as the dense scorer; only the summation order differs (SPEC
 * section 3's exact mode). The reduction index is permuted the same way for A and B so that each
 * thread reads its keys as 16-byte pieces: lane (g, q) of a warp owns bytes [64j + 16q, +16) of
 * keys g and g + 8 of a 16-key block.
 *
 * Streaming. Each warp owns a ring of kStages slots of kChunkBytes in shared memory, each slot
 * with an mbarrier: its lane 0 fills a slot with one bulk copy (cp.async.bulk) of contiguous keys
 * of a page, the warp scores them from shared memory once the copy has landed, and the slot is
 * refilled with the chunk kStages ahead as soon as it is scored. So each warp keeps up to
 * kStages x kChunkBytes on their way from HBM at the cost of one instruction per chunk and no
 * registers; keys loaded into registers (ld.global.nc) hold a register for every byte in flight,
 * which kept that streaming at 1.09-1.18x of a plain read of the same keys on large batches, where
 * this one runs at 1.01-1.10x (H200, bench/experiments/2026-12-01_h200_decode.md).
 *
 * Bad metadata: the request table holds q_len = 0 for requests the plan rejected; everything
 * read from it is clamped again here, physical page ids are clamped into the cache, and cells of
 * pages p >= nvp of their row are never written.
 */
#include "cuda_internal.cuh"
#include "device_tiles.cuh"
#include "sm90_ptx.cuh"

#include <cub/block/block_scan.cuh>

#include <atomic>
#include <climits>
#include <cmath>

namespace {

/* ---- tuning of the decode scorer (H200 sweep: bench/experiments/2026-12-01_h200_decode.md); the
 * macros let a build sweep them ---- */
#ifndef MSAIDX_DECODE_WARPS
#define MSAIDX_DECODE_WARPS 4 /* warps per CTA, each with its own run of units */
#endif
/* One bulk copy: 32 BF16 / 64 E4M3 keys. H200 sweep (geomean speedup over Triton on the
 * 48-configuration grid, chunk x stages): 8 KB x 2 1.20x, 4 KB x 2 1.19x, 4 KB x 3 1.18x, 4 KB x 4
 * and 8 KB x 3 1.16x (rings of 64 KB or more per CTA: fewer CTAs per SM, slower below 128K
 * contexts); an L2 prefetch of the chunks past the ring made every size slower (1.13x). */
#ifndef MSAIDX_DECODE_CHUNK_BYTES
#define MSAIDX_DECODE_CHUNK_BYTES 8192
#endif
#ifndef MSAIDX_DECODE_STAGES
#define MSAIDX_DECODE_STAGES 2 /* chunks per warp's ring */
#endif
constexpr int kWarps = MSAIDX_DECODE_WARPS;
constexpr int kChunkBytes = MSAIDX_DECODE_CHUNK_BYTES;
constexpr int kStages = MSAIDX_DECODE_STAGES;
/* ---- */

constexpr int kThreads = kWarps * 32;
constexpr int kBlockKeys = 16;
constexpr int kBlocksPerPage = kPageKeys / kBlockKeys;
constexpr int kSteps = kHeadDim / 16; /* m16n8k16 steps over D */
/* Shared memory of a CTA's key rings. */
constexpr int kRingBytes = kWarps * kStages * kChunkBytes;

template <bool kBf16>
struct KeyLayout {
    static constexpr int kRowBytes = kBf16 ? 256 : 128;
    static constexpr int kLoadsPerKey = kRowBytes / 64; /* 16-byte loads per lane per key */
    static constexpr int kLoads = 2 * kLoadsPerKey;     /* keys g and g + 8 */
    static constexpr int kBlockBytes = kBlockKeys * kRowBytes;
    static constexpr int kChunkBlocks = kChunkBytes / kBlockBytes;
    /* A chunk is whole blocks of one page. */
    static_assert(kChunkBlocks >= 1 && kChunkBytes % kBlockBytes == 0 &&
                      kBlocksPerPage % kChunkBlocks == 0 && kStages >= 1,
                  "decode chunk out of range");
};

struct DecodeArgs {
    const uint8_t *q;
    const uint8_t *k_cache;
    float *scores;
    const int32_t *block_table;
    const msaidx_cuda_request *requests;
    const int32_t *positions; /* context parallel: local positions per token, else NULL */
    int32_t batch_size, num_tokens, num_heads, bt_stride, num_pages, pitch;
    int64_t page_stride;
};

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* A warp's ring of key chunks in shared memory; `next` is the slot (and its barrier's phase) the
 * next chunk is scored from. It carries over from one segment of the warp's run to the next; a
 * segment leaves no copy in flight. */
struct KeyRing {
    uint8_t *slots; /* kStages x kChunkBytes */
    uint64_t *full; /* per slot: completes when the slot's copy has landed */
    sm90::RingPosition<kStages> next;
};

/* A request as the decode scorer sees it: everything clamped; units = 0 when it has no work. */
struct DecodeRequest {
    int32_t token_begin, q_len, first_pos, bt_row;
    int32_t pages;  /* visible pages of its last token, within bt_stride and pitch */
    int32_t groups; /* row groups */
    int64_t units;  /* groups * pages */
};

template <bool kSharded>
__device__ __forceinline__ DecodeRequest decode_request(const DecodeArgs &a, int32_t b,
                                                        int32_t group_rows) {
    const msaidx_cuda_request r = a.requests[b];
    DecodeRequest d = {0, 0, 0, 0, 0, 0, 0};
    if (r.q_len <= 0 || r.token_begin < 0 || (int64_t)r.token_begin + r.q_len > a.num_tokens ||
        r.bt_row < 0 || r.bt_row >= a.batch_size || r.seq_len < r.q_len)
        return d;
    /* The pages of its last token (sharded: the rank's pages it sees). */
    int64_t request_pages;
    if constexpr (kSharded)
        request_pages = msaidx_cuda_pages_at(a.positions[r.token_begin + r.q_len - 1]);
    else
        request_pages = ((int64_t)r.seq_len + kPageKeys - 1) / kPageKeys;
    const int64_t pages = min(request_pages, (int64_t)min(a.bt_stride, a.pitch));
    const int64_t rows = (int64_t)r.q_len * a.num_heads;
    d.token_begin = r.token_begin;
    d.q_len = r.q_len;
    d.first_pos = r.seq_len - r.q_len;
    d.bt_row = r.bt_row;
    d.pages = (int32_t)pages;
    d.groups = (int32_t)((rows + group_rows - 1) / group_rows);
    d.units = (int64_t)d.groups * pages;
    return d;
}

/* Scores row group `group` of request `r` against logical pages [page_begin, page_end): one warp.
 */
template <bool kBf16, int kNTiles, bool kSharded>
__device__ __forceinline__ void score_segment(const DecodeArgs &a, const DecodeRequest &r,
                                              int32_t group, int32_t page_begin, int32_t page_end,
                                              int lane, KeyRing &ring) {
    using L = KeyLayout<kBf16>;
    constexpr int kGroupRows = 8 * kNTiles;
    const int g = lane / 4, q = lane % 4;
    const int32_t H = a.num_heads;
    const int32_t rows = r.q_len * H;
    const int32_t row0 = group * kGroupRows; /* relative to the request's first row */
    const int32_t rows_here = min(kGroupRows, rows - row0);
    const int64_t row_base = (int64_t)r.token_begin * H + row0; /* absolute row of column 0 */
    /* Query position of the request's row `row` (a row past the request: its last token's). */
    auto position = [&](int32_t row) -> int32_t {
        if constexpr (kSharded)
            return a.positions[r.token_begin + min(row / H, r.q_len - 1)];
        else
            return r.first_pos + row / H;
    };
    /* Pages past the group's last row's visible pages hold no cell of it. */
    const int32_t last_nvp = msaidx_cuda_pages_at(position(row0 + rows_here - 1));
    page_end = min(page_end, last_nvp);
    if (page_begin >= page_end) return;
    const int32_t min_pos = position(row0);

    /* Query rows as B fragments, the reduction index permuted as the keys' loads permute it. */
    uint32_t qb[kNTiles][kSteps][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const int col = nt * 8 + g;
        const bool valid = col < rows_here;
        const uint8_t *src = a.q + (row_base + (valid ? col : 0)) * L::kRowBytes;
#pragma unroll
        for (int j = 0; j < L::kLoadsPerKey; ++j) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (valid) v = *reinterpret_cast<const uint4 *>(src + 64 * j + 16 * q);
            if constexpr (kBf16) {
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    qb[nt][2 * j + t][0] = word_of(v, 2 * t);
                    qb[nt][2 * j + t][1] = word_of(v, 2 * t + 1);
                }
            } else {
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    qb[nt][4 * j + t][0] = e4m3x2_to_f16x2((uint16_t)word_of(v, t));
                    qb[nt][4 * j + t][1] = e4m3x2_to_f16x2((uint16_t)(word_of(v, t) >> 16));
                }
            }
        }
    }
    /* This lane's accumulator columns: rows nt*8 + 2q + i of the group. */
    int32_t pos[kNTiles][2];
    bool writes[kNTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int col = nt * 8 + 2 * q + i;
            writes[nt][i] = g == 0 && col < rows_here;
            pos[nt][i] = position(row0 + col);
        }

    const int32_t *pages = a.block_table + (size_t)r.bt_row * a.bt_stride;
    auto physical = [&](int32_t logical) -> int64_t {
        return min(max(pages[logical], 0), a.num_pages - 1);
    };
    const int32_t num_blocks = (page_end - page_begin) * kBlocksPerPage;
    /* The copy front's page (relative to page_begin) and the physical ids of it and of the page
     * after it: moving onto a page never waits on a block-table read. */
    int32_t front_page = 0;
    int64_t front_phys = physical(page_begin);
    int64_t next_phys = page_begin + 1 < page_end ? physical(page_begin + 1) : front_phys;
    const int32_t num_chunks = num_blocks / L::kChunkBlocks;
    /* Chunks are issued in order, so the front moves one page at a time. */
    auto issue = [&](int32_t chunk, int slot) {
        const int32_t block = chunk * L::kChunkBlocks;
        const int32_t page = block / kBlocksPerPage;
        if (page != front_page) {
            front_page = page;
            front_phys = next_phys;
            if (page_begin + page + 1 < page_end) next_phys = physical(page_begin + page + 1);
        }
        if (lane == 0) {
            uint64_t *bar = ring.full + slot;
            sm90::mbarrier_expect_bytes(bar, kChunkBytes);
            sm90::bulk_load(ring.slots + slot * kChunkBytes,
                            a.k_cache + front_phys * a.page_stride +
                                (int64_t)(block % kBlocksPerPage) * L::kBlockBytes,
                            kChunkBytes, bar);
        }
    };
    for (int k = 0; k < kStages && k < num_chunks; ++k) issue(k, (ring.next.slot + k) % kStages);

    /* This lane's 16-byte pieces of a 16-key block in a slot (see Arithmetic above). */
    auto load_block = [&](uint4(&f)[L::kLoads], const uint8_t *base) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < L::kLoadsPerKey; ++j)
                f[h * L::kLoadsPerKey + j] = *reinterpret_cast<const uint4 *>(
                    base + (g + 8 * h) * L::kRowBytes + 64 * j + 16 * q);
    };

    float best[kNTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) best[nt][0] = best[nt][1] = -INFINITY;

    /* kAtOnce blocks of one page at a time, their MMA chains interleaved step by step. With one
     * row tile a block's 8 dependent MMAs (one accumulator) would otherwise leave the warp waiting
     * on each one's latency, which is a small batch's time (a warp a page); more row tiles already
     * interleave theirs. Each block's products, sums and maxima are taken in the same order as one
     * block alone. */
    constexpr int kAtOnce = kNTiles == 1 ? 2 : 1;
    static_assert(L::kChunkBlocks % kAtOnce == 0 && kBlocksPerPage % kAtOnce == 0,
                  "a chunk and a page hold whole groups of blocks");
    auto score_blocks = [&](const uint4(&f)[kAtOnce][L::kLoads], int32_t first_block) {
        uint32_t ka[kAtOnce][kSteps][4];
#pragma unroll
        for (int j = 0; j < kAtOnce; ++j)
#pragma unroll
            for (int s = 0; s < kSteps; ++s) {
                if constexpr (kBf16) {
                    const int l = s / 2, t = s % 2;
                    ka[j][s][0] = word_of(f[j][l], 2 * t);
                    ka[j][s][1] = word_of(f[j][L::kLoadsPerKey + l], 2 * t);
                    ka[j][s][2] = word_of(f[j][l], 2 * t + 1);
                    ka[j][s][3] = word_of(f[j][L::kLoadsPerKey + l], 2 * t + 1);
                } else {
                    const int l = s / 4, t = s % 4;
                    const uint32_t lo = word_of(f[j][l], t),
                                   hi = word_of(f[j][L::kLoadsPerKey + l], t);
                    ka[j][s][0] = e4m3x2_to_f16x2((uint16_t)lo);
                    ka[j][s][1] = e4m3x2_to_f16x2((uint16_t)hi);
                    ka[j][s][2] = e4m3x2_to_f16x2((uint16_t)(lo >> 16));
                    ka[j][s][3] = e4m3x2_to_f16x2((uint16_t)(hi >> 16));
                }
            }
        /* The blocks lie in one page (the static_assert above). */
        const int32_t page = page_begin + first_block / kBlocksPerPage;
        const int32_t first_key =
            page * kPageKeys + (first_block % kBlocksPerPage) * kBlockKeys + g;
        const bool masked = (int64_t)page * kPageKeys + kPageKeys - 1 > min_pos;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            float acc[kAtOnce][4] = {};
#pragma unroll
            for (int s = 0; s < kSteps; ++s)
#pragma unroll
                for (int j = 0; j < kAtOnce; ++j) mma<kBf16>(acc[j], ka[j][s], qb[nt][s]);
#pragma unroll
            for (int j = 0; j < kAtOnce; ++j) {
                const int32_t key = first_key + j * kBlockKeys;
                if (masked) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        if (key > pos[nt][i]) acc[j][i] = -INFINITY;
                        if (key + 8 > pos[nt][i]) acc[j][2 + i] = -INFINITY;
                    }
                }
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    best[nt][i] = fmaxf(best[nt][i], fmaxf(acc[j][i], acc[j][2 + i]));
            }
        }
        if ((first_block + kAtOnce) % kBlocksPerPage == 0) {
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float v = best[nt][i];
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
                    if (writes[nt][i] && page * kPageKeys <= pos[nt][i])
                        a.scores[(row_base + nt * 8 + 2 * q + i) * a.pitch + page] = v;
                    best[nt][i] = -INFINITY;
                }
        }
    };

#pragma unroll 1
    for (int32_t chunk = 0; chunk < num_chunks; ++chunk) {
        const int slot = ring.next.slot;
        sm90::mbarrier_wait(ring.full + slot, ring.next.phase);
        const uint8_t *keys = ring.slots + slot * kChunkBytes;
#pragma unroll
        for (int b = 0; b < L::kChunkBlocks; b += kAtOnce) {
            uint4 f[kAtOnce][L::kLoads];
#pragma unroll
            for (int j = 0; j < kAtOnce; ++j) load_block(f[j], keys + (b + j) * L::kBlockBytes);
            score_blocks(f, chunk * L::kChunkBlocks + b);
        }
        /* Every lane's reads of the slot are done before it is refilled. */
        __syncwarp();
        if (chunk + kStages < num_chunks) issue(chunk + kStages, slot);
        ring.next.advance();
    }
}

/* One row tile (decode proper): registers capped at 4 CTAs' worth, so that the key rings, not
 * registers, bound the CTAs per SM (3 with the default rings). */
template <bool kBf16, int kNTiles, bool kSharded>
__global__ void __launch_bounds__(kThreads, kNTiles == 1 ? 512 / kThreads : 1)
    decode_score_kernel(const DecodeArgs a) {
    constexpr int kGroupRows = 8 * kNTiles;
    using Scan = cub::BlockScan<int64_t, kThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int32_t first_request[kWarps];
    __shared__ int64_t first_offset[kWarps];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int32_t B = a.batch_size;
    extern __shared__ __align__(128) uint8_t key_slots[]; /* kRingBytes */
    __shared__ uint64_t full_barriers[kWarps][kStages];
    if (tid < kWarps * kStages) {
        sm90::mbarrier_init(&full_barriers[tid / kStages][tid % kStages], 1);
        sm90::mbarrier_init_fence();
    }
    msaidx_wait_for_prior_grids();

    /* The batch's units: with one chunk of requests the scan of pass 2 gives the total too. */
    int64_t total = 0;
    if (B > kThreads) {
        int64_t mine = 0;
        for (int32_t b = tid; b < B; b += kThreads)
            mine += decode_request<kSharded>(a, b, kGroupRows).units;
        int64_t ignored;
        Scan(scan_storage).ExclusiveSum(mine, ignored, total);
        __syncthreads();
    }
    if (tid < kWarps) first_request[tid] = INT_MAX;
    __syncthreads();
    int64_t carry = 0;
    for (int32_t base = 0; base < B; base += kThreads) {
        const int32_t b = base + tid;
        const int64_t units = b < B ? decode_request<kSharded>(a, b, kGroupRows).units : 0;
        int64_t start, chunk_total;
        Scan(scan_storage).ExclusiveSum(units, start, chunk_total);
        if (B <= kThreads) total = chunk_total;
        start += carry;
        const int64_t warps_total = (int64_t)gridDim.x * kWarps;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const int64_t begin = total * ((int64_t)blockIdx.x * kWarps + w) / warps_total;
            if (units > 0 && start <= begin && begin < start + units) {
                first_request[w] = b;
                first_offset[w] = begin - start;
            }
        }
        carry += chunk_total;
        __syncthreads();
        const int64_t last_begin =
            total * ((int64_t)blockIdx.x * kWarps + kWarps - 1) / warps_total;
        if (carry > last_begin) break; /* uniform: every warp's start is found */
    }
    const int64_t warps_total = (int64_t)gridDim.x * kWarps;
    const int64_t global_warp = (int64_t)blockIdx.x * kWarps + warp;
    int64_t remaining = total * (global_warp + 1) / warps_total - total * global_warp / warps_total;
    int32_t b = first_request[warp];
    int64_t offset = first_offset[warp];
    KeyRing ring = {key_slots + warp * kStages * kChunkBytes, full_barriers[warp], {}};
    while (remaining > 0 && b < B) {
        const DecodeRequest r = decode_request<kSharded>(a, b, kGroupRows);
        if (offset >= r.units) {
            ++b;
            offset = 0;
            continue;
        }
        const int32_t group = (int32_t)(offset / r.pages);
        const int32_t page = (int32_t)(offset % r.pages);
        const int32_t count = (int32_t)min((int64_t)(r.pages - page), remaining);
        score_segment<kBf16, kNTiles, kSharded>(a, r, group, page, page + count, lane, ring);
        remaining -= count;
        offset += count;
    }
}

/* Devices whose resident-CTA counts are remembered; others ask on every launch. */
constexpr int kRememberedDevices = 64;

/* Resident CTAs per SM of a kernel on the current device (registers and the key rings bound it;
 * after msaidx_cuda_decode_set_attributes on that device); 0 when none fits or the query fails.
 * Remembered per device once found, never a failure: a later call may succeed. */
template <bool kBf16, int kNTiles, bool kSharded>
int resident_ctas() {
    static std::atomic<int> remembered[kRememberedDevices];
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const bool remember = device >= 0 && device < kRememberedDevices;
    if (remember) {
        const int known = remembered[device].load(std::memory_order_relaxed);
        if (known > 0) return known;
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n,
                                                      decode_score_kernel<kBf16, kNTiles, kSharded>,
                                                      kThreads, kRingBytes) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (remember && n > 0) remembered[device].store(n, std::memory_order_relaxed);
    return n;
}

template <bool kBf16, int kNTiles, bool kSharded>
msaidx_status set_ring_bytes() {
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(decode_score_kernel<kBf16, kNTiles, kSharded>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes),
                    "cudaFuncSetAttribute(decode_score_kernel key rings)");
    return MSAIDX_SUCCESS;
}

/* One wave of resident CTAs, fewer when the batch bounds hold fewer units than warps. */
template <bool kBf16, int kNTiles, bool kSharded>
msaidx_status launch(const DecodeArgs &a, int64_t units, int64_t sms, cudaStream_t stream) {
    const int ctas_per_sm = resident_ctas<kBf16, kNTiles, kSharded>();
    if (ctas_per_sm <= 0)
        return msaidx_fail(MSAIDX_ERROR_CUDA,
                           "decode_score_kernel: no CTA of %d threads and %d bytes of shared "
                           "memory fits on a multiprocessor of this device",
                           kThreads, kRingBytes);
    const int64_t resident = sms * ctas_per_sm;
    const unsigned grid = (unsigned)max(min((units + kWarps - 1) / kWarps, resident), (int64_t)1);
    MSAIDX_CUDA_TRY(msaidx_launch_dependent(decode_score_kernel<kBf16, kNTiles, kSharded>,
                                            dim3(grid), dim3(kThreads), kRingBytes, stream, a),
                    "decode_score_kernel launch");
    return MSAIDX_SUCCESS;
}

/* A sharded plan's kernels read each token's local position; the others compute it, with no
 * branch or load for it in the scan and the setup that a one-request decode waits on. */
template <bool kBf16, bool kSharded>
msaidx_status launch_tiles(const DecodeArgs &a, int n_tiles, int64_t units, int64_t sms,
                           cudaStream_t stream) {
    if (n_tiles == 1) return launch<kBf16, 1, kSharded>(a, units, sms, stream);
    if (n_tiles == 2) return launch<kBf16, 2, kSharded>(a, units, sms, stream);
    return launch<kBf16, 4, kSharded>(a, units, sms, stream);
}

template <bool kSharded>
msaidx_status set_all_ring_bytes() {
    MSAIDX_CUDA_TRY_STATUS((set_ring_bytes<false, 1, kSharded>()));
    MSAIDX_CUDA_TRY_STATUS((set_ring_bytes<false, 2, kSharded>()));
    MSAIDX_CUDA_TRY_STATUS((set_ring_bytes<false, 4, kSharded>()));
    MSAIDX_CUDA_TRY_STATUS((set_ring_bytes<true, 1, kSharded>()));
    MSAIDX_CUDA_TRY_STATUS((set_ring_bytes<true, 2, kSharded>()));
    return set_ring_bytes<true, 4, kSharded>();
}

} // namespace

msaidx_status msaidx_cuda_decode_set_attributes(void) {
    MSAIDX_CUDA_TRY_STATUS(set_all_ring_bytes<false>());
    return set_all_ring_bytes<true>();
}

msaidx_status msaidx_cuda_score_decode(const msaidx_plan *plan, const void *q, const void *k_cache,
                                       float *scores, cudaStream_t stream) {
    const msaidx_batch_desc *d = &plan->desc;
    const msaidx_config *c = &plan->context->config;
    const int64_t H = c->num_heads;
    /* Row groups of 8, 16 or 32 rows: as many as the longest request's rows need, at most 32. */
    const int64_t max_rows = (int64_t)min(d->max_q_len, d->num_tokens) * H;
    const int n_tiles = max_rows <= 8 ? 1 : max_rows <= 16 ? 2 : 4;
    const int64_t group_rows = 8 * n_tiles;
    /* Upper bound of the units of any batch within desc: grid from the bounds alone. */
    const int64_t groups =
        min((int64_t)d->batch_size * ((max_rows + group_rows - 1) / group_rows),
            ((int64_t)d->num_tokens * H + group_rows - 1) / group_rows + d->batch_size);
    const int64_t pages =
        min(((int64_t)d->max_seq_len + kPageKeys - 1) / kPageKeys, (int64_t)d->pitch);
    const int64_t units = groups * pages;
    if (units <= 0) return MSAIDX_SUCCESS;
    const int64_t sms = plan->context->num_sms > 0 ? plan->context->num_sms : 1;
    DecodeArgs a;
    a.q = static_cast<const uint8_t *>(q);
    a.k_cache = static_cast<const uint8_t *>(k_cache);
    a.scores = scores;
    a.block_table = plan->block_table;
    a.requests = msaidx_cuda_requests(plan->workspace, d);
    a.positions = msaidx_cuda_positions(plan->workspace, d);
    a.batch_size = d->batch_size;
    a.num_tokens = d->num_tokens;
    a.num_heads = c->num_heads;
    a.bt_stride = d->bt_stride;
    a.num_pages = d->num_pages;
    a.pitch = d->pitch;
    a.page_stride = d->page_stride;
    const bool bf16 = c->dtype == MSAIDX_DTYPE_BF16;
    if (a.positions)
        return bf16 ? launch_tiles<true, true>(a, n_tiles, units, sms, stream)
                    : launch_tiles<false, true>(a, n_tiles, units, sms, stream);
    return bf16 ? launch_tiles<true, false>(a, n_tiles, units, sms, stream)
                : launch_tiles<false, false>(a, n_tiles, units, sms, stream);
}
