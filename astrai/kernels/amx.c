/* bfloat16 weights times a few activation rows on AMX tiles (Intel Sapphire Rapids and later),
 * the weights read where torch keeps them, [out][in].
 *
 * A tile product takes 16 weight rows x 32 inputs (a tile loaded straight from the matrix,
 * rows `in` apart) against the activations' 32 inputs x 16 rows (pairs of inputs side by side,
 * as the instruction wants them) and adds the 16 x 16 float32 sums. One instruction does 16
 * rows' work, where vdpbf16ps does one: at 16 activation rows, over a 0.5B-shaped model's
 * weights on a 2-core Intel Xeon, the AVX-512 BF16 path is bound by arithmetic (11 GB/s) and
 * this one by memory (21 GB/s, within a few percent of oneDNN's own packed AMX product), so one
 * copy of the weights serves a busy server's steps as well as a single stream's.
 *
 * The kernel needs the OS's leave to use the tiles (arch_prctl, Linux 5.16+), which
 * astrai_amx_usable asks for once; without it, or on an older compiler, the path is absent. */
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vector_math.h"

/* compilers that know the tile instructions, on Linux, where the OS hands out the tiles */
#if ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)) && \
    defined(__linux__) && defined(SYS_arch_prctl)
#define HAVE_AMX 1
#endif

#define TILE_ROWS 16  /* weight rows of a tile, and activation rows at most */
#define TILE_INPUTS 32 /* inputs a tile product sums */
#define BLOCKS 4      /* tiles of weight rows a pass multiplies, a quarter of the range apart */

int astrai_amx_usable(void) {
#ifdef HAVE_AMX
    static int usable = -1; /* asked once; a race only asks twice */
    if (usable < 0) {
        unsigned a, b, c, d;
        int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1);
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the tile registers' state */
        usable = tiles && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return usable;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) TileConfig;

/* Tiles 0-3: the sums of BLOCKS tiles of weight rows; 4, 5: weight rows; 6: activations. Every
 * tile is 16 rows of 64 bytes. The configuration is per thread. */
AMX static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 7; t++) {
        config.rows[t] = TILE_ROWS;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* x's n rows [.][in] float32 as pairs [in / 2][16] of two bfloat16 inputs (rounded to nearest
 * even), activation rows past n zero: each 32 inputs of the 16 rows, transposed, one tile */
AMX static void pair_activations(const float *x, int n, int in, uint32_t *pairs) {
    for (int k = 0; k < in; k += TILE_INPUTS) {
        __m512i r[16];
        for (int m = 0; m < TILE_ROWS; m++) {
            const float *at = x + (size_t)m * in + k;
            r[m] = m < n ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(at + 16),
                                                         _mm512_loadu_ps(at))
                         : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int p = 0; p < 16; p++)
            _mm512_store_si512(pairs + (size_t)(k / 2 + p) * TILE_ROWS, r[p]);
    }
}

/* a tile of sums, [weight row o + i][activation row m], into y[m][o + i] for m < n */
AMX static void store_sums(float sums[TILE_ROWS][TILE_ROWS], int n, int o, int out, float *y) {
    __m512i r[16];
    for (int i = 0; i < TILE_ROWS; i++)
        r[i] = _mm512_load_si512(sums[i]);
    transpose16(r);
    for (int m = 0; m < n; m++)
        _mm512_storeu_si512(y + (size_t)m * out + o, r[m]);
}

/* the 16 weight rows from o, inputs k..k+31, into `tile`, times the activations into `acc` */
#define PRODUCT(acc, tile, o)                                                \
    _tile_loadd(tile, w + (size_t)(o) * in + k, in * (int)sizeof(uint16_t)); \
    _tile_dpbf16ps(acc, tile, 6)

/* Weight rows lo..hi-1 (a multiple of 16 of them) times n activation rows (as pairs). A pass
 * multiplies BLOCKS tiles a quarter of the range apart, so that the range is read as that
 * many streams (see float_gemv.c's range); the blocks left over go one at a time. */
AMX static void range(const uint32_t *pairs, int n, int in, const uint16_t *w, int lo, int hi,
                      int out, float *y) {
    float sums[TILE_ROWS][TILE_ROWS] __attribute__((aligned(64)));
    int blocks = (hi - lo) / TILE_ROWS, span = blocks / BLOCKS;
    for (int b = 0; b < span; b++) {
        int o[BLOCKS];
        for (int j = 0; j < BLOCKS; j++)
            o[j] = lo + (b + j * span) * TILE_ROWS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < in; k += TILE_INPUTS) {
            _tile_loadd(6, pairs + (size_t)k / 2 * TILE_ROWS, 64);
            PRODUCT(0, 4, o[0]);
            PRODUCT(1, 5, o[1]);
            PRODUCT(2, 4, o[2]);
            PRODUCT(3, 5, o[3]);
        }
        _tile_stored(0, sums, 64);
        store_sums(sums, n, o[0], out, y);
        _tile_stored(1, sums, 64);
        store_sums(sums, n, o[1], out, y);
        _tile_stored(2, sums, 64);
        store_sums(sums, n, o[2], out, y);
        _tile_stored(3, sums, 64);
        store_sums(sums, n, o[3], out, y);
    }
    for (int o = lo + BLOCKS * span * TILE_ROWS; o < hi; o += TILE_ROWS) {
        _tile_zero(0);
        for (int k = 0; k < in; k += TILE_INPUTS) {
            _tile_loadd(6, pairs + (size_t)k / 2 * TILE_ROWS, 64);
            PRODUCT(0, 4, o);
        }
        _tile_stored(0, sums, 64);
        store_sums(sums, n, o, out, y);
    }
}

/* y[r][o] for o < whole (a multiple of 16) of bfloat16 w [.][in] (in a multiple of 32) and
 * float32 x [rows][in], y's rows `out` apart; 0, or -2: out of memory. Activation rows go 16
 * at a time, each block of them one read of the weights. */
AMX int astrai_amx_bf16_product(const float *x, int rows, int in, const uint16_t *w, int whole,
                                int out, float *y, int threads) {
    uint32_t *pairs = aligned_alloc(64, sizeof(uint32_t) * (size_t)(in / 2) * TILE_ROWS);
    if (!pairs)
        return -2;
    int blocks = whole / TILE_ROWS;
    for (int r = 0; r < rows; r += TILE_ROWS) {
        int n = rows - r < TILE_ROWS ? rows - r : TILE_ROWS;
        pair_activations(x + (size_t)r * in, n, in, pairs);
#pragma omp parallel num_threads(threads < blocks ? threads : blocks)
        {
            int t = omp_get_thread_num(), count = omp_get_num_threads();
            int lo = (int)((int64_t)blocks * t / count) * TILE_ROWS;
            int hi = (int)((int64_t)blocks * (t + 1) / count) * TILE_ROWS;
            configure_tiles();
            range(pairs, n, in, w, lo, hi, out, y + (size_t)r * out);
            _tile_release();
        }
    }
    free(pairs);
    return 0;
}
#else
int astrai_amx_bf16_product(const float *x, int rows, int in, const uint16_t *w, int whole,
                            int out, float *y, int threads) {
    return -3;
}
#endif
