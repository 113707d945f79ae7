/* Decode attention straight from the token-level KV pool, for the CPU.
 *
 * One query token per request attends over that request's whole sequence, whose K/V rows are
 * found through req_to_token. Reading the pool in place (no gathered copy, no padding) makes this
 * bandwidth-bound on the K/V bytes themselves. GQA: the G query heads that share a KV head are
 * computed together so each K/V row is read once. Two passes per request:
 * scores and their max, then exp-weighted V sums. Float32 or bfloat16 storage; float32 math.
 */
#include <math.h>
#include <stdint.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_scalar.h"

/* n elements from base[off..] (float32 or bfloat16 storage) into float32 dst */
static inline void load_row_f32(const void *base, int64_t off, int n, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, sizeof(float) * n);
    }
}

/* Rows are scattered through the pool, so fetch a few ahead: the loop is latency-bound otherwise. */
#define PREFETCH 8
static inline void prefetch_row(const void *base, int64_t byte_off, int64_t bytes) {
    const char *p = (const char *)base + byte_off;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
}

/* A thread's next request (the AVX-512 path), claimed before it starts the current one, so that its first K and
 * V rows can be prefetched into L2 while the current one computes. Why: a request's first KV head streams its rows from
 * memory (that head's passes prefetch whole rows, every head's part) and its later heads find them in L2,
 * so without this the memory sat idle while those heads computed; with it, SmolLM2's 64-request decode
 * step (370 tokens each) took 20% less time in attention on Zen 4 (engine/kernels/cpu/bench.py). */
typedef struct {
    const int64_t *rows; /* the next request's token rows */
    int64_t len;         /* how many of them to prefetch: all, or the first ones that fit in L2 beside the current */
    int64_t total;       /* keys the current request's passes will process */
    int64_t credit;      /* 2 * len per key processed, less total per row prefetched (no division a key) */
    int64_t done;        /* rows prefetched so far, of 2 * len (K rows, then V rows) */
} Lookahead;

/* n more keys processed by a pass of the current request: prefetch the same share of the next one's rows,
 * so the prefetches spread over all of its work instead of arriving in one burst the memory cannot serve. */
static inline void prefetch_ahead(Lookahead *next, const void *k, const void *v, int64_t n, int64_t W, int64_t elem) {
    next->credit += n * 2 * next->len;
    for (; next->credit >= next->total && next->done < 2 * next->len; next->done++) {
        const int is_k = next->done < next->len;
        const int64_t r = is_k ? next->done : next->done - next->len;
        prefetch_row(is_k ? k : v, next->rows[r] * W * elem, W * elem); /* the whole row: every KV head */
        next->credit -= next->total;
    }
}

/* The L2 bytes a thread may fill with the current request's rows and the next one's: 7/8 of L2 (512 KB
 * where the C library does not say). Asked once; callers on other threads may ask at the same time. */
static int64_t l2_budget(void) {
    static int64_t budget = 0;
    int64_t b = __atomic_load_n(&budget, __ATOMIC_RELAXED);
    if (b == 0) {
        long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        b = (l2 > 0 ? (int64_t)l2 : 512 * 1024) * 7 / 8;
        __atomic_store_n(&budget, b, __ATOMIC_RELAXED);
    }
    return b;
}

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define HAVE_SIMD 1
/* exp for 16 lanes: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (rel. error
 * about 2e-7); lanes below -87 flush to 0, which is all attention needs (x <= 0 here). */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 result = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(~tiny, result);
}

/* sh[t] = exp(sh[t] - m) for t < len, 16 at a time; returns their sum. */
static inline float exp_shifted_sum(float *sh, int64_t len, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 tot = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sh + t), vm));
        _mm512_storeu_ps(sh + t, e);
        tot = _mm512_add_ps(tot, e);
    }
    if (t < len) {
        const __mmask16 mk = (__mmask16)((1u << (len - t)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + t), vm)));
        _mm512_mask_storeu_ps(sh + t, mk, e);
        tot = _mm512_add_ps(tot, e);
    }
    return _mm512_reduce_add_ps(tot);
}

/* out[i] = the sum of a[i]'s 16 lanes: a transpose-and-add tree, 45 instructions for 16 sums
 * where one horizontal sum each takes about 8. */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of a pair */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: four keys' partial sums */
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* across the four 128-bit lanes */
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

#else
#define HAVE_SIMD 0
#endif

#if HAVE_SIMD
/* D == 64, register-blocked: for each KV head, its (up to 4 at a time) query heads keep their V
 * accumulators in registers across the whole sequence, and each K/V row segment is converted from
 * bfloat16 once per KV head instead of once per query head. */
static inline void load_row64(const void *base, int64_t off, int is_bf16, __m512 r[4]) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int c = 0; c < 4; c++) r[c] = load_bf16x16(p + 16 * c);
    } else {
        const float *p = (const float *)base + off;
        for (int c = 0; c < 4; c++) r[c] = _mm512_loadu_ps(p + 16 * c);
    }
}

/* NH (1..4, a constant at each call, so the loops unroll and the accumulators stay in registers) query
 * heads h0.. of KV head hk. fetch: this head's passes prefetch the whole row (span bytes: every KV head
 * of the unit); the unit's later heads find the rows in L2 and prefetch nothing. */
