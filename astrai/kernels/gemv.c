/* Few-row products y = x @ W.T that stream W once: 4-bit and 8-bit weights times activations
 * quantized to int8 on each call (the way llama.cpp's Q4_0 x Q8_0 dot works), a step per block
 * of 32 inputs, or per group for 4-bit weights in groups of 128.
 *
 * Built by astrai/kernels/build.py with the system C compiler and loaded with ctypes: no torch
 * headers, so it compiles in seconds. Two paths, picked at run time: AVX-512 VNNI (vpdpbusd)
 * and AVX2 (vpmaddubsw + vpmaddwd). Rows of W are split across the OpenMP threads of the
 * libgomp torch itself loads, so there is one thread pool in the process. The layouts and the
 * activations: quantized.h. */
#include "quantized.h"

/* How far ahead a pass over many rows asks for weights into L2 (bytes) */
#define FAR 16384

/* Whether a pass at one activation row asks for the weights ahead in software, per product kind
 * (vector_math.h). Past one row a pass runs behind the memory and the asks pay (below); at one
 * row the hardware's prefetchers may keep up alone, and which way is faster differs by CPU and
 * path: on a 2-core AMD Zen 5 without them a 0.5B int4 decode_step ran 1.02-1.04x as fast
 * (held to AVX2 1.09x), an int8 one 1.03-1.04x (held to AVX2 0.98x: that pass keeps asking),
 * float32 weights read 1.10-1.35x as fast and bfloat16 ones 1.07-1.14x, where on a 2-core
 * Intel Xeon the float pass's ask read a step's bfloat16 weights 13% faster. So the float
 * kinds' is timed once a process as the weights are prepared (astrai/infer/ahead.py) and set
 * here, where one way leads by a margin; the 4- and 8-bit passes keep theirs (a few percent
 * either way, which a short timing did not tell apart on that AMD). The values are the same
 * either way. */
int astrai_ahead_at_one_row[4] = {[FLOAT32] = 1, [BFLOAT16] = 1, [INT8] = 0, [INT4] = 0};

/* kind's setting: set to `on` first unless it is negative */
int astrai_one_row_ahead(int kind, int on) {
    if (kind < 0 || kind > 3) return -1;
    if (on >= 0) astrai_ahead_at_one_row[kind] = on != 0;
    return astrai_ahead_at_one_row[kind];
}

/* ---------------------------------------------------------------- 4-bit weights, AVX-512 VNNI */

/* acc += the 4-byte dots of w (unsigned) with the 4 signed bytes at p, broadcast from memory:
 * one instruction (gcc 12 copies the accumulator around the intrinsic: see gemm.c) */
#define DOT_BROADCAST(acc, w, p)                                                             \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))

/* Column block `column` (16 weight rows) times NX activation rows from x0, groups of G: y's
 * 16 outputs of each row in one vector. Each line of 8 inputs x 16 rows unpacks by two masks,
 * the low nibbles (inputs 0-3) as they are and the high ones (4-7) as 16 times their value,
 * into two vpdpbusd with the row's 4-byte inputs broadcast; a step's (quantized.h) integer
 * sums, low + high / 16 (exact: every high product is a multiple of 16), become float once,
 * times the step and the 16 rows' scales; the zero points' share, (zero - 8 scale) times the
 * row's sum over each group, is added at the end. At one row the sums alternate between two
 * pairs of accumulators, so that consecutive vpdpbusd do not wait on each other; integer sums
 * are exact, so each output is the same bits at any NX, and gemm.c adds the same floats in
 * the same order: the same bits on either road. */
