/* Few-row products y = x @ W.T that stream W once: 4-bit and 8-bit weights times activations
 * quantized to int8 on each call (the way llama.cpp's Q4_0 x Q8_0 dot works), a step per block
 * of 32 inputs, or per group for 4-bit weights in groups of 128.
 *
 * Built by astrai/kernels/build.py with the system C compiler and loaded with ctypes: no torch
 * headers, so it compiles in seconds. Two paths, picked at run time: AVX-512 VNNI (vpdpbusd,
 * two blocks of 32 per 512-bit register) and AVX2 (vpmaddubsw + vpmaddwd, one block per
 * register). Rows of W are split across the OpenMP threads of the libgomp torch itself loads, so
 * there is one thread pool in the process. The layouts and the activations: quantized.h. */
#include "quantized.h"

/* At one activation row a pass multiplies several tiles, each a share of the thread's range
 * apart, so that the weights are read as that many sequential streams. Over the 0.5B shapes on
 * a 2-core Intel Xeon (two threads; reading alone 28-31 GB/s), one stream a thread read the
 * int8 weights at 21-23 GB/s and four at 25-28; the 4-bit ones, whose products keep twice the
 * registers a row, 16-17 GB/s as one stream, 23-24 as two, 21-22 as four. On a 2-core AMD Zen 4
 * one, two and four streams of int8 weights read alike from memory (21-23 GB/s, alternating in
 * one process), while from cache four ran at a third of two's speed (33 against 107 GB/s):
 * gcc 12 did not unroll the loop over sixteen rows, so their accumulators lived in memory, not
 * registers. So two, and the loop unrolled by a pragma. Later, with the memory reading 37-44
 * GB/s, four streams of int8 weights read 1.09-1.10x as fast as two from memory (and 0.9x from
 * cache, at 88-103 GB/s, far past any memory): four for int8. Four 4-bit streams read 0.95x
 * from memory and 0.8x from cache: two. Row r of a pass is ROW(r). */
#define INT8_STREAMS 4
#define INT4_STREAMS 2
#define STREAMS 4 /* the most of either */
#define ROW(r) (row0 + (r) / TILE * apart + (r) % TILE)

/* ---------------------------------------------------------------- AVX-512 VNNI */

AVX512 INLINE float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Two groups' scales (bf16 bits) as 8 lanes each. */
AVX512 INLINE __m512 scale_pair(const uint16_t *s) {
    uint32_t two;
    memcpy(&two, s, 4);
    __m128i bits = _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_cvtsi32_si128((int)two));
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_castsi128_ps(bits)));
}

AVX512 INLINE __m512 scale_one(const uint16_t *s) { return _mm512_set1_ps(bf16_to_float(*s)); }

/* The lanes of the (up to) 16 groups from g of `groups`. */
AVX512 INLINE __mmask16 group_mask(int g, int groups) {
    return groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
}

/* The bfloat16 values (bits) of m's lanes from p as float32, 0 elsewhere. */
AVX512 INLINE __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

/* zero - 8 scale for the (up to) 16 groups of m from these: the offsets a group's activation
 * sum multiplies. Once a weight row and 16 groups, shared by every activation row of a pass. */
AVX512 INLINE __m512 offsets16(const uint16_t *scale, const uint16_t *zero, __mmask16 m) {
    return _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), load16_bf16(scale, m), load16_bf16(zero, m));
}

/* One weight row's outputs for NX activation rows from x0: the offsets' share of each group
 * into the row's accumulators `acc` (one reduction an output, the offsets converted once a
 * weight row and 16 groups), then y. */
AVX512 INLINE void int4_finish(__m512 *acc, const uint16_t *scale, const uint16_t *zero,
                               const Activations *a, float *y, int out, int row, int x0,
                               const int NX, int groups) {
    const size_t at = (size_t)row * groups;
    for (int g = 0; g < groups; g += 16) {
        __mmask16 m = group_mask(g, groups);
        __m512 off = offsets16(scale + at + g, zero + at + g, m);
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) {
            const float *sums = a->group_sum + (size_t)(x0 + i) * groups + g;
            acc[i] = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(m, sums), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NX; i++) y[(size_t)(x0 + i) * out + row] = hsum512(acc[i]);
}

