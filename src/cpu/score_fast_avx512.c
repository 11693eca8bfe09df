/* AVX-512 kernels of the fast scorer: 16 keys per zmm, up to 6 query rows x 64 keys of
 * accumulators per micro-kernel (24 zmm), the page max taken in the epilogue. */
#include "score_fast.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>
#include <pthread.h>

#include "../convert.h"

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

/* ---- The AVX512-BF16 dot product: each 32-bit lane holds dimensions (2j, 2j+1). E4M3 codes
 * become bf16 through byte permutes (AVX512-VBMI), so the set needs both extensions. */

#define AVX512_BF16_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,fma"
#define AVX512_BF16 __attribute__((target(AVX512_BF16_TARGET)))
#define AVX512_BF16_INLINE static inline __attribute__((always_inline, target(AVX512_BF16_TARGET)))

/* The bf16 bits of each E4M3 magnitude 0x00-0x7F, high and low byte apart: every E4M3 value is
 * exact in bf16 (0x7F: the quiet NaN), so the scalar decode fills them. */
static struct { uint8_t high[128], low[128]; } e4m3_bytes;
static pthread_once_t e4m3_bytes_once = PTHREAD_ONCE_INIT;

static void fill_e4m3_bytes(void) {
    for (int m = 0; m < 128; ++m) {
        const uint32_t bits = msaidx_float_bits(msaidx_e4m3_decode((uint8_t)m)) >> 16;
        e4m3_bytes.high[m] = (uint8_t)(bits >> 8);
        e4m3_bytes.low[m] = (uint8_t)bits;
    }
}

/* The tables in registers: a 128-byte table is two zmm for one two-source byte permute. */
typedef struct e4m3_table {
    __m512i high[2], low[2];
} e4m3_table;

AVX512_BF16_INLINE e4m3_table load_e4m3_table(void) {
    pthread_once(&e4m3_bytes_once, fill_e4m3_bytes);
    e4m3_table t;
    for (int i = 0; i < 2; ++i) {
        t.high[i] = _mm512_loadu_si512(e4m3_bytes.high + 64 * i);
        t.low[i] = _mm512_loadu_si512(e4m3_bytes.low + 64 * i);
    }
    return t;
}

/* 64 E4M3 codes to 64 bf16: codes 0-31 in out[0], 32-63 in out[1]. The byte permutes index by
 * the low 7 bits (the magnitude); the sign bit goes straight to the high byte. The unpacks
 * interleave within 128-bit lanes, so the code qwords are first put in the order 0,4,1,5,...
 * that brings the results out in code order. */
AVX512_BF16_INLINE void e4m3x64_to_bf16(const e4m3_table *t, __m512i codes, __m512i out[2]) {
    const __m512i ordered =
        _mm512_permutexvar_epi64(_mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0), codes);
    const __m512i magnitude_high = _mm512_permutex2var_epi8(t->high[0], ordered, t->high[1]);
    const __m512i high = _mm512_ternarylogic_epi32(magnitude_high, ordered,
                                                   _mm512_set1_epi8((char)0x80), 0xF8); /* a|b&c */
    const __m512i low = _mm512_permutex2var_epi8(t->low[0], ordered, t->low[1]);
    out[0] = _mm512_unpacklo_epi8(low, high);
    out[1] = _mm512_unpackhi_epi8(low, high);
}

/* 32 dimensions from d0 of one stored row as 16 bf16 pairs; past head_dim (a multiple of 16)
 * the pairs are zero, which adds nothing to a dot product. */
AVX512_BF16_INLINE __m512i e4m3_pairs(const e4m3_table *t, const uint8_t *row, int32_t d0,
                                      int32_t head_dim) {
    const __m256i codes =
        d0 + 32 <= head_dim ? _mm256_loadu_si256((const __m256i *)(row + d0))
                            : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(row + d0)));
    __m512i pairs[2];
    e4m3x64_to_bf16(t, _mm512_zextsi256_si512(codes), pairs);
    return pairs[0];
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

