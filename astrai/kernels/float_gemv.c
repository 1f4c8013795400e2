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
 * [rows][out]. in must be a multiple of 16. Four paths, picked at run time: for bfloat16
 * weights AMX tiles (amx.c, from five rows) and AVX-512 BF16 (vdpbf16ps; both round the
 * activations to bfloat16 once a call, as a bfloat16 model's already are, and sum the products
 * in float32; in a multiple of 32), AVX-512 (16 lanes, bfloat16 weights widened to float32;
 * up to six activation rows a pass: 24 accumulators) and AVX2 + FMA (8 lanes, three rows).
 * Output rows are split over the OpenMP threads of torch's libgomp, each thread one contiguous
 * range. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define AVX512F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define TILE 4 /* weight rows a pass reads */
#define ROWS 6  /* activation rows an AVX-512 pass takes: 24 accumulators, 4 weights, 1 input */
/* Each load of a pass asks for the same place in the next pass's rows (prefetch): at 1-4
 * activation rows of bfloat16 weights on a 2-core Intel Xeon a step over a 0.5B shape read them
 * 12-21% faster into L2 (one row 38 -> 33.5 ms, four 44.7 -> 35.1), float32 ones 12% at four
 * rows and as fast at one. At more than one row the next pass's rows are asked into L1, where
 * every block of activation rows reads them again: on a 2-core AMD Zen 5 the 0.5B shapes'
 * float32 matrices at 16 rows 1.05-1.2x as fast as into L2, bfloat16 ones by dot products
 * 1.05-1.15x at 4 and 16. At one row it depends on the CPU: on the AMD Zen 5 the matrices read
 * 1.10-1.35x as fast without asking in float32 and 1.07-1.14x in bfloat16 (a float32
 * decode_step 1.06x), the hardware's prefetchers keeping up alone; whether a pass at one row
 * asks is timed per machine (astrai_ahead_at_one_row, gemv.c), into L2 as measured. */
#define AHEAD(R) ((R) > 1 ? _MM_HINT_T0 : _MM_HINT_T1)

AVX512F INLINE __m512 load16(const void *w, int bf16, size_t i) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)w + i);
    __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* the sums of the lanes of a, b, c and d, in that order: the four at once, halving and adding
 * across them, in 13 instructions where four reductions take 32 */
AVX512F INLINE __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), high);
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* y[r][o + t * stride], the sum of acc[r][t]'s lanes, for R rows and T weight rows (1 or
 * TILE). One weight row's sums are added in the same order as four's, so that an output has
 * the same bits whichever pass reads its row (the threads' ranges move with the rows' count). */
AVX512F INLINE void store_sums(__m512 acc[][TILE], const int R, const int T, float *y, int out,
                               int o, int stride) {
    for (int r = 0; r < R; r++) {
        float sums[TILE], *row = y + (size_t)r * out + o;
        const __m512 *a = acc[r];
        _mm_storeu_ps(sums, T == 1 ? sum_lanes4(a[0], a[0], a[0], a[0])
                                   : sum_lanes4(a[0], a[1], a[2], a[3]));
        for (int t = 0; t < T; t++)
            row[t * stride] = sums[t];
    }
}

/* y[r][o + t * stride] for R activation rows and T weight rows `stride` apart from o: constants
 * once inlined, so that the accumulators stay in registers */
AVX512F INLINE void block512(const void *xs, int in, const void *w, int bf16, int o, int stride,
                             int out, float *y, const int R, const int T) {
    const float *x = xs;
    const int ahead = R > 1 || astrai_ahead_at_one_row[bf16 ? BFLOAT16 : FLOAT32];
    __m512 acc[ROWS][TILE];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 16) {
        __m512 wv[TILE];
        for (int t = 0; t < T; t++) {
            wv[t] = load16(w, bf16, (size_t)(o + t * stride) * in + i);
            if (ahead) /* the next pass's: see TILE */
                _mm_prefetch(
                    (const char *)w + (((size_t)(o + 1 + t * stride) * in + i) << (2 - bf16)),
                    AHEAD(R));
        }
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)r * in + i);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_fmadd_ps(wv[t], xv, acc[r][t]);
        }
    }
    store_sums(acc, R, T, y, out, o, stride);
}