static inline __attribute__((always_inline)) void d64_heads(const int NH, const float *qf, const void *q_raw,
                                                           float scale, const void *k, const void *v, float *acc_out,
                                                           const int64_t *rows, int64_t len, int W, int hk, int h0,
                                                           int is_bf16, float *scores, float *mx, float *sum,
                                                           int fetch, int64_t span, Lookahead *next) {
    const int D = 64;
    const int64_t elem = is_bf16 ? 2 : 4;
    __m512 qv[4][4];
    for (int j = 0; j < NH; j++)
        for (int c = 0; c < 4; c++) qv[j][c] = _mm512_loadu_ps(qf + (h0 + j) * D + 16 * c);
#if defined(__AVX512BF16__)
    __m512bh qb[4][2]; /* the unscaled bf16 query (exact), as pairs; the scale comes after the sum */
    if (is_bf16)
        for (int j = 0; j < NH; j++)
            for (int c = 0; c < 2; c++)
                qb[j][c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q_raw + (h0 + j) * D + 32 * c);
#endif
    __m512 vmax[4];
    for (int j = 0; j < NH; j++) vmax[j] = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < len; t0 += 16) { /* 16 keys a block: their scores as one vector */
        const int nt = len - t0 < 16 ? (int)(len - t0) : 16;
        const __mmask16 mk = (__mmask16)((1u << nt) - 1u);
        int64_t off[16];
        for (int t = 0; t < 16; t++) off[t] = rows[t0 + (t < nt ? t : 0)] * W + hk * D; /* tail: a real row, masked */
        if (fetch)
            for (int t = 0; t < nt; t++)
                if (t0 + 16 + t < len) prefetch_row(k, (rows[t0 + 16 + t] * W + hk * D) * elem, span);
        if (next != NULL) prefetch_ahead(next, k, v, 16, W, elem);
#if defined(__AVX512BF16__)
        if (is_bf16) { /* bf16 pairs straight from the pool: two dot-product instructions a row */
            for (int j = 0; j < NH; j++) {
                __m512 a[16];
#pragma GCC unroll 16
                for (int t = 0; t < 16; t++) {
                    const uint16_t *kr = (const uint16_t *)k + off[t];
                    __m512 z = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr), qb[j][0]);
                    a[t] = _mm512_dpbf16_ps(z, (__m512bh)_mm512_loadu_si512(kr + 32), qb[j][1]);
                }
                __m512 sc = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + (h0 + j) * len + t0, mk, sc);
                vmax[j] = _mm512_mask_max_ps(vmax[j], mk, vmax[j], sc);
            }
            continue;
        }
#endif
        float kb[16 * 64];
        const float *kf[16];
        for (int t = 0; t < 16; t++) {
            if (is_bf16) {
                __m512 r[4];
                load_row64(k, off[t], 1, r);
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(kb + t * 64 + 16 * c, r[c]);
                kf[t] = kb + t * 64;
            } else {
                kf[t] = (const float *)k + off[t];
            }
        }
        for (int j = 0; j < NH; j++) {
            __m512 a[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {
                __m512 x = _mm512_mul_ps(qv[j][0], _mm512_loadu_ps(kf[t]));
                x = _mm512_fmadd_ps(qv[j][1], _mm512_loadu_ps(kf[t] + 16), x);
                x = _mm512_fmadd_ps(qv[j][2], _mm512_loadu_ps(kf[t] + 32), x);
                a[t] = _mm512_fmadd_ps(qv[j][3], _mm512_loadu_ps(kf[t] + 48), x);
            }
            __m512 sc = reduce16(a);
            _mm512_mask_storeu_ps(scores + (h0 + j) * len + t0, mk, sc);
            vmax[j] = _mm512_mask_max_ps(vmax[j], mk, vmax[j], sc);
        }
    }
    for (int j = 0; j < NH; j++) {
        const float m = _mm512_reduce_max_ps(vmax[j]);
        mx[h0 + j] = m;
        sum[h0 + j] = exp_shifted_sum(scores + (h0 + j) * len, len, m);
    }
    __m512 acc[4][4];
    for (int j = 0; j < NH; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm512_setzero_ps();
    if (is_bf16) {
        /* a V row as two 64-byte loads of 32 bf16: each 32-bit lane holds dims 2i (low half) and 2i + 1 (high
         * half), so a shift makes the even dims float32 and a mask the odd ones, two instructions for 32
         * dims. acc[j][0..1] collect the even dims of the two halves, acc[j][2..3] the odd; interleaved at
         * the end, each dim's sum is the same as in dim order. */
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int64_t t = 0; t < len; t++) {
            if (fetch && t + PREFETCH < len) prefetch_row(v, (rows[t + PREFETCH] * W + hk * D) * elem, span);
            if (next != NULL) prefetch_ahead(next, k, v, 1, W, elem);
            const uint16_t *p = (const uint16_t *)v + rows[t] * W + hk * D;
            const __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 32);
            const __m512 vr[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(r0, 16)),
                                  _mm512_castsi512_ps(_mm512_slli_epi32(r1, 16)),
                                  _mm512_castsi512_ps(_mm512_and_si512(r0, hi)),
                                  _mm512_castsi512_ps(_mm512_and_si512(r1, hi))};
            for (int j = 0; j < NH; j++) {
                const __m512 pj = _mm512_set1_ps(scores[(h0 + j) * len + t]);
                for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(pj, vr[c], acc[j][c]);
            }
        }
        const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (int j = 0; j < NH; j++)
            for (int c = 0; c < 2; c++) { /* dims 32c.. from evens acc[j][c] and odds acc[j][2 + c] */
                float *o = acc_out + (h0 + j) * D + 32 * c;
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[j][c], lo_idx, acc[j][2 + c]));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[j][c], hi_idx, acc[j][2 + c]));
            }
        return;
    }
    for (int64_t t = 0; t < len; t++) {
        if (fetch && t + PREFETCH < len) prefetch_row(v, (rows[t + PREFETCH] * W + hk * D) * elem, span);
        if (next != NULL) prefetch_ahead(next, k, v, 1, W, elem);
        __m512 vr[4];
        load_row64(v, rows[t] * W + hk * D, 0, vr);
        for (int j = 0; j < NH; j++) {
            const __m512 pj = _mm512_set1_ps(scores[(h0 + j) * len + t]);
            for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(pj, vr[c], acc[j][c]);
        }
    }
    for (int j = 0; j < NH; j++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_out + (h0 + j) * D + 16 * c, acc[j][c]);
}

static void attend_one_d64(const float *qf, const void *q_raw, float scale, const void *k, const void *v,
                           float *acc_out, const int64_t *rows, int64_t len, int H, int Hkv, int hk0, int hk1,
                           int is_bf16, float *scores, float *mx, float *sum, Lookahead *next) {
    const int G = H / Hkv, W = Hkv * 64;
    const int64_t span = (int64_t)(hk1 - hk0) * 64 * (is_bf16 ? 2 : 4);
    for (int hk = hk0; hk < hk1; hk++) {
        /* rows hold every KV head contiguously: the first head's passes prefetch the whole of each row (one
         * stream of whole rows from memory instead of one per head), the later heads' find it in L2 */
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int n = G - g0 < 4 ? G - g0 : 4, h0 = hk * G + g0, fetch = hk == hk0 && g0 == 0;
            switch (n) {
            case 4: d64_heads(4, qf, q_raw, scale, k, v, acc_out, rows, len, W, hk, h0, is_bf16, scores, mx, sum, fetch, span, next); break;
            case 3: d64_heads(3, qf, q_raw, scale, k, v, acc_out, rows, len, W, hk, h0, is_bf16, scores, mx, sum, fetch, span, next); break;
            case 2: d64_heads(2, qf, q_raw, scale, k, v, acc_out, rows, len, W, hk, h0, is_bf16, scores, mx, sum, fetch, span, next); break;
            default: d64_heads(1, qf, q_raw, scale, k, v, acc_out, rows, len, W, hk, h0, is_bf16, scores, mx, sum, fetch, span, next);
            }
        }
    }
}
#endif

