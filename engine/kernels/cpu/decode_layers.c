/* A float32 decode step's decoder layers in one call (the quantized modes, and the exact mode where its layers
 * run on f32_linear): for each layer the residual add and RMSNorm, the qkv projection, rotary, the K/V store
 * and attention, o_proj, the second norm, gate_up, SiLU times up and down, then the final norm: the very kernels engine/model/fused_decode.py calls one by one, in the same
 * order on the same float32 rows and threads, so the rows come out bitwise the same.
 *
 * Why: at batch 1 a step's kernels are short (a 576 x 576 int8 matmul streams 0.33 MB), and calling nine
 * of them a layer from Python through ctypes cost a few microseconds each, about 270 calls a step. Here
 * Python makes one call a step. The layers' weights, norms and K/V buffers are described once
 * (decode_layer structs). The exact mode's bfloat16 decode keeps the Python loop (not measured here).
 */
#include <stdint.h>
#include <stddef.h>

/* The kernels of the other files of this library, as they declare them. */
int int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                int64_t N, int64_t K, int threads);
int int8_panel_linear(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int threads);
int gguf_panel_linear(int type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int threads);
int f32_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, float *y, int num_threads);
int f32_block_linear(int type, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                     int num_threads);
int decode_attention_store(const void *q, const void *k_new, const void *v_new, int64_t row_stride,
                           const int64_t *out_loc, void *k, void *v, void *out, const int64_t *req_to_token,
                           int64_t stride, const int64_t *slots, const int64_t *lens, int B, int H, int Hkv, int D,
                           float scale, int is_bf16, int num_threads);
void add_rms_norm(float *h, const float *a, const float *w, float *out, int64_t rows, int64_t n, float eps,
                  int threads);
void rotary_qkv(float *qkv, int64_t rows, int64_t stride, int heads, int kv_heads, int d, const float *cos,
                const float *sin, int threads);
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int threads);

enum { LINEAR_INT8 = 1, LINEAR_GGUF = 2, LINEAR_F32 = 3, LINEAR_F32_BLOCKS = 4 };

typedef struct { /* one linear layer: y[m, n] = x[m, k] W^T (+ bias) */
    int32_t kind;    /* LINEAR_* */
    int32_t arg;     /* gguf, f32 blocks: the block type (gguf | ACT_INT8: gguf-q8's panels); int8: 1 for weights in panels (int8_panel_linear), 0 row-major */
    int32_t threads; /* the layer's own (QuantizedLinear._threads; f32: torch's threads when described) */
    int32_t pad;
    int64_t n, k;
    const void *w;       /* int8: [n, k] int8 or its panels; gguf: the blocks; f32: f32_linear_pack's panels;
                            f32 blocks: f32_blocks_pack's */
    const float *scale;  /* int8: per row */
    const float *bias;   /* int8, gguf; NULL: none */
} decode_linear;

typedef struct {
    const float *in_norm, *post_norm; /* RMSNorm weights */
    float *k_cache, *v_cache;         /* the pool's buffers of this layer */
    float in_eps, post_eps;
    decode_linear qkv, o, gate_up, down;
} decode_layer;

typedef struct { /* the model's shape and the step's float32 row buffers ([MAX_ROWS, width] each, reused) */
    int32_t layers, heads, kv_heads, head_dim, attn_threads, pad;
    int64_t hidden, inter;
    float attn_scale, final_eps;
    const float *final_norm;
    float *normed, *qkv, *attn, *a, *gate_up, *act, *down;
} decode_model;

static int linear(const decode_linear *l, const float *x, float *y, int64_t m) {
    switch (l->kind) {
    case LINEAR_INT8:
        return (l->arg ? int8_panel_linear : int8_linear)(x, (const int8_t *)l->w, l->scale, l->bias, y, m, l->n, l->k,
                                                          l->threads);
    case LINEAR_GGUF: return gguf_panel_linear(l->arg, x, (const uint8_t *)l->w, l->bias, y, m, l->n, l->k, l->threads);
    case LINEAR_F32: return f32_linear(x, m, l->k, (const float *)l->w, l->n, y, l->threads);
    case LINEAR_F32_BLOCKS: return f32_block_linear(l->arg, x, m, l->k, (const uint8_t *)l->w, l->n, y, l->threads);
    default: return -100;
    }
}

/* h [t, hidden] (the embedded rows, updated in place) through every layer; the final norm's rows in
 * s->normed. cos/sin [t, head_dim]; the attention's step arguments as decode_attention_store takes them.
 * 0, or the first failure: err = {layer, stage (0 qkv, 1 attention, 2 o, 3 gate_up, 4 down), its code}. */
int decode_layers(const decode_model *s, const decode_layer *layers, float *h, int64_t t, const float *cos,
                  const float *sin, const int64_t *out_loc, const int64_t *req_to_token, int64_t table_stride,
                  const int64_t *slots, const int64_t *lens, int threads, int32_t *err) {
    const int64_t q_size = (int64_t)s->heads * s->head_dim, kv_size = (int64_t)s->kv_heads * s->head_dim;
    const int64_t qkv_stride = q_size + 2 * kv_size;
    const float *pending = NULL; /* the last block's output, added to h by the next norm */
    for (int i = 0; i < s->layers; i++) {
        const decode_layer *L = layers + i;
        int rc, stage = 0;
        add_rms_norm(h, pending, L->in_norm, s->normed, t, s->hidden, L->in_eps, threads);
        if ((rc = linear(&L->qkv, s->normed, s->qkv, t))) goto fail;
        rotary_qkv(s->qkv, t, qkv_stride, s->heads, s->kv_heads, s->head_dim, cos, sin, threads);
        stage = 1;
        if ((rc = decode_attention_store(s->qkv, s->qkv + q_size, s->qkv + q_size + kv_size, qkv_stride, out_loc,
                                         L->k_cache, L->v_cache, s->attn, req_to_token, table_stride, slots, lens,
                                         (int)t, s->heads, s->kv_heads, s->head_dim, s->attn_scale, 0,
                                         s->attn_threads)))
            goto fail;
        stage = 2;
        if ((rc = linear(&L->o, s->attn, s->a, t))) goto fail;
        add_rms_norm(h, s->a, L->post_norm, s->normed, t, s->hidden, L->post_eps, threads);
        stage = 3;
        if ((rc = linear(&L->gate_up, s->normed, s->gate_up, t))) goto fail;
        silu_mul(s->gate_up, s->act, t, s->inter, threads);
        stage = 4;
        if ((rc = linear(&L->down, s->act, s->down, t))) goto fail;
        pending = s->down;
        continue;
    fail:
        err[0] = i, err[1] = stage, err[2] = rc;
        return 1;
    }
    add_rms_norm(h, pending, s->final_norm, s->normed, t, s->hidden, s->final_eps, threads);
    return 0;
}
