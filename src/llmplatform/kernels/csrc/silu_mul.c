/* silu(gate) * up for the MLP, one pass instead of two torch ops:
 *
 *   gate_up [rows, 2 I] (gate columns first, then up)  ->  out [rows, I]
 *   out = dtype(dtype(silu(gate)) * up)          (the eager roundings: silu rounded, then the product)
 *
 * bf16 (is_bf16) or fp32 throughout. silu(g) = g * sigmoid(g), with e^-|g| from a vectorizable
 * polynomial (about 1 ulp in fp32; torch's own exp differs by as much). Rows are split over
 * num_threads from 64 rows (a prefill chunk); a row's result does not depend on the split.
 */
#include "cpu_math.h"

/* One row, inlined with is_bf16 a constant so that the loop vectorizes. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate_up, void *out, int64_t in,
                                                               int64_t dst, int64_t size, const int is_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < size; i++) {
        const float g = load_value(gate_up, in + i, is_bf16);
        const float e = exp_nonpositive(-fabsf(g));          /* e^-|g|, in (0, 1] */
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        const float act = round_to(g * sigmoid, is_bf16);
        store_value(out, dst + i, act * load_value(gate_up, in + size + i, is_bf16), is_bf16);
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t size, int is_bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16)
            silu_mul_row(gate_up, out, r * 2 * size, r * size, size, 1);
        else
            silu_mul_row(gate_up, out, r * 2 * size, r * size, size, 0);
    }
}