AVX512 INLINE void int4_column512(const uint8_t *nibbles, const uint16_t *scale,
                                  const uint16_t *zero, const Activations *a, float *y, int out,
                                  int column, int x0, const int NX, const int G) {
    const int width = a->width, groups = width / G, octets = width / 8;
    const int block = G > PAIR ? G : BLOCK, blocks = width / block, per_block = block / 8;
    const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8((char)0xf0);
    const int ahead = NX > 1 || astrai_ahead_at_one_row[INT4];
    const uint8_t *line = nibbles + (size_t)column * octets * 64;
    const uint16_t *s16 = scale + (size_t)column * groups * 16;
    const uint16_t *z16 = zero + (size_t)column * groups * 16;
    const int8_t *xq = a->q + (size_t)x0 * width;
    __m512 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i lo[8], hi[8];
        lo[1] = hi[1] = _mm512_setzero_si512(); /* one row's second pair */
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) lo[i] = hi[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int k = 0; k < per_block; k++, line += 64) {
            /* Past one row each line feeds 2 NX vpdpbusd, a pass runs behind the memory and
             * the hardware's prefetchers fall behind: every other line asks L1 for the line
             * 2 KiB ahead and L2 for the one FAR ahead (8 rows 1.07-2.0x, 16 rows
             * 1.28-1.75x; 8 or 32 KiB alike). One row: astrai_ahead_at_one_row. */
            if (ahead && k % 2 == 0) _mm_prefetch((const char *)line + 2048, _MM_HINT_T0);
            if (NX > 1 && k % 2 == 1) _mm_prefetch((const char *)line + FAR, _MM_HINT_T1);
            const __m512i v = _mm512_load_si512(line);
            const __m512i l = _mm512_and_si512(v, low), h = _mm512_and_si512(v, high);
            const int8_t *x = xq + (size_t)b * block + 8 * k;
            if (NX == 1) {
                DOT_BROADCAST(lo[k & 1], l, x);
                DOT_BROADCAST(hi[k & 1], h, x + 4);
                continue;
            }
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) {
                DOT_BROADCAST(lo[i], l, x + (size_t)i * width);
                DOT_BROADCAST(hi[i], h, x + (size_t)i * width + 4);
            }
        }
        if (NX == 1) {
            lo[0] = _mm512_add_epi32(lo[0], lo[1]);
            hi[0] = _mm512_add_epi32(hi[0], hi[1]);
        }
        const __m512 s = load16_bf16(s16 + (size_t)(b * block / G) * 16);
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) {
            const __m512i sum = _mm512_add_epi32(lo[i], _mm512_srai_epi32(hi[i], 4));
            const __m512 step = _mm512_set1_ps(a->step[(size_t)(x0 + i) * blocks + b]);
            const __m512 k = _mm512_mul_ps(step, s);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), k, acc[i]);
        }
    }
    for (int g = 0; g < groups; g++) {
        const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), load16_bf16(s16 + 16 * g),
                                            load16_bf16(z16 + 16 * g));
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++)
            acc[i] = _mm512_fmadd_ps(
                off, _mm512_set1_ps(a->group_sum[(size_t)(x0 + i) * groups + g]), acc[i]);
    }
    const int left = out - 16 * column;
    const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++)
        _mm512_mask_storeu_ps(y + (size_t)(x0 + i) * out + 16 * column, m, acc[i]);
}

/* A thread's column blocks c0..c1, each times every activation row, eight at a time (16
 * integer and 8 float sums beside the unpacked line: 27 of the 32 registers), then the rest. */
#define INT4_COLUMNS512(G)                                                                   \
    AVX512 static void int4_columns512_##G(const uint8_t *n, const uint16_t *s,              \
                                           const uint16_t *z, const Activations *a, float *y, \
                                           int out, int c0, int c1) {                        \
        for (int c = c0; c < c1; c++) {                                                      \
            int x0 = 0;                                                                      \
            for (; a->rows - x0 >= 8; x0 += 8) int4_column512(n, s, z, a, y, out, c, x0, 8, G); \
            switch (a->rows - x0) {                                                          \
            case 7: int4_column512(n, s, z, a, y, out, c, x0, 7, G); break;                  \
            case 6: int4_column512(n, s, z, a, y, out, c, x0, 6, G); break;                  \
            case 5: int4_column512(n, s, z, a, y, out, c, x0, 5, G); break;                  \
            case 4: int4_column512(n, s, z, a, y, out, c, x0, 4, G); break;                  \
            case 3: int4_column512(n, s, z, a, y, out, c, x0, 3, G); break;                  \
            case 2: int4_column512(n, s, z, a, y, out, c, x0, 2, G); break;                  \
            case 1: int4_column512(n, s, z, a, y, out, c, x0, 1, G); break;                  \
            }                                                                                \
        }                                                                                    \
    }
INT4_COLUMNS512(32)
INT4_COLUMNS512(64)
INT4_COLUMNS512(128)

/* ---------------------------------------------------------------- 8-bit weights, AVX-512 VNNI */