/* Each activation row's step times each weight row's scale, for the 16 groups from g: what
 * a group's float32 dot is multiplied by, ready to broadcast (one load) where it was two
 * conversions and a product a group and row. The same product of the same two numbers: the
 * same bits. */
AVX512 INLINE void step_scales(const uint16_t *scale, const Activations *a, int row0, int apart,
                               int x0, int g, int groups, const int R, const int NX,
                               float k[][4][16]) {
    __mmask16 m = group_mask(g, groups);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        __m512 s = load16_bf16(scale + (size_t)ROW(r) * groups + g, m);
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) {
            __m512 step = _mm512_maskz_loadu_ps(m, a->step + (size_t)(x0 + i) * groups + g);
            _mm512_store_ps(k[r][i], _mm512_mul_ps(step, s));
        }
    }
}

/* Every loop over R, NX and the pairs of a unit is unrolled (the pragmas): with the counts
 * constants once inlined, the accumulators then live in registers, where a loop left rolled
 * keeps the whole array in memory. The offsets' share goes into the same accumulators (one
 * reduction an output, the offsets converted once a weight row).
 * At groups of 128 the activations have one step a group (gemv.py's activation_block), so a
 * group's integer sums run across its two pairs and become float once, multiplied by the step
 * times the weights' scale (step_scales, 16 groups at a time). Groups of 32 and 64 keep the
 * blocks of 32 (`lanes`, a pair's two steps: no instruction fewer with a step a group).
 * On a 2-core AMD Zen 4, two threads, one row, a 0.5B shape's layer of 4-bit matrices in cache
 * multiplied at 50 GB/s with two loads a group of 128 and its scales converted every group and
 * row, at 60 with one load (UNIT) and the products ahead.
 * R weight rows from `row0` (past TILE of them, tiles `apart` rows apart: see INT8_STREAMS)
 * times NX activation rows from `x0`; G the group size. */
AVX512 INLINE void int4_tile512(const uint8_t *nibbles, const uint16_t *scale,
                                const uint16_t *zero, const Activations *a, float *y, int out,
                                int row0, int apart, int x0, const int R, const int NX,
                                const int G) {
    const int width = a->width, pairs = width / PAIR, groups = width / G;
    const int units = width / UNIT(G), per_unit = UNIT(G) / PAIR; /* pairs a unit */
    const int groups_per_unit = G == BLOCK ? 2 : 1;
    __m512 acc[STREAMS * TILE][4];
    float k[STREAMS * TILE][4][16] __attribute__((aligned(64))); /* step_scales' */
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) acc[r][i] = _mm512_setzero_ps();
    for (int u = 0, g = 0; u < units; u++, g += groups_per_unit) {
        const int p = u * per_unit;
        if (G > PAIR && g % 16 == 0)
            step_scales(scale, a, row0, apart, x0, g, groups, R, NX, k);
        __m512i xq[2][4]; /* at most two pairs a unit */
        __m512 lanes[4];  /* G <= 64: each lane's step, the pair's two blocks' */
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) {
#pragma GCC unroll 2
            for (int j = 0; j < per_unit; j++)
                xq[j][i] = _mm512_load_si512(a->q + (size_t)(x0 + i) * width + (p + j) * PAIR);
            if (G <= PAIR)
                lanes[i] = _mm512_load_ps(a->lanes + ((size_t)(x0 + i) * pairs + p) * 16);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const uint8_t *w = nibbles + tiled(ROW(r), u, units, UNIT(G) / 2);
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
            __m512i wq[2];
            unpack_unit(w, G, wq);
            const uint16_t *s = scale + (size_t)ROW(r) * groups + g;
            __m512 sv;
            if (G <= PAIR)
                sv = G == BLOCK ? scale_pair(s) : scale_one(s);
#pragma GCC unroll 16
            for (int i = 0; i < NX; i++) {
                __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], xq[0][i]);
#pragma GCC unroll 2
                for (int j = 1; j < per_unit; j++)
                    sum = _mm512_dpbusd_epi32(sum, wq[j], xq[j][i]);
                __m512 times = G <= PAIR ? _mm512_mul_ps(lanes[i], sv)
                                         : _mm512_set1_ps(k[r][i][g % 16]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), times, acc[r][i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        if (ROW(r) < out)
            int4_finish(acc[r], scale, zero, a, y, out, ROW(r), x0, NX, groups);
}

