/* bfloat16 linear layer for CPUs with AVX512_BF16 and no AMX: y[M, N] = x[M, K] W[N, K]^T, float32
 * accumulation, rounded to bfloat16 once (nearest even), as torch's bfloat16 linear.
 *
 * W is packed once into panels of NB = 16 * NR output columns, [N / NB][K / 2][NB] pairs of K (uint32):
 * a panel is one stream, read by vdpbf16ps 16 columns at a time. Each thread takes a run of whole
 * panels; for each, tiles of up to 8 rows keep 8 x NR accumulators in registers (24 of the 32 zmm at
 * NR = 3), one broadcast of a row's K pair feeding NR dot-product instructions. While its first tile
 * runs, the thread's next panel is prefetched into L2: at a decode step's few rows the weights stream
 * from memory, and that wait is what oneDNN's kernel lost (figures: engine/model/bf16_linear.py).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define BF16_LINEAR 1
#include <immintrin.h>
#else
#define BF16_LINEAR 0
#endif

#define ROWS 8 /* rows a tile */

/* A bf16 pair as one uint32: memcpy, since a tensor may start at any even byte. */
static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 1 when this build runs bf16_linear (AVX512_BF16, no AMX), else 0. */
int bf16_linear_support(void) { return BF16_LINEAR; }

/* Pack W [N, K] (bfloat16) into out (N * K / 2 uint32) as panels of 16 * nr columns. 0, or 1 for a
 * shape the kernel does not take (K odd, N not a multiple of the panel). */
int bf16_linear_pack(const uint16_t *w, int64_t n, int64_t k, int nr, uint32_t *out) {
    const int64_t nb = 16 * (int64_t)nr, kp = k / 2;
    if (nr < 1 || nr > 3 || k % 2 != 0 || n % nb != 0) return 1;
    for (int64_t p = 0; p < n / nb; p++)
        for (int64_t q = 0; q < kp; q++)
            for (int64_t j = 0; j < nb; j++) out[(p * kp + q) * nb + j] = pair_at(w + (p * nb + j) * k + 2 * q);
    return 0;
}

#if BF16_LINEAR
/* Rows [0, mr) of x (K bfloat16 a row, read as pairs) against one panel: mr and NR constants where inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, const int NR, const uint16_t *x,
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
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair_at(x + 2 * (i * kp + q)));
            for (int r = 0; r < NR; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], b[r], a);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < NR; r++)
            _mm256_storeu_si256((__m256i *)(y + i * n + 16 * r), (__m256i)_mm512_cvtneps_pbh(acc[i][r]));
}

static inline __attribute__((always_inline)) void panel_rows(const int NR, const uint16_t *x, int64_t m,
                                                            int64_t kp, const uint32_t *panel, uint16_t *y,
                                                            int64_t n, const uint32_t *next) {
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
        const int mr = m - m0 < ROWS ? (int)(m - m0) : ROWS;
        const char *pf = m0 == 0 ? (const char *)next : NULL; /* the first tile streams the next panel */
        const uint16_t *xs = x + m0 * 2 * kp;
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
#pragma omp parallel num_threads(num_threads)
    { /* a thread's panels are one run, so the panel it prefetches is always its own next one */
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t t = 0, threads = 1;
#endif
        const int64_t first = panels * t / threads, end = panels * (t + 1) / threads;
        for (int64_t p = first; p < end; p++) {
            const uint32_t *panel = packed + p * kp * nb;
            const uint32_t *next = p + 1 < end ? panel + kp * nb : NULL;
            if (nr == 3) panel_rows(3, x, m, kp, panel, y + p * nb, n, next);
            else if (nr == 2) panel_rows(2, x, m, kp, panel, y + p * nb, n, next);
            else panel_rows(1, x, m, kp, panel, y + p * nb, n, next);
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)nr; (void)y; (void)num_threads;
    return 1;
#endif
}
