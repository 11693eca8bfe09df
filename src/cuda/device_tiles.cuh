/* Device helpers every scorer shares: the exact E4M3 -> FP16 widening, the XOR swizzle of 16-byte
 * chunks that their shared-memory tiles use, and the m16n8k16 mma.sync of the dense and decode
 * scorers. */
#ifndef MSAIDX_DEVICE_TILES_CUH
#define MSAIDX_DEVICE_TILES_CUH

#include <cstdint>

/* Two E4M3 values (low byte first) to an FP16 pair. Exact: every E4M3 value is an FP16 value, so
 * FP16 tensor cores with FP32 accumulation score E4M3 data exactly. */
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t pair) {
    uint32_t out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(pair));
    return out;
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRowBytes-byte rows whose chunks
 * are XOR-swizzled by the row's low 3 bits: the 8 rows of an ldmatrix hit 8 bank groups, and for
 * 128-byte rows it is the 128-byte swizzle that TMA writes and wgmma descriptors read. */
template <int kRowBytes = 128>
__device__ __forceinline__ uint32_t swizzled_chunk(int row, int chunk) {
    return (uint32_t)(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

/* d += A * B, one m16n8k16 tensor-core step with FP32 accumulation: BF16 operands, or FP16 ones
 * (E4M3 widened by e4m3x2_to_f16x2). */
template <bool kBf16>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    if constexpr (kBf16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

#endif
