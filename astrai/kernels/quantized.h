/* What the products of quantized weights share: gemv.c's few rows and gemm.c's many (a
 * prompt's) read the same 4-bit and 8-bit layouts and quantize their activations alike.
 *
 * Layouts (rows padded to a multiple of 64 inputs, the padding zero; `out` is the real count,
 * only those outputs are written):
 *   int4: nibbles uint8 in blocks of COLUMNS (16) output rows, [out/16][in/8][16][4]: a line of
 *         64 bytes holds 8 inputs of each of the block's 16 rows, row r's 4 bytes at 4r, byte j
 *         holding input j in its low nibble and input 4 + j in its high one. Masked, a line is
 *         vpdpbusd's unsigned operand as it lies, 4 inputs of 16 outputs, so that one output
 *         vector gathers 16 rows' sums and a block reads as one stream. scale, zero: bfloat16
 *         bits [out/16][in/group][16], out padded to 16 (the padding zero); W = (q - 8) * scale
 *         + zero. Against rows of 128 inputs a cache line, each output's 16 lanes summed at the
 *         end (2-core AMD Zen 5, one activation row, two threads, alternating in one process):
 *         the 0.5B shapes' matrices streamed at 57-73 GB/s from memory against 39-46.
 *   int8: w + 128 as bytes in the same column blocks, [out/16][in/4][16][4]: a line holds 4
 *         inputs of the block's 16 rows, vpdpbusd's unsigned operand as it lies; one float32
 *         scale per row, padded to 16. Unsigned, the 128 * sum(x) the offset adds is one number
 *         per activation row and call (`offset`): at one row on a 2-core AMD Zen 4, the product
 *         from cache ran 1.6x as fast as one that split each weight into magnitude and sign
 *         (llama.cpp's Q8_0 x Q8_0 way).
 * Activations x are float32 [rows][in] (in the real width, any); y float32
 * [rows][out]. */
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define BLOCK 32
#define PAIR 64
#define COLUMNS 16 /* a column block's output rows: one vector of sums */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

/* 16 bfloat16 values (bits) from p as float32 */
AVX512 INLINE __m512 load16_bf16(const uint16_t *p) {
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

/* The activations of one call, quantized once and read by every thread. */
typedef struct {
    int rows, width;      /* width: padded to a multiple of PAIR */
    int8_t *q;            /* [rows][width] */
    int block;            /* inputs a step covers: BLOCK, or a 4-bit group of 128 */
    float *step;          /* [rows][width / block]: x ~= q * step per block */
    float *group_sum;     /* [rows][width / group]: sum of q * step over each weight group */
    float *offset;        /* [rows]: 128 times the sum of q * step over the row (int8) */
} Activations;

/* compiled for AVX2 (every CPU the products run on has it), so the rounding is one instruction */
AVX2 static float nearest(float v) { return __builtin_roundevenf(v); }

/* One block of `block` inputs (a multiple of 32, all of them real) to int8: amax, the step
 * and q = round-half-even(v * (127 / amax)), eight lanes at a time; the same operations as the
 * scalar loop below, lane by lane (a max, one float multiply, one rounding), so the same bits.
 * Returns the sum of q. */
AVX2 static int quantize_block8(const float *v, int block, int8_t *q, float *step) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most = _mm256_setzero_ps();
    for (int j = 0; j < block; j += 8)
        most = _mm256_max_ps(most, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    *step = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i total = _mm256_setzero_si256();
    for (int j = 0; j < block; j += 32) {
        __m256i n[4];
        for (int k = 0; k < 4; k++) {
            __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * k), inv);
            n[k] = _mm256_cvtps_epi32(
                _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            total = _mm256_add_epi32(total, n[k]);
        }
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                           _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(bytes, order));
    }
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1)));
}

/* The scalar order of operations both paths share, so that the AVX-512 and AVX2 products
 * quantize identically; whole blocks take quantize_block8, which does the same lane by lane.
 * Rows are split over the threads. Against the scalar loop alone on one thread (a 2-core AMD
 * Zen 4, int8 products of 64 outputs, where quantizing is most of the call): 4864 inputs at
 * 1 / 4 / 16 rows 17.3 / 45.6 / 157 us -> 12.2 / 19.0 / 51.9, 896 inputs 9.2 / 14.4 / 35.8 ->
 * 8.5 / 10.4 / 17.2. */
AVX2 static void quantize_activations(const float *x, int in, Activations *a, int group,
                                      int threads) {
    const int block = a->block, blocks = a->width / block, groups = a->width / group;
#pragma omp parallel for num_threads(threads) if (a->rows > 1)
    for (int r = 0; r < a->rows; r++) {
        const float *row = x + (size_t)r * in;
        int8_t *q = a->q + (size_t)r * a->width;
        float *step = a->step + (size_t)r * blocks;
        /* each block's sum of q * step, into the row's total and its weight group's */
        float total = 0.0f, *sums = a->group_sum ? a->group_sum + (size_t)r * groups : NULL;
        for (int g = 0; sums && g < groups; g++) sums[g] = 0.0f;
        for (int b = 0; b < blocks; b++) {
            int start = b * block, left = in - start, t = 0;
            int valid = left < 0 ? 0 : left < block ? left : block; /* the padding reads as 0 */
            if (valid == block) {
                t = quantize_block8(row + start, block, q + start, step + b);
            } else {
                float amax = 0.0f;
                for (int j = 0; j < valid; j++) {
                    float v = __builtin_fabsf(row[start + j]);
                    amax = v > amax ? v : amax;
                }
                float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                step[b] = amax / 127.0f;
                for (int j = 0; j < block; j++) {
                    q[start + j] = (int8_t)(j < valid ? nearest(row[start + j] * inv) : 0.0f);
                    t += q[start + j];
                }
            }
            total += (float)t * step[b];
            if (sums)
                sums[b * block / group] += (float)t * step[b];
        }
        a->offset[r] = 128.0f * total;
    }
}

static int alloc_activations(Activations *a, int rows, int width, int group, int block) {
    a->rows = rows;
    a->width = width;
    a->block = block;
    size_t qbytes = ((size_t)rows * width + 63) / 64 * 64;
    a->q = aligned_alloc(64, qbytes);
    a->step = malloc(sizeof(float) * (size_t)rows * (width / block));
    a->group_sum = group ? malloc(sizeof(float) * (size_t)rows * (width / group)) : NULL;
    a->offset = malloc(sizeof(float) * (size_t)rows);
    return a->q && a->step && (!group || a->group_sum) && a->offset;
}

static void free_activations(Activations *a) {
    free(a->q);
    free(a->step);
    free(a->group_sum);
    free(a->offset);
}

/* 2: AVX-512 VNNI, 1: AVX2, 0: neither (gemv.c) */
int astrai_gemv_isa(void);
