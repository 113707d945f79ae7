/* float32 linear layer for CPUs with AVX2 and FMA (the ones that pack float32 for oneDNN: AMD Zen 1-3,
 * Intel without AVX-512): y[M, N] = x[M, K] W[N, K]^T.
 *
 * W is packed once into panels of 16 output columns, [N / 16][K][16]: a panel is one contiguous stream.
 * Each thread takes a run of whole panels; tiles of up to 6 rows keep 6 x 2 accumulators in registers
 * (12 of the 16 ymm), one broadcast of x[m][k] feeding two FMAs. Beyond one tile of rows and K = 768, K
 * goes in blocks of KC (a panel's block, 16 x KC floats, stays in L1/L2 while the rows' tiles pass over
 * it), rows in blocks of MC (their block stays in L2 across the thread's panels). Software prefetch of the
 * next panel was tried: at 64 rows up to 7% faster or nothing, at one row and at 2,048 slower; left out.
 *
 * Why: at one row oneDNN's packed float32 kernel read a decode step's weights at 7-12 GB/s on an AMD EPYC
 * Zen 1, this loop at 14-18; at 64 rows 1.1x, at 512 and 2,048 rows the same speed (both at the two
 * cores' FMA peak). Figures: engine/model/f32_linear.py.
 *
 * Every output is one FMA chain over k in order from 0 (a K block ends with the partial sum stored and
 * the next one loads it back: exact), whatever M, the row's place in its tile or the thread count: a
 * row's output is bitwise the same alone or in any batch (tests/test_f32_linear.py).
 */
#include <stdint.h>
#include <stddef.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define F32_LINEAR 1
#include <immintrin.h>
#else
#define F32_LINEAR 0
#endif

#define NB 16  /* columns a panel */
#define MR 6   /* rows a tile: 12 accumulators, two panel vectors and a broadcast in 16 registers */
#define KC 512 /* k a block: a panel's block is 32 KB */
#define MC 96  /* rows a block: 96 rows of a K block, 192 KB, stay in L2 across the panels */

/* 1 when this build runs f32_linear (AVX2 and FMA), else 0. */
int f32_linear_support(void) { return F32_LINEAR; }

/* Pack W [N, K] (float32) into out (N * K floats) as panels of 16 columns. 0, or 1 for a shape the kernel
 * does not take (N not a multiple of 16). */
int f32_linear_pack(const float *w, int64_t n, int64_t k, float *out, int num_threads) {
    if (n % NB != 0 || n <= 0 || k <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < n / NB; p++) {
        float *panel = out + p * k * NB;
        for (int64_t j = 0; j < NB; j++) {
            const float *row = w + (p * NB + j) * k;
            for (int64_t q = 0; q < k; q++) panel[q * NB + j] = row[q];
        }
    }
    return 0;
}

#if F32_LINEAR
/* Rows [0, mr) of x (row stride k) against kn k's of one panel (b: the block's first k), into y (row
 * stride n): the block's sums added to what y holds unless first. mr a constant where inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t k, const float *b,
                                                      int64_t kn, float *y, int64_t n, int first) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) {
        acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * n);
        acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * n + 8);
    }
    for (int64_t q = 0; q < kn; q++) {
        const __m256 b0 = _mm256_loadu_ps(b + q * NB), b1 = _mm256_loadu_ps(b + q * NB + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * k + q);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * n, acc[i][0]), _mm256_storeu_ps(y + i * n + 8, acc[i][1]);
}

/* Rows [0, m) of x (row stride k) against kn k's of one panel (b: the block's first k, [kn][16]) into y's
 * 16 columns (row stride n), in tiles of MR rows: the block's sums added to what y holds unless first.
 * int8_linear.c's many-row path calls it on int8 panels it has converted to float32. */
void f32_panel_block(const float *x, int64_t m, int64_t k, const float *b, int64_t kn, float *y, int64_t n,
                     int first) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) tile(MR, x + i * k, k, b, kn, y + i * n, n, first);
    const float *xs = x + i * k;
    float *ys = y + i * n;
    switch (m - i) {
    case 5: tile(5, xs, k, b, kn, ys, n, first); break;
    case 4: tile(4, xs, k, b, kn, ys, n, first); break;
    case 3: tile(3, xs, k, b, kn, ys, n, first); break;
    case 2: tile(2, xs, k, b, kn, ys, n, first); break;
    case 1: tile(1, xs, k, b, kn, ys, n, first); break;
    default: break;
    }
}
#endif

/* y [M, N] = x [M, K] times the packed W (f32_linear_pack). 0, or 1 when this build or shape is not
 * supported. x and y row-major and contiguous. */
int f32_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, float *y, int num_threads) {
#if F32_LINEAR
    if (n % NB != 0 || n <= 0 || k <= 0 || m < 0) return 1;
    const int64_t panels = n / NB;
#pragma omp parallel num_threads(num_threads)
    {
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t t = 0, threads = 1;
#endif
        const int64_t first = panels * t / threads, end = panels * (t + 1) / threads;
        const int64_t kc = (m <= MR || k <= 768) ? k : KC; /* one block where no rows share a panel's block */
        for (int64_t k0 = 0; k0 < k; k0 += kc) {
            const int64_t kn = k - k0 < kc ? k - k0 : kc;
            for (int64_t m0 = 0; m0 < m; m0 += MC) {
                const int64_t m1 = m - m0 < MC ? m : m0 + MC;
                for (int64_t p = first; p < end; p++)
                    f32_panel_block(x + m0 * k + k0, m1 - m0, k, packed + (p * k + k0) * NB, kn, y + m0 * n + p * NB, n,
                                    k0 == 0);
            }
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 1;
#endif
}
