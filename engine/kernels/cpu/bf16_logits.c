/* lm_head of a bfloat16 model in float32: y[M, N] = x[M, K] W[N, K]^T with x and y float32 and W
 * bfloat16, each weight widened exactly to float32 in registers and summed with float32 FMAs. The
 * logits are never rounded to bfloat16, whose spacing near the top logits ties close candidates.
 *
 * W is packed once into panels of NB = 16 * NR output columns, [N / NB][K][NB] (uint16); each thread
 * takes a run of whole panels, tiles of up to 8 rows keep 8 x NR accumulators in registers.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#define BF16_LOGITS 1
#include <immintrin.h>
#else
#define BF16_LOGITS 0
#endif

#define ROWS 8 /* rows a tile */

/* 1 when this build runs bf16_logits (AVX-512F), else 0. */
int bf16_logits_support(void) { return BF16_LOGITS; }

/* Pack W [N, K] (bfloat16) into out (N * K uint16) as panels of 16 * nr columns. 0, or 1 for a shape the
 * kernel does not take (N not a multiple of the panel). */
int bf16_logits_pack(const uint16_t *w, int64_t n, int64_t k, int nr, uint16_t *out) {
    const int64_t nb = 16 * (int64_t)nr;
    if (nr < 1 || nr > 3 || n % nb != 0) return 1;
    for (int64_t p = 0; p < n / nb; p++)
        for (int64_t q = 0; q < k; q++)
            for (int64_t j = 0; j < nb; j++) out[(p * k + q) * nb + j] = w[(p * nb + j) * k + q];
    return 0;
}

#if BF16_LOGITS
static inline __m512 widen(const uint16_t *p) { /* 16 bfloat16 -> float32, exact */
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* Rows [0, mr) of x against one panel: mr and NR constants where inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, const int NR, const float *x, int64_t k,
                                                      const uint16_t *panel, float *y, int64_t n) {
    __m512 acc[ROWS][3];
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t q = 0; q < k; q++) {
        __m512 b[3];
        for (int r = 0; r < NR; r++) b[r] = widen(panel + (q * NR + r) * 16);
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * k + q]);
            for (int r = 0; r < NR; r++) acc[i][r] = _mm512_fmadd_ps(a, b[r], acc[i][r]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + i * n + 16 * r, acc[i][r]);
}

static inline __attribute__((always_inline)) void panel_rows(const int NR, const float *x, int64_t m, int64_t k,
                                                            const uint16_t *panel, float *y, int64_t n) {
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
        const int mr = m - m0 < ROWS ? (int)(m - m0) : ROWS;
        const float *xs = x + m0 * k;
        float *ys = y + m0 * n;
        switch (mr) {
        case 8: tile(8, NR, xs, k, panel, ys, n); break;
        case 7: tile(7, NR, xs, k, panel, ys, n); break;
        case 6: tile(6, NR, xs, k, panel, ys, n); break;
        case 5: tile(5, NR, xs, k, panel, ys, n); break;
        case 4: tile(4, NR, xs, k, panel, ys, n); break;
        case 3: tile(3, NR, xs, k, panel, ys, n); break;
        case 2: tile(2, NR, xs, k, panel, ys, n); break;
        default: tile(1, NR, xs, k, panel, ys, n); break;
        }
    }
}
#endif

/* y [M, N] (float32) = x [M, K] (float32) times the packed W (bf16_logits_pack with the same nr). 0, or 1
 * when this build or shape is not supported. x and y row-major and contiguous. */
int bf16_logits(const float *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, int nr, float *y,
                int num_threads) {
#if BF16_LOGITS
    const int64_t nb = 16 * (int64_t)nr;
    if (nr < 1 || nr > 3 || n % nb != 0 || m < 0) return 1;
    const int64_t panels = n / nb;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *panel = packed + p * k * nb;
        if (nr == 3) panel_rows(3, x, m, k, panel, y + p * nb, n);
        else if (nr == 2) panel_rows(2, x, m, k, panel, y + p * nb, n);
        else panel_rows(1, x, m, k, panel, y + p * nb, n);
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)nr; (void)y; (void)num_threads;
    return 1;
#endif
}
