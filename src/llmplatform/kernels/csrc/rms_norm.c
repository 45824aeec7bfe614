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

void rms_norm(const void *x, const void *residual, void *residual_out, void *out, const void *weight,
              int64_t rows, int64_t hidden, float eps, int is_bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * hidden;
        float sum_sq = 0.0f;
        for (int64_t i = 0; i < hidden; i++) {
            float h = load_value(x, base + i, is_bf16);
            if (residual) {
                h = round_to(h + load_value(residual, base + i, is_bf16), is_bf16);
                store_value(residual_out, base + i, h, is_bf16);
            }
            sum_sq += h * h;
        }
        float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) {
            float h = residual ? load_value(residual_out, base + i, is_bf16) : load_value(x, base + i, is_bf16);
            store_value(out, base + i, load_value(weight, i, is_bf16) * round_to(h * inv, is_bf16), is_bf16);
        }
    }
}
