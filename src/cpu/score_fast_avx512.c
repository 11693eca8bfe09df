/* AVX-512 kernels of the fast scorer: 16 keys per zmm, up to 6 query rows x 64 keys of
 * accumulators per micro-kernel (24 zmm), the page max taken in the epilogue. */
#include "score_fast.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define AVX512_INLINE                                                                              \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,fma")))

/* E4M3 widens exactly to fp16 (exponent bits moved down one, bias 7 -> 15 is a factor 2^8,
 * subnormals included), which the hardware converts to float; 0x7F / 0xFF become NaN. */
AVX512_INLINE __m512 e4m3x16(const void *src) {
    const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i magnitude =
        _mm256_and_si256(_mm256_slli_epi16(codes, 7), _mm256_set1_epi16(0x3F80));
    const __m256i sign =
        _mm256_and_si256(_mm256_slli_epi16(codes, 8), _mm256_set1_epi16((short)0x8000));
    const __m512 value =
        _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x3F80));
    /* NaN lanes: (bits & sign bit) | quiet NaN, the reference's exact bits. */
    const __m512i bits = _mm512_mask_ternarylogic_epi32(_mm512_castps_si512(value), nan,
                                                        _mm512_set1_epi32((int)0x80000000u),
                                                        _mm512_set1_epi32(0x7FC00000), 0xEA);
    return _mm512_castsi512_ps(bits);
}

AVX512_INLINE __m512 bf16x16(const void *src) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 elements starting at element `index` of src. */
AVX512_INLINE __m512 load16(msaidx_dtype dtype, const void *src, size_t index) {
    return dtype == MSAIDX_DTYPE_BF16 ? bf16x16((const uint16_t *)src + index)
                                      : e4m3x16((const uint8_t *)src + index);
}

static AVX512 bool avx512_decode_q(msaidx_dtype dtype, const void *src, int32_t rows,
                                   int32_t head_dim, float *dst) {
    const int32_t n = rows * head_dim;
    for (int32_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(dtype, src, (size_t)i));
    return true;
}

AVX512_INLINE __m512 unpacklo_pd(__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
AVX512_INLINE __m512 unpackhi_pd(__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

/* In-register 16x16 transpose: pairs of floats, then pairs of pairs, then 128-bit lanes. */
AVX512_INLINE void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c]: rows i..i+3 of column 4 * lane + c */
        r[i] = unpacklo_pd(t[i], t[i + 2]);
        r[i + 1] = unpackhi_pd(t[i], t[i + 2]);
        r[i + 2] = unpacklo_pd(t[i + 1], t[i + 3]);
        r[i + 3] = unpackhi_pd(t[i + 1], t[i + 3]);
    }
    for (int g = 0; g < 16; g += 8)
        for (int c = 0; c < 4; ++c) {
            t[g + c] = _mm512_shuffle_f32x4(r[g + c], r[g + 4 + c], 0x88);
            t[g + 4 + c] = _mm512_shuffle_f32x4(r[g + c], r[g + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; ++c) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    }
}

/* Pages are scattered and the hardware prefetcher stops at 4 KiB boundaries: fetch the next 16
 * keys (group_bytes) while the 16 at k0 are transposed. */
static inline void prefetch_next_keys(const void *keys, int32_t k0, int32_t width,
                                      size_t group_bytes) {
    if (k0 + 16 >= width) return;
    for (size_t offset = 0; offset < group_bytes; offset += 64)
        _mm_prefetch((const char *)keys + (size_t)(k0 + 16) / 16 * group_bytes + offset,
                     _MM_HINT_T0);
}

static AVX512 bool avx512_pack_panel(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                     int32_t width, float *panel) {
    const size_t group_bytes = (size_t)16 * head_dim * msaidx_elem_size(dtype);
    for (int32_t k0 = 0; k0 < width; k0 += 16) {
        prefetch_next_keys(keys, k0, width, group_bytes);
        for (int32_t d0 = 0; d0 < head_dim; d0 += 16) {
            __m512 block[16];
            for (int i = 0; i < 16; ++i)
                block[i] = load16(dtype, keys, (size_t)(k0 + i) * head_dim + d0);
            transpose16(block);
            for (int j = 0; j < 16; ++j)
                _mm512_store_ps(panel + (size_t)(d0 + j) * width + k0, block[j]);
        }
    }
    return true;
}

/* Lanes [0, 16) of vector v hold keys 16v + lane; those below `limit` are valid. */
AVX512_INLINE __mmask16 valid_keys(int32_t limit, int v) {
    const int32_t valid = limit - 16 * v;
    return valid >= 16  ? (__mmask16)0xFFFF
           : valid <= 0 ? (__mmask16)0
                        : (__mmask16)((1u << valid) - 1u);
}

