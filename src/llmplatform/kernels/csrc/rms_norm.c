/* RMSNorm with the pre-norm residual add, one pass per row instead of ~9 torch ops:
 *
 *   h = x + residual (rounded to the model dtype, as the eager add is)   -> residual_out
 *   out = weight * dtype(h * rsqrt(mean(h^2) + eps))                     (HF's order of roundings)
 *
 * x, residual, residual_out, out and weight share one dtype, bf16 (is_bf16) or fp32, and are
 * row-major [rows, hidden] (weight [hidden]). residual may be NULL (layer 0: no add; residual_out
 * is then not written). Rows run in parallel on the calling thread's OpenMP team when there are
 * enough of them to pay for the fork.
 */
#include "cpu_math.h"

/* One row. Inlined with is_bf16 a constant, so every loop vectorizes; the sum of squares is
 * kept in vector lanes and added up at the end (one fixed order, like torch's own mean, which
 * does not sum in sequence either). Scalar, a 32-row call took ~120 us, as long as the torch ops. */
static inline __attribute__((always_inline)) void norm_row(
        const void *x, const void *residual, void *residual_out, void *out, const void *weight,
        int64_t base, int64_t hidden, float eps, const int is_bf16) {
    float sum_sq = 0.0f;
    if (residual) {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < hidden; i++) {
            const float h = round_to(load_value(x, base + i, is_bf16) + load_value(residual, base + i, is_bf16),
                                     is_bf16);
            store_value(residual_out, base + i, h, is_bf16);
            sum_sq += h * h;
        }
    } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < hidden; i++) {
            const float h = load_value(x, base + i, is_bf16);
            sum_sq += h * h;
        }
    }
    const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
    const void *h = residual ? residual_out : x;
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store_value(out, base + i, load_value(weight, i, is_bf16) * round_to(load_value(h, base + i, is_bf16) * inv,
                                                                           is_bf16), is_bf16);
}

void rms_norm(const void *x, const void *residual, void *residual_out, void *out, const void *weight,
              int64_t rows, int64_t hidden, float eps, int is_bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16)
            norm_row(x, residual, residual_out, out, weight, r * hidden, hidden, eps, 1);
        else
            norm_row(x, residual, residual_out, out, weight, r * hidden, hidden, eps, 0);
    }
}