/* Column block `column` (16 weight rows, stored w + 128) times NX activation rows from x0:
 * each line of 4 inputs x 16 rows is vpdpbusd's unsigned operand as it lies, against the row's
 * 4 bytes broadcast from memory; a block of 32 inputs' integer sums become float once, times
 * its step; at the end the offset (128 times the row's sum: quantized.h) comes off and the 16
 * rows' scales multiply. At one row the sums alternate between two accumulators, so that
 * consecutive vpdpbusd do not wait on each other; integer sums are exact, so each output is
 * the same bits at any NX. */
AVX512 INLINE void int8_column512(const uint8_t *weight, const float *row_scale,
                                  const Activations *a, float *y, int out, int column, int x0,
                                  const int NX) {
    const int width = a->width, blocks = width / BLOCK;
    const uint8_t *line = weight + (size_t)column * (width / 4) * 64;
    const int8_t *xq = a->q + (size_t)x0 * width;
    const int ahead = NX > 1 || astrai_ahead_at_one_row[INT8];
    __m512 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i dots[8];
        dots[1] = _mm512_setzero_si512(); /* one row's second accumulator */
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) dots[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < BLOCK / 4; k++, line += 64) {
            if (ahead && k % 2 == 1) _mm_prefetch((const char *)line + 8192, _MM_HINT_T1);
            if (ahead && k % 2 == 0) _mm_prefetch((const char *)line + 2048, _MM_HINT_T0);
            const __m512i v = _mm512_load_si512(line);
            const int8_t *x = xq + (size_t)b * BLOCK + 4 * k;
            if (NX == 1) {
                DOT_BROADCAST(dots[k & 1], v, x);
                continue;
            }
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) DOT_BROADCAST(dots[i], v, x + (size_t)i * width);
        }
        if (NX == 1) dots[0] = _mm512_add_epi32(dots[0], dots[1]);
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]),
                                     _mm512_set1_ps(a->step[(size_t)(x0 + i) * blocks + b]),
                                     acc[i]);
    }
    const __m512 scale = _mm512_loadu_ps(row_scale + (size_t)column * 16);
    const int left = out - 16 * column;
    const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        const __m512 sum = _mm512_sub_ps(acc[i], _mm512_set1_ps(a->offset[x0 + i]));
        _mm512_mask_storeu_ps(y + (size_t)(x0 + i) * out + 16 * column, m,
                              _mm512_mul_ps(sum, scale));
    }
}

/* A thread's column blocks c0..c1, each times every activation row, eight at a time. */
AVX512 static void int8_columns512(const uint8_t *w, const float *s, const Activations *a, float *y,
                                   int out, int c0, int c1) {
    for (int c = c0; c < c1; c++) {
        int x0 = 0;
        for (; a->rows - x0 >= 8; x0 += 8) int8_column512(w, s, a, y, out, c, x0, 8);
        switch (a->rows - x0) {
        case 7: int8_column512(w, s, a, y, out, c, x0, 7); break;
        case 6: int8_column512(w, s, a, y, out, c, x0, 6); break;
        case 5: int8_column512(w, s, a, y, out, c, x0, 5); break;
        case 4: int8_column512(w, s, a, y, out, c, x0, 4); break;
        case 3: int8_column512(w, s, a, y, out, c, x0, 3); break;
        case 2: int8_column512(w, s, a, y, out, c, x0, 2); break;
        case 1: int8_column512(w, s, a, y, out, c, x0, 1); break;
        }
    }
}

/* ---------------------------------------------------------------- 4-bit weights, AVX2 */

/* int4_column512 for AVX2, on H halves of a column block from `half` (8 rows each: a line's
 * 32-byte halves) times NX activation rows from x0. A half-line's low and high nibbles (0-15
 * each) multiply the row's broadcast inputs by vpmaddubsw into 16-bit pair sums, at most
 * 2 x 15 x 127 each, so four lines' (eight products) add in 16 bits before one vpmaddwd widens
 * them; a step's integer sums become float once, as on the AVX-512 path. One row takes both
 * halves a pass, more rows one half and up to three rows: 3 x 3 sums beside the unpacked
 * half-line fill AVX2's 16 registers. */
