/* A decode step's decoder layers in one call. Each layer: RMSNorm, the fused q/k/v product,
 * attention over the pages (astrai_paged_decode: RoPE, the new K/V stored, attention), the
 * output product, the residual add and RMSNorm, the fused gate/up product, the gated activation,
 * the down product and the residual add; after the last layer the model's final RMSNorm.
 *
 * These are the kernels a step's Python calls one by one (pointwise.c, attention.c, the
 * products of gemv.c and float_gemv.c), called in the same order on the same values with the
 * same roundings, so the hidden states are bit for bit that path's where it multiplies every
 * matrix by those products. Rows are tokens: one a sequence in a decode step, or a chunk's
 * consecutive tokens, each with its own position, slot and key count. What it saves is the
 * Python and torch dispatch around them: ~140 us a layer of a 17 ms int8 step of a 0.5B shape
 * at batch 1 (a 2-core AMD Zen 4), where the products alone take 13.6 ms.
 *
 * Activations are float32 or bfloat16 bits (`bf16`), [rows][width] contiguous. The products
 * take float32 rows and give float32, which are rounded to the activations' dtype as the Python
 * path's cast rounds them (a bias added after, and rounded again). */
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

typedef struct {
    int kind, in, out, group;            /* group: INT4's inputs per scale */
    const void *weight, *scale, *zero;   /* as the kind's product takes them (gemv.py) */
    const void *bias;                    /* NULL, or `out` values in the activations' dtype */
} Matrix;

typedef struct {
    const void *attn_norm, *mlp_norm; /* RMSNorm weights, in the activations' dtype */
    Matrix qkv, o, gate_up, down;
    int rotates; /* 0: a layer without RoPE */
} Layer;

typedef struct {
    int layers, rows, hidden, heads, kv_heads, dim, intermediate, bf16, act, threads;
    float eps, scale;
    const float *cos, *sin;               /* [rows][dim] */
    const int64_t *slots, *table, *keys;  /* as astrai_paged_decode takes them */
    int width, pool_bf16, pages, page_size;
    void *k, *v;                          /* layer 0 of the pool's keys and values */
    int64_t layer_bytes;                  /* from one layer of the pool to the next */
    const void *final_norm;
} Step;

int astrai_rms_norm(const void *x, const void *residual, int64_t stride, int rows, int dim,
                    const void *weight, int bf16, float eps, void *sum, void *out, int threads);
int astrai_gated_activation(const void *gate, const void *up, int64_t stride, int rows, int n,
                            int bf16, int act, void *out, int threads);
int astrai_paged_decode(const void *qkv, int64_t qkv_stride, int bf16_in, const float *cos,
                        const float *sin, const int64_t *slots, void *k, void *v, int bf16,
                        int pages, const int64_t *table, int width, const int64_t *keys,
                        int window, int rows, int heads, int kv_heads, int dim, int page_size,
                        float scale, float *out, int threads);
int astrai_float_gemv(const float *x, int rows, int in, const void *w, int out, int bf16,
                      float *y, int threads, int isa);
int astrai_panel_product(const void *x, int rows, int in, const void *w, int out, int bf16,
                         void *y, int threads, int io_bf16);
int astrai_int8_gemv(const float *x, int rows, int in, const uint8_t *weight,
                     const float *row_scale, int out, float *y, int threads, int isa);
int astrai_int4_gemv(const float *x, int rows, int in, const uint8_t *nibbles,
                     const uint16_t *scale, const uint16_t *zero, int out, int group, float *y,
                     int threads, int isa);

/* n bfloat16 values (their bits) as float32 */
static void widen(const void *x, size_t n, float *to) {
    for (size_t i = 0; i < n; i++)
        to[i] = bf16_to_float(((const uint16_t *)x)[i]);
}

/* y = x (float32) in the activations' dtype, plus bias (each row) rounded once more */
AVX2 static void narrow(const float *x, int bf16, int rows, int n, const void *bias, void *y) {
    for (int r = 0; r < rows; r++) {
        size_t at = (size_t)r * n;
        for (int i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + at + i);
            if (bias) /* the product is rounded first, as the cast before `+ bias` rounds it */
                v = _mm256_add_ps(bf16 ? round_bf16(v) : v, load8(bias, bf16, i));
            store8(y, bf16, at + i, v);
        }
    }
}

/* The buffers of a step, carved from one allocation. */
typedef struct {
    void *h, *qkv, *attn, *y, *gate_up, *gated;  /* the activations' dtype */
    float *heads, *wide, *flat;                   /* float32 */
    void *block;
} Buffers;

/* y = x @ m^T for the step's rows of x (activations' dtype) through m's product, by way of
 * b's float32 scratch where the activations are bfloat16 or a bias is added. */
