/* The exact mode's elementwise work in bfloat16, for prefill and decode: residual add fused with
 * RMSNorm, rotary embedding in place in the fused qkv rows, SiLU times up.
 *
 * Why: torch's CPU kernels for bfloat16 convert to float32 and back around every single operation, and
 * a decoder layer is about 25 of them: in the exact mode at batch 64 they took more time than the decode
 * attention once that was fast. Here each is one pass over the rows, threads over rows.
 *
 * Numerics follow llama.py's torch operations: every value torch rounds to bfloat16 is rounded here at
 * the same point (round to nearest even, as c10::BFloat16), and RMSNorm computes in float32 with one
 * rounding at the end. What differs is float32 summation order in the norm's mean, SiLU's exp (a
 * polynomial, about 2 ulp in float32, before the rounding to bfloat16) and the bits of a NaN.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h" /* bf16_to_f32, f32_to_bf16 */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#include "exp_poly.h"


/* h += a (when a is given, rounded to bfloat16 as torch's add), then
 * out = bf16(h * rsqrt(mean(h^2) + eps) * w), row by row; h, a, out, w: bfloat16. */
void add_rms_norm_bf16(uint16_t *h, const uint16_t *a, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n,
                       float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = h + r * n, *o = out + r * n;
        float ss = 0.0f;
        if (a) {
            const uint16_t *y = a + r * n;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
                x[i] = s;
                const float f = bf16_to_f32(s);
                ss += f * f;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                const float f = bf16_to_f32(x[i]);
                ss += f * f;
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) * inv * bf16_to_f32(w[i]));
    }
}

/* Rotary embedding (halves rotate) in place on the q heads and then the k heads of each fused qkv row
 * (row t at qkv + t * stride); cos/sin [rows, d]. As torch in bfloat16: x*cos and rotate_half(x)*sin
 * are each rounded, then their sum. */
void rotary_qkv_bf16(uint16_t *qkv, int64_t rows, int64_t stride, int heads, int kv_heads, int d,
                     const uint16_t *cos, const uint16_t *sin, int threads) {
    const int half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * (heads + kv_heads) * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos + t * d, *s = sin + t * d;
        for (int hd = 0; hd < heads + kv_heads; hd++) {
            uint16_t *x = qkv + t * stride + (int64_t)hd * d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float lo = bf16_to_f32(x[i]), hi = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(round_bf16(lo * bf16_to_f32(c[i])) + round_bf16(-hi * bf16_to_f32(s[i])));
                x[i + half] = f32_to_bf16(round_bf16(hi * bf16_to_f32(c[i + half])) + round_bf16(lo * bf16_to_f32(s[i + half])));
            }
        }
    }
}

/* out[r, i] = bf16(bf16(silu(g)) * u), each row of gate_up = [g (inter), u (inter)], as torch's
 * silu(gate) * up in bfloat16. */
void silu_mul_bf16(const uint16_t *restrict gate_up, uint16_t *restrict out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict g = gate_up + r * 2 * inter;
        uint16_t *restrict o = out + r * inter;
        float s[256];
        for (int64_t i0 = 0; i0 < inter; i0 += 256) { /* silu of a chunk, then times up: two simple loops */
            const int n = inter - i0 < 256 ? (int)(inter - i0) : 256;
#pragma omp simd
            for (int i = 0; i < n; i++) {
                const float x = bf16_to_f32(g[i0 + i]);
                s[i] = round_bf16(x / (1.0f + exp_poly(-x)));
            }
#pragma omp simd
            for (int i = 0; i < n; i++) o[i0 + i] = f32_to_bf16(s[i] * bf16_to_f32(g[inter + i0 + i]));
        }
    }
}
