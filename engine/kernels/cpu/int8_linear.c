/* Weight-only int8 linear layer for the CPU: y = (x W^T) * scale (+ bias), W int8 [N, K] with one
 * float32 scale per output row; x and y float32, so only the weights' rounding is lost.
 *
 * Why: a decode step at small batch streams every weight once and does little arithmetic on it, so
 * its time is the weight bytes over memory bandwidth, and int8 is a quarter of float32's bytes.
 * (torch's fbgemm int8 kernels also quantize the activations, per tensor, which on SmolLM2 raised
 * perplexity threefold: its MLP activations have outlier channels.) Each thread takes blocks of four
 * output rows; the four dot products run as independent FMA chains, so the loop is bound by memory,
 * not by one accumulator's latency. Meant for few input rows; the caller uses a float32 GEMM on
 * dequantized weights for many.
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
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
