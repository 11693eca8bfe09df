/* The persistent scorer's shape: threads, shared-memory layout, kernel arguments and the types its
 * producer and consumers exchange. Included by the scorer's translation unit
 * (score_persistent_sm90.cu) through persistent_producer_sm90.cuh and persistent_consumer_sm90.cuh.
 */
#ifndef MSAIDX_PERSISTENT_KERNEL_SM90_CUH
#define MSAIDX_PERSISTENT_KERNEL_SM90_CUH

#include "persistent_sm90.cuh"

namespace {

constexpr int kHeadBytes = kHeadDim; /* one E4M3 query or key row */
constexpr int kTileRows = MSAIDX_PERSISTENT_TILE_ROWS;
constexpr int kQSlots = MSAIDX_PERSISTENT_Q_SLOTS;
/* An E4M3 Q tile and an E4M3 page: each one TMA box of 128-byte rows, the widest rows the 128-byte
 * swizzle takes. A BF16 Q tile or page is two of them, dims 0-63 and 64-127. */
constexpr int kQTileBytes = kTileRows * kHeadBytes;
constexpr int kPageBytes = kPageKeys * kHeadBytes;
constexpr int kWidePageBytes = 2 * kPageBytes;     /* a page widened to FP16 */
constexpr int kWideHalfBytes = kWidePageBytes / 2; /* 64 dims of 128 keys: one swizzled tile */
constexpr int kSubRows = 64;                       /* rows of one wgmma */
constexpr int kConsumerThreads = 256;
constexpr int kThreads = 128 + kConsumerThreads; /* producer warpgroup + 2 consumer warpgroups */
constexpr int kTaskBytes = 32;                   /* a Task (below), next to its Q slot */
constexpr int kProducerRegisters = MSAIDX_PERSISTENT_PRODUCER_REGISTERS;
constexpr int kConsumerRegisters = MSAIDX_PERSISTENT_CONSUMER_REGISTERS;
static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                  kThreads * MSAIDX_PERSISTENT_LAUNCH_REGISTERS,
              "setmaxnreg cannot hand out more registers than the launch gave");
static_assert(kThreads * MSAIDX_PERSISTENT_LAUNCH_REGISTERS <= 65536, "registers of one SM");
/* Exact E4M3: warps 1 and 2 of the producer warpgroup widen the pages that its warp 0 loads. */
constexpr int kWidenerThreads = 64;

/* The scorer's three paths: E4M3 keys widened to FP16 (exact), E4M3 keys on FP8 wgmma (fast
 * accumulation), BF16 keys on BF16 wgmma (exact: BF16 products are exact in FP32, and BF16 wgmma
 * accumulates in FP32). */
enum class KeyPath { kE4m3Exact, kE4m3Fast, kBf16 };

/* Shared memory of one CTA: Q slots, then (exact E4M3 only) the ring of FP16 pages, then the ring
 * of key pages that TMA writes, then the mbarriers, then the task of each Q slot. The exact
 * scorer's consumers read the FP16 ring, the others the key ring; the fast-accumulation scorer,
 * which widens nothing, spends the FP16 ring's room on a deeper key ring. */
template <KeyPath kPath>
struct Layout {
    static constexpr int kBoxes = kPath == KeyPath::kBf16 ? 2 : 1; /* TMA boxes per Q tile / page */
    static constexpr int kQSlotBytes = kBoxes * kQTileBytes;
    static constexpr int kStageBytes = kBoxes * kPageBytes;
    static constexpr int kStages = kPath == KeyPath::kE4m3Fast ? MSAIDX_PERSISTENT_FAST_STAGES
                                   : kPath == KeyPath::kBf16   ? MSAIDX_PERSISTENT_BF16_STAGES
                                                               : MSAIDX_PERSISTENT_EXACT_STAGES;
    static constexpr int kWideStages =
        kPath == KeyPath::kE4m3Exact ? MSAIDX_PERSISTENT_EXACT_WIDE_STAGES : 0;
    static constexpr int kWideBytes = kWideStages * kWidePageBytes;
    /* The ring the consumers read, and who releases a key stage (the consumers or the wideners). */
    static constexpr int kConsumedStages = kWideStages > 0 ? kWideStages : kStages;
    static constexpr int kKeyStageReaders = kWideStages > 0 ? kWidenerThreads : kConsumerThreads;
    static constexpr size_t kSmemBytes =
        1024 /* 1024-byte alignment of the swizzled tiles */ + kQSlots * kQSlotBytes + kWideBytes +
        kStages * kStageBytes + (2 * kStages + 2 * kQSlots + 2 * kWideStages) * sizeof(uint64_t) +
        kQSlots * kTaskBytes;
    static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA on sm_90");
};

struct ScoreArgs {
    const msaidx_persistent_tile *tiles; /* by chunk count, most first */
    const msaidx_persistent_counts *counts;
    const msaidx_persistent_segment *segments; /* chunk rows of equal width */
    const msaidx_persistent_resolved_task *resolved_tasks;
    const int32_t *block_table;
    float *scores;
    /* NULL, or each row's maximum over the pages of each of its tasks: row r's chunk row c at
     * chunk_maxima[r * maxima_pitch + c], for chunk rows below maxima_pitch (the top-k of a fused
     * call reads them to skip the chunks that cannot hold a chosen page). */
    float *chunk_maxima;
    int32_t bt_stride, num_heads, pitch, maxima_pitch;
};

/* A task as the producer hands it to the consumers, next to its Q tile. */
using Task = msaidx_persistent_task;
static_assert(sizeof(Task) == kTaskBytes, "task slot size");

/* The carved shared memory of one CTA (Layout). */
struct SharedState {
    uint8_t *q_tiles;    /* kQSlots swizzled Q tiles */
    uint8_t *wide_pages; /* exact E4M3 scorer: the ring of FP16 pages */
    uint8_t *pages;      /* the ring of key pages */
    uint64_t *page_full, *page_empty, *q_full, *q_empty;
    uint64_t *wide_full, *wide_empty; /* exact E4M3 scorer: of the FP16 ring */
    Task *q_tasks;                    /* the task of each Q slot */
};

} // namespace

#endif
