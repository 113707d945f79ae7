/* GGUF-block linear layers at many input rows (Q4_0, Q4_1, Q8_0 as gguf_linear.c reads them): y = x W^T
 * (+ bias), W the file's blocks, one row of blocks per output row, never dequantized whole.
 *
 * Why: gguf_linear.c's integer loop reads the weights once for every four input rows and multiplies them
 * with AVX2's int16 madd, which on a Zen 1 runs no faster than float FMAs; at 64 rows (a decode step of a
 * batch) SmolLM2's layers took 1.7x int8's panels, and beyond 64 rows the caller dequantized each layer
 * whole into a scratch matrix for torch's GEMM. Here four panels of 16 output rows have one block of K
 * dequantized at a time into a float32 buffer on the stack, in f32_linear.c's panel layout ([k][16]), and
 * f32_linear.c's tiles multiply it by every row (int8_linear.c's buffered path, on GGUF blocks).
 *
 * The result is the integer loop's: x is rounded per block of 32 to int16 steps (gguf_linear.c's
 * quantize_x, max|x| / 32767), and since w = d q + m, x . w = rounded x . (d q + m) + m (sum x - sum
 * rounded x). The second term rides along as K / 32 more columns: x's rows are extended by each block's
 * residue (sum x - sum rounded x), the panels by each block's m (Q8_0 has no m and no extra columns).
 * Every output is one FMA chain over those columns in order (bias added after), so from BUFFER_MIN_ROWS
 * (12) rows on a row's output is bitwise the same in any batch, any thread count
 * (tests/test_gguf_quantization.py). Fewer rows go to gguf_linear, which reads the blocks once for all of
 * them; it agrees to float rounding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_PANELS 1
#include <immintrin.h>

#include "avx2_math.h"
#else
#define GGUF_PANELS 0
#endif
#include "gguf_blocks.h"

int gguf_q8_linear(int type, const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int threads); /* gguf_q8_linear.c */
int gguf_linear(int type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int threads); /* gguf_linear.c */
void f32_panel_block(const float *x, int64_t m, int64_t k, const float *b, int64_t kn, float *y, int64_t n,
                     int first); /* f32_linear.c */

#define PANEL 16     /* output rows a panel (f32_linear.c's NB) */
#define KC 512       /* k a block where K > KC_MAX (a multiple of QK) */
#define KC_MAX 768   /* K up to this in one block */
#define MC 96        /* rows a block (as f32_linear.c) */
#define GROUP 4      /* panels converted at a time: 192 KB of stack at most */
#ifndef BUFFER_MIN_ROWS
#define BUFFER_MIN_ROWS 12 /* rows from which the panels pay: SmolLM2's layers on a Zen 1 took 1.16x gguf_linear's
                              time at 10 rows, 0.91x at 12 */
#endif

/* 1 when this build takes many rows through the panels (AVX2, FMA and F16C), 0 where gguf_panel_linear
 * hands every call to gguf_linear (then the caller keeps it to few rows). */
int gguf_panel_vectorized(void) { return GGUF_PANELS; }

#if GGUF_PANELS
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One row of x (K floats) rounded as quantize_x rounds it, into xr; each block's sum(x) - sum(rounded x)
 * into res (K / 32 floats), unless res is NULL, summed as sum(x - rounded x): each difference is exact. */
static void round_row(const float *x, int64_t K, float *xr, float *res) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4], amax = _mm256_setzero_ps(), r = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float a = hmax256(amax), d = a > 1e-30f ? a / QX_MAX : 0.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vd = _mm256_set1_ps(d), vid = _mm256_set1_ps(id);
        for (int i = 0; i < 4; i++) {
            const __m256 q = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 o = _mm256_mul_ps(q, vd);
            _mm256_storeu_ps(xr + b * QK + 8 * i, o);
            r = _mm256_add_ps(r, _mm256_sub_ps(v[i], o));
        }
        if (res) res[b] = hsum256(r);
    }
}

