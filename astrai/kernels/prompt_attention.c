/* Attention of a prompt's rows under a mask: softmax(q k^T * scale, where the mask allows) v,
 * float32, for the rows of a prefill (astrai/model/masked_attention.py). torch's fused CPU
 * kernel computes every score and masks it afterwards, so a causal prompt costs it the whole
 * square; here each block of query rows reads only the keys its mask rows allow, so a causal
 * prompt costs half, and the scores never leave L1 (an online softmax, as flash attention's).
 *
 * Layouts (contiguous): q [B][H][T][D]; k, v [B][Hkv][S][D]; mask [B or 1][T][S], bool (true
 * where query t may attend key s) or additive float32 (-inf where it may not), at least one
 * key a row; out [B][H][T][D]. Query heads
 * h = g * groups + j share K/V head g. D at most MAX_DIM.
 *
 * K is first transposed per (batch, K/V head) to [D][S rounded up to 16], so that a step of
 * the scores multiplies one query input (broadcast) by 16 keys' inputs: ROWS query rows x 64
 * keys in 16 accumulators. The probabilities of a block (ROWS x 64, in L1) then multiply V's
 * rows, 64 outputs at a time for the ROWS rows. Work is split over (batch, head, block of ROWS
 * rows) on the OpenMP threads of the libgomp torch loads, dynamically, since a causal row's
 * work grows with its position. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define AVX512F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ROWS 4     /* query rows a block */
#define KEYS 64    /* keys a block: four vectors */
#define MAX_DIM 256

/* A mask: bool bytes, true where a query may attend a key, or additive float32 (added to the
 * scaled scores; -inf where it may not), [batches][T][S]. */
typedef struct {
    const void *values;
    int additive, batches, T, S;
} Mask;

/* Where row t of batch b's mask starts (one mask for every batch where batches is 1). */
static const void *mask_row(const Mask *m, int b, int t) {
    const size_t at = ((size_t)(m->batches == 1 ? 0 : b) * m->T + t) * m->S;
    return m->additive ? (const void *)((const float *)m->values + at)
                       : (const void *)((const uint8_t *)m->values + at);
}

static int allows(const Mask *m, const void *row, int s) {
    return m->additive ? ((const float *)row)[s] != -INFINITY : ((const uint8_t *)row)[s] != 0;
}

/* The keys mask row `row` allows lie in [*first, *last): widened to hold them. */
static void allowed(const Mask *m, const void *row, int *first, int *last) {
    int a = 0, b = m->S;
    while (a < b && !allows(m, row, a)) a++;
    while (b > a && !allows(m, row, b - 1)) b--;
    if (a < b) {
        *first = a < *first ? a : *first;
        *last = b > *last ? b : *last;
    }
}

/* Lanes of mask row `row` at keys j .. j + 15 that are allowed (keys past S are not), and
 * into *add what the mask adds to their scores (0 for a bool mask). */
AVX512F INLINE __mmask16 lanes_allowed(const Mask *m, const void *row, int j, __m512 *add) {
    const int S = m->S;
    const __mmask16 inside = S - j >= 16 ? 0xffff : (__mmask16)((1u << (S - j)) - 1);
    if (m->additive) {
        *add = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), inside, (const float *)row + j);
        return _mm512_cmp_ps_mask(*add, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    }
    *add = _mm512_setzero_ps();
    __m128i bytes = _mm_maskz_loadu_epi8(inside, (const uint8_t *)row + j);
    return _mm_test_epi8_mask(bytes, bytes);
}

/* The lanes of a vector of 16 at element e that lie within a row of D */
INLINE __mmask16 part(int D, int e) {
    return D - e >= 16 ? 0xffff : (__mmask16)((1u << (D - e)) - 1);
}

/* One block: R query rows q (of stride D) against keys [first, last) of kt [D][stride] and
 * v [S][D], under the mask's rows t0 .. t0 + R of batch b, into out (stride D). */