AVX2 INLINE void int4_half256(const uint8_t *nibbles, const uint8_t *unpacked,
                              const uint16_t *scale, const uint16_t *zero, const Activations *a,
                              float *y, int out, int column, int half, const int H, int x0,
                              const int NX, const int G) {
    const int width = a->width, groups = width / G, octets = width / 8;
    const int block = G > PAIR ? G : BLOCK, blocks = width / block, per_block = block / 8;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int ahead = H == 1 || astrai_ahead_at_one_row[INT4]; /* H 2: one row, both halves */
    const uint8_t *line = unpacked ? unpacked : nibbles + (size_t)column * octets * 64 + 32 * half;
    const uint16_t *s8 = scale + (size_t)column * groups * 16 + 8 * half;
    const uint16_t *z8 = zero + (size_t)column * groups * 16 + 8 * half;
    const int8_t *xq = a->q + (size_t)x0 * width;
    __m256 acc[2][3];
#pragma GCC unroll 2
    for (int h = 0; h < H; h++)
#pragma GCC unroll 3
        for (int i = 0; i < NX; i++) acc[h][i] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i sum[2][3];
#pragma GCC unroll 2
        for (int h = 0; h < H; h++)
#pragma GCC unroll 3
            for (int i = 0; i < NX; i++) sum[h][i] = _mm256_setzero_si256();
        for (int k0 = 0; k0 < per_block; k0 += 4) {
            __m256i pairs[2][3];
#pragma GCC unroll 2
            for (int h = 0; h < H; h++)
#pragma GCC unroll 3
                for (int i = 0; i < NX; i++) pairs[h][i] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int k = k0; k < k0 + 4; k++, line += 64) {
                if (ahead && k % 2 == 0) _mm_prefetch((const char *)line + 2048, _MM_HINT_T0);
                if (!unpacked && NX > 1 && k % 2 == 1)
                    _mm_prefetch((const char *)line + FAR, _MM_HINT_T1);
                const int8_t *x = xq + (size_t)b * block + 8 * k;
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    __m256i l, u;
                    if (unpacked) { /* unpack_half256's: the low nibbles, then the high */
                        l = _mm256_load_si256((const __m256i *)line);
                        u = _mm256_load_si256((const __m256i *)(line + 32));
                    } else {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(line + 32 * h));
                        l = _mm256_and_si256(v, low);
                        u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
#pragma GCC unroll 3
                    for (int i = 0; i < NX; i++) {
                        int32_t first, second;
                        memcpy(&first, x + (size_t)i * width, 4);
                        memcpy(&second, x + (size_t)i * width + 4, 4);
                        pairs[h][i] = _mm256_add_epi16(
                            pairs[h][i],
                            _mm256_add_epi16(_mm256_maddubs_epi16(l, _mm256_set1_epi32(first)),
                                             _mm256_maddubs_epi16(u, _mm256_set1_epi32(second))));
                    }
                }
            }
#pragma GCC unroll 2
            for (int h = 0; h < H; h++)
#pragma GCC unroll 3
                for (int i = 0; i < NX; i++)
                    sum[h][i] = _mm256_add_epi32(sum[h][i], _mm256_madd_epi16(pairs[h][i], ones));
        }
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            const __m256 s = load8(s8 + (size_t)(b * block / G) * 16 + 8 * h, 1, 0);
#pragma GCC unroll 3
            for (int i = 0; i < NX; i++) {
                const __m256 k =
                    _mm256_mul_ps(_mm256_set1_ps(a->step[(size_t)(x0 + i) * blocks + b]), s);
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][i]), k, acc[h][i]);
            }
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) {
        for (int g = 0; g < groups; g++) {
            const __m256 off = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f),
                                                load8(s8 + 16 * g + 8 * h, 1, 0),
                                                load8(z8 + 16 * g + 8 * h, 1, 0));
#pragma GCC unroll 3
            for (int i = 0; i < NX; i++)
                acc[h][i] = _mm256_fmadd_ps(
                    off, _mm256_set1_ps(a->group_sum[(size_t)(x0 + i) * groups + g]), acc[h][i]);
        }
        const int first = 16 * column + 8 * (half + h), left = out - first;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
#pragma GCC unroll 3
        for (int i = 0; i < NX; i++)
            _mm256_maskstore_ps(y + (size_t)(x0 + i) * out + first, m, acc[h][i]);
    }
}

/* A column block's half (8 rows) with its nibbles apart, [octets][2][32] bytes (each line's
 * low nibbles, then its high ones), for int4_half256 to read where many activation rows pass
 * over the same weights: the unpacking once, not once every three rows. */