/* A block's offset m (w = d q + m) */
static inline float block_offset(int type, const uint8_t *blk) {
    return type == T_Q4_1 ? half_at(blk + 2) : type == T_Q4_0 ? -8.0f * half_at(blk) : 0.0f;
}

/* r[j] byte i -> r[i] byte j for 16 x 16 bytes: four rounds of interleaving rows i and i + 8 */
static inline void transpose16_bytes(__m128i r[PANEL]) {
    for (int round = 0; round < 4; round++) {
        __m128i t[PANEL];
        for (int i = 0; i < 8; i++)
            t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]), t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
        for (int i = 0; i < PANEL; i++) r[i] = t[i];
    }
}

/* One k's 16 quants (one per row of the panel, bytes) as d q + m into o[0..16] */
static inline void store_k(__m128i v, int is_signed, const __m256 d[2], const __m256 m[2], float *o) {
    const __m128i h = _mm_srli_si128(v, 8);
    const __m256i a = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
    const __m256i b = is_signed ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
    _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), d[0], m[0]));
    _mm256_store_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), d[1], m[1]));
}

/* Panel p's columns [k0, k0 + kn) (whole blocks) as float32 [kn][16] into dst (32-byte aligned); columns from
 * K on are the blocks' offsets m (the extra columns, see the top). A block's 16 rows of quants are transposed
 * as bytes (16 x 16 at a time), then widened one k at a time with the 16 rows' d and m as vectors. Dequantizing
 * each row's block and transposing the floats 8 x 8 took 1.45x as long (all of SmolLM2's weights: 53 against
 * 36 ms on a Zen 1). */
static inline __attribute__((always_inline)) void convert_panel(const int type, const int bs, const uint8_t *w,
                                                                int64_t row_bytes, int64_t p, int64_t K, int64_t k0,
                                                                int64_t kn, float *dst) {
    const uint8_t *rows = w + p * PANEL * row_bytes;
    if (k0 >= K) {
        for (int64_t b = 0; b < kn; b++)
            for (int j = 0; j < PANEL; j++)
                dst[b * PANEL + j] = block_offset(type, rows + j * row_bytes + (k0 - K + b) * bs);
        return;
    }
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int64_t b = k0 / QK; b < (k0 + kn) / QK; b++) {
        const uint8_t *blk = rows + b * bs;
        uint16_t hd[PANEL], hm[PANEL];
        for (int j = 0; j < PANEL; j++) {
            memcpy(&hd[j], blk + j * row_bytes, 2);
            if (type == T_Q4_1) memcpy(&hm[j], blk + j * row_bytes + 2, 2);
        }
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 8 * h)));
            m[h] = type == T_Q4_1   ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hm + 8 * h)))
                   : type == T_Q4_0 ? _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f))
                                    : _mm256_setzero_ps();
        }
        float *o = dst + (b * QK - k0) * PANEL;
        __m128i r[PANEL];
        if (type == T_Q8_0) {
            for (int half = 0; half < 2; half++) {
                for (int j = 0; j < PANEL; j++)
                    r[j] = _mm_loadu_si128((const __m128i *)(blk + j * row_bytes + 2 + 16 * half));
                transpose16_bytes(r);
                for (int i = 0; i < PANEL; i++) store_k(r[i], 1, d, m, o + (16 * half + i) * PANEL);
            }
        } else {
            const int head = type == T_Q4_1 ? 4 : 2;
            for (int j = 0; j < PANEL; j++) r[j] = _mm_loadu_si128((const __m128i *)(blk + j * row_bytes + head));
            transpose16_bytes(r);
            for (int i = 0; i < PANEL; i++) {
                store_k(_mm_and_si128(r[i], lo4), 0, d, m, o + i * PANEL);
                store_k(_mm_and_si128(_mm_srli_epi16(r[i], 4), lo4), 0, d, m, o + (i + 16) * PANEL);
            }
        }
    }
}