AVX512F INLINE void attend_block(const float *q, const int R, const float *kt, int stride,
                                 const float *v, const Mask *mask, int b, int t0, const int D,
                                 float scale, int first, int last, float *out) {
    float o[ROWS][MAX_DIM] __attribute__((aligned(64)));
    float p[ROWS][KEYS] __attribute__((aligned(64)));
    float most[ROWS], total[ROWS];
    for (int r = 0; r < R; r++) {
        most[r] = -INFINITY;
        total[r] = 0.0f;
        memset(o[r], 0, sizeof(float) * (D + 15) / 16 * 16);
    }
    for (int j0 = first / 16 * 16; j0 < last; j0 += KEYS) {
        const int left = (last - j0 + 15) / 16, vectors = left < KEYS / 16 ? left : KEYS / 16;
        __m512 s[ROWS][KEYS / 16];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
            for (int c = 0; c < KEYS / 16; c++) s[r][c] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const float *krow = kt + (size_t)d * stride + j0;
            __m512 kv[KEYS / 16];
#pragma GCC unroll 4
            for (int c = 0; c < KEYS / 16; c++)
                kv[c] = c < vectors ? _mm512_loadu_ps(krow + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 x = _mm512_set1_ps(q[(size_t)r * D + d]);
#pragma GCC unroll 4
                for (int c = 0; c < KEYS / 16; c++)
                    s[r][c] = _mm512_fmadd_ps(x, kv[c], s[r][c]);
            }
        }
        for (int r = 0; r < R; r++) {
            const void *row = mask_row(mask, b, t0 + r);
            __m512 high = _mm512_set1_ps(-INFINITY);
            __mmask16 m[KEYS / 16];
            for (int c = 0; c < KEYS / 16; c++) {
                __m512 add = _mm512_setzero_ps();
                m[c] = c < vectors ? lanes_allowed(mask, row, j0 + 16 * c, &add) : 0;
                s[r][c] = _mm512_mask_fmadd_ps(s[r][c], m[c], _mm512_set1_ps(scale), add);
                s[r][c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m[c], s[r][c]);
                high = _mm512_max_ps(high, s[r][c]);
            }
            const float block_most = _mm512_reduce_max_ps(high);
            if (block_most == -INFINITY) { /* nothing allowed for this row here */
                memset(p[r], 0, sizeof p[r]);
                continue;
            }
            const float new_most = block_most > most[r] ? block_most : most[r];
            const float keep = most[r] == -INFINITY ? 0.0f : expf(most[r] - new_most);
            most[r] = new_most;
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < KEYS / 16; c++) {
                /* masked lanes 0, not exp16's floor e^-87.3 */
                __m512 e = exp16(_mm512_sub_ps(s[r][c], _mm512_set1_ps(new_most)));
                e = _mm512_maskz_mov_ps(m[c], e);
                sum = _mm512_add_ps(sum, e);
                _mm512_store_ps(p[r] + 16 * c, e);
            }
            total[r] = total[r] * keep + _mm512_reduce_add_ps(sum);
            if (keep != 1.0f)
                for (int e = 0; e < D; e += 16)
                    _mm512_store_ps(o[r] + e, _mm512_mul_ps(_mm512_load_ps(o[r] + e),
                                                            _mm512_set1_ps(keep)));
        }
        const int keys = last - j0 < KEYS ? last - j0 : KEYS;
        for (int e0 = 0; e0 < D; e0 += 64) {
            const int width = D - e0 < 64 ? (D - e0 + 15) / 16 : 4;
            __m512 acc[ROWS][4];
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) /* every row set: R is a constant only at ROWS */
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    acc[r][c] = r < R && c < width ? _mm512_load_ps(o[r] + e0 + 16 * c)
                                                   : _mm512_setzero_ps();
            for (int j = 0; j < keys; j++) {
                const float *vrow = v + (size_t)(j0 + j) * D + e0;
                __m512 vv[4];
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    vv[c] = c < width ? _mm512_maskz_loadu_ps(part(D, e0 + 16 * c), vrow + 16 * c)
                                      : _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m512 w = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++)
                        acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int c = 0; c < width; c++)
                    _mm512_store_ps(o[r] + e0 + 16 * c, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        for (int e = 0; e < D; e += 16)
            _mm512_mask_storeu_ps(out + (size_t)r * D + e, part(D, e),
                                  _mm512_mul_ps(_mm512_load_ps(o[r] + e), inv));
    }
}

/* Every block of ROWS query rows of every (batch, head), with its keys from the mask. */
AVX512F static void attend_all(const float *q, const float *kt, int stride, const float *v,
                               const Mask *mask, float *out, int B, int H, int Hkv, int T, int D,
                               float scale, int threads) {
    const int S = mask->S, groups = H / Hkv, blocks = (T + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) collapse(3) schedule(dynamic, 2)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < blocks; i++) {
                const int g = h / groups, t0 = i * ROWS, R = T - t0 < ROWS ? T - t0 : ROWS;
                int first = S, last = 0;
                for (int r = 0; r < R; r++) allowed(mask, mask_row(mask, b, t0 + r), &first, &last);
                const size_t at = (((size_t)b * H + h) * T + t0) * D;
                const float *kb = kt + ((size_t)b * Hkv + g) * D * stride;
                const float *vb = v + ((size_t)b * Hkv + g) * S * D;
                if (R == ROWS)
                    attend_block(q + at, ROWS, kb, stride, vb, mask, b, t0, D, scale, first, last,
                                 out + at);
                else
                    attend_block(q + at, R, kb, stride, vb, mask, b, t0, D, scale, first, last,
                                 out + at);
            }
}

/* 1 where the kernel runs here (AVX-512 F/BW/VL/DQ, and torch's kernels not held below it by
 * ATEN_CPU_CAPABILITY), else 0 */
int astrai_masked_attention_isa(void) {
    __builtin_cpu_init();
    const char *torch_held = getenv("ATEN_CPU_CAPABILITY");
    if (torch_held && *torch_held && strncmp(torch_held, "avx512", 6)) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/* Returns 0, or -1 for a shape it does not take, -2 out of memory, -3 no AVX-512.
 * mask_batches: 1 (one mask for every batch) or B; additive: the mask is float32 (else bool). */
int astrai_masked_attention(const float *q, const float *k, const float *v, const void *mask,
                            int additive, int mask_batches, float *out, int B, int H, int Hkv,
                            int T, int S, int D, float scale, int threads) {
    if (B <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || T <= 0 || S <= 0 || D <= 0 ||
        D > MAX_DIM || (mask_batches != 1 && mask_batches != B) || threads <= 0)
        return -1;
    if (!astrai_masked_attention_isa()) return -3;
    /* K transposed, [B][Hkv][D][stride], the keys past S zero */
    const int stride = (S + 15) / 16 * 16;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)B * Hkv * D * stride);
    if (!kt) return -2;
#pragma omp parallel for num_threads(threads) collapse(2)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            const float *src = k + ((size_t)b * Hkv + g) * S * D;
            float *dst = kt + ((size_t)b * Hkv + g) * D * stride;
            for (int d = 0; d < D; d++) {
                for (int s = 0; s < S; s++) dst[(size_t)d * stride + s] = src[(size_t)s * D + d];
                for (int s = S; s < stride; s++) dst[(size_t)d * stride + s] = 0.0f;
            }
        }
    const Mask m = {mask, additive, mask_batches, T, S};
    attend_all(q, kt, stride, v, &m, out, B, H, Hkv, T, D, scale, threads);
    free(kt);
    return 0;
}