AVX2 static void unpack_half256(const uint8_t *nibbles, int octets, int column, int half,
                                uint8_t *to) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *line = nibbles + (size_t)column * octets * 64 + 32 * half;
    for (int k = 0; k < octets; k++, line += 64, to += 64) {
        _mm_prefetch((const char *)line + FAR, _MM_HINT_T1); /* for the passes after this one */
        const __m256i v = _mm256_loadu_si256((const __m256i *)line);
        _mm256_store_si256((__m256i *)to, _mm256_and_si256(v, low));
        _mm256_store_si256((__m256i *)(to + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
}

/* A thread's column blocks c0..c1: one activation row both halves a pass, more rows each half
 * three rows at a time, from its nibbles unpacked once where there are more than three. */
#define INT4_COLUMNS256(G)                                                                   \
    AVX2 static void int4_columns256_##G(const uint8_t *n, const uint16_t *s, const uint16_t *z, \
                                         const Activations *a, float *y, int out, int c0,    \
                                         int c1) {                                           \
        const int octets = a->width / 8;                                                     \
        uint8_t *u = a->rows > 3 ? aligned_alloc(64, (size_t)octets * 64) : NULL;            \
        for (int c = c0; c < c1; c++) {                                                      \
            if (a->rows == 1) {                                                              \
                int4_half256(n, NULL, s, z, a, y, out, c, 0, 2, 0, 1, G);                    \
                continue;                                                                    \
            }                                                                                \
            for (int half = 0; half < 2; half++) {                                           \
                if (u) unpack_half256(n, octets, c, half, u);                                \
                int x0 = 0;                                                                  \
                for (; a->rows - x0 >= 3; x0 += 3)                                           \
                    int4_half256(n, u, s, z, a, y, out, c, half, 1, x0, 3, G);               \
                if (a->rows - x0 == 2) int4_half256(n, u, s, z, a, y, out, c, half, 1, x0, 2, G); \
                else if (a->rows - x0 == 1)                                                  \
                    int4_half256(n, u, s, z, a, y, out, c, half, 1, x0, 1, G);               \
            }                                                                                \
        }                                                                                    \
        free(u);                                                                             \
    }
INT4_COLUMNS256(32)
INT4_COLUMNS256(64)
INT4_COLUMNS256(128)

/* ---------------------------------------------------------------- 8-bit weights, AVX2 */

/* int8_column512 for AVX2, on H halves of a column block from `half` (8 rows each) times NX
 * activation rows from x0. vpmaddubsw's 16-bit sums of (w + 128) x would saturate, so each
 * stored byte is flipped back to w (one xor) and split into |w| and a sign carried over to x;
 * each line's pair sums widen by one vpmaddwd, a block of 32 inputs' integer sums become float
 * once. One row takes both halves a pass, more rows one half and three rows a pass. */
AVX2 INLINE void int8_half256(const uint8_t *weight, const float *row_scale, const Activations *a,
                              float *y, int out, int column, int half, const int H, int x0,
                              const int NX) {
    const int width = a->width, blocks = width / BLOCK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const uint8_t *line = weight + (size_t)column * (width / 4) * 64 + 32 * half;
    const int8_t *xq = a->q + (size_t)x0 * width;
    __m256 acc[2][3];
#pragma GCC unroll 2
    for (int h = 0; h < H; h++)
#pragma GCC unroll 3
        for (int i = 0; i < NX; i++) acc[h][i] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i sum[2][3];
#pragma GCC unroll 2
        for (int h = 0; h < H; h++)
#pragma GCC unroll 3
            for (int i = 0; i < NX; i++) sum[h][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < BLOCK / 4; k++, line += 64) {
            /* at one row too (astrai_ahead_at_one_row aside): without, a 0.5B int8 step held
             * to AVX2 ran 0.98x as fast on the AMD Zen 5 */
            if (k % 2 == 1) _mm_prefetch((const char *)line + 8192, _MM_HINT_T1);
            if (k % 2 == 0) _mm_prefetch((const char *)line + 2048, _MM_HINT_T0);
            const int8_t *x = xq + (size_t)b * BLOCK + 4 * k;
#pragma GCC unroll 2
            for (int h = 0; h < H; h++) {
                const __m256i w = _mm256_xor_si256(
                    _mm256_loadu_si256((const __m256i *)(line + 32 * h)), flip);
                const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 3
                for (int i = 0; i < NX; i++) {
                    int32_t four;
                    memcpy(&four, x + (size_t)i * width, 4);
                    const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
                    sum[h][i] = _mm256_add_epi32(sum[h][i], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < H; h++)
#pragma GCC unroll 3
            for (int i = 0; i < NX; i++)
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][i]),
                                            _mm256_set1_ps(a->step[(size_t)(x0 + i) * blocks + b]),
                                            acc[h][i]);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) {
        const int first = 16 * column + 8 * (half + h);
        const __m256 scale = _mm256_loadu_ps(row_scale + first);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(out - first), lane);
#pragma GCC unroll 3
        for (int i = 0; i < NX; i++)
            _mm256_maskstore_ps(y + (size_t)(x0 + i) * out + first, m,
                                _mm256_mul_ps(acc[h][i], scale));
    }
}