/* int4_tile512 for many activation rows: R weight rows from `row0` (side by side) times NX
 * activation rows from `x0`, the weights unpacked once a unit for all NX rows and each
 * activation row's input loaded inside, so that 2 x 8 accumulators and the unpacked weights
 * fit the 32 registers. The same operations per output in the same order as int4_tile512:
 * the same bits. Where int4_tile512 unpacked a pass's weights again for every four activation
 * rows, on a 2-core AMD Zen 4 at 16 rows groups of 128 streamed 5.5-5.9 -> 6.5-6.8 GB/s of
 * weights, groups of 32 4.4 -> 4.7-4.9, and a 1B-shaped int4 decode step of 16 rows took
 * 127-131 -> 113-114 ms. */
AVX512 INLINE void int4_wide512(const uint8_t *nibbles, const uint16_t *scale,
                                const uint16_t *zero, const Activations *a, float *y, int out,
                                int row0, int x0, const int R, const int NX, const int G) {
    const int width = a->width, pairs = width / PAIR, groups = width / G;
    const int units = width / UNIT(G), per_unit = UNIT(G) / PAIR;
    const int groups_per_unit = G == BLOCK ? 2 : 1;
    __m512 acc[2][8];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) acc[r][i] = _mm512_setzero_ps();
    for (int u = 0, g = 0; u < units; u++, g += groups_per_unit) {
        const int p = u * per_unit;
        __m512i wq[2][2];
        __m512 sv[2];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const uint8_t *w = nibbles + tiled(row0 + r, u, units, UNIT(G) / 2);
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
            unpack_unit(w, G, wq[r]);
            const uint16_t *s = scale + (size_t)(row0 + r) * groups + g;
            sv[r] = G == BLOCK ? scale_pair(s) : scale_one(s);
        }
#pragma GCC unroll 16
        for (int i = 0; i < NX; i++) {
            __m512i xq[2];
#pragma GCC unroll 2
            for (int j = 0; j < per_unit; j++)
                xq[j] = _mm512_load_si512(a->q + (size_t)(x0 + i) * width + (p + j) * PAIR);
            __m512 xstep = G <= PAIR
                               ? _mm512_load_ps(a->lanes + ((size_t)(x0 + i) * pairs + p) * 16)
                               : _mm512_set1_ps(a->step[(size_t)(x0 + i) * groups + g]);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[r][0], xq[0]);
#pragma GCC unroll 2
                for (int j = 1; j < per_unit; j++)
                    sum = _mm512_dpbusd_epi32(sum, wq[r][j], xq[j]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(xstep, sv[r]),
                                            acc[r][i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        if (row0 + r < out)
            int4_finish(acc[r], scale, zero, a, y, out, row0 + r, x0, NX, groups);
}

/* A thread's rows of the output, in passes of int4_tile512 and int4_wide512.
 * Three or four activation rows take a tile's four weight rows in one pass where a group is
 * a unit (128): its scales come from step_scales, so the 16 accumulators, 8 activation
 * vectors and the unpacked weights fit the 32 registers. Two passes of two rows each would read
 * alternate pairs of lines of the unit layout: on a 2-core AMD Zen 4 a 0.5B shape's layers of
 * 4-bit weights streamed at 16.5-18 GB/s that way (18-20 with the 64-input units, whose
 * passes read alternate lines and each the other's neighbour) and at 21-24 in one pass. Smaller
 * groups keep two passes: their lanes and scales take more registers. */
#define INT4_TILES(G)                                                                    \
    AVX512 static void int4_rows512_##G(const uint8_t *n, const uint16_t *s,             \
                                        const uint16_t *z, const Activations *a, float *y, \
                                        int out, int r0, int r1) {                        \
        if (a->rows == 1) { /* as in int8_rows512 */                                      \
            int span = (r1 - r0) / (TILE * INT4_STREAMS) * TILE;                          \
            for (int row = r0; row < r0 + span; row += TILE)                              \
                int4_tile512(n, s, z, a, y, out, row, span, 0, INT4_STREAMS * TILE, 1, G); \
            r0 += INT4_STREAMS * span;                                                    \
        }                                                                                 \
        for (int row = r0; row < r1;) {                                                   \
            int R = TILE; /* r1 - r0: whole tiles */                                      \
            int x0 = 0;                                                                   \
            for (; a->rows - x0 >= 8; x0 += 8) /* eight at a time: see int4_wide512 */    \
                for (int h = 0; h < 4; h += 2)                                            \
                    int4_wide512(n, s, z, a, y, out, row + h, x0, 2, 8, G);               \
            for (; x0 < a->rows; x0 += 4) {                                               \
                int nx = a->rows - x0 < 4 ? a->rows - x0 : 4;                             \
                if (R == 4 && nx == 1) int4_tile512(n, s, z, a, y, out, row, 0, x0, 4, 1, G); \
                else if (R == 4 && nx == 2)                                               \
                    int4_tile512(n, s, z, a, y, out, row, 0, x0, 4, 2, G);                   \
                else if (R == 4 && G > PAIR && nx == 3) /* one pass: see above */       \
                    int4_tile512(n, s, z, a, y, out, row, 0, x0, 4, 3, G);                   \
                else if (R == 4 && G > PAIR)                                              \
                    int4_tile512(n, s, z, a, y, out, row, 0, x0, 4, 4, G);                   \
                else if (R == 4) {                                                        \
                    for (int h = 0; h < 4; h += 2) {                                      \
                        if (nx == 3) int4_tile512(n, s, z, a, y, out, row + h, 0, x0, 2, 3, G); \
                        else int4_tile512(n, s, z, a, y, out, row + h, 0, x0, 2, 4, G);      \
                    }                                                                     \
                } else if (nx == 1) int4_tile512(n, s, z, a, y, out, row, 0, x0, 1, 1, G);   \
                else if (nx == 2) int4_tile512(n, s, z, a, y, out, row, 0, x0, 1, 2, G);     \
                else if (nx == 3) int4_tile512(n, s, z, a, y, out, row, 0, x0, 1, 3, G);     \
                else int4_tile512(n, s, z, a, y, out, row, 0, x0, 1, 4, G);                  \
            }                                                                             \
            row += R;                                                                     \
        }                                                                                 \
    }
