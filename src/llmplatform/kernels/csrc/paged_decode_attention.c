/* Paged decode attention for CPUs: one query token per sequence over its paged KV cache.
 *
 * Reads K/V where they live (block by block through the block table), in the cache's own dtype
 * (bfloat16 or float32), so nothing is gathered or padded first. Work item = (sequence, kv head):
 * the q_per_kv query heads sharing a kv head are done together, so each K/V row is loaded and
 * (for bf16) widened once for all of them. Softmax is computed online one block at a time
 * (running max and sum in float32, the accumulator rescaled when the max grows), so the scores
 * never need a buffer longer than a block. Items are spread over OpenMP threads; linked against
 * the same libgomp as torch, the calling thread's team is torch's own.
 *
 * Built at first use by llmplatform/kernels/cpu_decode.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Pointers to a block's n rows (token j at base + j * row): float32 rows are used in place,
 * bf16 rows are widened into buf (bf16 is the top half of a float32). */
static inline void load_rows(const void *cache, int64_t base, int64_t row, int64_t n, int64_t head_dim,
                             int is_bf16, float (*buf)[head_dim], const float **rows) {
    for (int64_t j = 0; j < n; j++) {
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)cache + base + j * row;
            float *dst = buf[j];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const uint32_t bits = (uint32_t)src[d] << 16;
                memcpy(&dst[d], &bits, sizeof bits); /* a bit copy, not a pointer pun (strict aliasing) */
            }
            rows[j] = buf[j];
        } else {
            rows[j] = (const float *)cache + base + j * row;
        }
    }
}

/* e^x for x <= 0 (softmax scores minus their max), vectorizable: x = k ln2 + r with |r| <= ln2/2,
 * e^r by Cephes' degree-6 polynomial (about 1 ulp in float32), 2^k put in the exponent bits.
 * Below -87 the result would be subnormal: it is clamped there (e^-87 ~ 1.6e-38, as good as 0
 * next to the max's own term, which is 1). */
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
    const int32_t bits = ((int32_t)k + 127) << 23; /* k >= -126 after the clamp: a normal 2^k */
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

/* One (sequence, kv head) item. Inlined into specialized copies below, so the common head
 * sizes and block sizes are compile-time constants and the inner loops vectorize without
 * remainders. */
static inline __attribute__((always_inline)) void decode_item(
        int64_t item, const float *query, const void *k_cache, const void *v_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
        int64_t num_heads, int64_t num_kv_heads, int64_t group, int64_t row, const int64_t head_dim,
        const int64_t block_size, int cache_is_bf16, float scale) {
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t len = seq_lens[s];
    float q[group][head_dim], acc[group][head_dim], scores[group][block_size];
    float rows[block_size][head_dim]; /* one block's K (then V) rows, widened to float32 */
    float running_max[group], running_sum[group];
    for (int64_t g = 0; g < group; g++) {
        const float *src = query + (s * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) q[g][d] = src[d] * scale;
        memset(acc[g], 0, sizeof(float) * head_dim);
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t block = block_tables[s * table_stride + start / block_size];
        const int64_t base = (block * block_size * num_kv_heads + h) * head_dim;
        const float *k_rows[block_size], *v_rows[block_size];
        load_rows(k_cache, base, row, n, head_dim, cache_is_bf16, rows, k_rows);
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < group; g++) scores[g][j] = dot(q[g], k_rows[j], head_dim);
        for (int64_t g = 0; g < group; g++) {
            float *sc = scores[g];
            float block_max = -INFINITY;
            for (int64_t j = 0; j < n; j++) block_max = sc[j] > block_max ? sc[j] : block_max;
            if (block_max > running_max[g]) { /* rescale what was summed under the old max */
                const float correction = expf(running_max[g] - block_max);
                running_sum[g] *= correction;
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
                running_max[g] = block_max;
            }
            const float m = running_max[g];
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                sc[j] = exp_nonpositive(sc[j] - m);
                sum += sc[j];
            }
            running_sum[g] += sum;
        }
        load_rows(v_cache, base, row, n, head_dim, cache_is_bf16, rows, v_rows);
        for (int64_t j = 0; j < n; j++) {
            const float *v = v_rows[j];
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g][j];
                float *a = acc[g];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *dst = out + (s * num_heads + h * group + g) * head_dim;
        const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[g][d] * inv;
    }
}

/* query/out: [num_seqs, num_heads, head_dim] float32, contiguous.
 * k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, bf16 or float32.
 * block_tables: [num_seqs, table_stride] int32. seq_lens: [num_seqs] int32 (>= 0).
 * Returns 0, or -1 if a shape is out of the supported range (nothing is written then). */
int paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                           float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int cache_is_bf16, float scale,
                           int num_threads) {
    /* The per-item buffers live on the thread's stack: keep them to a few hundred KiB. */
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0 ||
        block_size * head_dim > 16384 || (num_heads / num_kv_heads) * head_dim > 8192 ||
        (num_heads / num_kv_heads) * block_size > 8192)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements between consecutive tokens */
    const int64_t items = num_seqs * num_kv_heads;
#define ITEM_LOOP(HEAD_DIM, BLOCK_SIZE)                                                            \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                     \
    for (int64_t item = 0; item < items; item++)                                                   \
        decode_item(item, query, k_cache, v_cache, block_tables, table_stride, seq_lens, out,      \
                    num_heads, num_kv_heads, group, row, HEAD_DIM, BLOCK_SIZE, cache_is_bf16, scale)
    if (head_dim == 64 && block_size == 16) {
        ITEM_LOOP(64, 16);
    } else if (head_dim == 128 && block_size == 16) {
        ITEM_LOOP(128, 16);
    } else {
        ITEM_LOOP(head_dim, block_size);
    }
#undef ITEM_LOOP
    return 0;
}
