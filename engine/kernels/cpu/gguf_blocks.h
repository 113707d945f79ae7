/* What gguf_linear.c and gguf_panel_linear.c must agree on: ggml's block types, their sizes, and the int16
 * steps the activations are rounded to (both kernels' results equal only if they round alike). */
#ifndef ENGINE_GGUF_BLOCKS_H
#define ENGINE_GGUF_BLOCKS_H

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 }; /* ggml's type ids */
#define QK 32                                  /* weights a block */
#define QX_MAX 32767.0f /* activations are rounded per block to int16 steps of max|x| / QX_MAX */
/* A flag on gguf_panel_linear's type argument (quantization="gguf-q8"): its weights are gguf_q8_pack's
 * panels and the activations are rounded per block to int8 steps of max|x| / QX8_MAX, as llama.cpp rounds
 * them (gguf_q8_linear.c, every row count). */
#define ACT_INT8 0x100
#define QX8_MAX 127.0f

/* bytes a block of the type (0 for a type the kernels do not read) */
static inline int block_bytes(int type) {
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
}

#endif
