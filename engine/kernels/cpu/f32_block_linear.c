/* The exact float32 linear layer with its weights kept as a GGUF's blocks (Q4_0, Q4_1, Q8_0): y[M, N] =
 * x[M, K] W[N, K]^T, where W is what the model's float32 conversion holds, bitwise, and is never stored as
 * float32.
 *
 * Why: the embedded model ships as a GGUF whose float32 conversion (the exact mode's weights, 540 MB) holds
 * nothing but the blocks' values: w = d q + m (Q4_1), d (q - 8) (Q4_0), d q (Q8_0), d and m half-precision
 * and q small integers. d q is exact in float32 (11 bits times at most 8), so each w is one rounding of
 * d q + m, the same with or without an FMA: the conversion's value. A decode step at one row streams every
 * weight once; as blocks that is 0.63 bytes a weight (Q4_1) instead of 4.
 *
 * Layout (f32_blocks_pack): panels of 16 output rows, as f32_linear.c's; in a panel its blocks of 32 k in
 * order, each block the 16 rows' d (half), for Q4_1 their m (half), then the quants transposed: for Q4_x
 * 16 x 16 bytes, byte j of line i the row j's byte i of its block (low nibble: k = i, high: k = i + 16), for
 * Q8_0 32 x 16 int8, line i the 16 rows' k = i. A k's 16 weights are then one 16-byte load, widened.
 *
 * The products: up to MR rows dequantize each k's 16 weights in registers and FMA them into the rows'
 * accumulators; more rows have a panel's block of K dequantized into a float32 buffer in f32_linear.c's
 * panel layout, which f32_linear.c's tiles multiply by every row. Either way every output is one FMA chain
 * over k in order from 0 with the same operands as f32_linear on the converted weights, so its outputs are
 * bitwise f32_linear's, alone or in any batch, whatever the thread count (tests/test_f32_block_linear.py).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define F32_BLOCKS 1
#include <immintrin.h>
#else
#define F32_BLOCKS 0
#endif
#include "gguf_blocks.h"

#define NB 16      /* rows a panel (f32_linear.c's NB) */
#define MR 6       /* rows multiplied straight from the blocks; more go through the buffer */
#define KC 512     /* k a buffered block where K > KC_MAX (a multiple of QK) */
#define KC_MAX 768 /* K up to this in one buffered block */
#define MC 96      /* rows a block (as f32_linear.c) */

void f32_panel_block(const float *x, int64_t m, int64_t k, const float *b, int64_t kn, float *y, int64_t n,
                     int first); /* f32_linear.c */

/* 1 when this build runs f32_block_linear (AVX2, FMA and F16C), else 0. */
int f32_blocks_support(void) { return F32_BLOCKS; }

/* bytes of one packed block of a panel (16 rows x 32 k), 0 for a type this kernel does not take */
static int64_t panel_block_bytes(int type) {
    return type == T_Q4_1 ? 64 + 256 : type == T_Q4_0 ? 32 + 256 : type == T_Q8_0 ? 32 + 512 : 0;
}

/* Bytes f32_blocks_pack writes for an n x k layer of the type: 0 where the kernel does not take it. */
int64_t f32_blocks_bytes(int type, int64_t n, int64_t k) {
    if (!panel_block_bytes(type) || n <= 0 || k <= 0 || n % NB || k % QK) return 0;
    return n / NB * (k / QK) * panel_block_bytes(type);
}

/* dst[i * 16 + j] = src[j * stride + i] for i, j < 16 */
static void transpose16(const uint8_t *src, int64_t stride, uint8_t *dst) {
#if F32_BLOCKS
    __m128i r[NB];
    for (int j = 0; j < NB; j++) r[j] = _mm_loadu_si128((const __m128i *)(src + j * stride));
    for (int round = 0; round < 4; round++) { /* interleave rows i and i + 8, four times */
        __m128i t[NB];
        for (int i = 0; i < 8; i++)
            t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]), t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
        for (int i = 0; i < NB; i++) r[i] = t[i];
    }
    for (int i = 0; i < NB; i++) _mm_storeu_si128((__m128i *)(dst + i * NB), r[i]);