INT4_TILES(32)
INT4_TILES(64)
INT4_TILES(128)

/* int8 weights, stored w + 128: sum((w + 128) x) - offset = sum(w x) */
AVX512 INLINE void int8_tile512(const uint8_t *weight, const float *row_scale,
                                const Activations *a, float *y, int out, int row0, int apart,
                                int x0, const int R, const int NX) {
    const int width = a->width, pairs = width / PAIR;
    __m512 acc[STREAMS * TILE][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NX; i++) acc[r][i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m512i xq[4];
        __m512 lanes[4];
        for (int i = 0; i < NX; i++) {
            xq[i] = _mm512_load_si512(a->q + (size_t)(x0 + i) * width + p * PAIR);
            lanes[i] = _mm512_load_ps(a->lanes + ((size_t)(x0 + i) * pairs + p) * 16);
        }
#pragma GCC unroll 16 /* the accumulators in registers: see INT8_STREAMS */
        for (int r = 0; r < R; r++) {
            const uint8_t *w = weight + tiled(ROW(r), p, pairs, PAIR);
            /* into L1 a little ahead and into L2 far ahead: the 0.5B shapes' streamed matrices
             * read 1.11-1.25x as fast at one row and 1.16-1.8x at four as with only L1's 2 KiB
             * ahead (2-core AMD Zen 4, alternating in one process); the 4-bit product, half
             * the bytes a weight, gained nothing from the second */
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
            _mm_prefetch((const char *)w + 8192, _MM_HINT_T1);
            __m512i wu = _mm512_loadu_si512(w);
            for (int i = 0; i < NX; i++) {
                __m512 dot =
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xq[i]));
                acc[r][i] = _mm512_fmadd_ps(dot, lanes[i], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NX && ROW(r) < out; i++)
            y[(size_t)(x0 + i) * out + ROW(r)] =
                (hsum512(acc[r][i]) - a->offset[x0 + i]) * row_scale[ROW(r)];
}

AVX512 static void int8_rows512(const uint8_t *w, const float *s, const Activations *a, float *y,
                                int out, int r0, int r1) {
    if (a->rows == 1) { /* INT8_STREAMS tiles a pass, that share of the range apart */
        int span = (r1 - r0) / (TILE * INT8_STREAMS) * TILE;
        for (int row = r0; row < r0 + span; row += TILE)
            int8_tile512(w, s, a, y, out, row, span, 0, INT8_STREAMS * TILE, 1);
        r0 += INT8_STREAMS * span;
    }
    for (int row = r0; row < r1;) {
        int R = TILE; /* r1 - r0: whole tiles */
        for (int x0 = 0; x0 < a->rows; x0 += 4) {
            int nx = a->rows - x0 < 4 ? a->rows - x0 : 4;
            if (R == 4 && nx == 1) int8_tile512(w, s, a, y, out, row, 0, x0, 4, 1);
            else if (R == 4 && nx == 2) int8_tile512(w, s, a, y, out, row, 0, x0, 4, 2);
            else if (R == 4 && nx == 3) int8_tile512(w, s, a, y, out, row, 0, x0, 4, 3);
            else if (R == 4) int8_tile512(w, s, a, y, out, row, 0, x0, 4, 4);
            else if (nx == 1) int8_tile512(w, s, a, y, out, row, 0, x0, 1, 1);
            else if (nx == 2) int8_tile512(w, s, a, y, out, row, 0, x0, 1, 2);
            else if (nx == 3) int8_tile512(w, s, a, y, out, row, 0, x0, 1, 3);
            else int8_tile512(w, s, a, y, out, row, 0, x0, 1, 4);
        }
        row += R;
    }
}

/* ---------------------------------------------------------------- AVX2 */

/* the dot of 32 unsigned bytes with 32 signed ones, as 8 float lanes */
AVX2 INLINE __m256 dot32(__m256i u, __m256i s) {
    __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* k[j] = the activation step j times its group's weight scale, for the 8 steps from s of n
 * (fewer at the end), steps of `block` inputs in groups of G: the same product of the same two
 * numbers in both branches. */
AVX2 INLINE void step_scales8(const float *step, const uint16_t *scale, int s, int n,
                              const int G, const int block, float *k) {
    if (n - s < 8) {
        for (int j = 0; s + j < n; j++)
            k[j] = step[s + j] * bf16_to_float(scale[(s + j) * block / G]);
        return;
    }
    __m256 scales;
    if (block == G) { /* a scale a step */
        scales = load8(scale, 1, s);
    } else { /* groups of 64, steps of 32: four scales (no more: the row may end), each twice */
        __m128i four = _mm_loadl_epi64((const __m128i *)(scale + s / 2));
        __m256i bits = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(four),
                                                   _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        scales = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    }
    _mm256_store_ps(k, _mm256_mul_ps(_mm256_loadu_ps(step + s), scales));
}

/* The zero points' share of one output: sum over groups of (zero - 8 scale) x the activation
 * row's sum over the group, eight groups at a time. */
AVX2 INLINE float int4_offsets256(const uint16_t *scale, const uint16_t *zero, const float *sums,
                                  int groups) {
    __m256 total = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 off = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), load8(scale, 1, g), load8(zero, 1, g));
        total = _mm256_fmadd_ps(off, _mm256_loadu_ps(sums + g), total);
    }
    float rest = 0.0f;
    for (; g < groups; g++)
        rest += (bf16_to_float(zero[g]) - 8.0f * bf16_to_float(scale[g])) * sums[g];
    return sum8(total) + rest;
}

