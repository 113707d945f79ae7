/* The float32 elementwise work of a step, fused: residual add with RMSNorm, rotary embedding in place in
 * the fused qkv rows, SiLU times up.
 *
 * Why: at batch 1 a decoder layer of this model is about 35 torch calls on tensors of a few hundred
 * floats, each costing microseconds of dispatch, not arithmetic (8 ms of a 25 ms step over 30 layers,
 * measured in-process); at batch 64 and in prefill each torch call is a pass over memory of its own
 * and a new tensor. These make one pass each, threads over rows where the rows are many. The
 * summation order of the norm's mean, SiLU's exp (a polynomial, about 2 ulp) and the fused
 * multiply-adds differ from torch's by float32 roundings, far below what oneDNN's matmul kernel
 * already differs from transformers' by; greedy parity with transformers is tested on them.
 */
#include <math.h>
#include <stdint.h>

#include "exp_poly.h"

/* h += a (when a is given), then out = w * (h * rsqrt(mean(h^2) + eps)), row by row. */
void add_rms_norm(float *h, const float *a, const float *w, float *out, int64_t rows, int64_t n, float eps,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n, *o = out + r * n;
        float ss = 0.0f;
        if (a) {
            const float *y = a + r * n;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                x[i] += y[i];
                ss += x[i] * x[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (x[i] * inv);
    }
}

/* Rotary embedding (halves rotate, as Llama's rotate_half) in place on the q heads and the k heads of
 * each fused qkv row: row t starts at qkv + t * stride, q heads first, then k heads; cos/sin [T, D]. */
void rotary_qkv(float *qkv, int64_t rows, int64_t stride, int heads, int kv_heads, int d, const float *cos,
                const float *sin, int threads) {
    const int half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * (heads + kv_heads) * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int h = 0; h < heads + kv_heads; h++) {
            float *x = qkv + t * stride + (int64_t)h * d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float lo = x[i], hi = x[i + half];
                x[i] = lo * c[i] - hi * s[i];
                x[i + half] = hi * c[i + half] + lo * s[i + half];
            }
        }
    }
}

/* out[r, i] = silu(g) * u with each row of gate_up = [g (inter), u (inter)]. */
void silu_mul(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * 2 * inter, *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}
