/* Decode attention over the page pool: one new query row per sequence attends over that
 * sequence's keys where they lie in their pages, so nothing is gathered into a contiguous copy
 * first (a copy of every sequence's keys and values, each layer of each step).
 *
 * Layouts (all contiguous unless a stride is given):
 *   q     float32, query head h of row b at q + b * q_stride + h * dim
 *   k, v  one layer of the pool, [pages * page_size][kv_heads][dim], float32 or bfloat16 bits
 *   table int64 [rows][width]: the pages of each row in order
 *   keys  int64 [rows]: how many keys row b sees (its position + 1)
 *   out   float32 [rows][heads][dim]
 * Query heads h = g * groups + j share K/V head g (grouped-query attention). With window > 0 a
 * row sees only its last `window` keys. Work is split over (row, K/V head) pairs on the OpenMP
 * threads of the libgomp torch loads. Scores and sums are float32, softmax by its maximum.
 * astrai_paged_decode does a decode step's whole attention in one call: each row's new query
 * and key rotated, the key and value written to the pool, then the same attention. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

/* lane i = the sum of the lanes of a[i] */
AVX2 INLINE __m256 sums8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Keys ahead of the eight at work whose rows are asked for: a key's row of one K/V head lies
 * apart from the next key's (the other heads between, and pages anywhere), a pattern the
 * hardware's prefetchers miss. 16 keys ahead read a 1B shape's pool at 16 rows 1.25x as fast
 * (pages in order; in random order 1.53x), 64 rows 1.59x, one row of 500 keys 1.55x, the 0.5B
 * shape's 16 rows 1.16x (2-core AMD Zen 5); 8 or 32 keys ahead 0.85-1.03x of 16. */
#define AHEAD 16

/* Ask the cache for the `dim` values from element `at` of a layer of the pool. */
static inline void ask_for_row(const void *p, int bf16, size_t at, int dim) {
    const char *first = (const char *)p + (at << (2 - bf16));
    for (int b = 0; b < dim << (2 - bf16); b += 64)
        _mm_prefetch(first + b, _MM_HINT_T0);
}

typedef struct {
    const void *k, *v;
    int bf16, pages, kv_heads, dim, page_size;
    float scale;
} Pool;

/* Where keys first..first+n-1 of K/V head g start in the layer's pool, for a row with these
 * pages: worked out once, as both passes over the keys read them for every query head. */
static int locate(const Pool *pool, const int64_t *pages, int first, int n, int g, size_t *at) {
    for (int i = 0; i < n; i++) {
        int t = first + i;
        int64_t page = pages[t / pool->page_size];
        if (page < 0 || page >= pool->pages)
            return 0;
        size_t slot = (size_t)page * pool->page_size + t % pool->page_size;
        at[i] = (slot * pool->kv_heads + g) * pool->dim;
    }
    return 1;
}

/* scores[j][i] = q_j . k_(first + i) * scale for the `groups` query heads of K/V head g, eight
 * keys at a time (a short last block repeats its first key and keeps only the real scores). */
AVX2 static void score(const Pool *pool, const float *q, const size_t *at, int n, int groups,
                       int stride, float *scores) {
    for (int i = 0; i < n; i += 8) {
        size_t key[8];
        int count = n - i < 8 ? n - i : 8;
        for (int r = i + AHEAD; r < i + AHEAD + 8 && r < n; r++)
            ask_for_row(pool->k, pool->bf16, at[r], pool->dim);
        for (int r = 0; r < 8; r++)
            key[r] = at[i + (r < count ? r : 0)];
        for (int j = 0; j < groups; j++) {
            const float *qj = q + (size_t)j * pool->dim;
            __m256 acc[8];
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_setzero_ps();
            for (int d = 0; d < pool->dim; d += 8) {
                __m256 qd = _mm256_loadu_ps(qj + d);
                for (int r = 0; r < 8; r++)
                    acc[r] = _mm256_fmadd_ps(qd, load8(pool->k, pool->bf16, key[r] + d), acc[r]);
            }
            float block[8];
            _mm256_storeu_ps(block, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(pool->scale)));
            for (int r = 0; r < count; r++)
                scores[(size_t)j * stride + i + r] = block[r];
        }
    }
}

/* Each head's scores in place -> softmax weights (padded with zeros to a multiple of 8). */
AVX2 static void softmax(float *scores, int n, int groups, int stride) {
    for (int j = 0; j < groups; j++) {
        float *s = scores + (size_t)j * stride, top = -INFINITY, sum = 0.0f;
        for (int i = 0; i < n; i++)
            top = s[i] > top ? s[i] : top;
        for (int i = n; i < stride; i++)
            s[i] = -INFINITY;
        __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
        for (int i = 0; i < stride; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
            e = _mm256_blendv_ps(e, _mm256_setzero_ps(),
                                 _mm256_cmp_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(-INFINITY),
                                               _CMP_EQ_OQ));
            _mm256_storeu_ps(s + i, e);
            total = _mm256_add_ps(total, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, total);
        for (int l = 0; l < 8; l++)
            sum += lanes[l];
        __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (int i = 0; i < stride; i += 8)
            _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
    }
}

