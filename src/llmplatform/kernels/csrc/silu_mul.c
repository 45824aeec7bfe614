/* silu(gate) * up for the MLP of a decode step, one pass instead of two torch ops:
 *
 *   gate_up [rows, 2 I] (gate columns first, then up)  ->  out [rows, I]
 *   out = dtype(dtype(silu(gate)) * up)          (the eager roundings: silu rounded, then the product)
 *
 * bf16 (is_bf16) or fp32 throughout. silu(g) = g * sigmoid(g), with e^-|g| from a vectorizable
 * polynomial (about 1 ulp in fp32; torch's own exp differs by as much).
 */
#include "cpu_math.h"

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t size, int is_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * size, dst = r * size;
        for (int64_t i = 0; i < size; i++) {
            const float g = load_value(gate_up, in + i, is_bf16);
            const float e = exp_nonpositive(-fabsf(g));          /* e^-|g|, in (0, 1] */
            const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            const float act = round_to(g * sigmoid, is_bf16);
            store_value(out, dst + i, act * load_value(gate_up, in + size + i, is_bf16), is_bf16);
        }
    }
}