/* A 4-bit unit's `halves` 32-byte halves as bytes: lo[h] the low nibbles (inputs 32h on), hi[h]
 * the high ones (UNIT / 2 + 32h on). */
AVX2 INLINE void unpack256(const uint8_t *w, const int halves, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 2
    for (int h = 0; h < halves; h++) {
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
        lo[h] = _mm256_and_si256(bytes, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    }
}

/* A group of 128's dot with the activations' bytes xq as 8 float lanes: blocks 0, 1 (low
 * nibbles), 2, 3 (high) in 16-bit pair sums, one vpmaddwd and one conversion. */
AVX2 INLINE __m256 dot128(const __m256i *lo, const __m256i *hi, const int8_t *xq) {
#define XQ(at) _mm256_loadu_si256((const __m256i *)(xq + (at)))
    __m256i pairs = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], XQ(0)), _mm256_maddubs_epi16(lo[1], XQ(32))),
        _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], XQ(64)), _mm256_maddubs_epi16(hi[1], XQ(96))));
#undef XQ
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* int4_tile512's pass for AVX2: R weight rows from row0 (up to a tile) times NX activation rows
 * from x0, groups of G. A unit's 32-byte halves unpack into bytes (low nibbles: inputs 32h on,
 * high: UNIT / 2 + 32h on), multiplied with the activations' bytes by vpmaddubsw into 16-bit
 * pair sums (at most 2 x 15 x 128 each: four blocks of them add without overflow, so a group
 * of 128 is one vpmaddwd and one float conversion), then into float32 by the step times the
 * scale (step_scales8, 8 steps ahead). Each output's sum runs in the same order whatever R, NX or
 * thread: the same bits. Where the loop took one weight and activation row at a time, with
 * integer divisions in it and one chain of dependent sums, a 0.5B shape's layer of 4-bit
 * matrices in cache (2-core AMD Zen 4 on this path, one row) multiplied at 8 GB/s. */