#else
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < NB; j++) dst[i * NB + j] = src[j * stride + i];
#endif
}

/* w: the layer's rows of blocks as the GGUF stores them ([n][k / 32] blocks), out: f32_blocks_bytes bytes.
 * 0, or 1 for a type or shape the kernel does not take. */
int f32_blocks_pack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int num_threads) {
    const int64_t pb = panel_block_bytes(type), bs = block_bytes(type);
    if (!f32_blocks_bytes(type, n, k)) return 1;
    const int64_t blocks = k / QK, row_bytes = blocks * bs, head = type == T_Q4_1 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < n / NB; p++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *o = out + (p * blocks + b) * pb, *q = o + (type == T_Q4_1 ? 4 * NB : 2 * NB);
            const uint8_t *first = w + p * NB * row_bytes + b * bs;
            for (int j = 0; j < NB; j++) {
                memcpy(o + 2 * j, first + j * row_bytes, 2);                                  /* d */
                if (type == T_Q4_1) memcpy(o + 2 * NB + 2 * j, first + j * row_bytes + 2, 2); /* m */
            }
            for (int half = 0; half < (type == T_Q8_0 ? 2 : 1); half++) /* 16 x 16 bytes at a time */
                transpose16(first + head + 16 * half, row_bytes, q + 16 * NB * half);
        }
    return 0;
}

#if F32_BLOCKS
/* A block's 16 rows' d and offsets m as two vectors each (Q4_0: m = -8 d, exact; Q8_0: none) */
static inline __attribute__((always_inline)) void scales(const int type, const uint8_t *blk, __m256 d[2],
                                                         __m256 m[2]) {
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        m[h] = type == T_Q4_1   ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * NB + 16 * h)))
               : type == T_Q4_0 ? _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f))
                                : _mm256_setzero_ps();
    }
}

/* One k's 16 quants (bytes, one a row) as the 16 rows' weights: d q + m (one rounding: d q is exact), or
 * d q for Q8_0 (exact) */
static inline __attribute__((always_inline)) void weights(const int type, __m128i v, const __m256 d[2],
                                                          const __m256 m[2], __m256 w[2]) {
    const __m128i h = _mm_srli_si128(v, 8);
    if (type == T_Q8_0) {
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d[0]);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h)), d[1]);
    } else {
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d[0], m[0]);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h)), d[1], m[1]);
    }
}

/* k = line (+ 16 for the high nibbles) of a block: its 16 weights */
static inline __attribute__((always_inline)) __m128i quants(const int type, const uint8_t *q, int kk) {
    if (type == T_Q8_0) return _mm_loadu_si128((const __m128i *)(q + kk * NB));
    const __m128i v = _mm_loadu_si128((const __m128i *)(q + (kk & 15) * NB)), lo4 = _mm_set1_epi8(0x0F);
    return kk < 16 ? _mm_and_si128(v, lo4) : _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
}

/* Rows [0, mr) of x (row stride k) against one panel (its blocks from pan) into y (row stride n): every
 * weight dequantized once, in registers, for all mr rows. mr and type constants where inlined. */
