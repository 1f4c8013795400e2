/* The cores' arithmetic ceiling, for the benchmark's prompt roofline: multiply-adds issued as
 * fast as the cores take them, each thread on independent accumulators held in registers,
 * nothing read from memory. No matrix product multiplies faster than this, so a prompt's share
 * of it says how much any kernel could still gain; torch's square product, the other ceiling
 * the benchmark measures, is a library's rate and our own products run past it on some CPUs.
 *
 * Each kind takes the widest instructions the kernels of this library use here (the
 * ATEN_CPU_CAPABILITY hold included, astrai_gemv_isa): float32 FMAs; bfloat16 dot products
 * where the CPU has them, else float32 FMAs (bfloat16 weights are widened and multiplied as
 * float32 there); int8 dot products into 32-bit sums (VNNI), on AVX2 the multiply-add of byte
 * pairs the integer kernels start from (vpmaddubsw, an upper bound: their sums need more). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "vector_math.h" /* AVX2 */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

int astrai_gemv_isa(void);
int astrai_float_gemv_isa(void);

/* `steps` x CHAINS instructions `r = op(r, a, b)` on CHAINS accumulators starting at `first`:
 * more independent chains than an instruction's latency x the pipes that issue it. The empty
 * asm says each accumulator is read and changed after every step, so none is merged with
 * another, dropped, or kept anywhere but in a register. */
#define CHAINS 12
#define CHAINED(type, first, op, a, b)                                                          \
    type r0 = first, r1 = first, r2 = first, r3 = first, r4 = first, r5 = first, r6 = first,   \
         r7 = first, r8 = first, r9 = first, r10 = first, r11 = first;                          \
    for (int64_t s = 0; s < steps; s++) {                                                       \
        r0 = op(r0, a, b), r1 = op(r1, a, b), r2 = op(r2, a, b), r3 = op(r3, a, b);             \
        r4 = op(r4, a, b), r5 = op(r5, a, b), r6 = op(r6, a, b), r7 = op(r7, a, b);             \
        r8 = op(r8, a, b), r9 = op(r9, a, b), r10 = op(r10, a, b), r11 = op(r11, a, b);         \
        __asm__ volatile("" : "+x"(r0), "+x"(r1), "+x"(r2), "+x"(r3), "+x"(r4), "+x"(r5),        \
                         "+x"(r6), "+x"(r7), "+x"(r8), "+x"(r9), "+x"(r10), "+x"(r11));         \
    }

AVX2 static void fma8(int64_t steps) {
    __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    CHAINED(__m256, b, _mm256_fmadd_ps, a, b)
}

AVX512 static void fma16(int64_t steps) {
    __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    CHAINED(__m512, b, _mm512_fmadd_ps, a, b)
}

AVX512BF16 static void bf16_dot(int64_t steps) {
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);
    CHAINED(__m512, _mm512_set1_ps(1.0f), _mm512_dpbf16_ps, a, b)
}

#define maddubs(r, a, b) _mm256_maddubs_epi16(r, a)
AVX2 static void byte_pairs(int64_t steps) {
    __m256i a = _mm256_set1_epi8(3);
    CHAINED(__m256i, a, maddubs, a, a)
}

AVX512 static void vnni(int64_t steps) {
    __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(3);
    CHAINED(__m512i, a, _mm512_dpbusd_epi32, a, b)
}

/* Runs `steps` steps of `kind` (0 float32, 1 bfloat16, 2 int8) on each of `threads` threads
 * and returns the operations done, a multiply-add counted as two; 0 where the kernels do not
 * run here. */
double astrai_arithmetic_peak(int kind, int64_t steps, int threads) {
    int isa = astrai_gemv_isa(), wide = isa >= 2;
    int bf16 = kind == 1 && astrai_float_gemv_isa() >= 3;
    if (isa < 1 || kind < 0 || kind > 2 || steps < 1)
        return 0;
    void (*path)(int64_t) = kind == 2 ? (wide ? vnni : byte_pairs)
                            : bf16    ? bf16_dot
                                      : (wide ? fma16 : fma8);
    double per_instruction = kind == 2 ? (wide ? 128 : 64) : bf16 ? 64 : (wide ? 32 : 16);
    int ran = 0;
#pragma omp parallel num_threads(threads) reduction(+ : ran)
    {
        path(steps);
        ran += 1;
    }
    return per_instruction * CHAINS * (double)steps * ran;
}
