/* The next-token cross-entropy of a chunk of logits and its gradient, in one call: each row's
 * loss, and the row overwritten in place by d loss / d logits (softmax minus the smoothed one-hot).
 *
 * torch runs this as eight ops over the chunk (amax, gather, sub, exp, sum, div, scatter_add,
 * mul), and in bfloat16 two casts more, each a pass over the whole chunk; here one row at a
 * time (128 KB for 32,000 float32 logits: in L2) is read three times while it is in cache:
 * its maximum (and sum, for smoothing and to spot a NaN), exp(x - max) into a float32 row of
 * scratch and their sum, then the gradient from the scratch row. bfloat16 rows round once, at
 * the end, where torch rounds them (its softmax runs in float32 over the widened logits).
 *
 * Logits are float32 or bfloat16 bits (`bf16`), `vocab` a multiple of 8; labels equal to
 * `ignore` give a zero loss and a zero gradient row. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define GRAIN 32768 /* logits below which a call is not worth waking the other threads */

/* The loss of row x (at element `at`) and its gradient written over it; `scratch` holds
 * `vocab` floats (the row's exponentials, kept in float32 between the last two passes). */
AVX2 static float loss_row(void *x, int bf16, size_t at, int64_t vocab, int64_t target,
                           float smoothing, float *scratch) {
    __m256 top8 = _mm256_set1_ps(-INFINITY), sum8_ = _mm256_setzero_ps();
    for (int64_t i = 0; i < vocab; i += 8) {
        __m256 v = load8(x, bf16, at + i);
        top8 = _mm256_max_ps(top8, v);
        sum8_ = _mm256_add_ps(sum8_, v);
    }
    float total = sum8(sum8_);
    if (!isfinite(total)) /* a NaN or infinite logit: the loss says so, the step skips */
        return NAN;
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int l = 0; l < 8; l++)
        top = lanes[l] > top ? lanes[l] : top;
    __m256 shift = _mm256_set1_ps(top), norm8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < vocab; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(load8(x, bf16, at + i), shift));
        _mm256_storeu_ps(scratch + i, e);
        norm8 = _mm256_add_ps(norm8, e);
    }
    float norm = sum8(norm8);
    float picked = bf16 ? bf16_to_float(((uint16_t *)x)[at + target]) : ((float *)x)[at + target];
    float log_norm = top + logf(norm); /* the row's logsumexp */
    /* F.cross_entropy's smoothing: eps times the mean NLL over the vocabulary */
    float loss = (1.0f - smoothing) * (log_norm - picked) +
                 smoothing * (log_norm - total / (float)vocab);
    scratch[target] -= (1.0f - smoothing) * norm; /* minus (1 - eps) at the label, once scaled */
    __m256 inv = _mm256_set1_ps(1.0f / norm), floor_ = _mm256_set1_ps(smoothing / (float)vocab);
    for (int64_t i = 0; i < vocab; i += 8) {
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(scratch + i), inv);
        store8(x, bf16, at + i, _mm256_sub_ps(p, floor_));
    }
    return loss;
}

/* A zero gradient row (an ignored label). */
AVX2 static void zero_row(void *x, int bf16, size_t at, int64_t vocab) {
    for (int64_t i = 0; i < vocab; i += 8)
        store8(x, bf16, at + i, _mm256_setzero_ps());
}

/* logits [rows, vocab] become d loss / d logits; loss[r] is row r's loss (0 where ignored).
 * 0, 1: vocab not a multiple of 8, 2: a label outside [0, vocab) that is not `ignore`,
 * 3: no memory for a row's exponentials. */
int astrai_cross_entropy_grad(void *logits, int bf16, int64_t rows, int64_t vocab,
                              const int64_t *labels, int64_t ignore, float smoothing,
                              float *loss, int threads) {
    if (vocab < 8 || vocab % 8)
        return 1;
    for (int64_t r = 0; r < rows; r++)
        if (labels[r] != ignore && (labels[r] < 0 || labels[r] >= vocab))
            return 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * vocab >= GRAIN)
    {
        float *scratch = malloc((size_t)vocab * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t r = 0; r < rows; r++) {
            size_t at = (size_t)r * vocab;
            if (!scratch)
                continue;
            if (labels[r] == ignore) {
                zero_row(logits, bf16, at, vocab);
                loss[r] = 0.0f;
            } else {
                loss[r] = loss_row(logits, bf16, at, vocab, labels[r], smoothing, scratch);
            }
        }
        free(scratch);
    }
    if (failed)
        return 3;
    return 0;
}
