/* What more than one kernel of this folder computes: bfloat16 widening and rounding, 8 floats
 * at a time (AVX2 + FMA), and a 16 x 16 transpose of 32-bit words (AVX-512). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* one bfloat16 value (its bits) as float32 */
static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x for x <= 0 (Cephes' single-precision polynomial: relative error ~1e-7) */
AVX2 INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, x), x, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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
