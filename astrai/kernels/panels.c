/* Products y = x @ W.T of float32 or bfloat16 weights laid out in panels of 16 output rows:
 * float32 [out / 16][in][16], bfloat16 [out / 16][in / 2][16][2] (each input pair side by side,
 * as vdpbf16ps takes them), the last panel padded with zero rows. A load of weights (16
 * outputs of one input, or of a pair) is multiplied into up to 16 activation rows, each input
 * broadcast to every lane, so each output sums in its own lane, in input order: no lane sums,
 * and a row's outputs have the same bits whatever rows share the call.
 *
 * Against float_gemv.c's kernel, which multiplies rows of W [out, in] as torch holds them by
 * activation rows in dot products, this reads far fewer bytes from the caches a product: one
 * vector of weights and 16 broadcast words for 16 products, where a dot product block reads a
 * vector of weights or activations for every 2.4. On a 2-core AMD Zen 5, the 1B shape's
 * bfloat16 matrices streamed from memory at 16 rows: 745-790 GFLOP/s (45-49 GB/s) against the
 * dot products' 460-540 and oneDNN's packed layout's 500-530; at 64 rows 920-1000 against
 * oneDNN's 890-900; at one row as fast as the dot products (the memory's speed); at 512 rows
 * 0.88-0.93x oneDNN's. float32 alike: 1.3-1.4x oneDNN at 16 rows, 1.04-1.1x at 64.
 *
 * Layouts: x [rows][in] and y [rows][out] float32, or bfloat16 both (bfloat16 weights only;
 * float32 activations are rounded to bfloat16 once a call for bfloat16 weights, as a bfloat16
 * model's already are). in a multiple of 16. AVX-512 (float32) and AVX-512 BF16 (bfloat16),
 * else AVX2 + FMA (below). Panels are split over the OpenMP threads of torch's libgomp, each
 * thread one contiguous range, read as one stream. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define AVX512F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define PANEL 16 /* output rows a panel holds: one vector's lanes */
#define BLOCK 16 /* activation rows a pass takes: 16 accumulators and their 16 broadcasts */
/* At more than one row the weights are asked for this far ahead, into L2. Asked into L1 16 KiB
 * ahead (with the hardware's prefetchers alone a Zen 5 read 0.6x as fast), an AMD Zen 4, whose
 * L1 holds 32 KiB to Zen 5's 48, ran the 1B shape's layers at 16 rows 0.85x (float32) and 0.78x
 * (bfloat16) as fast (docs/inference.md, "Float weights in panels", has the figures). At one
 * row, where a pass is as fast as memory alone, asking slowed it (Zen 5: 47 against 51 GB/s). */
#define AHEAD 32768
/* Many rows (a prompt) are taken a group of blocks at a time, all panels for each group: the
 * group's activation words (at most this many bytes) stay in L2 while the panels stream by,
 * where all the rows' words, read again for every panel, would come from memory. */
#define GROUP_BYTES (256 << 10)

/* The activation rows of one pass, [inputs][rows] words (a float32 input, or a pair of
 * bfloat16 inputs): each step of a pass reads its rows' words from one cache line at most. */
typedef uint32_t Word;

/* y[r][0..16) for r < R (a partial last panel: its first `width` lanes) from one panel w and
 * the pass's words xs, `steps` words a row; y float32 (bfloat16 weights: or, where `narrow`,
 * bfloat16, rounded as torch rounds). */
AVX512F INLINE void pass_f32(const Word *xs, int steps, const float *w, void *y, int out,
                             int width, int narrow, const int R) {
    (void)narrow; /* float32 weights: float32 outputs */
    __m512 acc[BLOCK];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < steps; k++) {
        __m512 wv = _mm512_loadu_ps(w + (size_t)k * PANEL);
        if (R > 1)
            _mm_prefetch((const char *)(w + (size_t)k * PANEL) + AHEAD, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32((int)xs[(size_t)k * R + r]));
            acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
        }
    }
    __mmask16 lanes = (__mmask16)((1u << width) - 1);
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps((float *)y + (size_t)r * out, lanes, acc[r]);
}