#define MAX_H 64

#if !HAVE_SIMD && defined(__AVX2__) && defined(__FMA__)
/* The same D == 64 decode with 256-bit vectors, for CPUs without AVX-512 (AMD Zen 2, older Intel): the
 * plain loop below takes one horizontal sum and one scalar expf per score, half of a step's attention. */
#include <immintrin.h>
#include "avx2_math.h"
#define HAVE_AVX2_D64 1

static inline __m256 load8(const void *base, int64_t off, int is_bf16) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

/* out[i] = the sum of a[i]'s 8 lanes (three levels of adds instead of eight horizontal sums) */
static inline __m256 reduce8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* sh[t] = exp(sh[t] - m) for t < len, 8 at a time (the tail scalar); returns their sum (exp_shifted_sum's
 * 256-bit form) */
static inline float exp_shifted_sum256(float *sh, int64_t len, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 tot = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + t), vm));
        _mm256_storeu_ps(sh + t, e);
        tot = _mm256_add_ps(tot, e);
    }
    float total = hsum256(tot);
    for (; t < len; t++) {
        sh[t] = expf(sh[t] - m);
        total += sh[t];
    }
    return total;
}

#ifndef CHUNK
#define CHUNK 8 /* keys a chunk, and how far ahead rows are prefetched: of 8, 16 and 32, 8 was the fastest on an
                 * AMD Zen 1 (docs/performance.md) */
#endif
#if CHUNK <= 0 || CHUNK % 8 != 0
#error "CHUNK must be a multiple of the 8-key block"
#endif

/* P.V for NH query heads (a constant at each call: their 4 x NH accumulators then stay in registers) over
 * one half of D and the keys [t0, t1): out[j] (+)= sum over t of p[j][t] V[t][32 half .. 32 half + 31], from
 * zero at the first chunk (t0 == 0), else carried on from out in the same order of additions */
static inline __attribute__((always_inline)) void pv_half(const int NH, const void *v, const float *p, float *out,
                                                          const int64_t *rows, int64_t t0, int64_t t1, int64_t len,
                                                          int W, int hk, int half, int is_bf16, int64_t elem,
                                                          int64_t span, int fetch) {
    __m256 acc[3][4];
    for (int j = 0; j < NH; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + j * 64 + 8 * c);
    for (int64_t t = t0; t < t1; t++) {
        if (fetch && t + CHUNK < len) prefetch_row(v, (rows[t + CHUNK] * W + hk * 64 + 32 * half) * elem, span);
        const int64_t off = rows[t] * W + hk * 64 + 32 * half;
        __m256 vr[4];
        for (int c = 0; c < 4; c++) vr[c] = load8(v, off + 8 * c, is_bf16);
        for (int j = 0; j < NH; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j * len + t);
            for (int c = 0; c < 4; c++) acc[j][c] = _mm256_fmadd_ps(pj, vr[c], acc[j][c]);
        }
    }
    for (int j = 0; j < NH; j++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + j * 64 + 8 * c, acc[j][c]);
}

/* Keys are walked in chunks of CHUNK, every KV head of the part over one chunk before the next: a token's
 * row holds all its KV heads side by side, so each chunk's rows come from memory once and serve every head
 * from L1 (or L2, for many KV heads), and every head's pass prefetches its own part of the next chunk's
 * rows, so that the stream from memory runs under all of the work (walking all keys head by head, only the
 * first head's pass fetched ahead and the others found rows the last pass had pushed out of L2: 14-18%
 * slower). Each head's scores, maxima, sums and P.V are added up in the same order as that walk: the
 * results are bitwise the same. */
static void attend_one_d64_avx2(const float *qf, const void *k, const void *v, float *acc_out, const int64_t *rows,
                                int64_t len, int H, int Hkv, int hk0, int hk1, int is_bf16, float *scores, float *mx,
                                float *sum) {
    const int G = H / Hkv;
    const int D = 64, W = Hkv * 64;
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t span = (int64_t)(hk1 - hk0) * D * elem; /* the part's heads of one row: prefetched together */
    __m256 vmax[MAX_H];
    for (int h = hk0 * G; h < hk1 * G; h++) vmax[h] = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len && t < CHUNK; t++) /* the first chunk's rows */
        prefetch_row(k, (rows[t] * W + hk0 * D) * elem, span);
    for (int64_t c0 = 0; c0 < len; c0 += CHUNK) {
        const int64_t c1 = len - c0 < CHUNK ? len : c0 + CHUNK;
        for (int hk = hk0; hk < hk1; hk++)
            for (int g0 = 0; g0 < G; g0 += 3) { /* 3 query heads at a time, as P.V below */
                const int n = G - g0 < 3 ? G - g0 : 3;
                const int h0 = hk * G + g0, fetch = g0 == 0;
                for (int64_t t0 = c0; t0 < c1; t0 += 8) { /* 8 keys a block: their scores as one vector */
                    const int nt = len - t0 < 8 ? (int)(len - t0) : 8;
                    float kb[8 * 64];
                    if (fetch) /* this head's part of the next chunk's rows: the stream runs under every head's work */
                        for (int t = 0; t < nt; t++)
                            if (t0 + CHUNK + t < len)
                                prefetch_row(k, (rows[t0 + CHUNK + t] * W + hk * D) * elem, D * elem);
                    const float *kf[8];
                    for (int t = 0; t < 8; t++) { /* the tail repeats a real row; its scores are not kept */
                        const int64_t off = rows[t0 + (t < nt ? t : 0)] * W + hk * D;
                        if (is_bf16) { /* converted once for all n query heads */
                            for (int c = 0; c < 8; c++) _mm256_storeu_ps(kb + t * 64 + 8 * c, load8(k, off + 8 * c, 1));
                            kf[t] = kb + t * 64;
                        } else {
                            kf[t] = (const float *)k + off;
                        }
                    }
                    for (int j = 0; j < n; j++) {
                        const float *qh = qf + (h0 + j) * D;
                        __m256 a[8];
                        for (int t = 0; t < 8; t++) {
                            const float *kr = kf[t];
                            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kr));
                            __m256 y = _mm256_mul_ps(_mm256_loadu_ps(qh + 8), _mm256_loadu_ps(kr + 8));
                            for (int c = 2; c < 8; c += 2) {
                                x = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(kr + 8 * c), x);
                                y = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c + 8), _mm256_loadu_ps(kr + 8 * c + 8), y);
                            }
                            a[t] = _mm256_add_ps(x, y);
                        }
                        __m256 sc = reduce8(a);
                        float *dst = scores + (h0 + j) * len + t0;
                        if (nt == 8) {
                            _mm256_storeu_ps(dst, sc);
                            vmax[h0 + j] = _mm256_max_ps(vmax[h0 + j], sc);
                        } else {
                            float tmp[8];
                            _mm256_storeu_ps(tmp, sc);
                            for (int t = 0; t < nt; t++) dst[t] = tmp[t];
                            for (int t = nt; t < 8; t++) tmp[t] = -INFINITY;
                            vmax[h0 + j] = _mm256_max_ps(vmax[h0 + j], _mm256_loadu_ps(tmp));
                        }
                    }
                }
            }
    }
    for (int h = hk0 * G; h < hk1 * G; h++) {
        mx[h] = hmax256(vmax[h]);
        sum[h] = exp_shifted_sum256(scores + h * len, len, mx[h]);
    }
    /* P.V in halves of D: 12 accumulators, the broadcast and the V vectors fit the 16 registers only with the
     * head count a constant (pv_half) */
    for (int64_t t = 0; t < len && t < CHUNK; t++) prefetch_row(v, (rows[t] * W + hk0 * D) * elem, span);
    for (int64_t c0 = 0; c0 < len; c0 += CHUNK) {
        const int64_t c1 = len - c0 < CHUNK ? len : c0 + CHUNK;
        for (int hk = hk0; hk < hk1; hk++)
            for (int g0 = 0; g0 < G; g0 += 3) {
                const int n = G - g0 < 3 ? G - g0 : 3;
                const int h0 = hk * G + g0;
                for (int half = 0; half < 2; half++) {
#define PV(NH) pv_half(NH, v, scores + (int64_t)h0 * len, acc_out + h0 * D + 32 * half, rows, c0, c1, len, W, hk, \
                       half, is_bf16, elem, 32 * elem, g0 == 0)
                    if (n == 3) PV(3);
                    else if (n == 2) PV(2);
                    else PV(1);
#undef PV
                }
            }
    }
}
#else
#define HAVE_AVX2_D64 0
#endif