/* block512 for bfloat16 weights and activations, 32 inputs a vector, pairs summed by vdpbf16ps */
AVX512BF16 INLINE void block_dot(const void *xs, int in, const void *ws, int bf16, int o,
                                 int stride, int out, float *y, const int R, const int T) {
    const uint16_t *x = xs, *w = ws;
    const int ahead = R > 1 || astrai_ahead_at_one_row[BFLOAT16];
    __m512 acc[ROWS][TILE];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 32) {
        __m512bh wv[TILE];
        for (int t = 0; t < T; t++) {
            wv[t] = (__m512bh)_mm512_loadu_si512(w + (size_t)(o + t * stride) * in + i);
            if (ahead)
                _mm_prefetch((const char *)(w + (size_t)(o + 1 + t * stride) * in + i),
                             AHEAD(R));
        }
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)r * in + i);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], xv);
        }
    }
    store_sums(acc, R, T, y, out, o, stride);
}

/* AVX2 has 16 vector registers: three rows' 12 accumulators, the three activation vectors and
 * one weight vector at a time fill them exactly (all four weight vectors at once spilled an
 * accumulator to the stack). Against two rows a pass, the 0.5B shape's matrices on a 2-core AMD
 * Zen 4 held to AVX2: 16 rows 113 -> 134 GFLOP/s, 64 rows 138 -> 170. */
AVX2 INLINE void block256(const void *xs, int in, const void *w, int bf16, int o, int stride,
                          int out, float *y, const int R, const int T) {
    const float *x = xs;
    __m256 acc[3][TILE];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int i = 0; i < in; i += 8) {
        __m256 xv[3];
        for (int r = 0; r < R; r++)
            xv[r] = _mm256_loadu_ps(x + (size_t)r * in + i);
        for (int t = 0; t < T; t++) {
            __m256 wv = load8(w, bf16, (size_t)(o + t * stride) * in + i);
            for (int r = 0; r < R; r++)
                acc[r][t] = _mm256_fmadd_ps(wv, xv[r], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)r * out + o + t * stride] = sum8(acc[r][t]);
}

/* Each path's blocks as functions of R (index R - 1) and T (index 0: one weight row, 1: TILE),
 * the constants inlined into each. */
typedef void (*Block)(const void *x, int in, const void *w, int bf16, int o, int stride, int out,
                      float *y);
#define BLOCK_AS(target, block, R, T)                                                           \
    target static void block##_##R##_##T(const void *x, int in, const void *w, int bf16, int o, \
                                         int stride, int out, float *y) {                       \
        block(x, in, w, bf16, o, stride, out, y, R, T);                                         \
    }
#define BLOCKS_OF(target, block, T)                                                             \
    BLOCK_AS(target, block, 1, T) BLOCK_AS(target, block, 2, T) BLOCK_AS(target, block, 3, T)   \
    BLOCK_AS(target, block, 4, T) BLOCK_AS(target, block, 5, T) BLOCK_AS(target, block, 6, T)
BLOCKS_OF(AVX512F, block512, 1)
BLOCKS_OF(AVX512F, block512, 4)
BLOCKS_OF(AVX512BF16, block_dot, 1)
BLOCKS_OF(AVX512BF16, block_dot, 4)
BLOCK_AS(AVX2, block256, 1, 1)
BLOCK_AS(AVX2, block256, 2, 1)
BLOCK_AS(AVX2, block256, 3, 1)
BLOCK_AS(AVX2, block256, 1, 4)
BLOCK_AS(AVX2, block256, 2, 4)
BLOCK_AS(AVX2, block256, 3, 4)

typedef struct {
    Block blocks[2][ROWS];
    int rows;         /* activation rows a block takes at most */
    size_t row_bytes; /* per input of an activation row: float32 or bfloat16 */
} Path;

static const Path PATHS[4] = {
    [1] = {{{block256_1_1, block256_2_1, block256_3_1}, {block256_1_4, block256_2_4, block256_3_4}},
           3,
           sizeof(float)},
    [2] = {{{block512_1_1, block512_2_1, block512_3_1, block512_4_1, block512_5_1, block512_6_1},
            {block512_1_4, block512_2_4, block512_3_4, block512_4_4, block512_5_4, block512_6_4}},
           ROWS,
           sizeof(float)},
    [3] = {{{block_dot_1_1, block_dot_2_1, block_dot_3_1, block_dot_4_1, block_dot_5_1,
             block_dot_6_1},
            {block_dot_1_4, block_dot_2_4, block_dot_3_4, block_dot_4_4, block_dot_5_4,
             block_dot_6_4}},
           ROWS,
           sizeof(uint16_t)},
};

