/* Causal extend (prefill) attention for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3; Intel from
 * Haswell on where AVX-512 is absent, as in most client CPUs): decode_attention.c's extend_attention calls
 * this where its 512-bit kernel is not built.
 * Why: torch's SDPA was 48% of a 2,500-token prefill on a Zen 1 (as much as all its matmuls).
 *
 * The same flash-style walk as the 512-bit kernel, in 8-key blocks: K of one request and KV head is first
 * transposed into blocks [D][8] (float32), V widened to float32 rows; two query rows at a time, each with
 * its heads of a KV head (up to 4), walk the key blocks up to the second row's position (the first row's
 * key past its own scores -inf), scores of 8 keys from D broadcast-FMAs, an online softmax every X2_SB
 * blocks. With 16 vector registers the output accumulators (rows x heads x D / 8 vectors) cannot stay in
 * registers across the walk: P.V adds a step's keys into them two vectors of D at a time (one with two
 * rows of 4 heads; at most 12 accumulators live), kept in L1 between steps.
 * A request's queries may be split in ranges across threads (one long prompt on a few cores), each
 * range over the keys it needs. Float32 math for float32 or bfloat16 storage. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include "avx2_math.h"
#include "bf16_scalar.h"

#define X2_MAX_D 256 /* as decode_attention.c's MAX_D */
#define X2_SB 4      /* 8-key blocks per online-softmax step: one max, one rescale per 32 keys */
#define X2_PARTS 4   /* query ranges a (request, KV head) unit is cut into when units are fewer than 2 a thread */

static inline float x2_widen(const void *base, int64_t off, int is_bf16) { /* one element as float32 */
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[off]) : ((const float *)base)[off];
}

/* R consecutive query rows (R = 1 or 2, at positions pos and pos + 1) of n heads each (n <= 4; qv[r * n + j]
 * pre-scaled) against keys 0..pos + R - 1 of kt (blocks [D][8]) and vf (rows), row r's head j written at
 * out + qoff[r * n + j]. Two rows share each K block and V row they read (half the L2 traffic where a long
 * prompt's keys do not fit L1). Each row's sums are the same, bitwise, whether it runs alone or paired:
 * one chain a (row, head) in the same order; a paired first row's key past its position (and a whole block
 * or step past it) scores -inf, adds 0 to its softmax sum and 0 x V to its output. Always inlined, with R,
 * n and C (D / 8) constants where extend_rows8 can: the chains and accumulators are then registers. */
