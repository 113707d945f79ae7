/* Linear layers computed straight from a GGUF file's own blocks (Q4_0, Q4_1, Q8_0): y = x W^T (+ bias),
 * x and y float32, W as the file stores it, one row of blocks per output row.
 *
 * Why: a decode step at small batch reads every weight once, so its time is the weight bytes over
 * memory bandwidth. The embedded model's layers are Q4_1 (5 bits a weight, 20 bytes per 32) and its
 * tied lm_head Q8_0 (34 bytes per 32): about 96 MB a token against int8's 135 MB and float32's 540 MB.
 * The weights are the exact mode's own (its float32 weights are these blocks dequantized).
 *
 * Per block of 32 weights, w = d * q + m (Q4_1; Q4_0: m = -8 d; Q8_0: m = 0), so
 * x . w = d * (x . q) + m * sum(x). x . q is an integer dot product: each block of x is rounded to int16
 * with its own scale (max|x| / 32767: a relative error of 1.5e-5 of the block's largest value, next to
 * nothing against the weights' own 4 bits), the quants are widened to int16, and AVX2's madd multiplies
 * them. sum(x) stays float. Measured on this model's
 * step at batch 1: float products of the unpacked nibbles 18 ms, int8 activations with vpdpbusd
 * (llama.cpp's scheme) 5-6 ms but perplexity +1.3% and greedy text parting from the exact mode's
 * after 9 tokens on average, int16 activations about 15% slower than int8. Software prefetch a few KB
 * ahead: without it the loop waited on memory (12 ms a step against 5 ms on an Intel Xeon under KVM).
 * With AVX-512 two blocks go through one 512-bit madd and their four half-precision scales through one
 * conversion: the per-block scalar conversions had cost a third of the loop (Q4_1 layers 13.7 -> 20 GB/s
 * on a 2-core Xeon; the same loop at 512 bits with scalar scales gained nothing). With AVX2 and F16C the
 * loop also takes two blocks a step for the one conversion (30 Q4_1 layers at one row 7.08 -> 6.52 ms on
 * a 2-core AMD EPYC, Zen 2).
 * Meant for few input rows: gguf_panel_linear.c takes 12 and more (for widths not a multiple of 16, and on
 * builds without AVX2, FMA and F16C, the caller multiplies dequantized tiles by the same rounded x beyond 64).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MB 4 /* input rows handled together: each unpacked block is used MB times */
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the block being read: streaming alone left the loop waiting on memory */
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return half_bits_to_float(h);
#endif
}

/* d and m of a block, and where its quants start */
static inline const uint8_t *block_head(int type, const uint8_t *blk, float *d, float *m) {
    *d = half_to_float(blk);
    if (type == T_Q4_1) {
        *m = half_to_float(blk + 2);
        return blk + 4;
    }
    *m = type == T_Q4_0 ? -8.0f * *d : 0.0f;
    return blk + 2;
}

/* The block's 32 quants as floats (q, not yet scaled), in weight order. */
static inline void quants_scalar(int type, const uint8_t *qs, float q[QK]) {
    if (type == T_Q8_0) {
        for (int j = 0; j < QK; j++) q[j] = (float)(int8_t)qs[j];
    } else {
        for (int j = 0; j < 16; j++) q[j] = (float)(qs[j] & 0x0F), q[j + 16] = (float)(qs[j] >> 4);
    }
}

/* rows x K weights -> float32 (the prefill path's tiles). Returns 0, or -1 for an unknown type. */
int gguf_dequantize(int type, const uint8_t *w, float *out, int64_t rows, int64_t K, int threads) {
    const int bs = block_bytes(type);
    if (!bs || K % QK) return -1;
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            float d, m, q[QK];
            const uint8_t *qs = block_head(type, w + (r * nb + b) * bs, &d, &m);
            quants_scalar(type, qs, q);
            float *o = out + r * K + b * QK;
            for (int j = 0; j < QK; j++) o[j] = d * q[j] + m;
        }
    }
    return 0;
}

