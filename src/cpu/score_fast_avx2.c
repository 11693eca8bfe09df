/* AVX2 + FMA kernels of the fast scorer: 8 keys per ymm, up to 6 query rows x 16 keys of
 * accumulators per micro-kernel (12 of the 16 ymm registers). */
#include "score_fast.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

/* Same exact bit construction as the AVX-512 path: rebias normals, scale subnormals, NaN. */
AVX2_INLINE __m256 e4m3x8(const void *src) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(0x7F));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)), 24);
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 subnormal =
        _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512.0f));
    const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude);
    const __m256i is_nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F));
    __m256 value = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(is_subnormal));
    value = _mm256_blendv_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                             _mm256_castsi256_ps(is_nan));
    return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

AVX2_INLINE __m256 bf16x8(const void *src) {
    const __m128i bits = _mm_loadu_si128((const __m128i *)src);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* 8 elements starting at element `index` of src. */
AVX2_INLINE __m256 load8(msaidx_dtype dtype, const void *src, size_t index) {
    return dtype == MSAIDX_DTYPE_BF16 ? bf16x8((const uint16_t *)src + index)
                                      : e4m3x8((const uint8_t *)src + index);
}

static AVX2 bool avx2_decode_q(msaidx_dtype dtype, const void *src, int32_t rows, int32_t head_dim,
                               float *dst) {
    const int32_t n = rows * head_dim;
    for (int32_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load8(dtype, src, (size_t)i));
    return true;
}

/* In-register 8x8 transpose: pairs of floats, pairs of pairs, then 128-bit halves. */
AVX2_INLINE void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* r[i + c]: rows i..i+3 of column 4 * half + c */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
        t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
        t[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
    }
    for (int c = 0; c < 8; ++c) r[c] = t[c];
}

static AVX2 bool avx2_pack_panel(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                 int32_t width, float *panel) {
    const size_t group_bytes = (size_t)16 * head_dim * msaidx_elem_size(dtype);
    for (int32_t k0 = 0; k0 < width; k0 += 8) {
        /* Pages are scattered and the hardware prefetcher stops at 4 KiB boundaries: fetch the
         * next 16 keys while these are transposed. */
        if (k0 % 16 == 0 && k0 + 16 < width)
            for (size_t offset = 0; offset < group_bytes; offset += 64)
                _mm_prefetch((const char *)keys + (k0 + 16) / 16 * group_bytes + offset,
                             _MM_HINT_T0);
        for (int32_t d0 = 0; d0 < head_dim; d0 += 8) {
            __m256 block[8];
            for (int i = 0; i < 8; ++i)
                block[i] = load8(dtype, keys, (size_t)(k0 + i) * head_dim + d0);
            transpose8(block);
            for (int j = 0; j < 8; ++j)
                _mm256_store_ps(panel + (size_t)(d0 + j) * width + k0, block[j]);
        }
    }
    return true;
}

/* R rows x 16 keys starting at key k0 of the panel. */
AVX2_INLINE void block(const float *q, int32_t head_dim, const float *panel, int32_t width,
                       int32_t k0, const int32_t *limit, float *row_max, const int R) {
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int32_t d = 0; d < head_dim; ++d) {
        const float *keys = panel + (size_t)d * width + k0;
        const __m256 k_lo = _mm256_load_ps(keys), k_hi = _mm256_load_ps(keys + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m256 qr = _mm256_broadcast_ss(q + (size_t)r * head_dim + d);
            acc[r][0] = _mm256_fmadd_ps(qr, k_lo, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qr, k_hi, acc[r][1]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 none = _mm256_set1_ps(-INFINITY);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        /* max(dot, best) keeps best when dot is NaN, matching the reference's `dot > best`. */
        __m256 best = none;
        for (int v = 0; v < 2; ++v) {
            const __m256i valid =
                _mm256_cmpgt_epi32(_mm256_set1_epi32(limit[r] - k0 - 8 * v), lane);
            best =
                _mm256_max_ps(_mm256_blendv_ps(none, acc[r][v], _mm256_castsi256_ps(valid)), best);
        }
        best = _mm256_max_ps(best, _mm256_permute2f128_ps(best, best, 1));
        best = _mm256_max_ps(best, _mm256_shuffle_ps(best, best, 0x4E));
        best = _mm256_max_ps(best, _mm256_shuffle_ps(best, best, 0xB1));
        const float m = _mm256_cvtss_f32(best);
        if (m > row_max[r]) row_max[r] = m;
    }
}

typedef void (*block_fn)(const float *, int32_t, const float *, int32_t, int32_t, const int32_t *,
                         float *);

#define BLOCK(R)                                                                                   \
    static AVX2 void block_##R(const float *q, int32_t head_dim, const float *panel,               \
                               int32_t width, int32_t k0, const int32_t *limit, float *row_max) {  \
        block(q, head_dim, panel, width, k0, limit, row_max, R);                                   \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)
BLOCK(5)
BLOCK(6)

static const block_fn blocks[6] = {block_1, block_2, block_3, block_4, block_5, block_6};

/* Rows split into near-equal groups of at most 6, so a 7-row tail is 4 + 3, not 6 + 1. */
static AVX2 void avx2_panel_max(const float *q, int32_t rows, int32_t head_dim, const float *panel,
                                int32_t width, const int32_t *limit, float *row_max) {
    const int32_t groups = (rows + 5) / 6;
    for (int32_t g = 0, r = 0; g < groups; ++g) {
        const int32_t n = rows / groups + (g < rows % groups);
        for (int32_t k0 = 0; k0 < width; k0 += 16)
            blocks[n - 1](q + (size_t)r * head_dim, head_dim, panel, width, k0, limit + r,
                          row_max + r);
        r += n;
    }
}

const msaidx_fast_kernels msaidx_fast_avx2 = {
    .name = "avx2",
    .decode_q = avx2_decode_q,
    .pack_panel = avx2_pack_panel,
    .panel_max = avx2_panel_max,
};

#endif
