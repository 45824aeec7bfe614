/* silu(gate) * up for the MLP of a decode step, one pass instead of two torch ops:
 *
 *   gate_up [rows, 2 I] (gate columns first, then up)  ->  out [rows, I]
 *   out = dtype(dtype(silu(gate)) * up)          (the eager roundings: silu rounded, then the product)
 *
 * bf16 (is_bf16) or fp32 throughout. silu(g) = g * sigmoid(g), with e^-|g| from a vectorizable
 * polynomial (about 1 ulp in fp32; torch's own exp differs by as much).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load(const void *p, int64_t i, int is_bf16) {
    if (is_bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

static inline float round_to(float f, int is_bf16) {
    if (!is_bf16) return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) & 0xffff0000u;
    else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* e^x for x <= 0 (Cephes' polynomial after x = k ln2 + r; clamped at -87). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t size, int is_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * size, dst = r * size;
        for (int64_t i = 0; i < size; i++) {
            const float g = load(gate_up, in + i, is_bf16);
            const float e = exp_nonpositive(-fabsf(g));          /* e^-|g|, in (0, 1] */
            const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            const float act = round_to(g * sigmoid, is_bf16);
            const float v = round_to(act * load(gate_up, in + size + i, is_bf16), is_bf16);
            if (is_bf16) {
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                ((uint16_t *)out)[dst + i] = (uint16_t)(u >> 16);
            } else {
                ((float *)out)[dst + i] = v;
            }
        }
    }
}