/* x's rows in blocks of 32 as int16 with one float scale each, and the float sum of each block of x
 * (what the min m of Q4_0/Q4_1 multiplies). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
/* One row's int16 blocks, each pair (b, b+1) reordered to halves: b[0:16] b+1[0:16] b[16:32] b+1[16:32].
 * The AVX-512 loop widens two blocks' quants in that order (fewer shuffles than weight order). */
static void x_pair_order(int16_t *row, int64_t nb) {
    int16_t t[2 * QK];
    for (int64_t b = 0; b + 1 < nb; b += 2) {
        int16_t *p = row + b * QK;
        memcpy(t, p, sizeof t);
        memcpy(p, t, 32), memcpy(p + 16, t + QK, 32), memcpy(p + 32, t + 16, 32), memcpy(p + 48, t + QK + 16, 32);
    }
}
#endif

static void quantize_x(const float *x, int64_t blocks, int64_t nb, int16_t *qx, float *ds) {
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * QK;
        float s;
        const float amax = block_amax_sum(xb, &s);
        const float d = amax > 1e-30f ? amax / QX_MAX : 0.0f, id = d != 0.0f ? 1.0f / d : 0.0f; /* 1/d finite */
        for (int j = 0; j < QK; j++) qx[i * QK + j] = (int16_t)__builtin_lrintf(xb[j] * id);
        ds[2 * i] = d, ds[2 * i + 1] = s;
    }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
    for (int64_t r = 0; nb > 0 && r < blocks / nb; r++) x_pair_order(qx + r * nb * QK, nb);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* a block's 32 quants as bytes in weight order: unsigned nibbles (Q4), or signed int8 (Q8_0) */
static inline __m256i quants_bytes(int type, const uint8_t *qs) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)qs);
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), lo4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), _mm_and_si128(b, lo4));
}

/* a block's 32 quants widened to int16: w[0] weights 0-15, w[1] weights 16-31 */
static inline void quants_int16(int type, const uint8_t *qs, __m256i w[2]) {
    const __m256i q = quants_bytes(type, qs);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = type == T_Q8_0 ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
    w[1] = type == T_Q8_0 ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
}

/* q . x of one block: 8 int32 partial sums (x: the block's 32 rounded activations, in weight order) */
static inline __m256i block_dot(const __m256i w[2], const int16_t *xq) {
    return _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)xq)),
                            _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(xq + 16))));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

static inline int32_t dot_scalar(int type, const uint8_t *qs, const int16_t *qx) {
    int32_t s = 0;
    if (type == T_Q8_0) {
        for (int j = 0; j < QK; j++) s += (int8_t)qs[j] * qx[j];
    } else {
        for (int j = 0; j < 16; j++) s += (qs[j] & 0x0F) * qx[j] + (qs[j] >> 4) * qx[j + 16];
    }
    return s;
}

