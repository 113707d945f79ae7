/* quantization="gguf-q8": a GGUF's Q4_0/Q4_1/Q8_0 blocks against activations rounded per block of 32 to int8
 * (llama.cpp's scheme; not its arithmetic to the bit: dx and sx stay float32 and sx is the float sum of x), as
 * integer products: y = x W^T (+ bias), x and y float32.
 *
 * Definition (a build computes exactly this, in this order, at every row count, so a row's output is bitwise the
 * same alone or in any batch, whatever the thread count; a scalar build sums each block's x in another order
 * than AVX2's eight lanes, so the two agree to float rounding): per block b of 32 k, x is rounded to int8 steps
 * dx = max|x| / 127 (quantize_x8), dot = sum_k q_k qx_k is an exact int32, and
 *     y = fma(m, sx, fma((float)dot, d * dx, y))        for b = 0, 1, ...   (y from 0; then + bias)
 * with d and m the block's scale and offset (Q4_1: w = d q + m; Q4_0: m = -8 d; Q8_0: m = 0) and sx the float
 * sum of the block's x.
 *
 * Layout (gguf_q8_pack): panels of 8 output rows; a panel's blocks in order, each block its 8 rows' d (half),
 * for Q4 their m (half), then the quants as vectors of 8 rows x 4 k: Q4 in 4 vectors of 32 bytes whose low
 * nibbles are k = 4j..4j+3 and high nibbles k = 16+4j..16+4j+3 (j = 0..3); Q8_0 in 8 vectors, k = 4g..4g+3.
 * One broadcast of 4 bytes of x meets a vector in AVX2's maddubs: 8 rows' products in one instruction, summed
 * in int16 over the block (Q4: at most 8 * 2 * 15 * 127 = 30,480), then to int32 by one madd. Q8_0's signed
 * quants go as |q| with their signs moved onto x (maddubs takes one unsigned operand), a madd each group.
 *
 * Why: at one row the row-major int8 loop spent its time unpacking each row's block alone and summing its
 * lanes; here the unpacking serves 8 rows and up to 4 input rows, and from a few rows on the products run
 * at maddubs' rate, about twice float32 FMAs' on AVX2 CPUs (figures: docs/quantization.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include "gguf_blocks.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_VECTOR 1
#include <immintrin.h>

#include "avx2_math.h"
#else
#define Q8_VECTOR 0
#endif

#define NP 8  /* output rows a panel */
#define MR 4  /* input rows a tile (6 measured the same at 1, 64 and 512 rows) */
#define MC 64 /* input rows a chunk: their int8 x stays in L2 across the panels */

/* One row's blocks of x rounded to int8 steps of max|x| / 127, and each block's (step, float sum of x), as
 * gguf_linear.c's quantize_x does for int16. With AVX2 eight lanes at a time (a scalar loop was 4% of a
 * batch's time): the same steps and rounding (to nearest, ties to even, as lrintf), the sum in another order
 * than the scalar loop's. */
static void quantize_x8(const float *x, int64_t blocks, int8_t *qx, float *ds) {
#if Q8_VECTOR
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        const float a = hmax256(amax);
        const float d = a > 1e-30f ? a / QX8_MAX : 0.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid)); /* |q| <= 127 */
        const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8),
                      q16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(qx + i * QK), _mm256_permute4x64_epi64(_mm256_packs_epi16(q16, q16b), 0xD8));
        ds[2 * i] = d, ds[2 * i + 1] = hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
#else
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * QK;
        float s;
        const float amax = block_amax_sum(xb, &s);
        const float d = amax > 1e-30f ? amax / QX8_MAX : 0.0f, id = d != 0.0f ? 1.0f / d : 0.0f; /* 1/d finite */
        for (int j = 0; j < QK; j++) qx[i * QK + j] = (int8_t)__builtin_lrintf(xb[j] * id);
        ds[2 * i] = d, ds[2 * i + 1] = s;
    }
#endif
}

/* bytes of one packed block of a panel (0 for a type this kernel does not take) */
static int64_t q8_block_bytes(int type) {
    return type == T_Q4_0 || type == T_Q4_1 ? 32 + 128 : type == T_Q8_0 ? 16 + 256 : 0;
}

/* Bytes gguf_q8_pack writes for an n x k layer (n rounded up to whole panels): 0 where not taken. */
int64_t gguf_q8_bytes(int type, int64_t n, int64_t k) {
    if (!q8_block_bytes(type) || n <= 0 || k <= 0 || k % QK) return 0;
    return (n + NP - 1) / NP * (k / QK) * q8_block_bytes(type);
}

