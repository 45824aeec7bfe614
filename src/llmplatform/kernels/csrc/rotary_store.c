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

void rotary_store(const void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache,
                  const int64_t *slots, float *q_out, int64_t num_tokens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int is_bf16) {
    int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
    int64_t half = head_dim / 2;
    int64_t kv_row = num_kv_heads * head_dim;
    size_t element = is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t base = t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            int64_t head = base + h * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                float x = load_value(qkv, head + i, is_bf16);
                float x_rolled = load_value(qkv, head + (i + half) % head_dim, is_bf16);
                float scaled = round_to(x * load_value(cos, t * head_dim + i, is_bf16), is_bf16);
                float rotated = round_to(scaled + x_rolled * load_value(sin, t * head_dim + i, is_bf16), is_bf16);
                if (h < num_heads)
                    q_out[(t * num_heads + h) * head_dim + i] = rotated;
                else
                    store_value(k_cache, slots[t] * kv_row + (h - num_heads) * head_dim + i, rotated, is_bf16);
            }
        }
        memcpy((char *)v_cache + (size_t)(slots[t] * kv_row) * element,
               (const char *)qkv + (size_t)(base + (num_heads + num_kv_heads) * head_dim) * element,
               (size_t)kv_row * element);
    }
}
