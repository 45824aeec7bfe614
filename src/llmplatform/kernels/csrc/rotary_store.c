/* The decode step's attention prologue in one call per layer: rotate q and k of every new token
 * (neox style, from the step's cos/sin rows), store k and v in their paged-cache slots, and write
 * q in fp32 for the decode-attention kernel, which reads it as fp32. Replaces the eager path's
 * slices, roll, mul, addcmul, two index_copy_ and the query's widening copy.
 *
 *   qkv      [T, (H + 2 Hkv) D]  the fused projection's output (q heads, then k, then v)
 *   cos, sin [T, D]              signed sin: rotated = x * cos + roll(x, D/2) * sin
 *   caches   [num_slots, Hkv, D] (the paged [num_blocks, block_size, Hkv, D] viewed flat)
 *   q_out    [T, H, D] fp32
 *
 * qkv, cos, sin and the caches share one dtype, bf16 (is_bf16) or fp32; with bf16 every product
 * rounds as the eager ops do (x * cos rounded, then the add of roll(x) * sin rounded).
 */
#include "cpu_math.h"

/* One head's rotation: x [head_dim] at x_at, rotated = x * cos + roll(x, half) * sin, written at
 * dst (fp32 when to_float, else the model dtype); cs: the token's cos/sin rows at cs_at. Inlined
 * with is_bf16 and to_float constants, the two halves' loops vectorize (a roll inside one loop
 * did not: a 32-row step spent ~140 us a layer here). */
static inline __attribute__((always_inline)) void rotate_head(
        const void *qkv, int64_t x_at, const void *cos, const void *sin, int64_t cs_at, void *dst,
        int64_t dst_at, int64_t head_dim, const int is_bf16, const int to_float) {
    const int64_t half = head_dim / 2;
    for (int64_t part = 0; part < 2; part++) { /* first half rolls in the second, and back */
        const int64_t from = part * half, rolled = half - from;
#pragma omp simd
        for (int64_t i = from; i < from + half; i++) {
            const float x = load_value(qkv, x_at + i, is_bf16);
            const float x_rolled = load_value(qkv, x_at + i + rolled - from, is_bf16);
            const float scaled = round_to(x * load_value(cos, cs_at + i, is_bf16), is_bf16);
            const float rotated = round_to(scaled + x_rolled * load_value(sin, cs_at + i, is_bf16), is_bf16);
            if (to_float)
                ((float *)dst)[dst_at + i] = rotated;
            else
                store_value(dst, dst_at + i, rotated, is_bf16);
        }
    }
}

static inline __attribute__((always_inline)) void rotary_store_rows(
        const void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache, const int64_t *slots,
        float *q_out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
        const int is_bf16) {
    const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, kv_row = num_kv_heads * head_dim;
    const size_t element = is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t base = t * row;
        for (int64_t h = 0; h < num_heads; h++)
            rotate_head(qkv, base + h * head_dim, cos, sin, t * head_dim, q_out, (t * num_heads + h) * head_dim,
                        head_dim, is_bf16, 1);
        for (int64_t h = 0; h < num_kv_heads; h++)
            rotate_head(qkv, base + (num_heads + h) * head_dim, cos, sin, t * head_dim, k_cache,
                        slots[t] * kv_row + h * head_dim, head_dim, is_bf16, 0);
        memcpy((char *)v_cache + (size_t)(slots[t] * kv_row) * element,
               (const char *)qkv + (size_t)(base + (num_heads + num_kv_heads) * head_dim) * element,
               (size_t)kv_row * element);
    }
}

void rotary_store(const void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache,
                  const int64_t *slots, float *q_out, int64_t num_tokens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int is_bf16) {
    if (is_bf16)
        rotary_store_rows(qkv, cos, sin, k_cache, v_cache, slots, q_out, num_tokens, num_heads, num_kv_heads,
                          head_dim, 1);
    else
        rotary_store_rows(qkv, cos, sin, k_cache, v_cache, slots, q_out, num_tokens, num_heads, num_kv_heads,
                          head_dim, 0);
}