AVX512BF16 INLINE void pass_bf16(const Word *xs, int steps, const uint16_t *w, void *y, int out,
                                 int width, int narrow, const int R) {
    __m512 acc[BLOCK];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < steps; k++) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (size_t)k * 2 * PANEL);
        if (R > 1)
            _mm_prefetch((const char *)(w + (size_t)k * 2 * PANEL) + AHEAD, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xs[(size_t)k * R + r]);
            acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
        }
    }
    __mmask16 lanes = (__mmask16)((1u << width) - 1);
    for (int r = 0; r < R; r++)
        if (narrow)
            _mm256_mask_storeu_epi16((uint16_t *)y + (size_t)r * out, lanes,
                                     (__m256i)_mm512_cvtneps_pbh(acc[r]));
        else
            _mm512_mask_storeu_ps((float *)y + (size_t)r * out, lanes, acc[r]);
}

/* AVX2 (16 vector registers): a panel's 16 outputs in two vectors of 8, up to SMALL_BLOCK rows a
 * pass. bfloat16 weights are widened in registers: a 32-bit lane holds an output's pair of
 * weights, the first input's the low half (the lane shifted left 16 is its float32) and the
 * second's the high half (the lane with its low half cleared); the activations' words alike.
 * Six float32 rows: 12 accumulators, 2 weight vectors and a broadcast (against five, a 1B
 * layer's matrices at 16 rows 1.15-1.25x on an AMD Zen 4 held to AVX2: docs/inference.md);
 * five bfloat16 rows: 10 accumulators, 4 widened weight vectors and 2 broadcasts (six spilled:
 * 0.7x). The outputs go through a row of scratch, which takes a partial panel and bfloat16
 * outputs. */
#define SMALL_BLOCK 6      /* float32 weights */
#define SMALL_BLOCK_BF16 5 /* bfloat16 weights */

AVX2 INLINE void store_row(const float *sums, void *y, int width, int narrow) {
    if (!narrow) {
        memcpy(y, sums, sizeof(float) * width);
        return;
    }
    uint16_t bits[PANEL];
    store8(bits, 1, 0, _mm256_loadu_ps(sums));
    store8(bits, 1, 8, _mm256_loadu_ps(sums + 8));
    memcpy(y, bits, sizeof(uint16_t) * width);
}

AVX2 INLINE __m256 low_halves(__m256i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

AVX2 INLINE __m256 high_halves(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

AVX2 INLINE void pass_avx2(const Word *xs, int steps, const void *w, int bf16, void *y, int out,
                           int width, int narrow, const int R) {
    __m256 lo[SMALL_BLOCK], hi[SMALL_BLOCK];
    for (int r = 0; r < R; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int k = 0; k < steps; k++) {
        const char *at = (const char *)w + (size_t)k * PANEL * 4; /* a step: 64 bytes either way */
        if (R > 1)
            _mm_prefetch(at + AHEAD, _MM_HINT_T1);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)at);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(at + 32));
        if (!bf16) {
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_castsi256_ps(_mm256_set1_epi32((int)xs[(size_t)k * R + r]));
                lo[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(w0), xv, lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(w1), xv, hi[r]);
            }
            continue;
        }
        __m256 first0 = low_halves(w0), second0 = high_halves(w0);
        __m256 first1 = low_halves(w1), second1 = high_halves(w1);
        for (int r = 0; r < R; r++) {
            __m256i word = _mm256_set1_epi32((int)xs[(size_t)k * R + r]);
            __m256 first = low_halves(word), second = high_halves(word);
            lo[r] = _mm256_fmadd_ps(second0, second, _mm256_fmadd_ps(first0, first, lo[r]));
            hi[r] = _mm256_fmadd_ps(second1, second, _mm256_fmadd_ps(first1, first, hi[r]));
        }
    }
    size_t bytes = narrow ? 2 : 4;
    for (int r = 0; r < R; r++) {
        float sums[PANEL];
        _mm256_storeu_ps(sums, lo[r]);
        _mm256_storeu_ps(sums + 8, hi[r]);
        store_row(sums, (char *)y + (size_t)r * out * bytes, width, narrow);
    }
}