/* out_j = sum_i weights[j][i] v_(first + i), eight keys at a time: their values are read from
 * memory once and then from the first-level cache for every query head. The weights past n are
 * zero (softmax pads them), so a short last block repeats a key to no effect. */
AVX2 static void weigh(const Pool *pool, const float *weights, const size_t *at, int n,
                       int groups, int stride, float *out) {
    for (int j = 0; j < groups * pool->dim; j += 8)
        _mm256_storeu_ps(out + j, _mm256_setzero_ps());
    for (int i = 0; i < n; i += 8) {
        size_t value[8];
        for (int r = i + AHEAD; r < i + AHEAD + 8 && r < n; r++)
            ask_for_row(pool->v, pool->bf16, at[r], pool->dim);
        for (int r = 0; r < 8; r++)
            value[r] = at[i + r < n ? i + r : i];
        for (int j = 0; j < groups; j++) {
            const float *w = weights + (size_t)j * stride + i;
            float *o = out + (size_t)j * pool->dim;
            for (int d = 0; d < pool->dim; d += 8) {
                __m256 acc = _mm256_loadu_ps(o + d);
                for (int r = 0; r < 8; r++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(w[r]),
                                          load8(pool->v, pool->bf16, value[r] + d), acc);
                _mm256_storeu_ps(o + d, acc);
            }
        }
    }
}

/* Each decoding row's new token, for astrai_paged_decode: its projections and where they go. */
typedef struct {
    const void *qkv;        /* [rows] x [heads + 2 kv_heads][dim], rows `stride` apart */
    int64_t stride;
    int bf16;               /* qkv (and so the rotated q and k) in bfloat16 */
    const float *cos, *sin; /* [rows][dim] rotation tables (sin's first half negated), or NULL */
    const int64_t *slots;   /* [rows]: the pool slot of each row's new K/V */
} NewTokens;