/* Panels [first, end): GROUP panels' block of columns converted at a time, then the rows in blocks of MC. */
static void buffered_panels(int type, const float *xe, int64_t ke, const uint8_t *w, const float *bias, float *y,
                            int64_t M, int64_t N, int64_t K, int64_t first, int64_t end) {
    /* 192 KB of the calling thread's stack, as int8_linear.c's buffered path (its note on stack sizes holds) */
    float buf[GROUP * KC_MAX * PANEL] __attribute__((aligned(32)));
    const int bs = block_bytes(type);
    const int64_t row_bytes = K / QK * bs, kc = K <= KC_MAX ? K : KC;
    for (int64_t g0 = first; g0 < end; g0 += GROUP) {
        const int64_t g1 = end - g0 < GROUP ? end : g0 + GROUP;
        int64_t kn;
        for (int64_t k0 = 0; k0 < ke; k0 += kn) {
            kn = k0 < K ? (K - k0 < kc ? K - k0 : kc) : (ke - k0 < KC_MAX ? ke - k0 : KC_MAX);
            for (int64_t p = g0; p < g1; p++) {
                float *dst = buf + (p - g0) * kn * PANEL;
                if (type == T_Q4_1) convert_panel(T_Q4_1, block_bytes(T_Q4_1), w, row_bytes, p, K, k0, kn, dst);
                else if (type == T_Q4_0) convert_panel(T_Q4_0, block_bytes(T_Q4_0), w, row_bytes, p, K, k0, kn, dst);
                else convert_panel(T_Q8_0, block_bytes(T_Q8_0), w, row_bytes, p, K, k0, kn, dst); /* constants */
            }
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                for (int64_t p = g0; p < g1; p++)
                    f32_panel_block(xe + m0 * ke + k0, M - m0 < MC ? M - m0 : MC, ke, buf + (p - g0) * kn * PANEL, kn,
                                    y + m0 * N + p * PANEL, N, k0 == 0);
        }
        if (bias)
            for (int64_t p = g0; p < g1; p++) {
                const __m256 c0 = _mm256_loadu_ps(bias + p * PANEL), c1 = _mm256_loadu_ps(bias + p * PANEL + 8);
                for (int64_t i = 0; i < M; i++) {
                    float *yi = y + i * N + p * PANEL;
                    _mm256_storeu_ps(yi, _mm256_add_ps(_mm256_loadu_ps(yi), c0));
                    _mm256_storeu_ps(yi + 8, _mm256_add_ps(_mm256_loadu_ps(yi + 8), c1));
                }
            }
    }
}
#endif

/* y[M, N] = x[M, K] W^T (+ bias), W the blocks as gguf_linear takes them; the same returns (0; -1 for an
 * unknown type or K not a multiple of 32; -2 when out of memory). Below BUFFER_MIN_ROWS rows, for N not a
 * multiple of 16 and on builds without AVX2, FMA and F16C, it is gguf_linear. */
int gguf_panel_linear(int type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int threads) {
    if (type & ACT_INT8) /* quantization="gguf-q8": w is gguf_q8_pack's panels, every row count */
        return gguf_q8_linear(type & ~ACT_INT8, x, w, bias, y, M, N, K, threads);
#if GGUF_PANELS
    if (!block_bytes(type) || K % QK || K <= 0) return -1;
    if (N % PANEL || N <= 0 || M < BUFFER_MIN_ROWS) return gguf_linear(type, x, w, bias, y, M, N, K, threads);
    const int64_t ke = type == T_Q8_0 ? K : K + K / QK, panels = N / PANEL;
    float *xe = malloc(sizeof(float) * (size_t)(M * ke));
    if (!xe) return -2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) round_row(x + i * K, K, xe + i * ke, type == T_Q8_0 ? NULL : xe + i * ke + K);
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        buffered_panels(type, xe, ke, w, bias, y, M, N, K, panels * t / nt, panels * (t + 1) / nt);
    }
    free(xe);
    return 0;
#else
    return gguf_linear(type, x, w, bias, y, M, N, K, threads);
#endif
}