static int product(const Matrix *m, const void *x, const Step *s, const Buffers *b, void *y) {
    const float *in = x;
    if (s->bf16) {
        widen(x, (size_t)s->rows * m->in, b->wide);
        in = b->wide;
    }
    float *out = s->bf16 || m->bias ? b->flat : y;
    int code;
    switch (m->kind) {
    case FLOAT32:
    case BFLOAT16:
        code = astrai_float_gemv(in, s->rows, m->in, m->weight, m->out, m->kind == BFLOAT16, out,
                                 s->threads, 0);
        break;
    case PANEL_FLOAT32:
    case PANEL_BFLOAT16:
        code = astrai_panel_product(in, s->rows, m->in, m->weight, m->out,
                                    m->kind == PANEL_BFLOAT16, out, s->threads, 0);
        break;
    case INT8:
        code = astrai_int8_gemv(in, s->rows, m->in, m->weight, m->scale, m->out, out, s->threads,
                                0);
        break;
    case INT4:
        code = astrai_int4_gemv(in, s->rows, m->in, m->weight, m->scale, m->zero, m->out,
                                m->group, out, s->threads, 0);
        break;
    default:
        return 1;
    }
    if (code)
        return 2;
    if (out != y)
        narrow(out, s->bf16, s->rows, m->out, m->bias, y);
    return 0;
}

static size_t largest(size_t a, size_t b, size_t c) {
    size_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* The step's buffers in one allocation, each [rows][its width]: 1, or 0 out of memory. */
static int buffers(const Step *s, Buffers *b) {
    size_t hidden = s->hidden, q = (size_t)s->heads * s->dim, mlp = s->intermediate;
    size_t qkv = q + 2 * (size_t)s->kv_heads * s->dim, rows = s->rows, es = s->bf16 ? 2 : 4;
    void **at[] = {&b->h, &b->qkv, &b->attn, &b->y, &b->gate_up, &b->gated,
                   (void **)&b->heads, (void **)&b->wide, (void **)&b->flat};
    size_t bytes[] = {hidden * es, qkv * es, q * es, hidden * es, 2 * mlp * es, mlp * es,
                      q * 4, largest(hidden, q, mlp) * 4, largest(qkv, hidden, 2 * mlp) * 4};
    size_t total = 0;
    for (int i = 0; i < 9; i++)
        total += (rows * bytes[i] + 63) / 64 * 64;
    char *p = b->block = aligned_alloc(64, total);
    for (int i = 0; p && i < 9; i++) {
        *at[i] = p;
        p += (rows * bytes[i] + 63) / 64 * 64;
    }
    return b->block != NULL;
}

/* One layer, x (the residual stream) updated in place; h holds x normed by the layer's first
 * norm on entry. The sum that closes the layer is left to the caller, with the next norm. */
static int layer(const Layer *l, int i, const Step *s, const Buffers *b, void *x) {
    int code, q = s->heads * s->dim;
    if ((code = product(&l->qkv, b->h, s, b, b->qkv)))
        return code;
    char *k = (char *)s->k + i * s->layer_bytes, *v = (char *)s->v + i * s->layer_bytes;
    if (astrai_paged_decode(b->qkv, (int64_t)(s->heads + 2 * s->kv_heads) * s->dim, s->bf16,
                            l->rotates ? s->cos : NULL, l->rotates ? s->sin : NULL, s->slots,
                            k, v, s->pool_bf16, s->pages, s->table, s->width, s->keys, 0,
                            s->rows, s->heads, s->kv_heads, s->dim, s->page_size, s->scale,
                            b->heads, s->threads))
        return 3;
    narrow(b->heads, s->bf16, s->rows, q, NULL, b->attn); /* the attention's output rounded */
    if ((code = product(&l->o, b->attn, s, b, b->y)))
        return code;
    if (astrai_rms_norm(x, b->y, s->hidden, s->rows, s->hidden, l->mlp_norm, s->bf16, s->eps, x,
                        b->h, s->threads))
        return 4;
    if ((code = product(&l->gate_up, b->h, s, b, b->gate_up)))
        return code;
    size_t es = s->bf16 ? 2 : 4;
    if (astrai_gated_activation(b->gate_up, (char *)b->gate_up + s->intermediate * es,
                                2 * (int64_t)s->intermediate, s->rows, s->intermediate, s->bf16,
                                s->act, b->gated, s->threads))
        return 5;
    return product(&l->down, b->gated, s, b, b->y);
}

/* x: the embedded tokens [rows][hidden], updated in place to the residual stream after the
 * last layer; out: that normed by final_norm. 0, or 1 a product kind unknown, 2 a product
 * refused, 3 attention refused, 4 an RMSNorm or 5 the activation refused, 6 out of memory. */
int astrai_decode_layers(const Layer *layers, const Step *s, void *x, void *out) {
    Buffers b;
    if (!buffers(s, &b))
        return 6;
    int code = astrai_rms_norm(x, NULL, s->hidden, s->rows, s->hidden, layers[0].attn_norm,
                               s->bf16, s->eps, NULL, b.h, s->threads) ? 4 : 0;
    for (int i = 0; i < s->layers && !code; i++) {
        if ((code = layer(&layers[i], i, s, &b, x)))
            break;
        /* x + the MLP's output, normed by the next layer's first norm (the final one after
         * the last): the sum is stored rounded and normed as stored, as torch's add and norm */
        int last = i + 1 == s->layers;
        const void *weight = last ? s->final_norm : layers[i + 1].attn_norm;
        if (astrai_rms_norm(x, b.y, s->hidden, s->rows, s->hidden, weight, s->bf16, s->eps, x,
                            last ? out : b.h, s->threads))
            code = 4;
    }
    free(b.block);
    return code;
}
