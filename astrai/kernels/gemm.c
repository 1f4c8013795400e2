/* Many-row products y = x @ W.T of 4-bit weights (a prompt's rows), where gemv.c streams the
 * weights once and multiplies each activation row apart: the same packed weights and the same
 * int8 activations (quantized.h), multiplied as a blocked matrix product. AVX-512 VNNI only.
 *
 * Each thread takes panels of PANEL output columns (two column blocks). A panel's weights are
 * masked apart once from the nibbles into vpdpbusd's unsigned operand, [width / 4][PANEL][4]
 * bytes (four consecutive inputs of each column side by side), and stay in L2 while every
 * activation row passes over them, ROWS at a time: each step loads the panel's 4 inputs x
 * PANEL columns (two vectors), broadcasts each row's 4 int8 inputs, and adds 2 x ROWS integer
 * dots into as many accumulators. A group's integer sums become float once, times the row's
 * step and the column's scale; the zero points' share is added at the end, (zero - 8 scale)
 * times the row's sum over each group.
 *
 * Measured on a 2-core AMD EPYC Zen 5 (two threads, freed memory kept as prepare_params has
 * it: astrai/infer/allocator.py), the 0.5B shape's layer of 4-bit matrices (1152, 896, 4864,
 * 4864 x 896 and 896 x 4864): 1,400-1,800 GOP/s from 256 to 2,048 rows, against 500-700 for
 * gemv then (in column blocks since, about as fast up to 64 rows), 660-920 for the dense road
 * (dequantized to bfloat16 and torch's product) and 1,180-1,230 for torch's int8 x int8
 * product; unpacking the panels takes 1% of it at 2,048 rows, quantizing the activations 3%
 * (panels unpacked then by a transpose, since by two masks). Blocks of 4 or 6 rows and 32 or
 * 64 columns ran alike (within 2%). gcc 12 copied each accumulator to another register around
 * every vpdpbusd of the intrinsic (730 GOP/s against 1,050 at the time), hence the one-line
 * assembly.
 *
 * Each output's sum runs in the same order whatever the number of rows or threads (a row's
 * accumulators are its own; threads split the columns): a row's outputs are the same bits alone
 * or in any batch, and the same as gemv's, which sums the same integers and floats in the same
 * order. */
#include "quantized.h"

#define PANEL 32                  /* output columns a panel: two vectors of 16 */
#define VECTORS (PANEL / 16)
#define ROWS 6                    /* activation rows a block: 12 integer and 12 float sums */

/* vpdpbusd, acc += the 4-byte dots of w (unsigned) with x (signed), as one instruction */
#define DOT(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))

/* Columns c0 .. c0 + PANEL of the 4-bit matrix as the panel's bytes (columns past
 * `padded_out`, the last panel's, zero), and each group's scale and zero - 8 scale per column,
 * float32 [groups][PANEL]. A line of a column block (quantized.h) is two of the panel's steps
 * once its nibbles are apart: the low ones (inputs 0-3 of its 16 columns) and the high ones. */
AVX512 static void unpack_panel(const uint8_t *nibbles, const uint16_t *scale,
                                const uint16_t *zero, int padded_out, int width, const int G,
                                int c0, uint8_t *panel, float *scales, float *offsets) {
    const int octets = width / 8, groups = width / G;
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < VECTORS; v++) {
        const int column = c0 / COLUMNS + v;
        const int real = COLUMNS * column < padded_out;
        const uint8_t *line = nibbles + (size_t)column * octets * 64;
        for (int k = 0; k < octets; k++) {
            /* the next panel's line into L2, while this panel's rows run: 1.00-1.04x */
            _mm_prefetch((const char *)line + ((size_t)VECTORS * octets + k) * 64, _MM_HINT_T1);
            const __m512i bytes = real ? _mm512_load_si512(line + (size_t)k * 64)
                                       : _mm512_setzero_si512();
            uint8_t *to = panel + (size_t)k * 8 * PANEL + 64 * v;
            _mm512_store_si512(to, _mm512_and_si512(bytes, low));
            _mm512_store_si512(to + 4 * PANEL, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
        }
        for (int g = 0; g < groups; g++) {
            const size_t at = ((size_t)column * groups + g) * COLUMNS;
            __m512 s = _mm512_setzero_ps(), z = _mm512_setzero_ps();
            if (real) {
                s = load16_bf16(scale + at);
                z = load16_bf16(zero + at);
            }
            _mm512_store_ps(scales + g * PANEL + 16 * v, s);
            _mm512_store_ps(offsets + g * PANEL + 16 * v,
                            _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z));
        }
    }
}

/* R activation rows from x0 times the panel at column c0, into y. The step is the
 * activations' block (32, or the group of 128: quantized.h), so a group of 32 or 64 spans
 * one or two steps, each with its own step. */
AVX512 INLINE void panel_rows(const uint8_t *panel, const float *scales, const float *offsets,
                              const Activations *a, int x0, const int R, float *y, int out,
                              int c0, const int G) {
    const int width = a->width, groups = width / G, block = a->block, blocks = width / block;
    __m512 sums[ROWS][VECTORS];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < VECTORS; v++) sums[i][v] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i dots[ROWS][VECTORS];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
