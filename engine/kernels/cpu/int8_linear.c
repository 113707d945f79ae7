/* Weight-only int8 linear layer for the CPU: y = (x W^T) * scale (+ bias), W int8 [N, K] with one
 * float32 scale per output row; x and y float32, so only the weights' rounding is lost.
 *
 * Why: a decode step at small batch streams every weight once and does little arithmetic on it, so
 * its time is the weight bytes over memory bandwidth, and int8 is a quarter of float32's bytes.
 * (torch's fbgemm int8 kernels also quantize the activations, per tensor, which on SmolLM2 raised
 * perplexity threefold: its MLP activations have outlier channels.) Each thread takes blocks of four
 * output rows; the four dot products run as independent FMA chains, so the loop is bound by memory,
 * not by one accumulator's latency. Meant for few input rows and for shapes int8_panel_linear does not take;
 * the caller uses a float32 GEMM on dequantized weights for many.
 *
 * int8_panel_linear: the same layer with W stored in panels of 16 output rows, [N / 16][K][16] int8 (N a
 * multiple of 16): a panel is one contiguous stream and 16 consecutive bytes are one k's 16 outputs.
 * Below BUFFER_MIN_ROWS rows each k's 16 weights are converted in registers and feed f32_linear.c's tile
 * of up to 6 rows (12 accumulators; one row runs four panels at once and two rows two, so that enough
 * chains are in flight); from it on, four panels' block of K at a time is converted once into a float32
 * buffer on the stack that f32_linear.c's tiles multiply by every row. Either way every output is one FMA chain over k
 * in order, then times its scale (plus bias): a row's output is bitwise the same alone or in any batch,
 * with any thread count (tests/test_quantization.py). Why: the row-major loop above converts each weight
 * again for every pair of rows, so at 64 rows it was slower than float32, and for more rows the caller
 * dequantized whole layers into a scratch matrix for torch's GEMM, 4 bytes a weight written and read
 * through memory at every call. On an AMD EPYC Zen 1 (SmolLM2's layers, figures in
 * engine/quantization/int8.py and docs/performance.md): 1.3-2.1x the row-major loop from 6 rows up, 1.25x torch's GEMM on
 * dequantized weights at 512 rows and 0.95x at 2,048, 0.84-1.0x f32_linear on float32 weights while
 * reading a quarter of the bytes; at one row 0.92x the row-major loop (conversion-bound there).
 */
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16          /* output rows a panel */
#define MR 6              /* rows a tile (as f32_linear.c) */
#define KC 512            /* k a block where K > KC_MAX and rows share a panel's block */
#define KC_MAX 768        /* K up to this in one block */
#define MC 96             /* rows a block on the buffered path (as f32_linear.c) */
#define GROUP 4           /* panels converted at a time on the buffered path: 192 KB of stack at most */
#define PREFETCH 256      /* bytes ahead in a panel that the one- and two-row loops prefetch: 4-5% faster at one row */
#ifndef BUFFER_MIN_ROWS
#define BUFFER_MIN_ROWS 16 /* from this many rows panels are converted once into a buffer (at 8-23 rows the two
                              paths' best times were within 6% of each other on Zen 1, either way) */
#endif

static float dot_scalar(const float *x, const int8_t *w, int64_t k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; i++) acc += x[i] * (float)w[i];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* four rows of W against one row of x; K a multiple of 8 */
static inline void dot4(const float *x, const int8_t *w, int64_t K, float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        _mm_prefetch((const char *)(w + 4 * K + 4 * k), _MM_HINT_T0); /* the next four rows, as these are read */
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, load8_i8(w + k), a0);
        a1 = _mm256_fmadd_ps(xv, load8_i8(w + K + k), a1);
        a2 = _mm256_fmadd_ps(xv, load8_i8(w + 2 * K + k), a2);
        a3 = _mm256_fmadd_ps(xv, load8_i8(w + 3 * K + k), a3);
    }
    out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
}

/* four rows of W against two rows of x (each converted weight used twice); K a multiple of 8 */
static inline void dot4x2(const float *x, const int8_t *w, int64_t K, float out0[4], float out1[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        _mm_prefetch((const char *)(w + 4 * K + 4 * k), _MM_HINT_T0);
        __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + K + k);
        __m256 w0 = load8_i8(w + k), w1 = load8_i8(w + K + k), w2 = load8_i8(w + 2 * K + k), w3 = load8_i8(w + 3 * K + k);
        a0 = _mm256_fmadd_ps(xa, w0, a0), b0 = _mm256_fmadd_ps(xb, w0, b0);
        a1 = _mm256_fmadd_ps(xa, w1, a1), b1 = _mm256_fmadd_ps(xb, w1, b1);
        a2 = _mm256_fmadd_ps(xa, w2, a2), b2 = _mm256_fmadd_ps(xb, w2, b2);
        a3 = _mm256_fmadd_ps(xa, w3, a3), b3 = _mm256_fmadd_ps(xb, w3, b3);
    }
    out0[0] = hsum(a0), out0[1] = hsum(a1), out0[2] = hsum(a2), out0[3] = hsum(a3);
    out1[0] = hsum(b0), out1[1] = hsum(b1), out1[2] = hsum(b2), out1[3] = hsum(b3);
}
#endif