static inline __attribute__((always_inline)) void direct(const int type, const int mr, const float *x, int64_t k,
                                                        const uint8_t *pan, float *y, int64_t n) {
    const int64_t pb = panel_block_bytes(type), q0 = type == T_Q4_1 ? 4 * NB : 2 * NB;
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = _mm256_setzero_ps(), acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = pan + b * pb;
        __m256 d[2], m[2];
        scales(type, blk, d, m);
        const float *xb = x + b * QK;
        for (int kk = 0; kk < QK; kk++) {
            __m256 w[2];
            weights(type, quants(type, blk + q0, kk), d, m, w);
            for (int i = 0; i < mr; i++) {
                const __m256 a = _mm256_broadcast_ss(xb + i * k + kk);
                acc[i][0] = _mm256_fmadd_ps(a, w[0], acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(a, w[1], acc[i][1]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * n, acc[i][0]), _mm256_storeu_ps(y + i * n + 8, acc[i][1]);
}

/* One row against np panels at once (the panels' blocks pan + i * panel_bytes, outputs y + i * NB): 2 np
 * accumulator chains in flight where one panel has two, each k's FMAs waiting on the last k's otherwise.
 * The same chains, in the same order. np (at most 4) a constant where inlined. */
static inline __attribute__((always_inline)) void direct_panels(const int type, const int np, const float *x,
                                                               int64_t k, const uint8_t *pan, int64_t panel_bytes,
                                                               float *y) {
    const int64_t bytes = panel_block_bytes(type), q0 = type == T_Q4_1 ? 4 * NB : 2 * NB;
    __m256 acc[4][2];
    for (int i = 0; i < np; i++) acc[i][0] = _mm256_setzero_ps(), acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++) {
        __m256 d[4][2], m[4][2];
        for (int i = 0; i < np; i++) scales(type, pan + i * panel_bytes + b * bytes, d[i], m[i]);
        const float *xb = x + b * QK;
        for (int kk = 0; kk < QK; kk++) {
            const __m256 v = _mm256_broadcast_ss(xb + kk);
            for (int i = 0; i < np; i++) {
                __m256 w[2];
                weights(type, quants(type, pan + i * panel_bytes + b * bytes + q0, kk), d[i], m[i], w);
                acc[i][0] = _mm256_fmadd_ps(v, w[0], acc[i][0]), acc[i][1] = _mm256_fmadd_ps(v, w[1], acc[i][1]);
            }
        }
    }
    for (int i = 0; i < np; i++) _mm256_storeu_ps(y + i * NB, acc[i][0]), _mm256_storeu_ps(y + i * NB + 8, acc[i][1]);
}

static inline __attribute__((always_inline)) void direct_rows(const int type, const float *x, int64_t m, int64_t k, const uint8_t *pan, float *y,
                        int64_t n) {
    switch (m) {
    case 6: direct(type, 6, x, k, pan, y, n); break;
    case 5: direct(type, 5, x, k, pan, y, n); break;
    case 4: direct(type, 4, x, k, pan, y, n); break;
    case 3: direct(type, 3, x, k, pan, y, n); break;
    case 2: direct(type, 2, x, k, pan, y, n); break;
    case 1: direct(type, 1, x, k, pan, y, n); break;
    default: break;
    }
}

/* A panel's k in [k0, k0 + kn) (whole blocks) as float32 [kn][16] into dst */
static inline __attribute__((always_inline)) void convert(const int type, const uint8_t *pan, int64_t k0, int64_t kn,
                                                         float *dst) {
    const int64_t pb = panel_block_bytes(type), q0 = type == T_Q4_1 ? 4 * NB : 2 * NB;
    for (int64_t b = k0 / QK; b < (k0 + kn) / QK; b++) {
        const uint8_t *blk = pan + b * pb;
        __m256 d[2], m[2];
        scales(type, blk, d, m);
        float *o = dst + (b * QK - k0) * NB;
        for (int kk = 0; kk < QK; kk++) {
            __m256 w[2];
            weights(type, quants(type, blk + q0, kk), d, m, w);
            _mm256_store_ps(o + kk * NB, w[0]);
            _mm256_store_ps(o + kk * NB + 8, w[1]);
        }
    }
}

/* Panels [first, end) of the layer for m rows: straight from the blocks up to MR rows, else buffered. */
static inline __attribute__((always_inline)) void panels(const int type, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                   int64_t first, int64_t end) {
    const int64_t panel_bytes = k / QK * panel_block_bytes(type);
    if (m == 1) { /* two panels at a time (direct_panels) */
        int64_t p = first;
        for (; p + 1 < end; p += 2) direct_panels(type, 2, x, k, packed + p * panel_bytes, panel_bytes, y + p * NB);
        if (p < end) direct_rows(type, x, 1, k, packed + p * panel_bytes, y + p * NB, n);
        return;
    }
    if (m <= MR) {
        for (int64_t p = first; p < end; p++) direct_rows(type, x, m, k, packed + p * panel_bytes, y + p * NB, n);
        return;
    }
    float buf[KC_MAX * NB] __attribute__((aligned(32))); /* 48 KB of the calling thread's stack */
    const int64_t kc = k <= KC_MAX ? k : KC;
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
        const int64_t kn = k - k0 < kc ? k - k0 : kc;
        /* rows in blocks of MC that stay in L2 across the panels, as f32_linear.c; each panel's block is
         * converted again for each block of rows (once where m <= MC): going through all rows per panel
         * instead read them from L3 for every panel, 6x the traffic of the weights at 2,048 rows */
        for (int64_t m0 = 0; m0 < m; m0 += MC)
            for (int64_t p = first; p < end; p++) {
                convert(type, packed + p * panel_bytes, k0, kn, buf);
                f32_panel_block(x + m0 * k + k0, m - m0 < MC ? m - m0 : MC, k, buf, kn, y + m0 * n + p * NB, n, k0 == 0);
            }
    }
}

/* panels() with the type a constant: one loop a type */
static void each_type(const int type, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                      int64_t first, int64_t end) {
    if (type == T_Q4_1) panels(T_Q4_1, x, m, k, packed, n, y, first, end);
    else if (type == T_Q4_0) panels(T_Q4_0, x, m, k, packed, n, y, first, end);
    else panels(T_Q8_0, x, m, k, packed, n, y, first, end);
}
#endif

/* y [M, N] = x [M, K] times the layer packed by f32_blocks_pack. 0, or 1 when this build, type or shape is
 * not supported. x and y row-major and contiguous. */
int f32_block_linear(int type, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                     int num_threads) {
#if F32_BLOCKS
    if (!f32_blocks_bytes(type, n, k) || m < 0) return 1;
    const int64_t count = n / NB;
#pragma omp parallel num_threads(num_threads)
    {
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t t = 0, threads = 1;
#endif
        /* Up to MR rows, panels go to threads as they come free (guided: large chunks first, then smaller).
         * With a static split, perf showed the scheduler's main thread waiting at the end of the layers for
         * about a fifth of its samples (9.6% of both threads'), for a worker that had lost its core for a while
         * (on 2 cores: to the detokenizer, the user process or the host). On an AMD EPYC Zen 1, alternating:
         * the kernel alone within 1-2% of the static split when the machine was quiet; the engine's one stream
         * 2% faster over 5 quiet rounds. Chunks of a fixed size gave 7% over 5 noisy rounds but cost the kernel
         * 2-3% when quiet; the same split in f32_linear.c, gguf_linear.c and int8_linear.c gained nothing
         * measurable. Past MR rows each thread keeps its own range, so the rows it buffers stay in its L2
         * across its panels. Whichever thread computes a panel computes it the same way: the outputs are
         * bitwise those of a static split. */
        if (m <= MR) {
            const int64_t pair = m == 1 ? 2 : 1, units = (count + pair - 1) / pair; /* m = 1: panels in twos */
#pragma omp for schedule(guided, 1) nowait
            for (int64_t u = 0; u < units; u++)
                each_type(type, x, m, k, packed, n, y, u * pair, (u + 1) * pair < count ? (u + 1) * pair : count);
        } else {
            each_type(type, x, m, k, packed, n, y, count * t / threads, count * (t + 1) / threads);
        }
    }
    return 0;
#else
    (void)type; (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 1;
#endif
}