/* Each pass as a function of its rows R (index R - 1), the constant inlined into each. */
typedef void (*Pass)(const Word *xs, int steps, const void *w, void *y, int out, int width,
                     int narrow);
#define PASS_AS(target, pass, T, R)                                                        \
    target static void pass##_##R(const Word *xs, int steps, const void *w, void *y, int out, \
                                  int width, int narrow) {                                 \
        pass(xs, steps, (const T *)w, y, out, width, narrow, R);                           \
    }
#define PASSES_OF(target, pass, T)                                                        \
    PASS_AS(target, pass, T, 1) PASS_AS(target, pass, T, 2) PASS_AS(target, pass, T, 3)   \
    PASS_AS(target, pass, T, 4) PASS_AS(target, pass, T, 5) PASS_AS(target, pass, T, 6)   \
    PASS_AS(target, pass, T, 7) PASS_AS(target, pass, T, 8) PASS_AS(target, pass, T, 9)   \
    PASS_AS(target, pass, T, 10) PASS_AS(target, pass, T, 11) PASS_AS(target, pass, T, 12) \
    PASS_AS(target, pass, T, 13) PASS_AS(target, pass, T, 14) PASS_AS(target, pass, T, 15) \
    PASS_AS(target, pass, T, 16)
PASSES_OF(AVX512F, pass_f32, float)
PASSES_OF(AVX512BF16, pass_bf16, uint16_t)
#define SMALL_AS(bf16, R)                                                                  \
    AVX2 static void pass_avx2_##bf16##_##R(const Word *xs, int steps, const void *w, void *y, \
                                            int out, int width, int narrow) {               \
        pass_avx2(xs, steps, w, bf16, y, out, width, narrow, R);                            \
    }
#define SMALL_OF(bf16) \
    SMALL_AS(bf16, 1) SMALL_AS(bf16, 2) SMALL_AS(bf16, 3) SMALL_AS(bf16, 4) SMALL_AS(bf16, 5)
SMALL_OF(0)
SMALL_AS(0, 6)
SMALL_OF(1)
#define ALL(p) {p##_1, p##_2, p##_3, p##_4, p##_5, p##_6, p##_7, p##_8, p##_9, p##_10, p##_11, \
                p##_12, p##_13, p##_14, p##_15, p##_16}
static const Pass PASSES[2][BLOCK] = {ALL(pass_f32), ALL(pass_bf16)};
static const Pass SMALL_PASSES[2][SMALL_BLOCK] = {
    {pass_avx2_0_1, pass_avx2_0_2, pass_avx2_0_3, pass_avx2_0_4, pass_avx2_0_5, pass_avx2_0_6},
    {pass_avx2_1_1, pass_avx2_1_2, pass_avx2_1_3, pass_avx2_1_4, pass_avx2_1_5},
};

/* x's n rows [steps][n] words, a block of a pass (at most BLOCK rows): float32
 * inputs as they are, or pairs of them rounded to bfloat16 (ties to even, as torch rounds). */
AVX512BF16 static void words_bf16(const float *x, int n, int in, Word *out) {
    for (int r = 0; r < n; r++)
        for (int i = 0; i < in; i += 16) {
            __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + (size_t)r * in + i));
            uint32_t pairs[8];
            _mm256_storeu_si256((__m256i *)pairs, (__m256i)h);
            for (int j = 0; j < 8; j++)
                out[(size_t)(i / 2 + j) * n + r] = pairs[j];
        }
}

