/* What more than one kernel of this folder computes: bfloat16 widening and rounding, 8 floats
 * at a time (AVX2 + FMA), and e^x 16 floats at a time and a 16 x 16 transpose of 32-bit words
 * (AVX-512). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma")))

/* the products' kinds (gemv.py's constants): the first four float_gemv.c's and gemv.c's */
enum { FLOAT32, BFLOAT16, INT8, INT4, PANEL_FLOAT32, PANEL_BFLOAT16 };

/* Whether a product's pass at one activation row asks for the weights ahead in software, per
 * kind (gemv.c): passes at more rows always ask. */
extern int astrai_ahead_at_one_row[4];
#define INLINE static inline __attribute__((always_inline))

/* one bfloat16 value (its bits) as float32 */
static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x for x <= 0 by Cephes' single-precision method (relative error ~1e-7): x = n ln 2 + r,
 * ln 2 in two parts, e^r = 1 + r + r^2 P(r), P of degree 5; exp8 and exp16 take the same steps
 * 8 and 16 lanes wide. */
#define EXP_FLOOR -87.3f
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

AVX2 INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HIGH), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LOW), x);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, x), x, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* 8 floats at element i of p, widened from bfloat16 bits where p holds those. */
AVX2 INLINE __m256 load8(const void *p, int bf16, size_t i) {
    if (!bf16)
        return _mm256_loadu_ps((const float *)p + i);
    __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* v rounded to the nearest bfloat16 (ties to even, as torch rounds; NaN stays NaN), as float32 */
AVX2 INLINE __m256 round_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan));
}

/* v to element i of p: as is, or as bfloat16 bits (round_bf16) */
AVX2 INLINE void store8(void *p, int bf16, size_t i, __m256 v) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}

/* the sum of the 8 lanes */
AVX2 INLINE float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define AVX512_WORDS __attribute__((target("avx512f")))

/* exp8, 16 lanes */
AVX512_WORDS INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HIGH), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LOW), x);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, x), x, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

/* The 16 x 16 32-bit values r[row] as their transpose, in place: pairs within 128-bit lanes,
 * then quads, then the lanes themselves. */
AVX512_WORDS INLINE void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + j], lane L: rows 4i..4i+3 of column 4L + j */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* column 4L + j: lane L of b[j], b[4 + j], b[8 + j], b[12 + j] */
        __m512i even = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
        __m512i odd = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xdd);
        __m512i even2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
        __m512i odd2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(even, even2, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(even, even2, 0xdd);
        r[4 + j] = _mm512_shuffle_i32x4(odd, odd2, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(odd, odd2, 0xdd);
    }
}
