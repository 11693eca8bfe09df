/* PTX wrappers for the sm_90a kernels: shared-memory addresses, mbarriers, TMA bulk and tensor
 * copies and warpgroup MMA (wgmma). Thin and inline: each wrapper is one instruction (or one wait
 * loop), so a kernel reads as the PTX it issues. wgmma and setmaxnreg exist on sm_90a only; include
 * this from device code compiled for it. */
#ifndef MSAIDX_SM90_PTX_CUH
#define MSAIDX_SM90_PTX_CUH

#include <cstdint>

namespace sm90 {

/* ---- shared memory, mbarriers, TMA ---- */

__device__ __forceinline__ uint32_t smem_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count));
}
/* Makes the initialised mbarriers visible to the async proxy (TMA) and the other threads. */
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, uint32_t parity) {
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "wait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n"
                 "}\n" ::"r"(smem_address(bar)),
                 "r"(parity)
                 : "memory");
}
/* One bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory
 * into this CTA's shared memory, counted on `bar`'s transaction bytes. */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes,
                                          uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2,"
                 " [%3];" ::"r"(smem_address(dst)),
                 "l"(src), "r"(bytes), "r"(smem_address(bar))
                 : "memory");
}
/* Pulls a tensor map (a __grid_constant__ kernel parameter) into the descriptor cache ahead of its
 * first copy. */
__device__ __forceinline__ void prefetch_tensor_map(const void *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}
__device__ __forceinline__ void tma_load_2d(void *dst, const void *map, uint64_t *bar, int32_t x,
                                            int32_t y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_address(dst)),
                 "l"(map), "r"(smem_address(bar)), "r"(x), "r"(y)
                 : "memory");
}
__device__ __forceinline__ void tma_load_3d(void *dst, const void *map, uint64_t *bar, int32_t x,
                                            int32_t y, int32_t z) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_address(dst)),
                 "l"(map), "r"(smem_address(bar)), "r"(x), "r"(y), "r"(z)
                 : "memory");
}

/* A ring position: slot index and the mbarrier phase parity of its current use. */
template <int kSlots>
struct RingPosition {
    int slot = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++slot == kSlots) {
            slot = 0;
            phase ^= 1;
        }
    }
};

/* ---- registers and proxies ---- */

/* Warpgroup register reallocation: a producer warpgroup gives registers back, consumers take them.
 */
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

/* Shared-memory writes of the generic proxy (plain stores) become visible to the async proxy
 * (wgmma, TMA) of the threads that synchronize with this thread afterwards (a barrier, or an
 * mbarrier arrive they wait on). */
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* ---- wgmma ---- */

/* Descriptor of a K-major operand tile of 128-byte rows in the 128-byte swizzle (8-row atoms of
 * 1024 bytes, the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B); the tile is 1024-byte
 * aligned. Adding n to the descriptor moves the start 16 * n bytes along the rows (a k-step). */
__device__ __forceinline__ uint64_t smem_descriptor_sw128(const void *p) {
    uint64_t desc = (uint64_t)(smem_address(p) & 0x3FFFF) >> 4;
    desc |= (uint64_t)1 << 16;           /* leading byte offset: unused by swizzled K-major */
    desc |= (uint64_t)(1024 >> 4) << 32; /* stride byte offset: next 8-row atom */
    desc |= (uint64_t)1 << 62;           /* 128-byte swizzle */
    return desc;
}

/* The 64 FP32 accumulators of an m64n128 wgmma: their place in the instruction (operands %0..%63)
 * and the matching read-write operands. */
#define MSAIDX_WGMMA_ACCUMULATOR_LIST                                                              \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define MSAIDX_WGMMA_ACCUMULATOR_OPERANDS(d)                                                       \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),            \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])

/* d (+)= A * B for one m64n128k16 FP16 wgmma: A (queries) from registers, B (keys) K-major in
 * shared memory; scale_d = 0 overwrites d. */
__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], const uint32_t (&a)[4],
                                                     uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" MSAIDX_WGMMA_ACCUMULATOR_LIST
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : MSAIDX_WGMMA_ACCUMULATOR_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

/* d (+)= A * B for one m64n128k16 BF16 wgmma (FP32 accumulation): A (queries) from registers, B
 * (keys) K-major in shared memory; scale_d = 0 overwrites d. */
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MSAIDX_WGMMA_ACCUMULATOR_LIST
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : MSAIDX_WGMMA_ACCUMULATOR_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

/* d (+)= A * B for one m64n128k32 E4M3 wgmma (FP8 tensor-core accumulation): A (queries) from
 * registers, B (keys) K-major in shared memory; scale_d = 0 overwrites d. */
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MSAIDX_WGMMA_ACCUMULATOR_LIST
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
        "}\n"
        : MSAIDX_WGMMA_ACCUMULATOR_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
/* Keeps the compiler from touching the accumulators while a wgmma may still write them. */
__device__ __forceinline__ void accumulators_settled(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

} // namespace sm90

#endif