AVX512_BF16_INLINE __m512i stored_pairs(const e4m3_table *t, msaidx_dtype dtype, const void *row,
                                        int32_t d0, int32_t head_dim, __mmask32 *subnormal) {
    return dtype == MSAIDX_DTYPE_BF16 ? bf16_pairs((const uint16_t *)row, d0, head_dim, subnormal)
                                      : e4m3_pairs(t, (const uint8_t *)row, d0, head_dim);
}

static AVX512_BF16 bool bf16_decode_q(msaidx_dtype dtype, const void *src, int32_t rows,
                                      int32_t head_dim, float *dst) {
    const e4m3_table table = load_e4m3_table();
    const size_t row_bytes = (size_t)head_dim * msaidx_elem_size(dtype);
    __mmask32 subnormal = 0;
    for (int32_t r = 0; r < rows; ++r) {
        const char *row = (const char *)src + (size_t)r * row_bytes;
        for (int32_t d0 = 0; d0 < head_dim; d0 += 32)
            _mm512_storeu_si512(dst + (size_t)r * head_dim + d0 / 2,
                                stored_pairs(&table, dtype, row, d0, head_dim, &subnormal));
    }
    return subnormal == 0;
}

static AVX512_BF16 bool bf16_pack_panel(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                        int32_t width, float *panel) {
    const e4m3_table table = load_e4m3_table();
    const size_t row_bytes = (size_t)head_dim * msaidx_elem_size(dtype);
    __mmask32 subnormal = 0;
    for (int32_t k0 = 0; k0 < width; k0 += 16) {
        prefetch_next_keys(keys, k0, width, 16 * row_bytes);
        for (int32_t d0 = 0; d0 < head_dim; d0 += 32) {
            __m512 block[16];
            for (int i = 0; i < 16; ++i)
                block[i] = _mm512_castsi512_ps(
                    stored_pairs(&table, dtype, (const char *)keys + (size_t)(k0 + i) * row_bytes,
                                 d0, head_dim, &subnormal));
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

/* Lane i of the result: the sum of the lanes of acc[i]. Pairs of vectors are added after
 * interleaving floats, then pairs of floats, then 128-bit lanes, twice: four halvings. */
AVX512_INLINE __m512 lane_sums16(const __m512 acc[16]) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; ++i) /* 128-bit lane: floats 0, 2 of acc[2i]'s sums, 1, 3 of 2i + 1 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* 128-bit lane: keys 4i..4i+3, that lane's part of their sums */
        u[i] =
            _mm512_add_ps(unpacklo_pd(t[2 * i], t[2 * i + 1]), unpackhi_pd(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i) /* lanes: keys 8i..8i+3 (halves 0+1, 2+3), then 8i+4..8i+7 */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                         _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

/* One query row's dot products with 16 key rows of bf16 pairs, `stride` bytes apart: lane i of
 * the result is key i's. Each key accumulates in its own vector; the last of the `vectors` pair
 * vectors of a row is loaded under last_mask (half of it when head_dim % 32 == 16, where the
 * query's pairs are zero but a stored row may hold a NaN). */
AVX512_BF16_INLINE __m512 dots16(const float *q_row, const char *keys, size_t stride,
                                 const int32_t vectors, __mmask32 last_mask) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int32_t v = 0; v < vectors; ++v) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q_row + 16 * v);
        const __mmask32 mask = v + 1 < vectors ? ~(__mmask32)0 : last_mask;
        for (int i = 0; i < 16; ++i)
            acc[i] = _mm512_dpbf16_ps(
                acc[i], qv, (__m512bh)_mm512_maskz_loadu_epi16(mask, keys + i * stride + 64 * v));
    }
    return lane_sums16(acc);
}

/* Few query rows against the stored keys, 16 keys at a time, without a transposed panel: BF16
 * keys are read straight from the page, E4M3 keys converted once into row order. Each row keeps
 * its best of every key in a vector until the end. The next page comes into L2 a share per
 * group, so its reads spread over the page's scoring. */