#pragma GCC unroll 4
            for (int v = 0; v < VECTORS; v++) dots[i][v] = _mm512_setzero_si512();
        const uint8_t *w = panel + (size_t)b * block * PANEL;
        const int8_t *xq = a->q + (size_t)x0 * width + (size_t)b * block;
        for (int j = 0; j < block / 4; j++) {
            __m512i wv[VECTORS];
#pragma GCC unroll 4
            for (int v = 0; v < VECTORS; v++)
                wv[v] = _mm512_load_si512(w + (size_t)j * 4 * PANEL + 64 * v);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                int32_t four;
                memcpy(&four, xq + (size_t)i * width + 4 * j, 4);
                const __m512i x = _mm512_set1_epi32(four);
#pragma GCC unroll 4
                for (int v = 0; v < VECTORS; v++) DOT(dots[i][v], wv[v], x);
            }
        }
        const float *s = scales + (size_t)(b * block / G) * PANEL;
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const __m512 step = _mm512_set1_ps(a->step[(size_t)(x0 + i) * blocks + b]);
#pragma GCC unroll 4
            for (int v = 0; v < VECTORS; v++) {
                const __m512 k = _mm512_mul_ps(step, _mm512_load_ps(s + 16 * v));
                sums[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i][v]), k, sums[i][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        const float *group_sum = a->group_sum + (size_t)(x0 + i) * groups;
        for (int g = 0; g < groups; g++) {
            const __m512 sum = _mm512_set1_ps(group_sum[g]);
#pragma GCC unroll 4
            for (int v = 0; v < VECTORS; v++)
                sums[i][v] = _mm512_fmadd_ps(_mm512_load_ps(offsets + g * PANEL + 16 * v), sum,
                                             sums[i][v]);
        }
#pragma GCC unroll 4
        for (int v = 0; v < VECTORS; v++) {
            const int left = out - (c0 + 16 * v);
            if (left <= 0) break;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(y + (size_t)(x0 + i) * out + c0 + 16 * v, m, sums[i][v]);
        }
    }
}

/* Every activation row times one panel, ROWS at a time, then the rest in one block. */
#define PANEL_ROWS(G)                                                                         \
    AVX512 static void panel_rows_##G(const uint8_t *p, const float *s, const float *o,      \
                                      const Activations *a, float *y, int out, int c0) {     \
        int x0 = 0;                                                                           \
        for (; a->rows - x0 >= ROWS; x0 += ROWS) panel_rows(p, s, o, a, x0, ROWS, y, out, c0, G); \
        switch (a->rows - x0) {                                                               \
        case 5: panel_rows(p, s, o, a, x0, 5, y, out, c0, G); break;                          \
        case 4: panel_rows(p, s, o, a, x0, 4, y, out, c0, G); break;                          \
        case 3: panel_rows(p, s, o, a, x0, 3, y, out, c0, G); break;                          \
        case 2: panel_rows(p, s, o, a, x0, 2, y, out, c0, G); break;                          \
        case 1: panel_rows(p, s, o, a, x0, 1, y, out, c0, G); break;                          \
        }                                                                                     \
    }
PANEL_ROWS(32)
PANEL_ROWS(64)
PANEL_ROWS(128)

/* astrai_int4_gemv's arguments and layouts; isa 0 or 2 (AVX-512 VNNI, the only path).
 * Returns 0, or a negative code: -1 bad shape, -2 out of memory, -3 no AVX-512 VNNI. */
int astrai_int4_gemm(const float *x, int rows, int in, const uint8_t *nibbles,
                     const uint16_t *scale, const uint16_t *zero, int out, int group, float *y,
                     int threads, int isa) {
    if (in <= 0 || rows <= 0 || out <= 0 || threads <= 0) return -1;
    if (group != 32 && group != 64 && group != 128) return -1;
    const int width = (in + PAIR - 1) / PAIR * PAIR;
    if (width % group) return -1;
    if (astrai_gemv_isa() < 2 || (isa != 0 && isa != 2)) return -3;
    Activations a;
    if (!alloc_activations(&a, rows, width, group, group > PAIR ? group : BLOCK)) {
        free_activations(&a);
        return -2;
    }
    quantize_activations(x, in, &a, group, threads);
    const int padded_out = (out + COLUMNS - 1) / COLUMNS * COLUMNS;
    const int panels = (out + PANEL - 1) / PANEL;
    const int groups = width / group;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *panel = aligned_alloc(64, (size_t)width * PANEL);
        float *scales = aligned_alloc(64, sizeof(float) * groups * PANEL);
        float *offsets = aligned_alloc(64, sizeof(float) * groups * PANEL);
        if (!panel || !scales || !offsets) {
#pragma omp atomic write
            failed = 1;
        } else {
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
            const int first = (int)((long)panels * t / n), last = (int)((long)panels * (t + 1) / n);
            for (int p = first; p < last; p++) {
                const int c0 = p * PANEL;
                unpack_panel(nibbles, scale, zero, padded_out, width, group, c0, panel, scales,
                             offsets);
                if (group == 32) panel_rows_32(panel, scales, offsets, &a, y, out, c0);
                else if (group == 64) panel_rows_64(panel, scales, offsets, &a, y, out, c0);
                else panel_rows_128(panel, scales, offsets, &a, y, out, c0);
            }
        }
        free(panel);
        free(scales);
        free(offsets);
    }
    free_activations(&a);
    return failed ? -2 : 0;
}
