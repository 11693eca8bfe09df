/* RoPE cos/sin computed from theta in the call (MSAIDX_COS_SIN_THETA), with no table: the same
 * integer and FP32 operations on the host (src/cpu/index_prepare.c) and in the CUDA kernel
 * (src/cuda/index_prepare.cu), so the backends agree bitwise.
 *
 * Pair i rotates by position * theta^(-i/32) radians. The host turns each inverse frequency into
 * turns (angle / 2 pi) in 0.64 fixed point once per call (msaidx_rope_turns, from FP64); a
 * position's angle is then one 64-bit multiplication, which wraps exactly at whole turns, so the
 * range reduction costs nothing and loses nothing at any position. What is left of the turn
 * after the nearest quarter turn, x in [-1/2, 1/2) quarter turns, goes through FP32 polynomials
 * of sin and cos (pi x / 2), and the quarter picks the signs and which is which.
 *
 * Error: the turn carries the FP64 inverse frequency's rounding, position * 2^-53 relative, under
 * 2^-29 radians for positions below MSAIDX_ROPE_THETA_MAX_POSITION = 2^24; x is rounded once to
 * FP32; the polynomials are the Taylor series cut where the next term is below 2^-29 at
 * |x| = 1/2, with FP32 coefficients and Horner rounding. Measured against FP64 cos and sin: at most
 * 1.28 FP32 ulps over 8M spread turns (an FP32 table is within half an ulp; both far inside the
 * 2^-20 of the terms that SPEC section 11's FP32 evaluation is allowed). tests/test_index_prepare.c
 * checks 1.5 ulps, and the absolute error at positions up to 2^24. */
#ifndef MSAIDX_ROPE_THETA_H
#define MSAIDX_ROPE_THETA_H

#include <stdint.h>

#ifdef __CUDACC__
#define MSAIDX_ROPE_FN static __host__ __device__ __forceinline__
#else
#include <math.h>
#define MSAIDX_ROPE_FN static inline __attribute__((always_inline))
#endif

/* sin(pi x / 2) = x (S1 + S3 x^2 + ... + S9 x^8), S_k = (-1)^((k-1)/2) (pi/2)^k / k!;
 * cos(pi x / 2) = 1 + C2 x^2 + ... + C10 x^10, C_k = (-1)^(k/2) (pi/2)^k / k!; FP32 roundings,
 * and S1 = pi / 2 in two parts: its FP32 rounding alone would cost sin half an ulp. */
#define MSAIDX_ROPE_S1 0x1.921fb6p+0f
#define MSAIDX_ROPE_S1_LOW -0x1.777a5cp-25f
#define MSAIDX_ROPE_S3 -0x1.4abbcep-1f
#define MSAIDX_ROPE_S5 0x1.466bc6p-4f
#define MSAIDX_ROPE_S7 -0x1.32d2ccp-8f
#define MSAIDX_ROPE_S9 0x1.507834p-13f
#define MSAIDX_ROPE_C2 -0x1.3bd3ccp+0f
#define MSAIDX_ROPE_C4 0x1.03c1fp-2f
#define MSAIDX_ROPE_C6 -0x1.55d3c8p-6f
#define MSAIDX_ROPE_C8 0x1.e1f506p-11f
#define MSAIDX_ROPE_C10 -0x1.a6d1f2p-16f

/* cos and sin of 2 pi turn / 2^64. */
MSAIDX_ROPE_FN void msaidx_rope_cos_sin_of_turn(uint64_t turn, float *cos_out, float *sin_out) {
    /* turn = quarter 2^62 + r, r in [-2^61, 2^61); the low 62 bits shifted up are 4 r. */
    const uint32_t quarter = (uint32_t)((turn + ((uint64_t)1 << 61)) >> 62);
    const float x = (float)(int64_t)(turn << 2) * 0x1p-64f; /* r / 2^62: exact scaling */
    const float x2 = x * x;
    const float s_rest =
        fmaf(fmaf(fmaf(fmaf(MSAIDX_ROPE_S9, x2, MSAIDX_ROPE_S7), x2, MSAIDX_ROPE_S5), x2,
                  MSAIDX_ROPE_S3),
             x2, MSAIDX_ROPE_S1_LOW);
    const float s = fmaf(x, MSAIDX_ROPE_S1, x * s_rest);
    const float c =
        fmaf(fmaf(fmaf(fmaf(fmaf(MSAIDX_ROPE_C10, x2, MSAIDX_ROPE_C8), x2, MSAIDX_ROPE_C6), x2,
                       MSAIDX_ROPE_C4),
                  x2, MSAIDX_ROPE_C2),
             x2, 1.0f);
    /* quarter 1: sin = c, cos = -s; 2: -s, -c; 3: -c, s. */
    const float sin_part = (quarter & 1) ? c : s, cos_part = (quarter & 1) ? s : c;
    *sin_out = (quarter & 2) ? -sin_part : sin_part;
    *cos_out = ((quarter + 1) & 2) ? -cos_part : cos_part;
}

/* Pair i's cos and sin at a position, from its turns per position (msaidx_rope_turns). */
MSAIDX_ROPE_FN void msaidx_rope_cos_sin(uint64_t turns_per_position, uint32_t position,
                                        float *cos_out, float *sin_out) {
    msaidx_rope_cos_sin_of_turn(turns_per_position * position, cos_out, sin_out);
}

#endif
