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