/* y[m, n] for m < M, n < N. Returns 0. */
int int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        int64_t rows = N - n0 < 4 ? N - n0 : 4;
        int64_t m = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == 4 && K % 8 == 0) {
            for (; m + 2 <= M; m += 2) {
                float d0[4], d1[4];
                dot4x2(x + m * K, w + n0 * K, K, d0, d1);
                for (int r = 0; r < 4; r++) {
                    float b = bias ? bias[n0 + r] : 0.0f;
                    y[m * N + n0 + r] = d0[r] * scale[n0 + r] + b;
                    y[(m + 1) * N + n0 + r] = d1[r] * scale[n0 + r] + b;
                }
            }
        }
#endif
        for (; m < M; m++) {
            float d[4];
#if defined(__AVX2__) && defined(__FMA__)
            if (rows == 4 && K % 8 == 0) {
                dot4(x + m * K, w + n0 * K, K, d);
            } else
#endif
            {
                for (int64_t r = 0; r < rows; r++) d[r] = dot_scalar(x + m * K, w + (n0 + r) * K, K);
            }
            for (int64_t r = 0; r < rows; r++) y[m * N + n0 + r] = d[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
void f32_panel_block(const float *x, int64_t m, int64_t k, const float *b, int64_t kn, float *y, int64_t n,
                     int first);

/* one k's 16 int8 weights as two vectors of float32 (exact) */
static inline __attribute__((always_inline)) void load16_i8(const int8_t *p, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}

/* f32_linear.c's tile with the panel's int8 weights converted as they are read */
static inline __attribute__((always_inline)) void tile_i8(const int mr, const float *x, int64_t k, const int8_t *b,
                                                          int64_t kn, float *y, int64_t n, int first) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) {
        acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * n);
        acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * n + 8);
    }
    for (int64_t q = 0; q < kn; q++) {
        __m256 b0, b1;
        load16_i8(b + q * PANEL, &b0, &b1);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * k + q);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * n, acc[i][0]), _mm256_storeu_ps(y + i * n + 8, acc[i][1]);
}

/* One row over four consecutive panels (b: the first; K a panel's length): eight chains, where one panel's
 * two would wait on the FMA's latency. */
static inline __attribute__((always_inline)) void row4_i8(const float *x, const int8_t *b, int64_t K, float *y) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t q = 0; q < K; q++) {
        const __m256 a = _mm256_broadcast_ss(x + q);
        for (int j = 0; j < 4; j++) {
            __m256 lo, hi;
            _mm_prefetch((const char *)(b + j * K * PANEL + q * PANEL + PREFETCH), _MM_HINT_T0);
            load16_i8(b + j * K * PANEL + q * PANEL, &lo, &hi);
            acc[2 * j] = _mm256_fmadd_ps(a, lo, acc[2 * j]);
            acc[2 * j + 1] = _mm256_fmadd_ps(a, hi, acc[2 * j + 1]);
        }
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(y + j * 8, acc[j]);
}

/* tile_i8 for one or two rows over two panels at once (b and b2): four chains a row */
static inline __attribute__((always_inline)) void tile2_i8(const int mr, const float *x, int64_t k, const int8_t *b,
                                                           const int8_t *b2, int64_t kn, float *y, int64_t n) {
    __m256 acc[2][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t q = 0; q < kn; q++) {
        __m256 b0, b1, b2v, b3;
        _mm_prefetch((const char *)(b + q * PANEL + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(b2 + q * PANEL + PREFETCH), _MM_HINT_T0);
        load16_i8(b + q * PANEL, &b0, &b1);
        load16_i8(b2 + q * PANEL, &b2v, &b3);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * k + q);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(a, b2v, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(a, b3, acc[i][3]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(y + i * n, acc[i][0]), _mm256_storeu_ps(y + i * n + 8, acc[i][1]);
        _mm256_storeu_ps(y + i * n + PANEL, acc[i][2]), _mm256_storeu_ps(y + i * n + PANEL + 8, acc[i][3]);
    }
}

/* Panel p's 16 columns of y's rows [0, m) (row stride n): the sums times their scales, plus bias */
static void scale_panel(float *y, int64_t m, int64_t n, const float *scale, const float *bias, int64_t p) {
    y += p * PANEL, scale += p * PANEL;
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    const __m256 c0 = bias ? _mm256_loadu_ps(bias + p * PANEL) : _mm256_setzero_ps();
    const __m256 c1 = bias ? _mm256_loadu_ps(bias + p * PANEL + 8) : _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i++) {
        _mm256_storeu_ps(y + i * n, _mm256_fmadd_ps(_mm256_loadu_ps(y + i * n), s0, c0));
        _mm256_storeu_ps(y + i * n + 8, _mm256_fmadd_ps(_mm256_loadu_ps(y + i * n + 8), s1, c1));
    }
}

static void panel_block_i8(const float *x, int64_t m, int64_t k, const int8_t *b, int64_t kn, float *y, int64_t n,
                           int first) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) tile_i8(MR, x + i * k, k, b, kn, y + i * n, n, first);
    const float *xs = x + i * k;
    float *ys = y + i * n;
    switch (m - i) {
    case 5: tile_i8(5, xs, k, b, kn, ys, n, first); break;
    case 4: tile_i8(4, xs, k, b, kn, ys, n, first); break;
    case 3: tile_i8(3, xs, k, b, kn, ys, n, first); break;
    case 2: tile_i8(2, xs, k, b, kn, ys, n, first); break;
    case 1: tile_i8(1, xs, k, b, kn, ys, n, first); break;
    default: break;
    }
}