/* out[j] for input rows j < rows at one output row: sum over blocks of d * dx * (q . qx) + m * sx */
static inline __attribute__((always_inline)) void dot_rows(const int type, const int bs, const int16_t *qx,
                                                             const float *ds, const uint8_t *wrow, int64_t nb,
                                                             const int rows, float *out) {
    float macc[MB];
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
    /* Two blocks an iteration, 512 bits wide: 32 quants of each block's first halves, then of its
     * second halves, widened to int16 (quantize_x laid x out in the same order, see x_pair_order).
     * Both blocks' d and m are converted from half in one instruction, and multiplied by x's (dx, sx)
     * in one: scalar conversions took a third of the loop. */
    __m512 acc[MB];
    __m128 macc4[MB];
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m512i halves = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 mscale = type == T_Q4_0 ? _mm_set_ps(-8.0f, 1.0f, -8.0f, 1.0f) : _mm_set_ps(0.0f, 1.0f, 0.0f, 1.0f);
    const int head = type == T_Q4_1 ? 4 : 2;
    for (int j = 0; j < rows; j++) acc[j] = _mm512_setzero_ps(), macc4[j] = _mm_setzero_ps(), macc[j] = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *h0 = wrow + b * bs, *h1 = h0 + bs, *q0 = h0 + head, *q1 = h1 + head;
        _mm_prefetch((const char *)(h0 + PREFETCH), _MM_HINT_T0);
        uint32_t u0, u1;
        memcpy(&u0, h0, 4), memcpy(&u1, h1, 4);
        __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)u0), (int)u1, 1)); /* d0 m0 d1 m1 */
        if (type != T_Q4_1) dm = _mm_mul_ps(_mm_shuffle_ps(dm, dm, _MM_SHUFFLE(2, 2, 0, 0)), mscale);
        __m512i wa, wb;
        if (type == T_Q8_0) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)q0), c = _mm256_loadu_si256((const __m256i *)q1);
            wa = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x20));
            wb = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x31));
        } else {
            const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q0)),
                                                      _mm_loadu_si128((const __m128i *)q1), 1);
            wa = _mm512_cvtepu8_epi16(_mm256_and_si256(v, lo4));
            wb = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
        }
        for (int j = 0; j < rows; j++) {
            const int64_t i = j * nb + b;
            const int16_t *xq = qx + i * QK;
            const __m512i dot = _mm512_add_epi32(_mm512_madd_epi16(wa, _mm512_loadu_si512((const void *)xq)),
                                                 _mm512_madd_epi16(wb, _mm512_loadu_si512((const void *)(xq + 32))));
            const __m128 p = _mm_mul_ps(dm, _mm_loadu_ps(ds + 2 * i)); /* d0 dx0, m0 sx0, d1 dx1, m1 sx1 */
            macc4[j] = _mm_add_ps(macc4[j], p);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(p)),
                                     acc[j]);
        }
    }
    for (; b < nb; b++) { /* an odd last block, x in weight order */
        float d, m;
        const uint8_t *qs = block_head(type, wrow + b * bs, &d, &m);
        const __m512i w = type == T_Q8_0 ? _mm512_cvtepi8_epi16(quants_bytes(type, qs))
                                         : _mm512_cvtepu8_epi16(quants_bytes(type, qs));
        for (int j = 0; j < rows; j++) {
            const int64_t i = j * nb + b;
            const __m512i dot = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(qx + i * QK)));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d * ds[2 * i]), acc[j]);
            macc[j] += m * ds[2 * i + 1];
        }
    }
    for (int j = 0; j < rows; j++) {
        const __m128 m2 = _mm_add_ps(macc4[j], _mm_movehl_ps(macc4[j], macc4[j])); /* lane 1: m0 sx0 + m1 sx1 */
        out[j] = _mm512_reduce_add_ps(acc[j]) + _mm_cvtss_f32(_mm_shuffle_ps(m2, m2, 1)) + macc[j];
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[MB];
    for (int j = 0; j < rows; j++) acc[j] = _mm256_setzero_ps(), macc[j] = 0.0f;
    int64_t b = 0;
#ifdef __F16C__
    /* Two blocks an iteration, as above at 256 bits: both blocks' d and m from half in one conversion
     * and multiplied by x's (dx, sx) in one (8% faster than one block a step on a Zen 2). */
    __m128 macc4[MB];
    const __m128 mscale = type == T_Q4_0 ? _mm_set_ps(-8.0f, 1.0f, -8.0f, 1.0f) : _mm_set_ps(0.0f, 1.0f, 0.0f, 1.0f);
    const int head = type == T_Q4_1 ? 4 : 2;
    for (int j = 0; j < rows; j++) macc4[j] = _mm_setzero_ps();
    for (; b + 1 < nb; b += 2) {
        const uint8_t *h0 = wrow + b * bs, *h1 = h0 + bs;
        _mm_prefetch((const char *)(h0 + PREFETCH), _MM_HINT_T0);
        uint32_t u0, u1;
        memcpy(&u0, h0, 4), memcpy(&u1, h1, 4);
        __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)u0), (int)u1, 1)); /* d0 m0 d1 m1 */
        if (type != T_Q4_1) dm = _mm_mul_ps(_mm_shuffle_ps(dm, dm, _MM_SHUFFLE(2, 2, 0, 0)), mscale);
        __m256i wa[2], wb[2];
        quants_int16(type, h0 + head, wa), quants_int16(type, h1 + head, wb);
        for (int j = 0; j < rows; j++) {
            const int64_t i = j * nb + b;
            const int16_t *xq = qx + i * QK;
            const __m256i da = block_dot(wa, xq), db = block_dot(wb, xq + QK);
            const __m128 p = _mm_mul_ps(dm, _mm_loadu_ps(ds + 2 * i)); /* d0 dx0, m0 sx0, d1 dx1, m1 sx1 */
            macc4[j] = _mm_add_ps(macc4[j], p);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_broadcastss_ps(p), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_broadcastss_ps(_mm_movehl_ps(p, p)), acc[j]);
        }
    }
    for (int j = 0; j < rows; j++) { /* lanes 1 and 3: m0 sx0, m1 sx1 */
        const __m128 m2 = _mm_add_ps(macc4[j], _mm_movehl_ps(macc4[j], macc4[j]));
        macc[j] = _mm_cvtss_f32(_mm_shuffle_ps(m2, m2, 1));
    }