#define MAX_D 256
#define SPLIT_MIN_LEN 256 /* tokens a part, at least, where a sequence is split among threads */

/* One request, KV heads hk0..hk1 (all of them unless the batch is smaller than the thread count) and
 * their query heads, over the sequence rows[0..len): for each query head h, acc[h * D..] = the sum over
 * t of exp(s_t - mx[h]) V_t and sum[h] that of exp(s_t - mx[h]), not yet divided (attend_one divides;
 * a sequence split in parts is merged by merge_parts). Each token's K (then V) row holds every KV head
 * contiguously, so one pass reads the request's rows front to back instead of striding through them
 * once per head. */
static void attend_part(const void *q, const void *k, const void *v, const int64_t *rows, int64_t len, int b,
                        int H, int Hkv, int hk0, int hk1, int D, float scale, int is_bf16, float *scores, float *acc,
                        float *mx, float *sum, Lookahead *next) {
    const int G = H / Hkv, h_lo = hk0 * G, h_hi = hk1 * G;
    const int W = Hkv * D; /* elements per token row */
    const int64_t elem = is_bf16 ? 2 : 4;
    static __thread float qf[MAX_H * MAX_D];
    static __thread float row[MAX_H * MAX_D];
    for (int h = h_lo; h < h_hi; h++) {
        int64_t base = ((int64_t)b * H + h) * D;
        for (int d = 0; d < D; d++)
            qf[h * D + d] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[base + d]) : ((const float *)q)[base + d]) * scale;
        mx[h] = -INFINITY;
    }
#if HAVE_SIMD
    if (D == 64) {
        attend_one_d64(qf, (const uint16_t *)q + (int64_t)b * H * D, scale, k, v, acc, rows, len, H, Hkv, hk0, hk1,
                       is_bf16, scores, mx, sum, next);
        return;
    }
#elif HAVE_AVX2_D64
    if (D == 64) {
        attend_one_d64_avx2(qf, k, v, acc, rows, len, H, Hkv, hk0, hk1, is_bf16, scores, mx, sum);
        return;
    }
#endif
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH < len) prefetch_row(k, (rows[t + PREFETCH] * W + hk0 * D) * elem, (hk1 - hk0) * D * elem);
        int64_t off = rows[t] * W + hk0 * D; /* only this unit's KV heads */
        load_row_f32(k, off, (hk1 - hk0) * D, is_bf16, row + hk0 * D);
        for (int h = h_lo; h < h_hi; h++) {
            const float *kr = row + (h / G) * D;
            const float *qh = qf + h * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qh[d] * kr[d];
            scores[h * len + t] = s;
            if (s > mx[h]) mx[h] = s;
        }
    }
    for (int h = h_lo; h < h_hi; h++) {
        float *sh = scores + h * len;
        float m = mx[h], total = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            float e = expf(sh[t] - m);
            sh[t] = e;
            total += e;
        }
        sum[h] = total;
    }
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH < len) prefetch_row(v, (rows[t + PREFETCH] * W + hk0 * D) * elem, (hk1 - hk0) * D * elem);
        int64_t off = rows[t] * W + hk0 * D;
        load_row_f32(v, off, (hk1 - hk0) * D, is_bf16, row + hk0 * D);
        for (int h = h_lo; h < h_hi; h++) {
            const float *vr = row + (h / G) * D;
            float *ah = acc + h * D;
            float p = scores[h * len + t];
            for (int d = 0; d < D; d++) ah[d] += p * vr[d];
        }
    }
}

static inline void store_out(void *out, int64_t base, int D, const float *acc, float inv, int is_bf16) {
    for (int d = 0; d < D; d++) {
        float o = acc[d] * inv;
        if (is_bf16) ((uint16_t *)out)[base + d] = f32_to_bf16(o);
        else ((float *)out)[base + d] = o;
    }
}