static uint16_t half_bits(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* The half -8 d, exactly (Q4_0's offset m); 1 where it overflows a half (|d| >= 8192, or inf or NaN). A
 * subnormal d (llama.cpp's writer stores them for blocks of weights below about 5e-4) has at most 10
 * significant bits, so -8 d is a half too, normal or not. */
static int neg8_half(uint16_t d, uint16_t *m) {
    const uint16_t sign = (uint16_t)((d ^ 0x8000) & 0x8000), exp = (d >> 10) & 0x1F, man = d & 0x3FF;
    if (exp + 3 >= 31) return 1;
    if (exp != 0) {
        *m = (uint16_t)(sign | ((exp + 3) << 10) | man);
    } else if (man < 128) { /* still subnormal: man 2^-24 * 8 */
        *m = (uint16_t)(sign | (man << 3));
    } else { /* normal: man 2^-21 = 2^(p - 21) (1.f), p its top bit */
        int p = 9;
        while (!(man >> p)) p--;
        *m = (uint16_t)(sign | ((p - 6) << 10) | ((man << (10 - p)) & 0x3FF));
    }
    return 0;
}

/* w: the layer's rows of blocks as the GGUF stores them; out: gguf_q8_bytes bytes (rows past n: zeros, so
 * their outputs are 0 and never stored). 0, or 1 for a type or shape not taken (or Q4_0's -8 d not a half). */
int gguf_q8_pack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    const int64_t pb = q8_block_bytes(type), bs = block_bytes(type);
    if (!gguf_q8_bytes(type, n, k)) return 1;
    const int64_t nb = k / QK, panels = (n + NP - 1) / NP;
    memset(out, 0, (size_t)(panels * nb * pb));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (p * nb + b) * pb, *q = o + (type == T_Q8_0 ? 16 : 32);
            for (int r = 0; r < NP && p * NP + r < n; r++) {
                const uint8_t *blk = w + ((p * NP + r) * nb + b) * bs;
                memcpy(o + 2 * r, blk, 2); /* d */
                if (type == T_Q4_1) {
                    memcpy(o + 16 + 2 * r, blk + 2, 2);
                } else if (type == T_Q4_0) { /* m = -8 d, exactly */
                    uint16_t m;
                    if (neg8_half(half_bits(blk), &m)) return 1;
                    o[16 + 2 * r] = (uint8_t)m, o[17 + 2 * r] = (uint8_t)(m >> 8);
                }
                const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
                if (type == T_Q8_0) {
                    for (int g = 0; g < 8; g++)
                        for (int t = 0; t < 4; t++) q[g * 32 + r * 4 + t] = qs[4 * g + t];
                } else { /* byte i of the stored block: k = i (low nibble), k = 16 + i (high) */
                    for (int j = 0; j < 4; j++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t lo = qs[4 * j + t] & 0x0F, hi = (uint8_t)(qs[4 * j + t] >> 4);
                            q[j * 32 + r * 4 + t] = (uint8_t)(lo | (hi << 4)); /* k = 4j+t low, 16+4j+t high */
                        }
                }
            }
        }
    return 0;
}

#if !Q8_VECTOR
/* The definition, one row and one panel at a time: builds without AVX2, FMA and F16C. */
static void panel_scalar(int type, const int8_t *qx, const float *ds, const uint8_t *pan, int64_t nb, float *y) {
    const int64_t pb = q8_block_bytes(type);
    for (int r = 0; r < NP; r++) y[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = pan + b * pb, *q = blk + (type == T_Q8_0 ? 16 : 32);
        const int8_t *xb = qx + b * QK;
        for (int r = 0; r < NP; r++) {
            int32_t dot = 0;
            if (type == T_Q8_0) {
                for (int g = 0; g < 8; g++)
                    for (int t = 0; t < 4; t++) dot += (int8_t)q[g * 32 + r * 4 + t] * xb[4 * g + t];
            } else {
                for (int j = 0; j < 4; j++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t v = q[j * 32 + r * 4 + t];
                        dot += (v & 0x0F) * xb[4 * j + t] + (v >> 4) * xb[16 + 4 * j + t];
                    }
            }
            const float d = half_bits_to_float(half_bits(blk + 2 * r));
            const float m = type == T_Q8_0 ? 0.0f : half_bits_to_float(half_bits(blk + 16 + 2 * r));
            y[r] = fmaf(m, ds[2 * b + 1], fmaf((float)dot, d * ds[2 * b], y[r]));
        }
    }
}
#endif

#if Q8_VECTOR
/* Rows [0, mr) of x (int8, row stride K bytes; ds: each row's (dx, sx) per block, row stride 2 nb) against
 * one panel, into y (row stride ny): the definition, 8 output rows a vector. mr and type constants. */
static inline __attribute__((always_inline)) void tile(const int type, const int mr, const int8_t *qx, int64_t K,
                                                      const float *ds, const uint8_t *pan, int64_t nb, __m256 y[MR]) {
    const int64_t pb = q8_block_bytes(type);
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < mr; i++) y[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = pan + b * pb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i dot[MR];
        if (type == T_Q8_0) {
            const uint8_t *q = blk + 16;
            for (int i = 0; i < mr; i++) dot[i] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * g)), aw = _mm256_sign_epi8(w, w);
                for (int i = 0; i < mr; i++) {
                    int32_t xv;
                    memcpy(&xv, qx + i * K + b * QK + 4 * g, 4);
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
                }
            }
        } else {
            const uint8_t *q = blk + 32;
            __m256i acc[MR];
            for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
                const __m256i wl = _mm256_and_si256(v, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                for (int i = 0; i < mr; i++) {
                    int32_t xl, xh;
                    memcpy(&xl, qx + i * K + b * QK + 4 * j, 4), memcpy(&xh, qx + i * K + b * QK + 16 + 4 * j, 4);
                    acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(xl)));
                    acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(xh)));
                }
            }
            for (int i = 0; i < mr; i++) dot[i] = _mm256_madd_epi16(acc[i], ones);
        }
        const __m256 m = type == T_Q8_0 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int i = 0; i < mr; i++) {
            const float *dsi = ds + i * 2 * nb + 2 * b;
            const __m256 s = _mm256_mul_ps(d, _mm256_set1_ps(dsi[0]));
            y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), s, y[i]);
            y[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(dsi[1]), y[i]); /* Q8_0: m = 0, the same steps as the definition */
        }
    }
}