#endif
    for (; b < nb; b++) { /* one block a step: all of them without F16C, else an odd last one */
        float d, m;
        _mm_prefetch((const char *)(wrow + b * bs + PREFETCH), _MM_HINT_T0);
        __m256i w[2];
        quants_int16(type, block_head(type, wrow + b * bs, &d, &m), w);
        for (int j = 0; j < rows; j++) {
            const int64_t i = j * nb + b;
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w, qx + i * QK)), _mm256_set1_ps(d * ds[2 * i]), acc[j]);
            macc[j] += m * ds[2 * i + 1];
        }
    }
    for (int j = 0; j < rows; j++) out[j] = hsum256(acc[j]) + macc[j];
#else
    for (int j = 0; j < rows; j++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float d, m;
            const int64_t i = j * nb + b;
            const uint8_t *qs = block_head(type, wrow + b * bs, &d, &m);
            total += d * ds[2 * i] * (float)dot_scalar(type, qs, qx + i * QK) + m * ds[2 * i + 1];
        }
        out[j] = total;
    }
    (void)macc;
#endif
}

/* y[M, N] = x[M, K] W^T (+ bias). Returns 0; -1 for an unknown type or K not a multiple of 32; -2 when
 * out of memory. */
int gguf_linear(int type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int threads) {
    const int bs = block_bytes(type);
    if (!bs || K % QK) return -1;
    const int64_t nb = K / QK, row_bytes = nb * bs;
    const int64_t blocks = M * nb;
    int16_t *qx = malloc(sizeof(int16_t) * (size_t)(blocks * QK + 1));
    float *ds = malloc(sizeof(float) * (size_t)(2 * blocks + 4));
    if (!qx || !ds) {
        free(qx), free(ds);
        return -2;
    }
    quantize_x(x, blocks, nb, qx, ds);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = w + n * row_bytes;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            float d[MB] = {0};
            const int rows = M - m0 < MB ? (int)(M - m0) : MB;
            const int16_t *q = qx + m0 * nb * QK;
            const float *dsm = ds + 2 * m0 * nb;
            /* constant types and row counts: branches folded, accumulators in registers */
#define ROWS(T)                                                                              \
    switch (rows) {                                                                          \
        case 4: dot_rows(T, bs, q, dsm, wrow, nb, 4, d); break;                              \
        case 3: dot_rows(T, bs, q, dsm, wrow, nb, 3, d); break;                              \
        case 2: dot_rows(T, bs, q, dsm, wrow, nb, 2, d); break;                              \
        default: dot_rows(T, bs, q, dsm, wrow, nb, 1, d); break;                             \
    }
            if (type == T_Q4_0) {
                ROWS(T_Q4_0)
            } else if (type == T_Q4_1) {
                ROWS(T_Q4_1)
            } else {
                ROWS(T_Q8_0)
            }
#undef ROWS
            for (int j = 0; j < rows; j++) y[(m0 + j) * N + n] = d[j] + b;
        }
    }
    free(qx), free(ds);
    return 0;
}