/* A request's KV heads hk0..hk1 over its whole sequence, normalized into out [B, H, D]. */
static void attend_one(const void *q, const void *k, const void *v, void *out, const int64_t *rows, int64_t len,
                       int b, int H, int Hkv, int hk0, int hk1, int D, float scale, int is_bf16, float *scores,
                       Lookahead *next) {
    static __thread float acc[MAX_H * MAX_D];
    float mx[MAX_H], sum[MAX_H];
    const int G = H / Hkv;
    memset(acc + hk0 * G * D, 0, sizeof(float) * (hk1 - hk0) * G * D);
    attend_part(q, k, v, rows, len, b, H, Hkv, hk0, hk1, D, scale, is_bf16, scores, acc, mx, sum, next);
    for (int h = hk0 * G; h < hk1 * G; h++) store_out(out, ((int64_t)b * H + h) * D, D, acc + h * D, 1.0f / sum[h], is_bf16);
}

/* One KV head's G query heads of request b from its n parts (part j: acc [G * D], then mx [G], sum [G]):
 * rescaled to the largest max, summed, divided, into out. */
static void merge_parts(const float *parts, int n, int64_t part_size, void *out, int b, int H, int G, int hk, int D,
                        int is_bf16) {
    float acc[MAX_D];
    for (int g = 0; g < G; g++) {
        float m = -INFINITY, total = 0.0f;
        for (int j = 0; j < n; j++) {
            const float pm = parts[j * part_size + G * D + g];
            if (pm > m) m = pm;
        }
        memset(acc, 0, sizeof(float) * D);
        for (int j = 0; j < n; j++) {
            const float *part = parts + j * part_size;
            if (part[G * D + G + g] == 0.0f) continue; /* an empty part (its max is -inf) */
            const float w = expf(part[G * D + g] - m);
            total += w * part[G * D + G + g];
            for (int d = 0; d < D; d++) acc[d] += w * part[g * D + d];
        }
        store_out(out, ((int64_t)b * H + hk * G + g) * D, D, acc, 1.0f / total, is_bf16);
    }
}

/* What this build computes for a model's shape: bit 0 decode, bit 1 extend (extend needs AVX-512 and
 * D a multiple of 16, or AVX2 with FMA and D a multiple of 8). The backend asks once, at start, and sends the rest to torch; a kernel's non-zero
 * return at run time is then an error (2: out of memory), never a shape it quietly refuses. */
int native_support(int H, int Hkv, int D) {
    int ok = 0;
    if (Hkv > 0 && H % Hkv == 0 && H <= MAX_H && D > 0 && D <= MAX_D) ok |= 1;
#if defined(__AVX512F__)
    if (Hkv > 0 && H % Hkv == 0 && D > 0 && D % 16 == 0 && D <= MAX_D) ok |= 2;
#elif defined(__AVX2__) && defined(__FMA__)
    if (Hkv > 0 && H % Hkv == 0 && D > 0 && D % 8 == 0 && D <= MAX_D) ok |= 2; /* extend_avx2.c */
#endif
    return ok;
}

/* q, out: [B, H, D]; k, v: [N, Hkv, D]; req_to_token: [R, stride]; slots, lens: [B]. Returns 0 or an error code. */
int decode_attention(const void *q, const void *k, const void *v, void *out, const int64_t *req_to_token,
                     int64_t stride, const int64_t *slots, const int64_t *lens, int B, int H, int Hkv, int D,
                     float scale, int is_bf16, int num_threads) {
    if (Hkv <= 0 || H % Hkv != 0 || H > MAX_H || D <= 0 || D > MAX_D) return 1;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) if (lens[b] > max_len) max_len = lens[b];
    /* fewer requests than threads (one user): each KV head is a unit of work, else each request; and where
     * the KV heads do not divide among the threads (3 on 2), each head's sequence in one part a thread,
     * merged after (flash-decoding's split), so no thread waits a head's time for the last one */
    const int split = B < num_threads ? Hkv : 1, per = Hkv / split;
    const int parts = split > 1 && (B * Hkv) % num_threads != 0 && max_len >= (int64_t)num_threads * SPLIT_MIN_LEN
                          ? num_threads : 1;
    const int G = H / Hkv;
    const int64_t part_size = (int64_t)G * D + 2 * G;
    float *part_buf = parts > 1 ? (float *)malloc(sizeof(float) * part_size * B * Hkv * parts) : NULL;
    if (parts > 1 && part_buf == NULL) return 2;
    int failed = 0, next_unit = 0;
    const int64_t row_bytes = (int64_t)Hkv * D * (is_bf16 ? 2 : 4), budget = l2_budget();
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * H * (max_len > 0 ? max_len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 2;
        }
        /* every thread must reach the worksharing loops, even one whose allocation failed */
        if (parts == 1) {
            /* units handed out one at a time (requests of unequal lengths). With whole requests as units (split
             * == 1) a thread claims its next one before it starts the current one and prefetches the next
             * one's first rows meanwhile, as many as fit in L2 beside the current one's; KV heads as units
             * (fewer requests than threads) are claimed one at a time, so an idle thread takes the last */
            const int n_units = B * split, ahead_ok = split == 1;
            int u = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);
            while (u < n_units) {
                const int nu = ahead_ok ? __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED) : n_units;
                const int b = u / split, hk0 = (u % split) * per;
                Lookahead ahead, *next = NULL;
                const int64_t room = budget / (2 * row_bytes) - lens[b]; /* rows of K and V that fit beside b's */
                if (nu < n_units && room > 0 && lens[nu] > 0 && lens[b] > 0) {
                    ahead = (Lookahead){req_to_token + slots[nu] * stride, lens[nu] < room ? lens[nu] : room,
                                        lens[b] * 2 * Hkv * ((G + 3) / 4), 0, 0}; /* keys: 2 passes a group of 4 heads */
                    next = &ahead;
                }
                if (scores != NULL)
                    attend_one(q, k, v, out, req_to_token + slots[b] * stride, lens[b], b, H, Hkv, hk0, hk0 + per, D,
                               scale, is_bf16, scores, next);
                u = ahead_ok ? nu : __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);
            }
        } else {
            static __thread float acc[MAX_H * MAX_D];
            float mx[MAX_H], sum[MAX_H];
#pragma omp for schedule(dynamic, 1) /* requests of unequal lengths: parts of unequal sizes */
            for (int u = 0; u < B * Hkv * parts; u++) { /* unit u: request b, KV head hk, part j */
                const int j = u % parts, hk = (u / parts) % Hkv, b = u / (parts * Hkv);
                const int64_t t0 = lens[b] * j / parts, t1 = lens[b] * (j + 1) / parts;
                float *part = part_buf + (int64_t)u * part_size;
                memset(acc + hk * G * D, 0, sizeof(float) * G * D);
                for (int g = 0; g < G; g++) mx[hk * G + g] = -INFINITY, sum[hk * G + g] = 0.0f;
                if (scores != NULL && t1 > t0)
                    attend_part(q, k, v, req_to_token + slots[b] * stride + t0, t1 - t0, b, H, Hkv, hk, hk + 1, D,
                                scale, is_bf16, scores, acc, mx, sum, NULL);
                memcpy(part, acc + hk * G * D, sizeof(float) * G * D);
                memcpy(part + G * D, mx + hk * G, sizeof(float) * G);
                memcpy(part + G * D + G, sum + hk * G, sizeof(float) * G);
            }
#pragma omp for schedule(static)
            for (int u = 0; u < B * Hkv; u++)
                merge_parts(part_buf + (int64_t)u * parts * part_size, parts, part_size, out, u / Hkv, H, G, u % Hkv, D,
                            is_bf16);
        }
        free(scores);
    }
    free(part_buf);
    return failed;
}

