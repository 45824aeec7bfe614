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
 * Sliding window (window > 0): the query at position len - 1 sees keys j >= len - window only;
 * blocks wholly before that are never read (the engine may have freed them: their table entries
 * are placeholders or blocks of other sequences), the rows before it in the first block read are
 * masked. Soft-capping (softcap > 0): scores become softcap * tanh(score / softcap) before the
 * mask and the softmax (Gemma 2).
 *
 * On a CPU with AVX512-BF16 a bf16 cache is read by bf16 dot products (attend_block_bf16): q and
 * the probabilities are rounded to bf16 for the products, as a bf16 model's reference attention
 * rounds them (its error against float64 stays below that reference's; the float32 path's is
 * ~1e-7). Half the instructions: at 32 sequences the float32 copy was bound by arithmetic.
 *
 * Built at first use by llmplatform/kernels/cpu_decode.py (cc -O3 -march=native -fopenmp).
 */
#include "cpu_math.h"

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

/* One (sequence, kv head) item. Inlined into specialized copies below, so the common head
 * sizes and block sizes are compile-time constants and the inner loops vectorize without
 * remainders. */
static inline __attribute__((always_inline)) void decode_item(
        int64_t item, const float *query, const void *k_cache, const void *v_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
        int64_t num_heads, int64_t num_kv_heads, int64_t group, int64_t row, const int64_t head_dim,
        const int64_t block_size, int cache_is_bf16, float scale, int64_t window, float softcap) {
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t len = seq_lens[s];
    const int64_t lo = window > 0 && len > window ? len - window : 0; /* first visible key */
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
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t hidden = lo > start ? lo - start : 0; /* leading rows before the window */
        const int64_t block = block_tables[s * table_stride + start / block_size];
        const int64_t base = (block * block_size * num_kv_heads + h) * head_dim;
        const float *k_rows[block_size], *v_rows[block_size];
        load_rows(k_cache, base, row, n, head_dim, cache_is_bf16, rows, k_rows);
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < group; g++) {
                const float score = dot(q[g], k_rows[j], head_dim);
                scores[g][j] = j < hidden ? -INFINITY : softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
            }
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
                sc[j] = j < hidden ? 0.0f : exp_nonpositive(sc[j] - m);
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

#include "paged_decode_avx512.h" /* the AVX-512 copies (decode_item_avx512) */

/* query/out: [num_seqs, num_heads, head_dim] float32, contiguous.
 * k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, bf16 or float32.
 * block_tables: [num_seqs, table_stride] int32. seq_lens: [num_seqs] int32 (>= 0).
 * window: sliding window (0: none). softcap: score soft-capping (0: none).
 * Returns 0, or -1 if a shape is out of the supported range (nothing is written then). */
int paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                           float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int cache_is_bf16, float scale,
                           int64_t window, float softcap, int num_threads) {
    /* The per-item buffers live on the thread's stack: keep them to a few hundred KiB. */
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0 ||
        block_size * head_dim > 16384 || (num_heads / num_kv_heads) * head_dim > 8192 ||
        (num_heads / num_kv_heads) * block_size > 8192 || window < 0 || softcap < 0.0f)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements between consecutive tokens */
    const int64_t items = num_seqs * num_kv_heads;
#if defined(__AVX512F__)
    if (block_size == FAST_BLOCK && head_dim % 16 == 0 && head_dim / 16 <= FAST_MAX_CHUNKS &&
        group <= FAST_MAX_GROUP) {
        /* A whole sequence per item when there are enough sequences to share out (contiguous
         * reads), else one kv head per item (more items than threads). */
        const int64_t parts = num_seqs >= 4 * (int64_t)num_threads && num_heads <= 64 ? 1 : num_kv_heads;
#define FAST_LOOP(CHUNKS, DOT)                                                                     \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                     \
    for (int64_t item = 0; item < num_seqs * parts; item++)                                        \
        decode_item_avx512(item, parts, query, k_cache, v_cache, block_tables, table_stride,       \
                           seq_lens, out, num_heads, num_kv_heads, group, CHUNKS, cache_is_bf16, scale,  \
                           window, softcap, DOT)
#if defined(__AVX512BF16__)
        if (cache_is_bf16 && head_dim == 64) {
            FAST_LOOP(4, 1);
            return 0;
        }
        if (cache_is_bf16 && head_dim % 32 == 0) {
            FAST_LOOP(head_dim / 16, 1);
            return 0;
        }
#endif
        if (head_dim == 64) {
            FAST_LOOP(4, 0);
        } else if (head_dim == 128) {
            FAST_LOOP(8, 0);
        } else {
            FAST_LOOP(head_dim / 16, 0);
        }
#undef FAST_LOOP
        return 0;
    }
#endif
#define ITEM_LOOP(HEAD_DIM, BLOCK_SIZE)                                                            \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                     \
    for (int64_t item = 0; item < items; item++)                                                   \
        decode_item(item, query, k_cache, v_cache, block_tables, table_stride, seq_lens, out,      \
                    num_heads, num_kv_heads, group, row, HEAD_DIM, BLOCK_SIZE, cache_is_bf16, scale,   \
                    window, softcap)
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