/* Output rows lo..hi-1 for all activation rows. A pass reads TILE weight rows a quarter of
 * the range apart, so the range is read as TILE sequential streams: rows side by side read
 * short rows (896 bfloat16 inputs) at 23-25 GB/s on a 2-core Intel Xeon, rows apart at 29-30,
 * what reading alone reaches. Each pass's weight rows come once from memory, again from the
 * caches for each further block of activation rows. */
static void range(const Path *path, const void *x, int rows, int in, const void *w, int bf16,
                  int lo, int hi, int out, float *y) {
    int span = (hi - lo) / TILE; /* rows each stream reads; the last (hi - lo) % TILE alone */
    int blocks = (rows + path->rows - 1) / path->rows; /* of activation rows, as even as can be */
    for (int o = lo; o < hi; o++) {
        int whole = o < lo + span;
        if (!whole && o < lo + TILE * span)
            continue; /* read by the passes of lo..lo + span - 1 */
        for (int b = 0; b < blocks; b++) {
            int r = rows * b / blocks, n = rows * (b + 1) / blocks - r;
            const char *xr = (const char *)x + (size_t)r * in * path->row_bytes;
            path->blocks[whole][n - 1](xr, in, w, bf16, o, span, out, y + (size_t)r * out);
        }
    }
}

/* x [n] rounded to bfloat16 bits (n a multiple of 32) */
AVX512BF16 static void round_activations(const float *x, size_t n, uint16_t *out) {
    for (size_t i = 0; i < n; i += 32) {
        __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i, (__m512i)pair);
    }
}

int astrai_gemv_isa(void);
int astrai_amx_usable(void);
int astrai_amx_bf16_product(const float *x, int rows, int in, const uint16_t *w, int whole,
                            int out, float *y, int threads);

/* The paths this CPU runs: 1 AVX2, 2 AVX-512, 3 AVX-512 with BF16 dot products, 4 that and AMX
 * tiles (amx.c). */
int astrai_float_gemv_isa(void) {
    int best = astrai_gemv_isa();
    if (best < 2 || !__builtin_cpu_supports("avx512bf16"))
        return best;
    return astrai_amx_usable() ? 4 : 3;
}

/* 0, or -1: in is not a multiple of 16, -2: out of memory, -3: the path asked for is missing
 * here (isa 0: the best here; 1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX, the last two for
 * bfloat16 weights with in a multiple of 32, else the best of the others). The AMX path takes
 * the outputs in whole tiles of 16, the dot products the rest. */
int astrai_float_gemv(const float *x, int rows, int in, const void *w, int out, int bf16,
                      float *y, int threads, int isa) {
    if (in < 16 || in % 16 || rows < 1 || out < 1)
        return -1;
    int best = astrai_float_gemv_isa();
    /* up to 4 rows the dot products read the weights faster (a 0.5B shape's bfloat16 step on a
     * 2-core Intel Xeon, 1 / 2 / 4 / 8 / 16 rows: 33.5 / 35.1 / 36.7 / 47.4 / 83.3 ms, on AMX 40.1
     * / 39.4 / 39.7 / 39.9 / 40.8): AMX's tiles are a quarter used or less there */
    isa = isa ? isa : best == 4 && rows <= 4 ? 3 : best;
    if (isa > best || isa < 1)
        return -3;
    if (isa >= 3 && (!bf16 || in % 32))
        isa = 2;
    int first = 0; /* outputs before it are done */
    if (isa == 4) {
        first = out / 16 * 16;
        if (first && astrai_amx_bf16_product(x, rows, in, w, first, out, y, threads))
            return -2;
        if (first == out)
            return 0;
        isa = 3;
    }
    uint16_t *rounded = NULL;
    if (isa == 3) {
        if (!(rounded = malloc(sizeof(uint16_t) * (size_t)rows * in)))
            return -2;
        round_activations(x, (size_t)rows * in, rounded);
    }
    int left = out - first, tiles = (left + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads < tiles ? threads : tiles)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int lo = first + (int)((int64_t)left * t / n);
        int hi = first + (int)((int64_t)left * (t + 1) / n);
        range(&PATHS[isa], isa == 3 ? (const void *)rounded : x, rows, in, w, bf16, lo, hi, out, y);
    }
    free(rounded);
    return 0;
}