/* R rows x NV vectors of 16 keys: acc[r][v] += q[r][d] * panel[d][16v..], d over head_dim. */
AVX512_INLINE void block(const float *q, int32_t head_dim, const float *panel, int32_t width,
                         const int32_t *limit, float *row_max, const int R, const int NV) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int32_t d = 0; d < head_dim; ++d) {
        const float *keys = panel + (size_t)d * width;
        __m512 k[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) k[v] = _mm512_load_ps(keys + 16 * v);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m512 qr = _mm512_set1_ps(q[(size_t)r * head_dim + d]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(qr, k[v], acc[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        /* max(dot, best) keeps best when dot is NaN, matching the reference's `dot > best`. */
        __m512 best = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            best = _mm512_mask_max_ps(best, valid_keys(limit[r], v), acc[r][v], best);
        const float m = _mm512_reduce_max_ps(best);
        if (m > row_max[r]) row_max[r] = m;
    }
}

typedef void (*block_fn)(const float *, int32_t, const float *, int32_t, const int32_t *, float *);

#define BLOCK(R, NV)                                                                               \
    static AVX512 void block_##R##x##NV(const float *q, int32_t head_dim, const float *panel,      \
                                        int32_t width, const int32_t *limit, float *row_max) {     \
        block(q, head_dim, panel, width, limit, row_max, R, NV);                                   \
    }
#define BLOCKS(R) BLOCK(R, 1) BLOCK(R, 2) BLOCK(R, 3) BLOCK(R, 4)
BLOCKS(1)
BLOCKS(2)
BLOCKS(3)
BLOCKS(4)
BLOCKS(5)
BLOCKS(6)

/* Left unformatted: clang-format 14 and 18 lay out a braced macro body differently. */
/* clang-format off */
#define ROW(R) {block_##R##x1, block_##R##x2, block_##R##x3, block_##R##x4}
/* clang-format on */
static const block_fn blocks[6][4] = {ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6)};

/* Rows split into near-equal groups of at most 6, so a 7-row tail is 4 + 3, not 6 + 1. */
static AVX512 void avx512_panel_max(const float *q, int32_t rows, int32_t head_dim,
                                    const float *panel, int32_t width, const int32_t *limit,
                                    float *row_max) {
    const int32_t groups = (rows + 5) / 6;
    for (int32_t g = 0, r = 0; g < groups; ++g) {
        const int32_t n = rows / groups + (g < rows % groups);
        blocks[n - 1][width / 16 - 1](q + (size_t)r * head_dim, head_dim, panel, width, limit + r,
                                      row_max + r);
        r += n;
    }
}

const msaidx_fast_kernels msaidx_fast_avx512 = {
    .name = "avx512",
    .decode_q = avx512_decode_q,
    .pack_panel = avx512_pack_panel,
    .panel_max = avx512_panel_max,
};

/* ---- The AVX512-BF16 dot product: each 32-bit lane holds dimensions (2j, 2j+1). */

#define AVX512_BF16_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,fma"
#define AVX512_BF16 __attribute__((target(AVX512_BF16_TARGET)))
#define AVX512_BF16_INLINE static inline __attribute__((always_inline, target(AVX512_BF16_TARGET)))

/* E4M3 codes in 16-bit lanes to bf16, exactly: normals rebias the exponent (7 -> 127),
 * subnormals m * 2^-9 come from a table, 0x7F / 0xFF are NaN. */
AVX512_BF16_INLINE __m512i e4m3_to_bf16(__m512i codes) {
    static const uint16_t subnormals[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                            0x3C00, 0x3C20, 0x3C40, 0x3C60};
    const __m512i magnitude = _mm512_and_si512(codes, _mm512_set1_epi16(0x7F));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(codes, _mm512_set1_epi16(0x80)), 8);
    __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
    bits =
        _mm512_mask_mov_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)),
                              _mm512_permutexvar_epi16(magnitude, _mm512_loadu_si512(subnormals)));
    bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                                 _mm512_set1_epi16(0x7FC0));
    return _mm512_or_si512(bits, sign);
}

/* 32 dimensions from d0 of one stored row as 16 bf16 pairs; past head_dim (a multiple of 16)
 * the pairs are zero, which adds nothing to a dot product. */
AVX512_BF16_INLINE __m512i e4m3_pairs(const uint8_t *row, int32_t d0, int32_t head_dim) {
    const __m256i codes =
        d0 + 32 <= head_dim ? _mm256_loadu_si256((const __m256i *)(row + d0))
                            : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(row + d0)));
    return e4m3_to_bf16(_mm512_cvtepu8_epi16(codes));
}

/* The same from BF16 data, which is already pairs; *subnormal gathers the lanes holding a bf16
 * subnormal, which the dot product would flush to zero. */
AVX512_BF16_INLINE __m512i bf16_pairs(const uint16_t *row, int32_t d0, int32_t head_dim,
                                      __mmask32 *subnormal) {
    const __m512i bits =
        _mm512_maskz_loadu_epi16(d0 + 32 <= head_dim ? ~(__mmask32)0 : 0xFFFFu, row + d0);
    *subnormal |= _mm512_testn_epi16_mask(bits, _mm512_set1_epi16(0x7F80)) &
                  _mm512_test_epi16_mask(bits, _mm512_set1_epi16(0x007F));
    return bits;
}

