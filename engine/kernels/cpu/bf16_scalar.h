/* Scalar bfloat16 <-> float32, shared by the kernels that read or write bfloat16 one element at a time
 * (decode_attention.c, extend_avx2.c, elementwise_bf16.c). */
#ifndef ENGINE_BF16_SCALAR_H
#define ENGINE_BF16_SCALAR_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)h) << 16;
    return x.f;
}

/* Round to nearest even; a NaN stays a NaN (0x7FC0, torch's scalar conversion's bits). */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    uint32_t u = x.u;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FC0u; /* NaN: the carry below would make it 0 or inf */
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#endif
