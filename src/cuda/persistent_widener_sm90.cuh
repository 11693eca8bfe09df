/* The exact E4M3 scorer's wideners: warps 1 and 2 of the producer warpgroup (idle on the other
 * paths) take each key page from the ring that TMA fills, widen it to FP16 (E4M3 values are exact
 * in FP16, and FP16 wgmma accumulates in FP32) into a second ring of FP16 pages, and hand that to
 * the consumers, which then run FP16 wgmma straight from shared memory as the BF16 scorer does on
 * its pages. Per 256-row page the tensor cores take ~2000 cycles; widening it is 16 16-byte chunks
 * per thread of two warps, ~200 instructions, so they keep ahead without taking issue slots from
 * the consumers. */
#ifndef MSAIDX_PERSISTENT_WIDENER_SM90_CUH
#define MSAIDX_PERSISTENT_WIDENER_SM90_CUH

#include "device_tiles.cuh"
#include "persistent_kernel_sm90.cuh"
#include "sm90_ptx.cuh"

namespace {

using namespace sm90;

/* 16 bytes from or to shared memory at a shared-space address: the compiler does not see that the
 * pages are in shared memory and would use generic accesses with 64-bit addresses. */
__device__ __forceinline__ uint4 load_shared_16(uint32_t at) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(at));
    return v;
}
__device__ __forceinline__ void store_shared_16(uint32_t at, uint32_t x, uint32_t y, uint32_t z,
                                                uint32_t w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(x), "r"(y), "r"(z),
                 "r"(w)
                 : "memory");
}

/* Four E4M3 values (low byte first) to two FP16 pairs, both halves of the word converted in place
 * (no shifts to extract the high half). Exact, as e4m3x2_to_f16x2. */
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t word, uint32_t &low, uint32_t &high) {
    asm("{\n"
        ".reg .b16 lo, hi;\n"
        "mov.b32 {lo, hi}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n"
        "cvt.rn.f16x2.e4m3x2 %1, hi;\n"
        "}\n"
        : "=r"(low), "=r"(high)
        : "r"(word));
}

/* This thread's share of widening an FP8 page (128 rows of 8 swizzled 16-byte chunks, as TMA wrote
 * it) into an FP16 page: two swizzled tiles of 64 dims, the K-major layout the wgmma B descriptors
 * read. Thread t takes chunk t / 8 of row t % 8 of every 8-row atom, so that its addresses move by
 * one atom (an immediate offset) from one chunk to the next, and the 8 threads of each quarter warp
 * hit 8 different bank groups with their loads and with both of their stores. */
__device__ __forceinline__ void widen_page(uint32_t wide_page, uint32_t page, int widener_tid) {
    static_assert(kWidenerThreads == 64, "one thread per (row of an atom, chunk)");
    constexpr int kAtoms = kPageKeys / 8;
    constexpr int kAtomBytes = 8 * kHeadBytes;
    const int row = widener_tid & 7, chunk = widener_tid >> 3;
    /* FP8 chunk c (dims 16c ..+ 15) is FP16 chunks 2 (c % 4) and 2 (c % 4) + 1 of tile c / 4. */
    const int wide_chunk = (chunk & 3) * 2;
    const uint32_t from = page + swizzled_chunk(row, chunk);
    const uint32_t to = wide_page + (chunk >> 2) * kWideHalfBytes;
    const uint32_t to_first = to + swizzled_chunk(row, wide_chunk);
    const uint32_t to_second = to + swizzled_chunk(row, wide_chunk + 1);
    /* Two loads in flight before their conversions: the accesses are volatile, so the compiler
     * keeps them in this order. */
    constexpr int kBatch = 2;
    static_assert(kAtoms % kBatch == 0, "whole batches");
#pragma unroll
    for (int first = 0; first < kAtoms; first += kBatch) {
        uint4 raw[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) raw[i] = load_shared_16(from + (first + i) * kAtomBytes);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            uint32_t h[8];
            e4m3x4_to_f16x4(raw[i].x, h[0], h[1]);
            e4m3x4_to_f16x4(raw[i].y, h[2], h[3]);
            e4m3x4_to_f16x4(raw[i].z, h[4], h[5]);
            e4m3x4_to_f16x4(raw[i].w, h[6], h[7]);
            const uint32_t atom = (first + i) * kAtomBytes;
            store_shared_16(to_first + atom, h[0], h[1], h[2], h[3]);
            store_shared_16(to_second + atom, h[4], h[5], h[6], h[7]);
        }
    }
}

/* The wideners' side of the kernel: the CTA's tasks in the consumers' order, each one's page range
 * read from its Q slot, every page widened from key stage to FP16 stage. The FP16 writes (generic
 * proxy) are fenced before the arrive that hands them to the consumers' wgmma (async proxy). */
template <int kStages, int kWideStages>
__device__ __forceinline__ void run_wideners(const SharedState &smem, const ScoreArgs &args) {
    const int widener_tid = threadIdx.x - 32;
    const uint32_t wide_pages = smem_address(smem.wide_pages), pages = smem_address(smem.pages);
    const int32_t num_tasks = args.counts->num_tasks;
    RingPosition<kQSlots> q_ring;
    RingPosition<kStages> ring;
    RingPosition<kWideStages> wide;
#pragma unroll 1
    for (int64_t k = blockIdx.x; k < num_tasks; k += gridDim.x) {
        mbarrier_wait(&smem.q_full[q_ring.slot], q_ring.phase);
        const int32_t page_begin = smem.q_tasks[q_ring.slot].page_begin;
        const int32_t page_end = smem.q_tasks[q_ring.slot].page_end;
        mbarrier_arrive(&smem.q_empty[q_ring.slot]);
        q_ring.advance();
#pragma unroll 1
        for (int32_t page = page_begin; page < page_end; ++page) {
            mbarrier_wait(&smem.page_full[ring.slot], ring.phase);
            mbarrier_wait(&smem.wide_empty[wide.slot], wide.phase ^ 1);
            widen_page(wide_pages + wide.slot * kWidePageBytes, pages + ring.slot * kPageBytes,
                       widener_tid);
            mbarrier_arrive(&smem.page_empty[ring.slot]);
            fence_proxy_async_shared();
            mbarrier_arrive(&smem.wide_full[wide.slot]);
            ring.advance();
            wide.advance();
        }
    }
}

} // namespace

#endif
