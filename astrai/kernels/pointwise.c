/* The element-wise steps between a decode step's matrix products, one call each: RMSNorm (with
 * the residual add before it) and the gated activation of the MLP. torch runs each as four to
 * eight small ops (RMSNorm alone ~14 us on 896 values, more once the weights streamed between
 * layers have pushed its code and buffers out of the caches); here each is one pass.
 *
 * Activations are float32 or bfloat16 bits (`bf16`), rows `stride` elements apart, the widths
 * a multiple of 8; outputs are contiguous. bfloat16 rounds where torch's bfloat16 ops round:
 * after the residual add, after normalising (before the weight multiplies, as Llama does),
 * after the activation and after the product with `up`. Each call runs on the calling thread
 * unless its work is large (a prompt chunk), then on the OpenMP threads of torch's libgomp. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vector_math.h"

#define GRAIN 32768 /* values below which a call is not worth waking the other threads */

/* One row of astrai_rms_norm; x and residual at element `in`, sum and out at `at`. */
AVX2 static void norm_row(const void *x, const void *residual, size_t in, size_t at, int dim,
                          const void *weight, int bf16, float eps, void *sum, void *out) {
    if (residual) { /* the sum is stored rounded, and normalised as stored */
        for (int i = 0; i < dim; i += 8)
            store8(sum, bf16, at + i,
                   _mm256_add_ps(load8(x, bf16, in + i), load8(residual, bf16, in + i)));
        x = sum, in = at;
    }
    __m256 squares = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 8) {
        __m256 v = load8(x, bf16, in + i);
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    __m256 scale = _mm256_set1_ps(1.0f / sqrtf(sum8(squares) / (float)dim + eps));
    for (int i = 0; i < dim; i += 8) {
        __m256 v = _mm256_mul_ps(load8(x, bf16, in + i), scale);
        v = bf16 ? round_bf16(v) : v; /* rounded before the weight multiplies */
        store8(out, bf16, at + i, _mm256_mul_ps(v, load8(weight, bf16, i)));
    }
}

/* sum = x + residual (when residual is given), out = RMSNorm(sum or x) * weight.
 * 0, or 1: a width that is not a multiple of 8. */
int astrai_rms_norm(const void *x, const void *residual, int64_t stride, int rows, int dim,
                    const void *weight, int bf16, float eps, void *sum, void *out, int threads) {
    if (dim < 8 || dim % 8)
        return 1;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * dim >= GRAIN)
    for (int r = 0; r < rows; r++)
        norm_row(x, residual, (size_t)r * stride, (size_t)r * dim, dim, weight, bf16, eps, sum,
                 out);
    return 0;
}

/* sigmoid(g) for any g: e^-|g| never overflows */
AVX2 INLINE __m256 sigmoid8(__m256 g) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
    __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), negative);
}

/* gelu with tanh's approximation: g * sigmoid(2 * sqrt(2 / pi) * (g + 0.044715 g^3)), which
 * is 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
AVX2 INLINE __m256 gelu8(__m256 g) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    __m256 z = _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g);
    return _mm256_mul_ps(g, sigmoid8(_mm256_mul_ps(z, _mm256_set1_ps(1.5957691216f))));
}

/* One row of astrai_gated_activation; gate and up at element `in`, out at `at`. */
AVX2 static void gate_row(const void *gate, const void *up, size_t in, size_t at, int n, int bf16,
                          int act, void *out) {
    for (int i = 0; i < n; i += 8) {
        __m256 g = load8(gate, bf16, in + i);
        __m256 a = act ? gelu8(g) : _mm256_mul_ps(g, sigmoid8(g));
        a = bf16 ? round_bf16(a) : a; /* rounded before the product */
        store8(out, bf16, at + i, _mm256_mul_ps(a, load8(up, bf16, in + i)));
    }
}

/* load8, round_bf16, store8, sigmoid8 and gelu8 16 lanes wide: the same steps a lane, so the
 * same bits as the 8-lane row (a prompt's gated activation 1.9x as fast: 4.7 -> 2.5 ms for
 * 2,048 x 4,864 bfloat16 values on 2 AMD Zen 5 cores). */
AVX512_WORDS INLINE __m512 load16(const void *p, int bf16, size_t i) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)p + i);
    __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

AVX512_WORDS INLINE __m512 round_bf16_16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000)));
}

AVX512_WORDS INLINE void store16(void *p, int bf16, size_t i, __m512 v) {
    if (!bf16) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(v)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(high));
}

AVX512_WORDS INLINE __m512 sigmoid16(__m512 g) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(negative, inv, _mm512_mul_ps(e, inv));
}

AVX512_WORDS INLINE __m512 gelu16(__m512 g) {
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, g);
    return _mm512_mul_ps(g, sigmoid16(_mm512_mul_ps(z, _mm512_set1_ps(1.5957691216f))));
}

/* gate_row, 16 values at a time; the last 8 (n an odd multiple of 8) by gate_row */
AVX512_WORDS static void gate_row16(const void *gate, const void *up, size_t in, size_t at,
                                    int n, int bf16, int act, void *out) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = load16(gate, bf16, in + i);
        __m512 a = act ? gelu16(g) : _mm512_mul_ps(g, sigmoid16(g));
        a = bf16 ? round_bf16_16(a) : a;
        store16(out, bf16, at + i, _mm512_mul_ps(a, load16(up, bf16, in + i)));
    }
    if (i < n)
        gate_row(gate, up, in + i, at + i, n - i, bf16, act, out);
}

int astrai_gemv_isa(void);

/* out = act(gate) * up, act 0: silu, 1: gelu (tanh). 0, or 1: a width not a multiple of 8 or
 * an activation it lacks. */
int astrai_gated_activation(const void *gate, const void *up, int64_t stride, int rows, int n,
                            int bf16, int act, void *out, int threads) {
    if (n < 8 || n % 8 || act < 0 || act > 1)
        return 1;
    void (*row)(const void *, const void *, size_t, size_t, int, int, int, void *) =
        astrai_gemv_isa() == 2 ? gate_row16 : gate_row; /* the AVX-512 path, where it runs */
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * n >= GRAIN)
    for (int r = 0; r < rows; r++)
        row(gate, up, (size_t)r * stride, (size_t)r * n, n, bf16, act, out);
    return 0;
}

/* The first index of the row's largest value, as torch's argmax gives it (a NaN counts as the
 * largest: the first NaN's index). Two passes over the row: its maximum eight lanes at a
 * time, then the first index holding it; the row, just written by the head's product, is in
 * the caches for both. */
AVX2 static int64_t argmax_row(const float *x, int n) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float most = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) most = lanes[l] > most ? lanes[l] : most;
    int any_nan = _mm256_movemask_ps(nan);
    for (int j = i; j < n; j++) {
        any_nan |= x[j] != x[j];
        most = x[j] > most ? x[j] : most;
    }
    for (int j = 0; any_nan && j < n; j++)
        if (x[j] != x[j]) return j;
    const __m256 target = _mm256_set1_ps(most);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 equal = _mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ);
        const int hit = _mm256_movemask_ps(equal);
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == most) return i;
    return 0; /* every value -inf */
}

/* out[r] = argmax_row of each of `rows` rows of `vocab` float32 logits, `stride` apart. */
void astrai_argmax_rows(const float *x, int rows, int vocab, long stride, int64_t *out,
                        int threads) {
#pragma omp parallel for num_threads(threads) if ((long)rows * vocab > GRAIN * 8)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * stride, vocab);
}