static float element(const void *p, int bf16, size_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One head of the projections at `at` rotated by the tables (x cos + x rolled by half sin), or
 * copied without them, into dst, rounded to bfloat16 where the projections are. */
AVX2 static void rotate(const NewTokens *t, size_t at, const float *cos, const float *sin,
                        int dim, float *dst) {
    int half = dim / 2;
    if (cos && half % 8) /* half a head is no whole vector: one value at a time */
        for (int i = 0; i < dim; i++)
            dst[i] = element(t->qkv, t->bf16, at + i) * cos[i] +
                     element(t->qkv, t->bf16, at + (i + half) % dim) * sin[i];
    else
        for (int i = 0; i < dim; i += 8) {
            __m256 x = load8(t->qkv, t->bf16, at + i);
            if (cos) {
                __m256 rolled = load8(t->qkv, t->bf16, at + (i + half) % dim);
                x = _mm256_fmadd_ps(rolled, _mm256_loadu_ps(sin + i),
                                    _mm256_mul_ps(x, _mm256_loadu_ps(cos + i)));
            }
            _mm256_storeu_ps(dst + i, x);
        }
    for (int i = 0; t->bf16 && i < dim; i += 8)
        _mm256_storeu_ps(dst + i, round_bf16(_mm256_loadu_ps(dst + i)));
}

/* Row b's new key of K/V head g rotated and stored with its value at the row's slot, and the
 * group's query heads rotated into q [groups][dim]. */
AVX2 static void place(const Pool *pool, const NewTokens *t, int b, int g, int heads, int groups,
                       float *q) {
    int dim = pool->dim;
    size_t row = (size_t)b * t->stride, to = ((size_t)t->slots[b] * pool->kv_heads + g) * dim;
    const float *cos = t->cos ? t->cos + (size_t)b * dim : NULL;
    const float *sin = t->sin ? t->sin + (size_t)b * dim : NULL;
    for (int j = 0; j < groups; j++)
        rotate(t, row + (size_t)(g * groups + j) * dim, cos, sin, dim, q + (size_t)j * dim);
    float key[dim];
    rotate(t, row + (size_t)(heads + g) * dim, cos, sin, dim, key);
    size_t value = row + (size_t)(heads + pool->kv_heads + g) * dim;
    for (int i = 0; i < dim; i += 8) {
        store8((void *)pool->k, pool->bf16, to + i, _mm256_loadu_ps(key + i));
        store8((void *)pool->v, pool->bf16, to + i, load8(t->qkv, t->bf16, value + i));
    }
}

/* Attention of every row's query heads over its pages (astrai_paged_attention); with `new`,
 * every row's new token placed first. All are placed before any row attends, so rows that are
 * consecutive tokens of one sequence (a chunk, each row its own position) see each other's. */
static int attend_rows(const Pool *pool, const NewTokens *new, const float *q, int64_t q_stride,
                       const int64_t *table, int width, const int64_t *keys, int window,
                       int rows, int heads, float *out, int threads) {
    int kv_heads = pool->kv_heads, dim = pool->dim, page_size = pool->page_size;
    if (rows < 1 || kv_heads < 1 || heads % kv_heads || dim < 8 || dim % 8 || page_size < 1 ||
        width < 1 || pool->pages < 1)
        return 1;
    int groups = heads / kv_heads, longest = 0;
    for (int b = 0; b < rows; b++) {
        if (keys[b] < 1 || keys[b] > (int64_t)width * page_size)
            return 2;
        if (new && (new->slots[b] < 0 || new->slots[b] >= (int64_t)pool->pages * page_size))
            return 4;
        longest = keys[b] > longest ? (int)keys[b] : longest;
    }
    /* the new tokens' rotated queries, [rows][heads][dim] as q is */
    float *placed = new ? malloc(sizeof(float) * (size_t)rows * heads * dim) : NULL;
    if (new && !placed)
        return 3;
    if (new)
        q = placed, q_stride = (int64_t)heads * dim;
    int stride = (longest + 7) / 8 * 8, failed = 0, tasks = rows * kv_heads;
#pragma omp parallel num_threads(threads < tasks ? threads : tasks)
    {
        if (new) {
#pragma omp for schedule(static)
            for (int task = 0; task < tasks; task++) {
                int b = task / kv_heads, g = task % kv_heads;
                place(pool, new, b, g, heads, groups, placed + b * q_stride + g * groups * dim);
            } /* (the loop's barrier: every new key is stored before any row reads the pool) */
        }
        float *scores = malloc(sizeof(float) * (size_t)groups * stride);
        size_t *at = malloc(sizeof(size_t) * stride);
        if (!scores || !at) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < tasks; task++) {
            if (!scores || !at)
                continue;
            int b = task / kv_heads, g = task % kv_heads, last = (int)keys[b];
            int first = window > 0 && last > window ? last - window : 0, n = last - first;
            int width8 = (n + 7) / 8 * 8;
            size_t head = (size_t)g * groups * dim;
            if (!locate(pool, table + (size_t)b * width, first, n, g, at)) {
#pragma omp atomic write
                failed = 4;
                continue;
            }
            score(pool, q + b * q_stride + head, at, n, groups, width8, scores);
            softmax(scores, n, groups, width8);
            weigh(pool, scores, at, n, groups, width8, out + (size_t)b * heads * dim + head);
        }
        free(scores);
        free(at);
    }
    free(placed);
    return failed;
}

/* 0, or 1: a shape is out of range (dim must be a multiple of 8), 2: a row sees no key or more
 * than its pages hold, 3: out of memory, 4: the table names a page the pool lacks. */
int astrai_paged_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                           int bf16, int pages, const int64_t *table, int width, const int64_t *keys,
                           int window, int rows, int heads, int kv_heads, int dim, int page_size,
                           float scale, float *out, int threads) {
    Pool pool = {k, v, bf16, pages, kv_heads, dim, page_size, scale};
    return attend_rows(&pool, NULL, q, q_stride, table, width, keys, window, rows, heads, out,
                       threads);
}

/* One decode step's attention in one call: each row's new token's query and key rotated (cos,
 * sin: NULL in a layer without RoPE), its key and value written to its slot of the pool, then
 * astrai_paged_attention. Rows may be consecutive tokens of one sequence (a chunk flattened,
 * each row with its own slot and key count): every row's K/V is stored before any row
 * attends. qkv: each row's projections, [heads + 2 kv_heads][dim], float32 or bfloat16 bits
 * (bf16_in), rows qkv_stride apart. The errors of astrai_paged_attention, and 4
 * for a slot the pool lacks. */
int astrai_paged_decode(const void *qkv, int64_t qkv_stride, int bf16_in, const float *cos,
                        const float *sin, const int64_t *slots, void *k, void *v, int bf16,
                        int pages, const int64_t *table, int width, const int64_t *keys,
                        int window, int rows, int heads, int kv_heads, int dim, int page_size,
                        float scale, float *out, int threads) {
    Pool pool = {k, v, bf16, pages, kv_heads, dim, page_size, scale};
    NewTokens new = {qkv, qkv_stride, bf16_in, cos, sin, slots};
    return attend_rows(&pool, &new, NULL, 0, table, width, keys, window, rows, heads, out,
                       threads);
}