AVX2 INLINE void int4_tile256(const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                              const Activations *a, float *y, int out, int row0, int x0,
                              const int R, const int NX, const int G) {
    const int width = a->width, units = width / UNIT(G), halves = UNIT(G) / PAIR;
    const int block = G > PAIR ? G : BLOCK, steps = width / block, groups = width / G;
    const int per_unit = UNIT(G) / block; /* steps a unit: 1 or 2 */
    __m256 acc[TILE][2];
    float k[TILE][2][8] __attribute__((aligned(32)));
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < NX; i++) acc[r][i] = _mm256_setzero_ps();
    for (int u = 0; u < units; u++) {
        const int s = u * per_unit;
        if (s % 8 == 0)
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int i = 0; i < NX; i++)
                    step_scales8(a->step + (size_t)(x0 + i) * steps,
                                 scale + (size_t)(row0 + r) * groups, s, steps, G, block,
                                 k[r][i]);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const uint8_t *w = nibbles + tiled(row0 + r, u, units, UNIT(G) / 2);
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
            __m256i lo[2], hi[2];
            unpack256(w, halves, lo, hi);
#pragma GCC unroll 2
            for (int i = 0; i < NX; i++) {
                const int8_t *xq = a->q + (size_t)(x0 + i) * width + (size_t)u * UNIT(G);
                if (G > PAIR) { /* the group */
                    acc[r][i] = _mm256_fmadd_ps(dot128(lo, hi, xq),
                                                _mm256_set1_ps(k[r][i][s % 8]), acc[r][i]);
                } else { /* two steps: the low nibbles' block, then the high ones' */
                    const __m256i *x = (const __m256i *)xq;
                    acc[r][i] = _mm256_fmadd_ps(dot32(lo[0], _mm256_loadu_si256(x)),
                                                _mm256_set1_ps(k[r][i][s % 8]), acc[r][i]);
                    acc[r][i] = _mm256_fmadd_ps(dot32(hi[0], _mm256_loadu_si256(x + 1)),
                                                _mm256_set1_ps(k[r][i][s % 8 + 1]), acc[r][i]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        if (row0 + r < out)
#pragma GCC unroll 2
            for (int i = 0; i < NX; i++) {
                const size_t at = (size_t)(row0 + r) * groups;
                const float *sums = a->group_sum + (size_t)(x0 + i) * groups;
                y[(size_t)(x0 + i) * out + row0 + r] =
                    sum8(acc[r][i]) + int4_offsets256(scale + at, zero + at, sums, groups);
            }
}

/* int4_tile256 for many activation rows at groups of 128: one weight row times WIDE activation
 * rows from x0, the row's unit unpacked once for all of them, where int4_tile256 unpacks a
 * tile's units again for every two rows. The same operations per output in the same order (the
 * step times the scale is the same one multiply step_scales8 makes): the same bits. */
#define WIDE 8
AVX2 INLINE void int4_wide256(const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                              const Activations *a, float *y, int out, int row, int x0) {
    const int G = 128, width = a->width, units = width / G, groups = width / G;
    __m256 acc[WIDE];
#pragma GCC unroll 8
    for (int i = 0; i < WIDE; i++) acc[i] = _mm256_setzero_ps();
    for (int u = 0; u < units; u++) {
        const uint8_t *w = nibbles + tiled(row, u, units, G / 2);
        __m256i lo[2], hi[2];
        unpack256(w, 2, lo, hi);
        const float sc = bf16_to_float(scale[(size_t)row * groups + u]);
#pragma GCC unroll 8
        for (int i = 0; i < WIDE; i++) {
            __m256 dot = dot128(lo, hi, a->q + (size_t)(x0 + i) * width + (size_t)u * G);
            const float k = a->step[(size_t)(x0 + i) * groups + u] * sc;
            acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(k), acc[i]);
        }
    }
    if (row >= out) return;
    const size_t at = (size_t)row * groups;
#pragma GCC unroll 8
    for (int i = 0; i < WIDE; i++) {
        const float *sums = a->group_sum + (size_t)(x0 + i) * groups;
        y[(size_t)(x0 + i) * out + row] =
            sum8(acc[i]) + int4_offsets256(scale + at, zero + at, sums, groups);
    }
}

/* A thread's rows of the output in passes of int4_tile256, a tile by one or two activation
 * rows, and at groups of 128 int4_wide256 for each WIDE rows. One stream: two tiles a pass at
 * one row (as int4_rows512) keep 8 accumulators beside the unpacked weights, past AVX2's 16
 * registers; in cache (the same shapes and machine as above) one tile a pass multiplied at 41
 * GB/s and two at 35, from memory alike. */
#define INT4_TILES256(G)                                                                  \
    AVX2 static void int4_rows256_##G(const uint8_t *n, const uint16_t *s, const uint16_t *z, \
                                      const Activations *a, float *y, int out, int r0,    \
                                      int r1) {                                           \
        for (int row = r0; row < r1; row += TILE) {                                       \
            int x0 = 0;                                                                   \
            for (; G == 128 && a->rows - x0 >= WIDE; x0 += WIDE)                          \
                for (int t = 0; t < TILE; t++) int4_wide256(n, s, z, a, y, out, row + t, x0); \
            for (; x0 < a->rows; x0 += 2) {                                               \
                if (a->rows - x0 == 1) int4_tile256(n, s, z, a, y, out, row, x0, TILE, 1, G); \
                else int4_tile256(n, s, z, a, y, out, row, x0, TILE, 2, G);               \
            }                                                                             \
        }                                                                                 \
    }