static inline __attribute__((always_inline)) void query_rows(const int R, const float (*qv)[X2_MAX_D], const int n,
                                                            const int C, const float *kt, const float *vf,
                                                            int64_t pos, void *out, const int64_t *qoff, int is_bf16) {
    const int D = 8 * C, S = R * n;
    const int W = S * 2 <= 12 ? 2 : 1; /* P.V: vectors of D a pass, so that S * W accumulators fit the registers */
    const int64_t last = (pos + R - 1) / 8; /* the last key block of the last row */
    float acc[8][X2_MAX_D] __attribute__((aligned(32)));
    float p[8][8 * X2_SB] __attribute__((aligned(32)));
    float m[8], l[8];
    for (int s = 0; s < S; s++) {
        memset(acc[s], 0, sizeof(float) * D);
        m[s] = -INFINITY;
        l[s] = 0.0f;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t sb = 0; sb <= last; sb += X2_SB) {
        const int nb = last - sb + 1 < X2_SB ? (int)(last - sb + 1) : X2_SB;
        const int64_t base = sb * 8, tail = base + 8 * (nb - 1); /* the step's first key, its last block's */
        const int nk = (int)((sb + nb - 1 == last ? pos + R : base + 8 * nb) - base); /* keys in the step */
        __m256 keep[2]; /* per row, which keys of the step's last block it attends */
        for (int r = 0; r < R; r++) {
            const int64_t cnt = pos + r + 1 - tail;
            keep[r] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cnt < 0 ? 0 : cnt > 8 ? 8 : cnt)), lane));
        }
        __m256 mv[8];
        for (int s = 0; s < S; s++) mv[s] = _mm256_set1_ps(-INFINITY);
        for (int b = 0; b < nb; b++) {
            const float *kb = kt + (sb + b) * 8 * D;
            __m256 sc[8];
            for (int s = 0; s < S; s++) sc[s] = _mm256_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m256 kd = _mm256_load_ps(kb + d * 8);
                for (int s = 0; s < S; s++) sc[s] = _mm256_fmadd_ps(_mm256_broadcast_ss(&qv[s][d]), kd, sc[s]);
            }
            for (int s = 0; s < S; s++) {
                if (b == nb - 1) sc[s] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc[s], keep[s / n]);
                _mm256_store_ps(p[s] + 8 * b, sc[s]);
                mv[s] = _mm256_max_ps(mv[s], sc[s]);
            }
        }
        for (int s = 0; s < S; s++) {
            const float bm = hmax256(mv[s]);
            const float m_new = bm > m[s] ? bm : m[s];
            const __m256 vm = _mm256_set1_ps(m_new);
            __m256 tot = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) { /* -inf (masked) lanes give 0 */
                const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(p[s] + 8 * b), vm));
                _mm256_store_ps(p[s] + 8 * b, e);
                tot = _mm256_add_ps(tot, e);
            }
            float alpha = 1.0f;
            if (m_new != m[s]) { /* the running max moved: rescale what was summed under the old one */
                alpha = expf(m[s] - m_new);
                const __m256 va = _mm256_set1_ps(alpha);
                for (int c = 0; c < C; c++) _mm256_store_ps(acc[s] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[s] + 8 * c), va));
            }
            /* one explicit fused multiply-add (l x 1 + sum is exact where the max stayed): a multiply then an
             * add could be contracted in one inlined copy of this function and not in another, and a row's
             * sums must not depend on which copy ran it */
            l[s] = fmaf(l[s], alpha, hsum256(tot));
            m[s] = m_new;
        }
        const float *vs = vf + base * D;
        int c0 = 0;
        for (; c0 + W <= C; c0 += W) { /* W vectors of D at a time: S * W accumulators, W V vectors */
            __m256 a[8][2];
            for (int s = 0; s < S; s++)
                for (int w = 0; w < W; w++) a[s][w] = _mm256_load_ps(acc[s] + 8 * (c0 + w));
            for (int t = 0; t < nk; t++) {
                __m256 vv[2];
                for (int w = 0; w < W; w++) vv[w] = _mm256_load_ps(vs + t * D + 8 * (c0 + w));
                for (int s = 0; s < S; s++) {
                    const __m256 ps = _mm256_broadcast_ss(&p[s][t]);
                    for (int w = 0; w < W; w++) a[s][w] = _mm256_fmadd_ps(ps, vv[w], a[s][w]);
                }
            }
            for (int s = 0; s < S; s++)
                for (int w = 0; w < W; w++) _mm256_store_ps(acc[s] + 8 * (c0 + w), a[s][w]);
        }
        if (c0 < C) { /* D / 8 odd and W 2: the last vector alone */
            __m256 a[8];
            for (int s = 0; s < S; s++) a[s] = _mm256_load_ps(acc[s] + 8 * c0);
            for (int t = 0; t < nk; t++) {
                const __m256 v0 = _mm256_load_ps(vs + t * D + 8 * c0);
                for (int s = 0; s < S; s++) a[s] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[s][t]), v0, a[s]);
            }
            for (int s = 0; s < S; s++) _mm256_store_ps(acc[s] + 8 * c0, a[s]);
        }
    }
    for (int s = 0; s < S; s++) {
        const float inv = 1.0f / l[s];
        for (int d = 0; d < D; d++) {
            if (is_bf16) ((uint16_t *)out)[qoff[s] + d] = f32_to_bf16(acc[s][d] * inv);
            else ((float *)out)[qoff[s] + d] = acc[s][d] * inv;
        }
    }
}

/* query_rows with R, n and C as constants where a model needs them: SmolLM2's 3 query heads a KV head at
 * head_dim 64, Llama's 4 at 64 and 128; a general loop for the rest. */
static void extend_rows8(int R, const float (*qv)[X2_MAX_D], int n, int C, const float *kt, const float *vf,
                         int64_t pos, void *out, const int64_t *qoff, int is_bf16) {
#define ROWS(r, nn, cc) \
    if (R == r && n == nn && C == cc) {                                                      \
        query_rows(r, qv, nn, cc, kt, vf, pos, out, qoff, is_bf16);                          \
        return;                                                                              \
    }
    ROWS(2, 3, 8)
    ROWS(1, 3, 8)
    ROWS(2, 4, 8)
    ROWS(1, 4, 8)
    ROWS(2, 4, 16)
    ROWS(1, 4, 16)
#undef ROWS
    if (R == 2) query_rows(2, qv, n, C, kt, vf, pos, out, qoff, is_bf16);
    else query_rows(1, qv, n, C, kt, vf, pos, out, qoff, is_bf16);
}

