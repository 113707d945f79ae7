/* What gguf_linear.c and gguf_panel_linear.c must agree on: ggml's block types, their sizes, and the int16
 * steps the activations are rounded to (both kernels' results equal only if they round alike). */
#ifndef ENGINE_GGUF_BLOCKS_H
#define ENGINE_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 }; /* ggml's type ids */
#define QK 32                                  /* weights a block */
#define QX_MAX 32767.0f /* activations are rounded per block to int16 steps of max|x| / QX_MAX */
/* A flag on gguf_panel_linear's type argument (quantization="gguf-q8"): its weights are gguf_q8_pack's
 * panels and the activations are rounded per block to int8 steps of max|x| / QX8_MAX, as llama.cpp rounds
 * them (gguf_q8_linear.c, every row count). */
#define ACT_INT8 0x100
#define QX8_MAX 127.0f

/* A half's bits as a float, without F16C (subnormals, infinities and NaNs too) */
static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* One block of x: its largest |x| (the return) and, into *sum, the float sum of its values in order */
static inline float block_amax_sum(const float *xb, float *sum) {
    float amax = 0.0f, s = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = xb[j] < 0 ? -xb[j] : xb[j];
        amax = a > amax ? a : amax;
        s += xb[j];
    }
    *sum = s;
    return amax;
}

/* bytes a block of the type (0 for a type the kernels do not read) */
static inline int block_bytes(int type) {
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
}

#endif