/* words_bf16 with AVX2's rounding (round_bf16: the same, ties to even) */
AVX2 static void words_bf16_avx2(const float *x, int n, int in, Word *out) {
    for (int r = 0; r < n; r++)
        for (int i = 0; i < in; i += 8) {
            uint32_t bits[8];
            __m256 rounded = round_bf16(_mm256_loadu_ps(x + (size_t)r * in + i));
            _mm256_storeu_si256((__m256i *)bits, _mm256_castps_si256(rounded));
            for (int j = 0; j < 4; j++) /* the first input's bits low, the second's high */
                out[(size_t)(i / 2 + j) * n + r] =
                    bits[2 * j] >> 16 | (bits[2 * j + 1] & 0xffff0000u);
        }
}

/* the same where x's rows already are words, `row_words` a row: float32 inputs, or pairs of
 * bfloat16 ones */
static void words_as_they_are(const void *x, int n, int row_words, Word *out) {
    for (int r = 0; r < n; r++)
        for (int k = 0; k < row_words; k++)
            memcpy(out + (size_t)k * n + r, (const Word *)x + (size_t)r * row_words + k,
                   sizeof(Word));
}

int astrai_float_gemv_isa(void);

/* x [rows][in] and y [rows][out] float32, or with bfloat16 weights and `io_bf16` both
 * bfloat16 (a bfloat16 model's prompt: no float32 copies of its activations and outputs).
 * 0, or -1: a shape it does not take (in not a multiple of 16; bfloat16 io with float32
 * weights), -2: out of memory, -3: the instructions it needs are missing here (AVX2 + FMA at
 * least). */
int astrai_panel_product(const void *x, int rows, int in, const void *w, int out, int bf16,
                         void *y, int threads, int io_bf16) {
    if (in < 16 || in % 16 || rows < 1 || out < 1 || (io_bf16 && !bf16))
        return -1;
    int isa = astrai_float_gemv_isa(), wide = isa >= (bf16 ? 3 : 2);
    if (isa < 1)
        return -3;
    int most = wide ? BLOCK : bf16 ? SMALL_BLOCK_BF16 : SMALL_BLOCK; /* rows a pass takes */
    const Pass *passes = wide ? PASSES[bf16] : SMALL_PASSES[bf16];
    int blocks = (rows + most - 1) / most, steps = bf16 ? in / 2 : in;
    size_t block_words = (size_t)most * steps;
    Word *words = malloc(sizeof(Word) * blocks * block_words);
    if (!words)
        return -2;
    int panels = (out + PANEL - 1) / PANEL;
    size_t panel_bytes = (size_t)PANEL * in * (bf16 ? 2 : 4), y_bytes = io_bf16 ? 2 : 4;
    int group = GROUP_BYTES / (sizeof(Word) * block_words);
    group = group < 1 ? 1 : group;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        for (int b = t; b < blocks; b += n) {
            int r = rows * b / blocks, m = rows * (b + 1) / blocks - r;
            Word *block = words + b * block_words;
            if (io_bf16 || !bf16) /* a row of steps words as it is */
                words_as_they_are((const Word *)x + (size_t)r * steps, m, steps, block);
            else
                (wide ? words_bf16 : words_bf16_avx2)((const float *)x + (size_t)r * in, m, in,
                                                      block);
        }
#pragma omp barrier
        int lo = (int)((int64_t)panels * t / n), hi = (int)((int64_t)panels * (t + 1) / n);
        for (int first = 0; first < blocks; first += group) {
            int last = first + group < blocks ? first + group : blocks;
            for (int p = lo; p < hi; p++) {
                const char *panel = (const char *)w + p * panel_bytes;
                int width = out - p * PANEL < PANEL ? out - p * PANEL : PANEL;
                for (int b = first; b < last; b++) {
                    int r = rows * b / blocks, m = rows * (b + 1) / blocks - r;
                    char *at = (char *)y + ((size_t)r * out + p * PANEL) * y_bytes;
                    passes[m - 1](words + b * block_words, steps, panel, at, out, width, io_bf16);
                }
            }
        }
    }
    free(words);
    return 0;
}
