/* The dot products of a few fp32 input rows with one weight row (bf16 or fp32), shared by the
 * kernels that stream weights row by row (small_linear.c, lora.c). */
#ifndef LLMPLATFORM_ROW_DOT_H
#define LLMPLATFORM_ROW_DOT_H

#include "cpu_math.h"

#define GROUP_M 8

#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifdef __AVX2__
static inline __m256 load8(const void *w, int w_bf16, int64_t i) {
    if (w_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

#endif

/* dots[r] = x32[r] . wrow for r < rows (rows <= GROUP_M). */
static void dot_rows(const float *x32, int64_t rows, const void *wrow, int w_bf16, int64_t k,
                     float *dots) {
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc[GROUP_M];
    for (int r = 0; r < GROUP_M; r++) acc[r] = _mm256_setzero_ps();
    int64_t k8 = k & ~(int64_t)7;
    if (rows <= 2) {
        /* Few rows: four independent sums per row over interleaved chunks, so consecutive
         * multiply-adds do not wait for each other (one chain per row would be bound by the
         * FMA latency, not by the memory). */
        __m256 part[2][4];
        for (int r = 0; r < 2; r++)
            for (int u = 0; u < 4; u++) part[r][u] = _mm256_setzero_ps();
        int64_t k32 = k & ~(int64_t)31;
        for (; i < k32; i += 32) {
            for (int u = 0; u < 4; u++) {
                __m256 wv = load8(wrow, w_bf16, i + 8 * u);
                part[0][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + i + 8 * u), part[0][u]);
                if (rows == 2)
                    part[1][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + k + i + 8 * u), part[1][u]);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            acc[r] = _mm256_add_ps(_mm256_add_ps(part[r][0], part[r][1]), _mm256_add_ps(part[r][2], part[r][3]));
        for (; i < k8; i += 8) {
            __m256 wv = load8(wrow, w_bf16, i);
            for (int64_t r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + r * k + i), acc[r]);
        }
    } else if (rows == GROUP_M) {  /* the unrolled common case: the compiler keeps acc in registers */
        for (; i < k8; i += 8) {
            __m256 wv = load8(wrow, w_bf16, i);
            for (int r = 0; r < GROUP_M; r++)
                acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + r * k + i), acc[r]);
        }
    } else {
        /* 3-7 rows (decode batches of a few sequences, speculative verification): a loop bound
         * known at compile time per case, so the sums stay in registers as in the 8-row case
         * (with a runtime bound the compiler keeps acc[] in memory), and two sums per row over
         * alternate chunks: 6-14 independent chains keep the FMA units busy where one chain per
         * row would wait on each multiply-add's latency. */
#define LLMPLATFORM_DOT_FIXED(R)                                                          \
        {                                                                                 \
            __m256 odd[R];                                                                \
            for (int r = 0; r < (R); r++) odd[r] = _mm256_setzero_ps();                   \
            int64_t k16 = k & ~(int64_t)15;                                               \
            for (; i < k16; i += 16) {                                                    \
                __m256 w0 = load8(wrow, w_bf16, i), w1 = load8(wrow, w_bf16, i + 8);      \
                for (int r = 0; r < (R); r++) {                                           \
                    acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x32 + r * k + i), acc[r]); \
                    odd[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x32 + r * k + i + 8), odd[r]); \
                }                                                                         \
            }                                                                             \
            for (; i < k8; i += 8) {                                                      \
                __m256 wv = load8(wrow, w_bf16, i);                                       \
                for (int r = 0; r < (R); r++)                                             \
                    acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + r * k + i), acc[r]); \
            }                                                                             \
            for (int r = 0; r < (R); r++) acc[r] = _mm256_add_ps(acc[r], odd[r]);         \
        }
        switch (rows) {
        case 3: LLMPLATFORM_DOT_FIXED(3) break;
        case 4: LLMPLATFORM_DOT_FIXED(4) break;
        case 5: LLMPLATFORM_DOT_FIXED(5) break;
        case 6: LLMPLATFORM_DOT_FIXED(6) break;
        default: LLMPLATFORM_DOT_FIXED(7) break;
        }
#undef LLMPLATFORM_DOT_FIXED
    }
    for (int64_t r = 0; r < rows; r++) dots[r] = hsum(acc[r]);
#else
    for (int64_t r = 0; r < rows; r++) dots[r] = 0.0f;
#endif
    for (; i < k; i++) {
        float wv = load_value(wrow, i, w_bf16);
        for (int64_t r = 0; r < rows; r++) dots[r] += wv * x32[r * k + i];
    }
}

#endif
