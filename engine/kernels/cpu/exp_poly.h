/* Shared by the elementwise kernels (float32 and bfloat16): SiLU's exp, and the size below which a
 * kernel runs on one thread. */
#ifndef ENGINE_EXP_POLY_H
#define ENGINE_EXP_POLY_H
#include <math.h>
#include <stdint.h>

/* exp(x) as 2^n * p(r), r = x - n ln2, degree-6 polynomial; plain C so the compiler vectorizes it. */
static inline float exp_poly(float x) {
    const float big = x > 88.7228f ? INFINITY : 1.0f; /* beyond float32's range: inf, as torch's exp */
    const float e1 = x > 87.0f ? 2.71828182845904524f : 1.0f; /* near the top: exp(x - 1) * e, so 2^n fits */
    x = x > 87.0f ? x - 1.0f : x;
    x = x < -87.0f ? -87.0f : x; /* not fminf/fmaxf: those do not vectorize */
    x = x > 88.0f ? 88.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f * e1 * big;
}

#define PARALLEL_MIN 32768 /* elements: below this, one thread (a fork costs more than the work) */

#endif