AVX512_BF16_INLINE __m512i stored_pairs(msaidx_dtype dtype, const void *row, int32_t d0,
                                        int32_t head_dim, __mmask32 *subnormal) {
    return dtype == MSAIDX_DTYPE_BF16 ? bf16_pairs((const uint16_t *)row, d0, head_dim, subnormal)
                                      : e4m3_pairs((const uint8_t *)row, d0, head_dim);
}

static AVX512_BF16 bool bf16_decode_q(msaidx_dtype dtype, const void *src, int32_t rows,
                                      int32_t head_dim, float *dst) {
    const size_t row_bytes = (size_t)head_dim * msaidx_elem_size(dtype);
    __mmask32 subnormal = 0;
    for (int32_t r = 0; r < rows; ++r) {
        const char *row = (const char *)src + (size_t)r * row_bytes;
        for (int32_t d0 = 0; d0 < head_dim; d0 += 32)
            _mm512_storeu_si512(dst + (size_t)r * head_dim + d0 / 2,
                                stored_pairs(dtype, row, d0, head_dim, &subnormal));
    }
    return subnormal == 0;
}

static AVX512_BF16 bool bf16_pack_panel(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                        int32_t width, float *panel) {
    const size_t row_bytes = (size_t)head_dim * msaidx_elem_size(dtype);
    __mmask32 subnormal = 0;
    for (int32_t k0 = 0; k0 < width; k0 += 16) {
        prefetch_next_keys(keys, k0, width, 16 * row_bytes);
        for (int32_t d0 = 0; d0 < head_dim; d0 += 32) {
            __m512 block[16];
            for (int i = 0; i < 16; ++i)
                block[i] = _mm512_castsi512_ps(
                    stored_pairs(dtype, (const char *)keys + (size_t)(k0 + i) * row_bytes, d0,
                                 head_dim, &subnormal));
            transpose16(block);
            for (int j = 0; j < 16; ++j)
                _mm512_store_ps(panel + (size_t)(d0 / 2 + j) * width + k0, block[j]);
        }
    }
    return subnormal == 0;
}

/* As block(), over pairs of dimensions: acc[r][v] += q[r][2j..2j+1] . panel[j][16v..]. */
AVX512_BF16_INLINE void bf16_block(const float *q, int32_t head_dim, const float *panel,
                                   int32_t width, const int32_t *limit, float *row_max, const int R,
                                   const int NV) {
    const int32_t pairs = (head_dim + 31) / 32 * 16;
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int32_t j = 0; j < pairs; ++j) {
        const float *keys = panel + (size_t)j * width;
        __m512bh k[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) k[v] = (__m512bh)_mm512_load_si512(keys + 16 * v);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m512bh qr =
                (__m512bh)_mm512_castps_si512(_mm512_set1_ps(q[(size_t)r * head_dim + j]));
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qr, k[v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        __m512 best = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            best = _mm512_mask_max_ps(best, valid_keys(limit[r], v), acc[r][v], best);
        const float m = _mm512_reduce_max_ps(best);
        if (m > row_max[r]) row_max[r] = m;
    }
}

#define BF16_BLOCK(R, NV)                                                                          \
    static AVX512_BF16 void bf16_block_##R##x##NV(const float *q, int32_t head_dim,                \
                                                  const float *panel, int32_t width,               \
                                                  const int32_t *limit, float *row_max) {          \
        bf16_block(q, head_dim, panel, width, limit, row_max, R, NV);                              \
    }
#define BF16_BLOCKS(R) BF16_BLOCK(R, 1) BF16_BLOCK(R, 2) BF16_BLOCK(R, 3) BF16_BLOCK(R, 4)
BF16_BLOCKS(1)
BF16_BLOCKS(2)
BF16_BLOCKS(3)
BF16_BLOCKS(4)
BF16_BLOCKS(5)
BF16_BLOCKS(6)

/* clang-format off */ /* as ROW above */
#define BF16_ROW(R) \
    {bf16_block_##R##x1, bf16_block_##R##x2, bf16_block_##R##x3, bf16_block_##R##x4}
/* clang-format on */
static const block_fn bf16_blocks[6][4] = {BF16_ROW(1), BF16_ROW(2), BF16_ROW(3),
                                           BF16_ROW(4), BF16_ROW(5), BF16_ROW(6)};

static AVX512_BF16 void bf16_panel_max(const float *q, int32_t rows, int32_t head_dim,
                                       const float *panel, int32_t width, const int32_t *limit,
                                       float *row_max) {
    const int32_t groups = (rows + 5) / 6;
    for (int32_t g = 0, r = 0; g < groups; ++g) {
        const int32_t n = rows / groups + (g < rows % groups);
        bf16_blocks[n - 1][width / 16 - 1](q + (size_t)r * head_dim, head_dim, panel, width,
                                           limit + r, row_max + r);
        r += n;
    }
}

const msaidx_fast_kernels msaidx_fast_avx512_bf16 = {
    .name = "avx512_bf16",
    .decode_q = bf16_decode_q,
    .pack_panel = bf16_pack_panel,
    .panel_max = bf16_panel_max,
    .fallback = &msaidx_fast_avx512,
};

#endif