AVX512_BF16_INLINE bool keys_max_body(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                      int32_t width, const float *q, int32_t rows,
                                      const int32_t *limit, float *row_max, const void *next,
                                      size_t next_bytes, const int32_t vectors) {
    const e4m3_table table = load_e4m3_table();
    const size_t row_bytes = (size_t)head_dim * msaidx_elem_size(dtype);
    const size_t next_share = (next_bytes / (size_t)(width / 16) + 63) / 64 * 64;
    const __mmask32 last_mask = head_dim % 32 ? 0xFFFFu : ~(__mmask32)0;
    __m512i converted[16][MSAIDX_MAX_HEAD_DIM / 32];
    __m512 best[MSAIDX_FEW_ROWS];
    for (int32_t r = 0; r < rows; ++r) best[r] = _mm512_set1_ps(-INFINITY);
    for (int32_t k0 = 0; k0 < width; k0 += 16) {
        const char *group = (const char *)keys + (size_t)k0 * row_bytes;
        prefetch_next_keys(keys, k0, width, 16 * row_bytes);
        for (size_t b = (size_t)k0 / 16 * next_share;
             next && b < ((size_t)k0 / 16 + 1) * next_share && b < next_bytes; b += 64)
            _mm_prefetch((const char *)next + b, _MM_HINT_T1);
        const char *rows_at = group;
        size_t stride = row_bytes;
        if (dtype == MSAIDX_DTYPE_BF16) {
            __mmask32 subnormal = 0;
            for (int i = 0; i < 16; ++i)
                for (int32_t v = 0; v < vectors; ++v)
                    bf16_pairs((const uint16_t *)(group + (size_t)i * row_bytes), 32 * v, head_dim,
                               &subnormal);
            if (subnormal) return false;
        } else {
            for (int i = 0; i < 16; ++i)
                for (int32_t v = 0; v < vectors; v += 2) {
                    const uint8_t *row = (const uint8_t *)group + (size_t)i * row_bytes;
                    const int32_t left = head_dim - 32 * v;
                    const __m512i codes = _mm512_maskz_loadu_epi8(
                        left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1), row + 32 * v);
                    __m512i pairs[2];
                    e4m3x64_to_bf16(&table, codes, pairs);
                    converted[i][v] = pairs[0];
                    if (v + 1 < vectors) converted[i][v + 1] = pairs[1];
                }
            rows_at = (const char *)converted;
            stride = sizeof converted[0];
        }
        for (int32_t r = 0; r < rows; ++r) {
            if (limit[r] <= k0) continue;
            const __m512 dots = dots16(q + (size_t)r * head_dim, rows_at, stride, vectors,
                                       dtype == MSAIDX_DTYPE_BF16 ? last_mask : ~(__mmask32)0);
            best[r] = _mm512_mask_max_ps(best[r], valid_keys(limit[r] - k0, 0), dots, best[r]);
        }
    }
    for (int32_t r = 0; r < rows; ++r) {
        const float m = _mm512_reduce_max_ps(best[r]);
        if (m > row_max[r]) row_max[r] = m;
    }
    return true;
}

/* D = 128, the model's, gets its own copy with the loops over dimensions unrolled. */
static AVX512_BF16 bool bf16_keys_max(msaidx_dtype dtype, const void *keys, int32_t head_dim,
                                      int32_t width, const float *q, int32_t rows,
                                      const int32_t *limit, float *row_max, const void *next,
                                      size_t next_bytes) {
    const int32_t vectors = (head_dim + 31) / 32;
    return vectors == 4 ? keys_max_body(dtype, keys, head_dim, width, q, rows, limit, row_max, next,
                                        next_bytes, 4)
                        : keys_max_body(dtype, keys, head_dim, width, q, rows, limit, row_max, next,
                                        next_bytes, vectors);
}

const msaidx_fast_kernels msaidx_fast_avx512_bf16 = {
    .name = "avx512_bf16",
    .decode_q = bf16_decode_q,
    .pack_panel = bf16_pack_panel,
    .panel_max = bf16_panel_max,
    .keys_max = bf16_keys_max,
    .fallback = &msaidx_fast_avx512,
};

#endif