/* Queries i0..i1 of one request's extend (ext new tokens after prefix cached ones) for KV head hk: its keys
 * 0..prefix + i1 - 1 transposed into kt and widened into vf (per-thread buffers), then each query's heads. */
static void extend_range(const void *q, const void *k, const void *v, void *out, const int64_t *rows, int64_t prefix,
                         int64_t i0, int64_t i1, int64_t q_start, int hk, int H, int Hkv, int D, float scale,
                         int is_bf16, float *kt, float *vf) {
    const int G = H / Hkv, W = Hkv * D, C = D / 8;
    const int64_t total = prefix + i1, nblocks = (total + 7) / 8;
    for (int64_t blk = 0; blk < nblocks; blk++) {
        float *dst = kt + blk * 8 * D;
        for (int j = 0; j < 8; j++) {
            const int64_t t = blk * 8 + j;
            const int64_t off = t < total ? rows[t] * W + (int64_t)hk * D : -1;
            for (int d = 0; d < D; d++) dst[d * 8 + j] = off >= 0 ? x2_widen(k, off + d, is_bf16) : 0.0f;
        }
    }
    for (int64_t t = 0; t < total; t++) {
        const int64_t off = rows[t] * W + (int64_t)hk * D;
        if (is_bf16)
            for (int d = 0; d < D; d++) vf[t * D + d] = x2_widen(v, off + d, 1);
        else
            memcpy(vf + t * D, (const float *)v + off, sizeof(float) * D);
    }
    for (int64_t i = i0; i < i1; i += 2) { /* two query rows at a time, the range's last one alone if odd */
        const int R = i + 1 < i1 ? 2 : 1;
        for (int g0 = 0; g0 < G; g0 += 4) { /* up to 4 query heads share each key block */
            const int n = G - g0 < 4 ? G - g0 : 4;
            float qv[8][X2_MAX_D] __attribute__((aligned(32)));
            int64_t qoff[8];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < n; j++) {
                    const int s = r * n + j;
                    qoff[s] = ((q_start + i + r) * H + hk * G + g0 + j) * D;
                    for (int d = 0; d < D; d++) qv[s][d] = x2_widen(q, qoff[s] + d, is_bf16) * scale;
                }
            extend_rows8(R, qv, n, C, kt, vf, prefix + i, out, qoff, is_bf16);
        }
    }
}

/* Where a range of queries starts so that each of `parts` ranges has about the same work: query i attends
 * prefix + i + 1 keys, so the work up to x is prefix x + x^2 / 2. */
static int64_t range_start(int64_t prefix, int64_t ext, int part, int parts) {
    if (part >= parts) return ext;
    const double p = (double)prefix, e = (double)ext;
    const double x = -p + sqrt(p * p + 2.0 * ((double)part / parts) * (p * e + e * e / 2.0));
    const int64_t i = (int64_t)x;
    return i < 0 ? 0 : (i > ext ? ext : i);
}

int extend_attention_avx2(const void *q, const void *k, const void *v, void *out, const int64_t *req_to_token,
                          int64_t stride, const int64_t *slots, const int64_t *prefix, const int64_t *ext,
                          const int64_t *q_start, int B, int H, int Hkv, int D, float scale, int is_bf16,
                          int num_threads) {
    if (Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 8 != 0 || D > X2_MAX_D) return 1;
    int64_t max_total = 1;
    for (int b = 0; b < B; b++) if (prefix[b] + ext[b] > max_total) max_total = prefix[b] + ext[b];
    const int64_t padded = (max_total + 7) / 8 * 8;
    const int parts = num_threads > 1 && B * Hkv < 2 * num_threads ? X2_PARTS : 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *kt = (float *)aligned_alloc(32, sizeof(float) * padded * D);
        float *vf = (float *)aligned_alloc(32, sizeof(float) * padded * D);
        if (kt == NULL || vf == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < B * Hkv * parts; u++) { /* the last ranges (the most keys) first: they take longest */
            const int r = parts - 1 - u % parts, hk = (u / parts) % Hkv, b = u / (parts * Hkv);
            const int64_t i0 = range_start(prefix[b], ext[b], r, parts), i1 = range_start(prefix[b], ext[b], r + 1, parts);
            if (kt != NULL && vf != NULL && i1 > i0)
                extend_range(q, k, v, out, req_to_token + slots[b] * stride, prefix[b], i0, i1, q_start[b], hk, H, Hkv,
                             D, scale, is_bf16, kt, vf);
        }
        free(kt);
        free(vf);
    }
    return failed;
}
#endif
