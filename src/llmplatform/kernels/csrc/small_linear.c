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

#include "row_dot.h"

#define BLOCK_N 16

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Three or more bf16 input rows over bf16 weights on a CPU with AVX512-BF16 (speculative
 * verification, decode batches of a few sequences): the AVX2 path below widens each weight and
 * multiplies it into every row with fp32 FMAs, so past two rows it is bound by arithmetic, not by
 * memory (5 rows: ~13 ms a pass over SmolLM2's weights on the 2-core EPYC, against ~8.5 at one).
 * vdpbf16ps multiplies 32 bf16 pairs (exact products) into 16 fp32 sums in one instruction, no
 * widening: 5 rows stay near the one-row time (docs/performance.md). One and two rows keep the
 * AVX2 path, which streams as fast there.
 *
 * Each weight row is read once, in order, and multiplied into up to 4 input rows at a time. A
 * (row, weight row) dot product has PARTS accumulators, 32-wide chunk c going to accumulator
 * c % PARTS (independent chains), summed in one fixed order at the end: a dot product is
 * computed the same way whatever the number of rows (>= 3) in the call. Input rows past m are
 * read from the last valid one and dropped, so the row count of a group is a compile-time
 * constant (the sums stay in registers). */
#define HAVE_DPBF16 1
#define ROW_GROUP 4
#define PARTS 4
#define DPBF16_MIN_ROWS 3

static inline __attribute__((always_inline)) __m512 dpbf16_chunk(__m512 acc, const uint16_t *x, const uint16_t *w,
                                                                 int64_t i, __mmask32 mask) {
    __m512i xv = _mm512_maskz_loadu_epi16(mask, x + i), wv = _mm512_maskz_loadu_epi16(mask, w + i);
    return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
}

static inline __attribute__((always_inline)) void dpbf16_rows(const uint16_t *x, int rows, int64_t m_left,
                                                              const uint16_t *w, int64_t k, float *sums) {
    const uint16_t *xr[ROW_GROUP];
    for (int r = 0; r < ROW_GROUP; r++) xr[r] = x + (r < m_left ? r : m_left - 1) * k;
    __m512 acc[ROW_GROUP][PARTS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < PARTS; p++) acc[r][p] = _mm512_setzero_ps();
    const __mmask32 all = (__mmask32)0xffffffffu;
    int64_t i = 0;
    for (; i + 32 * PARTS <= k; i += 32 * PARTS) {
        for (int p = 0; p < PARTS; p++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + i + 32 * p));
            for (int r = 0; r < rows; r++)
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i + 32 * p)), wv);
        }
    }
    for (int p = 0; p < PARTS; p++) {  /* the last chunks (a partial one masked), in order */
        const int64_t at = i + 32 * p;
        if (at >= k) break;
        __mmask32 mask = k - at >= 32 ? all : (__mmask32)((1u << (k - at)) - 1);
        for (int r = 0; r < rows; r++) acc[r][p] = dpbf16_chunk(acc[r][p], xr[r], w, at, mask);
    }
    for (int r = 0; r < rows; r++)
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                     _mm512_add_ps(acc[r][2], acc[r][3])));
}

static void small_linear_dpbf16(const uint16_t *x, const uint16_t *w, const float *bias, void *y,
                                int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
    int64_t num_blocks = (n + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n_end = (b + 1) * BLOCK_N < n ? (b + 1) * BLOCK_N : n;
        for (int64_t j = b * BLOCK_N; j < n_end; j++) {
            float add = bias ? bias[j] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += ROW_GROUP) {
                float sums[ROW_GROUP];
                int64_t rows = m - r0 < ROW_GROUP ? m - r0 : ROW_GROUP;
                const uint16_t *xg = x + r0 * k, *wrow = w + j * k;
                switch (rows) {  /* a constant row count per call: the sums stay in registers */
                case 1: dpbf16_rows(xg, 1, m - r0, wrow, k, sums); break;
                case 2: dpbf16_rows(xg, 2, m - r0, wrow, k, sums); break;
                case 3: dpbf16_rows(xg, 3, m - r0, wrow, k, sums); break;
                default: dpbf16_rows(xg, 4, m - r0, wrow, k, sums); break;
                }
                for (int64_t r = 0; r < rows; r++) store_value(y, (r0 + r) * n + j, sums[r] + add, y_bf16);
            }
        }
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* The fewest rows that run on AVX512-BF16 dot products here, or 0 where this build has none. */
int small_linear_dpbf16_rows(void) {
#if HAVE_DPBF16
    return DPBF16_MIN_ROWS;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when out of memory. */
int small_linear(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *y,
                 int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
#if HAVE_DPBF16
    if (x_bf16 && w_bf16 && m >= DPBF16_MIN_ROWS) {
        small_linear_dpbf16((const uint16_t *)x, (const uint16_t *)w, bias, y, y_bf16, m, n, k, num_threads);
        return 0;
    }
#endif
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
