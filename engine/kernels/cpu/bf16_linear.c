/* bfloat16 linear layer for CPUs with AVX512_BF16 and no AMX: y[M, N] = x[M, K] W[N, K]^T, float32
 * accumulation, rounded to bfloat16 once (nearest even), as torch's bfloat16 linear.
 *
 * Why: oneDNN's packed bf16 kernel (engine/model/packed_linear.py) reached 323 GFLOP/s at the 64 rows
 * of a batched decode step on AMD Zen 4, 20 at one row; this one 420 and 37 (30 SmolLM2 layers' four
 * matmuls: 42.1 -> 32.3 ms, 10.3 -> 5.7 ms), and as fast or faster for prefill (512 rows 1.08x, 2,048
 * 1.04x). W is packed once into panels of NB = 16 * NR output columns, [N / NB][K / 2][NB] pairs of K
 * (uint32): a panel is one stream, read by vdpbf16ps 16 columns at a time. A thread takes whole panels;
 * for each, tiles of up to 8 rows keep 8 x NR accumulators in registers (24 of the 32 zmm at NR = 3), one
 * broadcast of a row's K pair feeding NR dot-product instructions. While its first tile runs, the
 * next panel is prefetched into L2: at 64 rows every step streams the weights from memory, and that
 * wait was what oneDNN lost. CPUs with AMX keep oneDNN, whose tiles are far faster than this.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define BF16_LINEAR 1
#include <immintrin.h>
#else
#define BF16_LINEAR 0
#endif

#define ROWS 8 /* rows a tile */

/* 1 when this build runs bf16_linear (AVX512_BF16, no AMX), else 0. */
int bf16_linear_support(void) { return BF16_LINEAR; }

/* Pack W [N, K] (bfloat16) into out (N * K / 2 uint32) as panels of 16 * nr columns. 0, or 1 for a
 * shape the kernel does not take (K odd, N not a multiple of the panel). */
int bf16_linear_pack(const uint16_t *w, int64_t n, int64_t k, int nr, uint32_t *out) {
    const int64_t nb = 16 * (int64_t)nr, kp = k / 2;
    if (nr < 1 || nr > 3 || k % 2 != 0 || n % nb != 0) return 1;
    const uint32_t *w32 = (const uint32_t *)w;
    for (int64_t p = 0; p < n / nb; p++)
        for (int64_t q = 0; q < kp; q++)
            for (int64_t j = 0; j < nb; j++) out[(p * kp + q) * nb + j] = w32[(p * nb + j) * kp + q];
    return 0;
}

#if BF16_LINEAR
/* Rows [0, mr) of x32 (K pairs) against one panel: mr and NR constants where inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, const int NR, const uint32_t *x32,
                                                      int64_t kp, const uint32_t *panel, uint16_t *y, int64_t n,
                                                      const char *next) {
    __m512 acc[ROWS][3];
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t q = 0; q < kp; q++) {
        __m512bh b[3];
        for (int r = 0; r < NR; r++) b[r] = (__m512bh)_mm512_loadu_si512(panel + (q * NR + r) * 16);
        if (next != NULL) /* the next panel's lines at the same offset: NR a K pair */
            for (int r = 0; r < NR; r++) _mm_prefetch(next + (q * NR + r) * 64, _MM_HINT_T1);
        for (int i = 0; i < mr; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x32[i * kp + q]);
            for (int r = 0; r < NR; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], b[r], a);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < NR; r++)
            _mm256_storeu_si256((__m256i *)(y + i * n + 16 * r), (__m256i)_mm512_cvtneps_pbh(acc[i][r]));
}

static inline __attribute__((always_inline)) void panel_rows(const int NR, const uint32_t *x32, int64_t m,
                                                            int64_t kp, const uint32_t *panel, uint16_t *y,
                                                            int64_t n, const uint32_t *next) {
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
        const int mr = m - m0 < ROWS ? (int)(m - m0) : ROWS;
        const char *pf = m0 == 0 ? (const char *)next : NULL; /* the first tile streams the next panel */
        const uint32_t *xs = x32 + m0 * kp;
        uint16_t *ys = y + m0 * n;
        switch (mr) {
        case 8: tile(8, NR, xs, kp, panel, ys, n, pf); break;
        case 7: tile(7, NR, xs, kp, panel, ys, n, pf); break;
        case 6: tile(6, NR, xs, kp, panel, ys, n, pf); break;
        case 5: tile(5, NR, xs, kp, panel, ys, n, pf); break;
        case 4: tile(4, NR, xs, kp, panel, ys, n, pf); break;
        case 3: tile(3, NR, xs, kp, panel, ys, n, pf); break;
        case 2: tile(2, NR, xs, kp, panel, ys, n, pf); break;
        default: tile(1, NR, xs, kp, panel, ys, n, pf); break;
        }
    }
}
#endif

/* y [M, N] = x [M, K] times the packed W (bf16_linear_pack with the same nr). 0, or 1 when this build or
 * shape is not supported. x and y row-major and contiguous. */
int bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint32_t *packed, int64_t n, int nr, uint16_t *y,
                int num_threads) {
#if BF16_LINEAR
    const int64_t kp = k / 2, nb = 16 * (int64_t)nr;
    if (nr < 1 || nr > 3 || k % 2 != 0 || n % nb != 0 || m < 0) return 1;
    const int64_t panels = n / nb;
    const uint32_t *x32 = (const uint32_t *)x;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) { /* static: each thread's panels are consecutive, so "next" is its own */
        const uint32_t *panel = packed + p * kp * nb;
        const uint32_t *next = p + 1 < panels ? panel + kp * nb : NULL;
        if (nr == 3) panel_rows(3, x32, m, kp, panel, y + p * nb, n, next);
        else if (nr == 2) panel_rows(2, x32, m, kp, panel, y + p * nb, n, next);
        else panel_rows(1, x32, m, kp, panel, y + p * nb, n, next);
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)nr; (void)y; (void)num_threads;
    return 1;
#endif
}