/* A thread's column blocks c0..c1, as int4_columns256 takes them. */
AVX2 static void int8_columns256(const uint8_t *w, const float *s, const Activations *a, float *y,
                                 int out, int c0, int c1) {
    for (int c = c0; c < c1; c++) {
        if (a->rows == 1) {
            int8_half256(w, s, a, y, out, c, 0, 2, 0, 1);
            continue;
        }
        for (int half = 0; half < 2; half++) {
            int x0 = 0;
            for (; a->rows - x0 >= 3; x0 += 3) int8_half256(w, s, a, y, out, c, half, 1, x0, 3);
            if (a->rows - x0 == 2) int8_half256(w, s, a, y, out, c, half, 1, x0, 2);
            else if (a->rows - x0 == 1) int8_half256(w, s, a, y, out, c, half, 1, x0, 1);
        }
    }
}

/* ---------------------------------------------------------------- entry points */

/* 2: AVX-512 VNNI, 1: AVX2, 0: neither (the products refuse to run). Held to AVX2 where
 * torch's own kernels are (ATEN_CPU_CAPABILITY set to anything but avx512), so that one
 * variable runs a whole process as on an AVX2-only CPU. Asked once a process. */
int astrai_gemv_isa(void) {
    static int isa = -1;
    if (isa >= 0) return isa;
    __builtin_cpu_init();
    const char *torch_held = getenv("ATEN_CPU_CAPABILITY");
    int avx512 = !(torch_held && *torch_held && strncmp(torch_held, "avx512", 6));
    if (avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return isa = 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return isa = 1;
    return isa = 0;
}

/* Each thread's share of `units` column blocks, as [*u0, *u1). */
static void thread_share(int units, int *u0, int *u1) {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    *u0 = (int)((long)units * t / threads);
    *u1 = (int)((long)units * (t + 1) / threads);
}

/* Returns 0, or a negative code: -1 bad shape, -2 out of memory, -3 no usable ISA.
 * isa: 0 for the best here, else 1 (AVX2) or 2 (AVX-512 VNNI) to force one (tests). */
int astrai_int4_gemv(const float *x, int rows, int in, const uint8_t *nibbles,
                     const uint16_t *scale, const uint16_t *zero, int out, int group, float *y,
                     int threads, int isa) {
    if (in <= 0 || rows <= 0 || out <= 0 || threads <= 0) return -1;
    if (group != 32 && group != 64 && group != 128) return -1;
    int width = (in + PAIR - 1) / PAIR * PAIR;
    if (width % group) return -1;
    int best = astrai_gemv_isa();
    isa = isa ? isa : best;
    if (isa > best || isa == 0) return -3;
    Activations a;
    if (!alloc_activations(&a, rows, width, group, group > PAIR ? group : BLOCK)) {
        free_activations(&a);
        return -2;
    }
    quantize_activations(x, in, &a, group, threads);
#pragma omp parallel num_threads(threads)
    {
        int c0, c1;
        thread_share((out + COLUMNS - 1) / COLUMNS, &c0, &c1);
        if (isa == 2) {
            if (group == 32) int4_columns512_32(nibbles, scale, zero, &a, y, out, c0, c1);
            else if (group == 64) int4_columns512_64(nibbles, scale, zero, &a, y, out, c0, c1);
            else int4_columns512_128(nibbles, scale, zero, &a, y, out, c0, c1);
        } else {
            if (group == 32) int4_columns256_32(nibbles, scale, zero, &a, y, out, c0, c1);
            else if (group == 64) int4_columns256_64(nibbles, scale, zero, &a, y, out, c0, c1);
            else int4_columns256_128(nibbles, scale, zero, &a, y, out, c0, c1);
        }
    }
    free_activations(&a);
    return 0;
}

/* One row of a 4-bit matrix as its `in` weights, from the row's 4 bytes of each line of its
 * column block (`bytes`, then every 64): each 4 bytes, broadcast and shifted by lane, are the
 * line's 8 inputs; scale and zero: the row's float32 [in / group]. */
AVX2 static void dequantize_row(const uint8_t *bytes, const float *scale, const float *zero,
                                int in, int group, void *row, int bf16) {
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i nibble = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int g = 0, i = 0; g < in / group; g++) {
        const __m256 s = _mm256_set1_ps(scale[g]), z = _mm256_set1_ps(zero[g]);
        for (int k = 0; k < group / 8; k++, i += 8) {
            int32_t four;
            memcpy(&four, bytes + (size_t)(i / 8) * 64, 4);
            const __m256i lanes = _mm256_cvtepu8_epi32(_mm_set1_epi32(four)); /* bytes 0-3 twice */
            const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(lanes, shifts), nibble);
            const __m256 level = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight));
            store8(row, bf16, i, _mm256_fmadd_ps(level, s, z));
        }
    }
}