INT4_TILES256(32)
INT4_TILES256(64)
INT4_TILES256(128)

/* int8_tile512's pass for AVX2: a tile's R weight rows from row0 times NX activation rows from
 * x0. vpmaddubsw's 16-bit sums of (w + 128) x would saturate, so each stored byte is flipped
 * back to w (one xor) and split into |w| and a sign carried over to x. Where the loop took one
 * weight and activation row at a time (one chain of dependent sums), a 0.5B shape's layer of
 * 8-bit matrices (2-core AMD Zen 4 on this path, one row) multiplied at ~45 GB/s in cache
 * and 20 from memory. */
AVX2 INLINE void int8_tile256(const uint8_t *weight, const float *row_scale, const Activations *a,
                              float *y, int out, int row0, int x0, const int R, const int NX) {
    const int width = a->width, pairs = width / PAIR, blocks = width / BLOCK;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[TILE][2];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < NX; i++) acc[r][i] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const uint8_t *w = weight + tiled(row0 + r, p, pairs, PAIR);
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
            _mm_prefetch((const char *)w + 8192, _MM_HINT_T1);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i stored = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
                __m256i signed_w = _mm256_xor_si256(stored, flip);
                __m256i magnitude = _mm256_abs_epi8(signed_w);
#pragma GCC unroll 2
                for (int i = 0; i < NX; i++) {
                    const int8_t *xq = a->q + (size_t)(x0 + i) * width + (size_t)p * PAIR;
                    __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * h));
                    x = _mm256_sign_epi8(x, signed_w);
                    __m256 dot = dot32(magnitude, x);
                    float step = a->step[(size_t)(x0 + i) * blocks + 2 * p + h];
                    acc[r][i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(step), acc[r][i]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        if (row0 + r < out)
#pragma GCC unroll 2
            for (int i = 0; i < NX; i++)
                y[(size_t)(x0 + i) * out + row0 + r] = sum8(acc[r][i]) * row_scale[row0 + r];
}