static inline __attribute__((always_inline)) void rows_panel(const int type, const int8_t *qx, int64_t M, int64_t K,
                                                            const float *ds, const uint8_t *pan, int64_t nb,
                                                            const float *bias, float *y, int64_t N, int64_t n0) {
    const int cols = N - n0 < NP ? (int)(N - n0) : NP;
    __m256 bv = _mm256_setzero_ps();
    if (bias) {
        float b8[NP] = {0};
        for (int c = 0; c < cols; c++) b8[c] = bias[n0 + c];
        bv = _mm256_loadu_ps(b8);
    }
    for (int64_t i = 0; i < M; i += MR) {
        const int mr = M - i < MR ? (int)(M - i) : MR;
        __m256 acc[MR];
        const int8_t *xi = qx + i * K;
        const float *dsi = ds + i * 2 * nb;
        switch (mr) {
        case 4: tile(type, 4, xi, K, dsi, pan, nb, acc); break;
        case 3: tile(type, 3, xi, K, dsi, pan, nb, acc); break;
        case 2: tile(type, 2, xi, K, dsi, pan, nb, acc); break;
        default: tile(type, 1, xi, K, dsi, pan, nb, acc); break;
        }
        for (int r = 0; r < mr; r++) {
            const __m256 out = _mm256_add_ps(acc[r], bv);
            if (cols == NP) {
                _mm256_storeu_ps(y + (i + r) * N + n0, out);
            } else {
                float o8[NP];
                _mm256_storeu_ps(o8, out);
                memcpy(y + (i + r) * N + n0, o8, sizeof(float) * (size_t)cols);
            }
        }
    }
}
#endif

/* y [M, N] = x [M, K] times the layer packed by gguf_q8_pack (+ bias). 0; -1 for a type or shape not taken;
 * -2 out of memory. */
int gguf_q8_linear(int type, const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int threads) {
    if (!gguf_q8_bytes(type, N, K) || M < 0) return -1;
    if (M == 0) return 0;
    const int64_t nb = K / QK, panels = (N + NP - 1) / NP, pb = q8_block_bytes(type);
    int8_t *qx = malloc((size_t)(M * K));
    float *ds = malloc(sizeof(float) * (size_t)(2 * M * nb));
    if (!qx || !ds) {
        free(qx), free(ds);
        return -2;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize_x8(x + i * K, nb, qx + i * K, ds + i * 2 * nb);
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t mc = M - m0 < MC ? M - m0 : MC;
            for (int64_t p = first; p < end; p++) {
                const uint8_t *pan = packed + p * nb * pb;
#if Q8_VECTOR
                if (type == T_Q8_0)
                    rows_panel(T_Q8_0, qx + m0 * K, mc, K, ds + m0 * 2 * nb, pan, nb, bias, y + m0 * N, N, p * NP);
                else
                    rows_panel(T_Q4_1, qx + m0 * K, mc, K, ds + m0 * 2 * nb, pan, nb, bias, y + m0 * N, N, p * NP);
#else
                for (int64_t i = m0; i < m0 + mc; i++) {
                    float out[NP];
                    panel_scalar(type, qx + i * K, ds + i * 2 * nb, pan, nb, out);
                    for (int c = 0; c < NP && p * NP + c < N; c++) y[i * N + p * NP + c] = out[c] + (bias ? bias[p * NP + c] : 0.0f);
                }
#endif
            }
        }
    }
    free(qx), free(ds);
    return 0;
}
