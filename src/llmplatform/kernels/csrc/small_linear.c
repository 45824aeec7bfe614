/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for the few rows of a decode step.
 *
 * At 1-16 rows a projection is memory bound: every weight is used m times and read once, so the
 * step costs what streaming the weights costs. This kernel reads each weight row once, widens it
 * (bf16 -> fp32 is a 16-bit shift) in registers and multiplies it into up to 8 input rows at a
 * time, accumulating in fp32; bf16 weights are never widened in memory, so a bf16 model streams
 * half the bytes of the fp32 copy a CPU without bf16 matrix instructions otherwise multiplies.
 *
 * Layout: x, w, y row-major and contiguous. x and y are bf16 or fp32 (flags); w is bf16 or fp32;
 * bias is fp32 or NULL. The input rows are widened once into a per-call fp32 buffer [m, k].
 * Work is split over output columns (weight rows) in blocks of BLOCK_N across the calling
 * thread's OpenMP team; for m > 8 each weight row is reused from L1 for every group of 8 rows.
 *
 * Results are fp32 sums rounded once (to nearest even) when y is bf16: the same arithmetic as
 * widening the operands and multiplying in fp32, in another summation order.
 */
#include <stdlib.h>

#include "cpu_math.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP_M 8
#define BLOCK_N 16

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
        for (; i < k8; i += 8) {
            __m256 wv = load8(wrow, w_bf16, i);
            for (int64_t r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x32 + r * k + i), acc[r]);
        }
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

/* Returns 0, or -1 when out of memory. */
int small_linear(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *y,
                 int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
    float *x32 = (float *)malloc((size_t)(m * k) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++)
        x32[i] = load_value(x, i, x_bf16);
    int64_t num_blocks = (n + BLOCK_N - 1) / BLOCK_N;
    int64_t w_row_bytes = k * (w_bf16 ? 2 : 4);

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n_end = (b + 1) * BLOCK_N < n ? (b + 1) * BLOCK_N : n;
        for (int64_t j = b * BLOCK_N; j < n_end; j++) {
            const void *wrow = (const char *)w + j * w_row_bytes;
            float add = bias ? bias[j] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += GROUP_M) {
                int64_t rows = m - r0 < GROUP_M ? m - r0 : GROUP_M;
                float dots[GROUP_M];
                dot_rows(x32 + r0 * k, rows, wrow, w_bf16, k, dots);
                for (int64_t r = 0; r < rows; r++) {
                    float v = dots[r] + add;
                    store_value(y, (r0 + r) * n + j, v, y_bf16);
                }
            }
        }
    }
    free(x32);
    return 0;
}