/* decode_attention with the step's new K and V stored first: each row's K and V (rows of row_stride
 * elements, where the qkv projection wrote them) copied to out_loc, then its q (same row stride)
 * attended. In torch that is two index_put and a copy of q a layer (90 small ops a step at batch 1; at
 * batch 64 in bfloat16 about 0.1 ms a layer). Float32 (the quantized modes' fused decode steps,
 * engine/model/fused_decode.py) or bfloat16 (the exact mode, CpuNativeAttentionBackend.forward) rows and
 * pool. out: [B, H, D]. */
int decode_attention_store(const void *q, const void *k_new, const void *v_new, int64_t row_stride,
                           const int64_t *out_loc, void *k, void *v, void *out, const int64_t *req_to_token,
                           int64_t stride, const int64_t *slots, const int64_t *lens, int B, int H, int Hkv, int D,
                           float scale, int is_bf16, int num_threads) {
    if (Hkv <= 0 || H % Hkv != 0 || H > MAX_H || D <= 0 || D > MAX_D) return 1;
    const int64_t elem = is_bf16 ? 2 : 4, W = (int64_t)Hkv * D * elem, Q = (int64_t)H * D * elem, R = row_stride * elem;
    for (int b = 0; b < B; b++) {
        memcpy((char *)k + out_loc[b] * W, (const char *)k_new + b * R, W);
        memcpy((char *)v + out_loc[b] * W, (const char *)v_new + b * R, W);
    }
    char *packed = NULL; /* the kernel reads q as [B, H, D]: rows of one row stride are, not of a wider one */
    if (B > 1 && R != Q) {
        packed = (char *)malloc(Q * B);
        if (packed == NULL) return 2;
        for (int b = 0; b < B; b++) memcpy(packed + b * Q, (const char *)q + b * R, Q);
    }
    const int rc = decode_attention(packed != NULL ? packed : q, k, v, out, req_to_token, stride, slots, lens, B, H,
                                    Hkv, D, scale, is_bf16, num_threads);
    free(packed);
    return rc;
}

#if HAVE_SIMD
#define EXT_SB 4 /* key blocks of 16 per online-softmax step: its reductions, exp of the old max and
                  * rescale of the output, once per 64 keys instead of per 16 */
/* One query row's n heads (n <= 4; queries qv, pre-scaled) against the keys 0..pos of kt/vf, written at
 * out + qoff[j]. Always inlined: extend_one calls it with n and C as constants where it can, so the
 * accumulators (n * C vectors) and scores live in registers; with a run-time n they were kept on the stack. */
static inline __attribute__((always_inline)) void extend_query(const float (*qv)[MAX_D], const int n, const int C,
                                                              const float *kt, const float *vf, int64_t pos,
                                                              void *out, const int64_t *qoff, int is_bf16,
                                                              const int BF, const uint32_t (*qp)[MAX_D / 2],
                                                              float scale) {
    const int D = 16 * C;
    const int64_t last = pos / 16;
    __m512 acc[4][MAX_D / 16];
    float m[4], l[4];
    for (int j = 0; j < n; j++) {
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t sb = 0; sb <= last; sb += EXT_SB) { /* EXT_SB key blocks per online-softmax step */
        const int nb = last - sb + 1 < EXT_SB ? (int)(last - sb + 1) : EXT_SB;
        __m512 sc[4][EXT_SB];
#if defined(__AVX512BF16__)
        if (BF && nb == EXT_SB) { /* a whole step: the same sums as below (even and odd pairs apart, added at the
                                   * end), each query pair broadcast once for the step's EXT_SB key blocks, and
                                   * 2 n EXT_SB independent chains where the loop below has 2 n */
            const uint16_t *kb = (const uint16_t *)kt + sb * 16 * D;
            __m512 s2[4][EXT_SB];
            for (int j = 0; j < n; j++)
                for (int b = 0; b < EXT_SB; b++) sc[j][b] = s2[j][b] = _mm512_setzero_ps();
            for (int d2 = 0; d2 < D / 2; d2 += 2) {
                __m512bh q0[4], q1[4];
                for (int j = 0; j < n; j++) {
                    q0[j] = (__m512bh)_mm512_set1_epi32((int)qp[j][d2]);
                    q1[j] = (__m512bh)_mm512_set1_epi32((int)qp[j][d2 + 1]);
                }
                for (int b = 0; b < EXT_SB; b++) {
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + b * 16 * D + d2 * 32);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + b * 16 * D + (d2 + 1) * 32);
                    for (int j = 0; j < n; j++) {
                        sc[j][b] = _mm512_dpbf16_ps(sc[j][b], k0, q0[j]);
                        s2[j][b] = _mm512_dpbf16_ps(s2[j][b], k1, q1[j]);
                    }
                }
            }
            for (int j = 0; j < n; j++)
                for (int b = 0; b < EXT_SB; b++)
                    sc[j][b] = _mm512_mul_ps(_mm512_add_ps(sc[j][b], s2[j][b]), _mm512_set1_ps(scale));
        } else