AVX2 static void int8_rows256(const uint8_t *weight, const float *row_scale, const Activations *a,
                              float *y, int out, int r0, int r1) {
    for (int row = r0; row < r1; row += TILE) /* r1 - r0: whole tiles */
        for (int x0 = 0; x0 < a->rows; x0 += 2) {
            if (a->rows - x0 == 1) int8_tile256(weight, row_scale, a, y, out, row, x0, TILE, 1);
            else int8_tile256(weight, row_scale, a, y, out, row, x0, TILE, 2);
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

/* Each thread's share of the (padded) output rows, in whole tiles. */
static void thread_rows(int out, int *r0, int *r1) {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int tiles = (out + TILE - 1) / TILE;
    *r0 = (int)((long)tiles * t / threads) * TILE;
    *r1 = (int)((long)tiles * (t + 1) / threads) * TILE;
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
        int r0, r1;
        thread_rows(out, &r0, &r1);
        if (isa == 2) {
            if (group == 32) int4_rows512_32(nibbles, scale, zero, &a, y, out, r0, r1);
            else if (group == 64) int4_rows512_64(nibbles, scale, zero, &a, y, out, r0, r1);
            else int4_rows512_128(nibbles, scale, zero, &a, y, out, r0, r1);
        } else {
            if (group == 32) int4_rows256_32(nibbles, scale, zero, &a, y, out, r0, r1);
            else if (group == 64) int4_rows256_64(nibbles, scale, zero, &a, y, out, r0, r1);
            else int4_rows256_128(nibbles, scale, zero, &a, y, out, r0, r1);
        }
    }
    free_activations(&a);
    return 0;
}

/* One half-unit of a row's nibbles (`high`: their high halves) as n weights. */
AVX2 static void dequantize_half(const uint8_t *w, int high, int n, float s, float z, float *f,
                                 uint16_t *h) {
    for (int j = 0; j < n; j++) {
        float v = (float)((high ? w[j] >> 4 : w[j] & 15) - 8) * s + z;
        if (f) {
            f[j] = v;
        } else {
            uint32_t bits;
            memcpy(&bits, &v, 4);
            h[j] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
    }
}

/* Output rows row0..row1 of a 4-bit matrix (the tiles above) as the weights they stand for,
 * (q - 8) * scale + zero, into dst [row1 - row0][in]: float32, or bfloat16 (bits, rounded to
 * nearest even as torch rounds) where bf16 is set. scale, zero: float32 [out][in / group], each
 * a bfloat16 value, so that (q - 8) * scale is exact in float32 (at most 4 + 8 significant
 * bits) and a fused multiply-add rounds as the multiply and add apart do: the values of
 * astrai/infer/int4.py's `dequantize`, to the bit. For a prompt's rows (int4.py's dense road),
 * where torch's unpacking and conversions of the 0.5B shape's matrices took 2.5-17 ms a matrix
 * and this takes 0.6 (docs/inference.md, "Prompts take a dense road").
 * Returns 0, or -1 for a shape it does not take. */
int astrai_int4_dequantize(const uint8_t *nibbles, const float *scale, const float *zero,
                           int group, int in, int row0, int row1, void *dst, int bf16,
                           int threads) {
    if (in <= 0 || row0 < 0 || row1 < row0 || threads <= 0) return -1;
    if ((group != 32 && group != 64 && group != 128) || in % group) return -1;
    const int width = (in + PAIR - 1) / PAIR * PAIR, unit = UNIT(group), half = unit / 2;
    const int units = width / unit, groups = in / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int row = row0; row < row1; row++) {
        size_t at = (size_t)(row - row0) * in;
        for (int u = 0; u < units; u++) {
            const uint8_t *w = nibbles + tiled(row, u, units, half);
            for (int high = 0; high < 2; high++) { /* each half lies in one group */
                int i = u * unit + high * half, n = in - i < half ? in - i : half;
                if (n <= 0) break;
                int g = row * groups + i / group;
                dequantize_half(w, high, n, scale[g], zero[g],
                                bf16 ? NULL : (float *)dst + at + i,
                                bf16 ? (uint16_t *)dst + at + i : NULL);
            }
        }
    }
    return 0;
}

/* weight: w + 128 in tiles (see the top), width = in rounded up to 64 (w zero past in). */
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
        int r0, r1;
        thread_rows(out, &r0, &r1);
        if (isa == 2) int8_rows512(weight, row_scale, &a, y, out, r0, r1);
        else int8_rows256(weight, row_scale, &a, y, out, r0, r1);
    }
    free_activations(&a);
    return 0;
}
