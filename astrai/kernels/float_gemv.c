/* Few-row products y = x @ W.T of float32 or bfloat16 weights kept [out, in] as torch holds
 * them: the weights are streamed from memory once per call whatever the number of rows, four
 * weight rows at a time, each loaded vector multiplied into every activation row.
 *
 * At one row torch's general products read a 0.5B-shaped model's float32 weights at 20-25
 * GB/s on a 2-core Intel Xeon (oneDNN's packed layout ~20, MKL's GEMV ~24) and at 4-16 rows
 * re-read them per row block (8-13 GB/s); this read them at 21-29 GB/s at one row and matched
 * oneDNN's packed layout at 4 and 16 (measured by prepare_params' layout timing, which keeps
 * whichever wins here).
 *
 * Layouts: x float32 [rows][in]; w [out][in], float32 or bfloat16 bits (`bf16`); y float32
 * [rows][out]. in must be a multiple of 16. Two paths, picked at run time: AVX-512 (16 lanes,
 * four activation rows a pass: 16 accumulators) and AVX2 + FMA (8 lanes, two rows). Output
 * rows are split over the OpenMP threads of torch's libgomp, each thread one contiguous range:
 * one stream for the prefetcher. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "vector_math.h"

#define AVX512F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TILE 4 /* weight rows a pass reads */

AVX512F INLINE __m512 load16(const void *w, int bf16, size_t i) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)w + i);
    __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* y[r][o + t] for R activation rows and T weight rows from o: constants once inlined, so that
 * the accumulators stay in registers */
AVX512F INLINE void block512(const float *x, int in, const void *w, int bf16, int o, int out,
                             float *y, const int R, const int T) {
    __m512 acc[4][TILE];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 16) {
        __m512 wv[TILE];
        for (int t = 0; t < T; t++)
            wv[t] = load16(w, bf16, (size_t)(o + t) * in + i);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)r * in + i);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_fmadd_ps(wv[t], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)r * out + o + t] = _mm512_reduce_add_ps(acc[r][t]);
}

AVX2 INLINE void block256(const float *x, int in, const void *w, int bf16, int o, int out,
                          float *y, const int R, const int T) {
    __m256 acc[2][TILE];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int i = 0; i < in; i += 8) {
        __m256 wv[TILE];
        for (int t = 0; t < T; t++)
            wv[t] = load8(w, bf16, (size_t)(o + t) * in + i);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * in + i);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm256_fmadd_ps(wv[t], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)r * out + o + t] = sum8(acc[r][t]);
}

/* Output rows lo..hi-1 for all activation rows: each tile of weight rows once from memory,
 * again from the caches for each further block of activation rows. */
AVX512F static void range512(const float *x, int rows, int in, const void *w, int bf16, int lo,
                             int hi, int out, float *y) {
    for (int o = lo; o < hi; o += TILE) {
        int whole = o + TILE <= hi;
        for (int r = 0; r < rows; r += 4) {
            const float *xr = x + (size_t)r * in;
            float *yr = y + (size_t)r * out;
            int n = rows - r < 4 ? rows - r : 4;
            for (int t = 0; t < (whole ? 1 : hi - o); t++) {
                int at = o + t;
                if (whole)
                    switch (n) {
                    case 1: block512(xr, in, w, bf16, at, out, yr, 1, TILE); break;
                    case 2: block512(xr, in, w, bf16, at, out, yr, 2, TILE); break;
                    case 3: block512(xr, in, w, bf16, at, out, yr, 3, TILE); break;
                    default: block512(xr, in, w, bf16, at, out, yr, 4, TILE);
                    }
                else
                    switch (n) {
                    case 1: block512(xr, in, w, bf16, at, out, yr, 1, 1); break;
                    case 2: block512(xr, in, w, bf16, at, out, yr, 2, 1); break;
                    case 3: block512(xr, in, w, bf16, at, out, yr, 3, 1); break;
                    default: block512(xr, in, w, bf16, at, out, yr, 4, 1);
                    }
            }
        }
    }
}

AVX2 static void range256(const float *x, int rows, int in, const void *w, int bf16, int lo,
                          int hi, int out, float *y) {
    for (int o = lo; o < hi; o += TILE) {
        int whole = o + TILE <= hi;
        for (int r = 0; r < rows; r += 2) {
            const float *xr = x + (size_t)r * in;
            float *yr = y + (size_t)r * out;
            int two = rows - r >= 2;
            for (int t = 0; t < (whole ? 1 : hi - o); t++) {
                int at = o + t;
                if (whole && two)
                    block256(xr, in, w, bf16, at, out, yr, 2, TILE);
                else if (whole)
                    block256(xr, in, w, bf16, at, out, yr, 1, TILE);
                else if (two)
                    block256(xr, in, w, bf16, at, out, yr, 2, 1);
                else
                    block256(xr, in, w, bf16, at, out, yr, 1, 1);
            }
        }
    }
}

int astrai_gemv_isa(void);

/* 0, or -1: in is not a multiple of 16, -3: the instruction set asked for is missing here
 * (isa 0: the best here, 1: AVX2, 2: AVX-512). */
int astrai_float_gemv(const float *x, int rows, int in, const void *w, int out, int bf16,
                      float *y, int threads, int isa) {
    if (in < 16 || in % 16 || rows < 1 || out < 1)
        return -1;
    int best = astrai_gemv_isa();
    isa = isa ? isa : best;
    if (isa > best || isa < 1)
        return -3;
    int tiles = (out + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads < tiles ? threads : tiles)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int lo = (int)((int64_t)tiles * t / n) * TILE, hi = (int)((int64_t)tiles * (t + 1) / n) * TILE;
        hi = hi < out ? hi : out;
        if (isa == 2)
            range512(x, rows, in, w, bf16, lo, hi, out, y);
        else
            range256(x, rows, in, w, bf16, lo, hi, out, y);
    }
    return 0;
}