#endif
        for (int b = 0; b < nb; b++) {
#if defined(__AVX512BF16__)
            if (BF) { /* bf16 pairs: one dot-product instruction per two dims of 16 keys, half the FMAs */
                const uint16_t *kb = (const uint16_t *)kt + (sb + b) * 16 * D;
                __m512 s[4], s2[4];
                for (int j = 0; j < n; j++) s[j] = s2[j] = _mm512_setzero_ps();
                for (int d2 = 0; d2 < D / 2; d2 += 2) {
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + d2 * 32);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (d2 + 1) * 32);
                    for (int j = 0; j < n; j++) {
                        s[j] = _mm512_dpbf16_ps(s[j], k0, (__m512bh)_mm512_set1_epi32((int)qp[j][d2]));
                        s2[j] = _mm512_dpbf16_ps(s2[j], k1, (__m512bh)_mm512_set1_epi32((int)qp[j][d2 + 1]));
                    }
                }
                for (int j = 0; j < n; j++) sc[j][b] = _mm512_mul_ps(_mm512_add_ps(s[j], s2[j]), _mm512_set1_ps(scale));
                continue;
            }
#endif
            const float *kb = kt + (sb + b) * 16 * D;
            __m512 s[4], s2[4];
            for (int j = 0; j < n; j++) s[j] = s2[j] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 2) { /* two chains per head hide FMA latency */
                __m512 k0 = _mm512_loadu_ps(kb + d * 16), k1 = _mm512_loadu_ps(kb + (d + 1) * 16);
                for (int j = 0; j < n; j++) {
                    s[j] = _mm512_fmadd_ps(_mm512_set1_ps(qv[j][d]), k0, s[j]);
                    s2[j] = _mm512_fmadd_ps(_mm512_set1_ps(qv[j][d + 1]), k1, s2[j]);
                }
            }
            for (int j = 0; j < n; j++) sc[j][b] = _mm512_add_ps(s[j], s2[j]);
        }
        const int64_t base = sb * 16;
        const int nk = (int)((sb + nb - 1 == last ? pos + 1 : base + 16 * nb) - base); /* keys in the step */
        const int tail = nk - 16 * (nb - 1); /* valid keys of its last block, 1..16 */
        const __mmask16 keep = (__mmask16)((1u << tail) - 1u);
        float p[4][16 * EXT_SB];
        uint32_t pb[4][8 * EXT_SB]; /* BF: the weights as bf16 pairs of keys (2u, 2u + 1) */
        for (int j = 0; j < n; j++) {
            sc[j][nb - 1] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), sc[j][nb - 1]);
            __m512 mv = sc[j][0];
            for (int b = 1; b < nb; b++) mv = _mm512_max_ps(mv, sc[j][b]);
            const float bm = _mm512_reduce_max_ps(mv);
            const float m_new = bm > m[j] ? bm : m[j];
            const __m512 vm = _mm512_set1_ps(m_new);
            __m512 tot = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512 pj = exp512(_mm512_sub_ps(sc[j][b], vm));
                if (b == nb - 1) pj = _mm512_maskz_mov_ps(keep, pj);
                tot = _mm512_add_ps(tot, pj);
#if defined(__AVX512BF16__)
                if (BF) { /* rounded to bfloat16 for P.V, as torch's flash kernel does; the sum stays float32 */
                    _mm256_storeu_si256((__m256i *)(pb[j] + 8 * b), (__m256i)_mm512_cvtneps_pbh(pj));
                    continue;
                }
#endif
                _mm512_storeu_ps(p[j] + 16 * b, pj);
            }
            if (m_new != m[j]) { /* the running max moved: rescale what was summed under the old one */
                const float alpha = expf(m[j] - m_new);
                const __m512 va = _mm512_set1_ps(alpha);
                for (int c = 0; c < C; c++) acc[j][c] = _mm512_mul_ps(acc[j][c], va);
                l[j] *= alpha;
            }
            l[j] += _mm512_reduce_add_ps(tot);
            m[j] = m_new;
        }
#if defined(__AVX512BF16__)
        if (BF) { /* V as pairs of keys ([D][2] a pair, zero past the last key): one dot-product
                   * instruction per 16 dims of two keys, where the float32 path makes two FMAs */
            for (int u = 0; u < (nk + 1) / 2; u++) {
                const uint16_t *vp = (const uint16_t *)vf + (base + 2 * u) * D;
                for (int c = 0; c < C; c++) {
                    const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + 32 * c);
                    for (int j = 0; j < n; j++)
                        acc[j][c] = _mm512_dpbf16_ps(acc[j][c], vv, (__m512bh)_mm512_set1_epi32((int)pb[j][u]));
                }
            }
            continue;
        }
#endif
        for (int t = 0; t < nk; t++) {
            const float *vr = vf + (base + t) * D;
            for (int c = 0; c < C; c++) {
                __m512 vv = _mm512_loadu_ps(vr + 16 * c);
                for (int j = 0; j < n; j++) acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j][t]), vv, acc[j][c]);
            }
        }
    }
    for (int j = 0; j < n; j++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[j]);
        float o[MAX_D];
        for (int c = 0; c < C; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[j][c], inv));
        for (int d = 0; d < D; d++) {
            if (is_bf16) ((uint16_t *)out)[qoff[j] + d] = f32_to_bf16(o[d]);
            else ((float *)out)[qoff[j] + d] = o[d];
        }
    }
}

/* extend_query with n and C as constants where a model needs them (BF a constant too): SmolLM2's and
 * Llama 3 8B's 3 or 4 query heads a KV head at head_dim 64, 4 at 128; a general loop for the rest. */
static inline __attribute__((always_inline)) void extend_heads(const int BF, const float (*qv)[MAX_D],
                                                              const uint32_t (*qp)[MAX_D / 2], int n, int C,
                                                              const float *kt, const float *vf, int64_t pos,
                                                              void *out, const int64_t *qoff, int is_bf16,
                                                              float scale) {
    if (n == 3 && C == 4)
        extend_query(qv, 3, 4, kt, vf, pos, out, qoff, is_bf16, BF, qp, scale);
    else if (n == 4 && C == 4)
        extend_query(qv, 4, 4, kt, vf, pos, out, qoff, is_bf16, BF, qp, scale);
    else if (n == 4 && C == 8)
        extend_query(qv, 4, 8, kt, vf, pos, out, qoff, is_bf16, BF, qp, scale);
    else
        extend_query(qv, n, C, kt, vf, pos, out, qoff, is_bf16, BF, qp, scale);
}