/* Panels [first, end) for M >= BUFFER_MIN_ROWS rows: GROUP panels' block of K converted at a time, then
 * the rows in blocks of MC (a block of x stays in L2 across the group's panels), each panel's tiles
 * f32_linear.c's. Each weight is converted once a call. */
static void buffered_panels(const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
                            int64_t M, int64_t N, int64_t K, int64_t first, int64_t end) {
    /* 192 KB of the calling thread's stack: glibc's threads (OpenMP's included) get 8 MB by default; a
     * thread stack set below about 256 KB (OMP_STACKSIZE, musl's 128 KB default) would not hold it */
    float buf[GROUP * KC_MAX * PANEL] __attribute__((aligned(32)));
    const int64_t kc = K <= KC_MAX ? K : KC;
    for (int64_t g0 = first; g0 < end; g0 += GROUP) {
        const int64_t g1 = end - g0 < GROUP ? end : g0 + GROUP;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t kn = K - k0 < kc ? K - k0 : kc;
            for (int64_t p = g0; p < g1; p++) {
                const int8_t *src = w + (p * K + k0) * PANEL;
                float *dst = buf + (p - g0) * kn * PANEL;
                for (int64_t q = 0; q < kn; q++) {
                    __m256 b0, b1;
                    load16_i8(src + q * PANEL, &b0, &b1);
                    _mm256_store_ps(dst + q * PANEL, b0), _mm256_store_ps(dst + q * PANEL + 8, b1);
                }
            }
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                for (int64_t p = g0; p < g1; p++)
                    f32_panel_block(x + m0 * K + k0, M - m0 < MC ? M - m0 : MC, K, buf + (p - g0) * kn * PANEL, kn,
                                    y + m0 * N + p * PANEL, N, k0 == 0);
        }
        for (int64_t p = g0; p < g1; p++) scale_panel(y, M, N, scale, bias, p);
    }
}
#endif

/* 1 when this build runs int8_panel_linear on AVX2 and FMA (fast at every row count), 0 where it falls back
 * to the scalar loop (then the caller keeps it to few rows and multiplies dequantized tiles beyond). */
int int8_panel_vectorized(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* y [M, N] = x [M, K] W^T * scale (+ bias), W in panels ([N / 16][K][16] int8, see the top). 0, or 1 for N not
 * a multiple of 16. */
int int8_panel_linear(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int threads) {
    if (N % PANEL != 0 || N <= 0 || K <= 0 || M < 0) return 1;
    if (M == 0) return 0;
    const int64_t panels = N / PANEL;
#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
#if defined(__AVX2__) && defined(__FMA__)
        if (M >= BUFFER_MIN_ROWS)
            buffered_panels(x, w, scale, bias, y, M, N, K, first, end);
        else
            for (int64_t p = first; p < end; p++) {
                const int8_t *panel = w + p * K * PANEL;
                float *yp = y + p * PANEL;
                if (M == 1 && p + 3 < end) { /* four panels at once */
                    row4_i8(x, panel, K, yp);
                    for (int j = 0; j < 4; j++) scale_panel(y, M, N, scale, bias, p + j);
                    p += 3;
                    continue;
                }
                if (M <= 2 && p + 1 < end) { /* two panels at once */
                    if (M == 2) tile2_i8(2, x, K, panel, panel + K * PANEL, K, yp, N);
                    else tile2_i8(1, x, K, panel, panel + K * PANEL, K, yp, N);
                    scale_panel(y, M, N, scale, bias, p);
                    scale_panel(y, M, N, scale, bias, ++p);
                    continue;
                }
                panel_block_i8(x, M, K, panel, K, yp, N, 1);
                scale_panel(y, M, N, scale, bias, p);
            }
#else
        for (int64_t p = first; p < end; p++)
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < PANEL; j++) {
                    float acc = 0.0f;
                    for (int64_t q = 0; q < K; q++) acc += x[m * K + q] * (float)w[(p * K + q) * PANEL + j];
                    y[m * N + p * PANEL + j] = acc * scale[p * PANEL + j] + (bias ? bias[p * PANEL + j] : 0.0f);
                }
#endif
    }
    return 0;
}