/* Output rows row0..row1 of a 4-bit matrix (quantized.h's column blocks) as the weights they
 * stand for, (q - 8) * scale + zero, into dst [row1 - row0][in]: float32, or bfloat16 (bits,
 * rounded to nearest even as torch rounds) where bf16 is set. scale, zero: float32
 * [out][in / group], each a bfloat16 value, so that (q - 8) * scale is exact in float32 (at
 * most 4 + 8 significant bits) and a fused multiply-add rounds as the multiply and add apart
 * do: the values of astrai/infer/int4.py's `dequantize`, to the bit. For a prompt's rows
 * (int4.py's dense road), where torch's unpacking and conversions of the 0.5B shape's matrices
 * took 2.5-17 ms a matrix and this takes 0.6 (docs/inference.md, "Prompts take a dense road").
 * Returns 0, or -1 for a shape it does not take. */
int astrai_int4_dequantize(const uint8_t *nibbles, const float *scale, const float *zero,
                           int group, int in, int row0, int row1, void *dst, int bf16,
                           int threads) {
    if (in <= 0 || row0 < 0 || row1 < row0 || threads <= 0) return -1;
    if ((group != 32 && group != 64 && group != 128) || in % group) return -1;
    if (astrai_gemv_isa() == 0) return -3;
    const int octets = (in + PAIR - 1) / PAIR * PAIR / 8, groups = in / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int row = row0; row < row1; row++) {
        const size_t block = (size_t)(row / COLUMNS) * octets * 64;
        void *to = bf16 ? (void *)((uint16_t *)dst + (size_t)(row - row0) * in)
                        : (void *)((float *)dst + (size_t)(row - row0) * in);
        dequantize_row(nibbles + block + 4 * (row % COLUMNS), scale + (size_t)row * groups,
                       zero + (size_t)row * groups, in, group, to, bf16);
    }
    return 0;
}

/* weight: w + 128 in column blocks (quantized.h), width = in rounded up to 64 (w zero past in). */
int astrai_int8_gemv(const float *x, int rows, int in, const uint8_t *weight,
                     const float *row_scale, int out, float *y, int threads, int isa) {
    if (in <= 0 || rows <= 0 || out <= 0 || threads <= 0) return -1;
    int width = (in + PAIR - 1) / PAIR * PAIR;
    int best = astrai_gemv_isa();
    isa = isa ? isa : best;
    if (isa > best || isa == 0) return -3;
    Activations a;
    if (!alloc_activations(&a, rows, width, 0, BLOCK)) {
        free_activations(&a);
        return -2;
    }
    quantize_activations(x, in, &a, BLOCK, threads);
#pragma omp parallel num_threads(threads)
    {
        int c0, c1;
        thread_share((out + COLUMNS - 1) / COLUMNS, &c0, &c1);
        if (isa == 2) int8_columns512(weight, row_scale, &a, y, out, c0, c1);
        else int8_columns256(weight, row_scale, &a, y, out, c0, c1);
    }
    free_activations(&a);
    return 0;
}