/* Causal extend (prefill) attention for one request and one KV head, flash-style on the CPU.
 *
 * K is first transposed into 16-key blocks [D][16] (float32), V converted to float32 rows, both
 * small enough to stay in L2 for a prompt of a few hundred tokens; in bfloat16 with AVX512_BF16 both
 * stay bfloat16, as pairs for the dot-product instruction (K: [D / 2][16][2], V: two keys' rows
 * interleaved, [D][2] a pair). Each query vector then walks the
 * key blocks up to its own position: scores for 16 keys come from D broadcast-FMAs (no horizontal
 * sums); every EXT_SB blocks an online softmax step takes one max over their scores and rescales the
 * running output only if that max moved, and P.V adds their rows. */
static void extend_one(const void *q, const void *k, const void *v, void *out, const int64_t *rows,
                       int64_t prefix, int64_t ext, int64_t q_start, int hk, int H, int Hkv, int D, float scale,
                       int is_bf16, float *kt, float *vf) {
    const int G = H / Hkv, W = Hkv * D, C = D / 16;
    const int64_t total = prefix + ext, nblocks = (total + 15) / 16;
#if defined(__AVX512BF16__)
    const int bf = is_bf16; /* bfloat16 K as pairs of dims: block [D / 2][16 keys][2], as stored, no widening */
#else
    const int bf = 0;
#endif
    if (bf) {
        uint32_t *dst = (uint32_t *)kt;
        for (int64_t blk = 0; blk < nblocks; blk++, dst += 8 * D)
            for (int j = 0; j < 16; j++) {
                const int64_t t = blk * 16 + j;
                const uint32_t *row = t < total ? (const uint32_t *)((const uint16_t *)k + rows[t] * W + (int64_t)hk * D) : NULL;
                for (int d2 = 0; d2 < D / 2; d2++) dst[d2 * 16 + j] = row != NULL ? row[d2] : 0u;
            }
    }
    for (int64_t blk = 0; !bf && blk < nblocks; blk++) {
        float *dst = kt + blk * 16 * D;
        for (int j = 0; j < 16; j++) {
            int64_t t = blk * 16 + j;
            for (int d = 0; d < D; d++) {
                float x = 0.0f;
                if (t < total) {
                    int64_t off = rows[t] * W + (int64_t)hk * D + d;
                    x = is_bf16 ? bf16_to_f32(((const uint16_t *)k)[off]) : ((const float *)k)[off];
                }
                dst[d * 16 + j] = x;
            }
        }
    }
    if (bf) { /* V as pairs of keys: pair u is [D][2] (key 2u's dim d, then key 2u + 1's), zeros past the end */
        uint16_t *dst = (uint16_t *)vf;
        for (int64_t t = 0; t < nblocks * 16; t++) {
            const uint16_t *row = t < total ? (const uint16_t *)v + rows[t] * W + (int64_t)hk * D : NULL;
            uint16_t *pair = dst + (t / 2) * 2 * D + (t % 2);
            for (int d = 0; d < D; d++) pair[2 * d] = row != NULL ? row[d] : 0;
        }
    }
    for (int64_t t = 0; !bf && t < total; t++) load_row_f32(v, rows[t] * W + (int64_t)hk * D, D, is_bf16, vf + t * D);
    for (int64_t i = 0; i < ext; i++) {
        const int64_t pos = prefix + i; /* attends keys 0..pos */
        for (int g0 = 0; g0 < G; g0 += 4) { /* up to 4 query heads share each key block */
            const int n = G - g0 < 4 ? G - g0 : 4;
            float qv[4][MAX_D];
            uint32_t qp[4][MAX_D / 2]; /* bf: the unscaled bf16 query as pairs (exact); the scale after the sum */
            int64_t qoff[4];
            for (int j = 0; j < n; j++) {
                qoff[j] = ((q_start + i) * H + hk * G + g0 + j) * D;
                if (bf)
                    memcpy(qp[j], (const uint16_t *)q + qoff[j], sizeof(uint16_t) * D);
                else
                    for (int d = 0; d < D; d++)
                        qv[j][d] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[qoff[j] + d]) : ((const float *)q)[qoff[j] + d]) * scale;
            }
            if (bf)
                extend_heads(1, qv, qp, n, C, kt, vf, pos, out, qoff, is_bf16, scale);
            else
                extend_heads(0, qv, qp, n, C, kt, vf, pos, out, qoff, is_bf16, scale);
        }
    }
}
#endif

int extend_attention_avx2(const void *q, const void *k, const void *v, void *out, const int64_t *req_to_token,
                          int64_t stride, const int64_t *slots, const int64_t *prefix, const int64_t *ext,
                          const int64_t *q_start, int B, int H, int Hkv, int D, float scale, int is_bf16,
                          int num_threads); /* extend_avx2.c: the same, with 256-bit vectors */

/* Extend attention for a batch: request b's ext[b] new queries (rows q_start[b].. of q/out, [T, H, D])
 * attend its prefix[b] cached tokens plus themselves, causally, through req_to_token. K/V of the new
 * tokens must already be in the pool. Returns 0, or non-zero when this build or shape is unsupported. */
int extend_attention(const void *q, const void *k, const void *v, void *out, const int64_t *req_to_token,
                     int64_t stride, const int64_t *slots, const int64_t *prefix, const int64_t *ext,
                     const int64_t *q_start, int B, int H, int Hkv, int D, float scale, int is_bf16,
                     int num_threads) {
#if HAVE_SIMD
    if (Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 16 != 0 || D > MAX_D) return 1;
    int64_t max_total = 1;
    for (int b = 0; b < B; b++) if (prefix[b] + ext[b] > max_total) max_total = prefix[b] + ext[b];
    const int64_t padded = (max_total + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *kt = (float *)malloc(sizeof(float) * padded * D);
        float *vf = (float *)malloc(sizeof(float) * padded * D);
        if (kt == NULL || vf == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int hk = 0; hk < Hkv; hk++)
                if (kt != NULL && vf != NULL)
                    extend_one(q, k, v, out, req_to_token + slots[b] * stride, prefix[b], ext[b], q_start[b], hk,
                               H, Hkv, D, scale, is_bf16, kt, vf);
        free(kt);
        free(vf);
    }
    return failed;
#elif defined(__AVX2__) && defined(__FMA__)
    return extend_attention_avx2(q, k, v, out, req_to_token, stride, slots, prefix, ext, q_start, B, H, Hkv, D, scale,
                                 is_bf16, num_threads);
#else
    (void)q; (void)k; (void)v; (void)out; (void)req_to_token; (void)stride; (void)slots; (void)prefix;
    (void)ext; (void)q_start; (void)B; (void)H; (void)Hkv; (void)D; (void)scale; (void)is_bf16; (void)num_threads;
    return 3;
#endif
}
