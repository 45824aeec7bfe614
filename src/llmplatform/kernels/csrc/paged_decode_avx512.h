/* The AVX-512 copies of paged_decode_attention.c's work item (included there, after the generic
 * decode_item; nothing here is compiled on a CPU without AVX-512F). */
#ifndef LLMPLATFORM_PAGED_DECODE_AVX512_H
#define LLMPLATFORM_PAGED_DECODE_AVX512_H

#include "cpu_math.h"

#if defined(__AVX512F__)
/* The AVX-512 copy, for 16-token blocks and head sizes a multiple of 16 (every common model).
 * The generic loops above spend most of their time summing each K row's products across a
 * vector (one horizontal sum per row and query head); here the 16 rows of a block are summed
 * together by a transpose-and-add tree (sum16), so a block's 16 scores of one query head come
 * out as one vector, and softmax works on whole vectors. bf16 rows are widened in registers. */
#include <immintrin.h>

#define FAST_BLOCK 16
#define FAST_MAX_GROUP 8
#define FAST_MAX_CHUNKS 16 /* head_dim <= 256 */

static inline __m512 load16(const void *cache, int64_t offset, int is_bf16) {
    if (is_bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)cache + offset);
}

/* exp_nonpositive on 16 lanes (same polynomial); 2^k applied by scalef. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

/* The next block of a work item, to be brought into L2 while this one is computed. The cache is
 * far bigger than the CPU's caches and a sequence's blocks lie anywhere (the hardware prefetcher
 * cannot follow a block table). Asked for all at once, the requests queue behind each other and
 * stall the core, so each attend_block call asks for its share of the lines spread over its 16 V
 * rows. Measured here, this kernel alone over 30 layers' caches, 32 sequences of ~300 tokens in
 * SmolLM2's shapes: 24.4 ms asking for two blocks ahead at once into L1, 15.0 spread out into L1,
 * 12.9 spread out into L2; with every K/V row already in the caches, 11 ms. */
typedef struct {
    const char *k, *v; /* the block's first row of the item's heads, K and V */
    int64_t row_bytes; /* between consecutive rows */
    int64_t row_lines; /* 64-byte lines of one row's run of the item's heads, in K (and in V) */
    int64_t lines; /* in all: rows * 2 * row_lines; 0 when the item has no next block */
} next_block;

/* Lines first .. first + count - 1 of the next block (row by row, K and V lines alternating).
 * always_inline: GCC finds a function that only prefetches free of side effects and deletes its
 * calls before inlining (the prefetches this kernel had before were never in the binary). */
static inline __attribute__((always_inline)) void prefetch_lines(const next_block *next, int64_t first, int64_t count) {
    if (first >= next->lines) return;
    const int64_t per_row = 2 * next->row_lines, end = first + count < next->lines ? first + count : next->lines;
    int64_t j = first / per_row, within = first % per_row;
    for (int64_t i = first; i < end; i++) {
        _mm_prefetch((within % 2 ? next->v : next->k) + j * next->row_bytes + (within / 2) * 64, _MM_HINT_T1);
        if (++within == per_row) within = 0, j++;
    }
}

typedef struct {
    __m512 q[FAST_MAX_CHUNKS], acc[FAST_MAX_CHUNKS];
#if defined(__AVX512BF16__)
    __m512bh q_bf16[FAST_MAX_CHUNKS / 2]; /* q rounded to bf16, 32 elements each (dot-product path) */
#endif
    float max, sum; /* running max of the scores and sum of their exponentials */
} head_state;

/* A block's 16 raw scores (q.k times the scale) of one query head -> its softmax weights under
 * the running max: soft-capped, masked to the visible rows, the accumulator and the running sum
 * rescaled when the max grows. The caller adds the weights it multiplies by to head->sum. */
static inline __attribute__((always_inline)) __m512 block_weights(head_state *head, __m512 raw, __mmask16 valid,
                                                                  float softcap, int64_t acc_chunks) {
    if (softcap > 0.0f) { /* no vector tanh in the intrinsics: lane by lane */
        float lanes[FAST_BLOCK] __attribute__((aligned(64)));
        _mm512_store_ps(lanes, raw);
        for (int64_t j = 0; j < FAST_BLOCK; j++) lanes[j] = softcap * tanhf(lanes[j] / softcap);
        raw = _mm512_load_ps(lanes);
    }
    const __m512 scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), raw);
    const float block_max = _mm512_reduce_max_ps(scores);
    if (block_max > head->max) { /* rescale what was summed under the old max */
        const float correction = expf(head->max - block_max);
        const __m512 correction16 = _mm512_set1_ps(correction);
        head->sum *= correction;
        for (int64_t c = 0; c < acc_chunks; c++) head->acc[c] = _mm512_mul_ps(head->acc[c], correction16);
        head->max = block_max;
    }
    return _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(head->max))));
}

/* One block (n <= 16 rows starting at base) for the `group` query heads sharing one kv head;
 * asks for lines first_line .. first_line + share - 1 of the next block on the way. */
static inline __attribute__((always_inline)) void attend_block(
        head_state *heads, int64_t group, const void *k_cache, const void *v_cache, int64_t base,
        int64_t row, int64_t n, int64_t hidden, const int64_t chunks, int cache_is_bf16, float softcap,
        const next_block *next, int64_t first_line, int64_t share) {
    /* Rows hidden .. n - 1 are visible (the first hidden ones lie before the window). */
    const __mmask16 valid = (__mmask16)(((1u << n) - 1u) & ~((1u << hidden) - 1u));
    __m512 k[FAST_BLOCK][FAST_MAX_CHUNKS], partial[FAST_BLOCK];
    float probs[FAST_MAX_GROUP][FAST_BLOCK] __attribute__((aligned(64)));
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < chunks; c++) k[j][c] = load16(k_cache, base + j * row + 16 * c, cache_is_bf16);
    for (int64_t g = 0; g < group; g++) {
        head_state *head = &heads[g];
        for (int64_t j = 0; j < FAST_BLOCK; j++) {
            if (j >= n) { partial[j] = _mm512_setzero_ps(); continue; }
            __m512 p = _mm512_mul_ps(head->q[0], k[j][0]);
            for (int64_t c = 1; c < chunks; c++) p = _mm512_fmadd_ps(head->q[c], k[j][c], p);
            partial[j] = p;
        }
        const __m512 p = block_weights(head, sum16(partial), valid, softcap, chunks);
        head->sum += _mm512_reduce_add_ps(p);
        _mm512_store_ps(probs[g], p);
    }
    const int64_t per_row = (share + FAST_BLOCK - 1) / FAST_BLOCK;
    for (int64_t j = 0; j < FAST_BLOCK; j++) { /* the prefetches go on past n (the block's last rows) */
        prefetch_lines(next, first_line + j * per_row, per_row);
        if (j >= n) continue;
        __m512 v[FAST_MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) v[c] = load16(v_cache, base + j * row + 16 * c, cache_is_bf16);
        for (int64_t g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(probs[g][j]);
            for (int64_t c = 0; c < chunks; c++) heads[g].acc[c] = _mm512_fmadd_ps(p, v[c], heads[g].acc[c]);
        }
    }
}

#if defined(__AVX512BF16__)
/* attend_block for a bf16 cache on a CPU with AVX512-BF16, chunks2 = head_dim / 32: the q.k and
 * p.v products as bf16 dot products (vdpbf16ps: pairs of bf16 products summed into fp32 lanes),
 * q and the probabilities rounded to bf16 first, as a bf16 model's reference attention rounds
 * them. Half the instructions of the float32 path, which widens every K and V element. acc[2c]
 * and acc[2c + 1] hold chunk c's 32 outputs interleaved by the unpacks (see unpermute_acc). */
static inline __attribute__((always_inline)) void attend_block_bf16(
        head_state *heads, int64_t group, const void *k_cache, const void *v_cache, int64_t base,
        int64_t row, int64_t n, int64_t hidden, const int64_t chunks2, float softcap,
        const next_block *next, int64_t first_line, int64_t share) {
    const __mmask16 valid = (__mmask16)(((1u << n) - 1u) & ~((1u << hidden) - 1u));
    const uint16_t *keys = (const uint16_t *)k_cache + base, *values = (const uint16_t *)v_cache + base;
    __m512 partial[FAST_BLOCK];
    uint32_t probs[FAST_MAX_GROUP][FAST_BLOCK / 2] __attribute__((aligned(32))); /* bf16 pairs (p[2i], p[2i + 1]) */
    for (int64_t g = 0; g < group; g++) {
        head_state *head = &heads[g];
        for (int64_t j = 0; j < FAST_BLOCK; j++) {
            if (j >= n) { partial[j] = _mm512_setzero_ps(); continue; }
            __m512 p = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks2; c++)
                p = _mm512_dpbf16_ps(p, head->q_bf16[c], (__m512bh)_mm512_loadu_si512(keys + j * row + 32 * c));
            partial[j] = p;
        }
        const __m512 p = block_weights(head, sum16(partial), valid, softcap, 2 * chunks2);
        const __m256bh p_bf16 = _mm512_cvtneps_pbh(p);
        /* the sum of what is multiplied: the rounded probabilities */
        head->sum += _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32((__m256i)p_bf16), 16)));
        _mm256_store_si256((__m256i *)probs[g], (__m256i)p_bf16);
    }
    const int64_t per_row = (share + FAST_BLOCK - 1) / FAST_BLOCK;
    for (int64_t j = 0; j < FAST_BLOCK; j += 2) {
        prefetch_lines(next, first_line + j * per_row, 2 * per_row);
        if (j >= n) continue;
        /* rows j and j + 1 interleaved (a row past n reads as zeros: its slot may hold anything) */
        __m512i pairs[FAST_MAX_CHUNKS];
        for (int64_t c = 0; c < chunks2; c++) {
            const __m512i a = _mm512_loadu_si512(values + j * row + 32 * c);
            const __m512i b = j + 1 < n ? _mm512_loadu_si512(values + (j + 1) * row + 32 * c) : _mm512_setzero_si512();
            pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
            pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t g = 0; g < group; g++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)probs[g][j / 2]);
            for (int64_t c = 0; c < 2 * chunks2; c++)
                heads[g].acc[c] = _mm512_dpbf16_ps(heads[g].acc[c], pp, (__m512bh)pairs[c]);
        }
    }
}

/* acc[2c], acc[2c + 1] (lanes interleaved by attend_block_bf16's unpacks) back in head order. */
static inline void unpermute_acc(__m512 *acc, int64_t chunks2) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < chunks2; c++) {
        const __m512 lo = acc[2 * c], hi = acc[2 * c + 1];
        acc[2 * c] = _mm512_permutex2var_ps(lo, first, hi);
        acc[2 * c + 1] = _mm512_permutex2var_ps(lo, second, hi);
    }
}
#endif

/* One work item: sequence item / parts, and its share of the kv heads (all of them when parts is
 * 1, else one): several kv heads per item read each block row as one run (a block's rows hold
 * every kv head). */
static inline __attribute__((always_inline)) void decode_item_avx512(
        int64_t item, int64_t parts, const float *query, const void *k_cache, const void *v_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
        int64_t num_heads, int64_t num_kv_heads, int64_t group, const int64_t chunks,
        int cache_is_bf16, float scale, int64_t window, float softcap, const int dot) {
    const int64_t s = item / parts, per_part = num_kv_heads / parts;
    const int64_t h0 = (item % parts) * per_part;
    const int64_t head_dim = chunks * 16, row = num_kv_heads * head_dim, len = seq_lens[s];
    const int64_t element = cache_is_bf16 ? 2 : 4;
    const int64_t lo = window > 0 && len > window ? len - window : 0; /* first visible key */
    const int64_t first = lo - lo % FAST_BLOCK;
    head_state heads[per_part * group];
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < per_part * group; i++) {
        const float *src = query + (s * num_heads + h0 * group + i) * head_dim;
        for (int64_t c = 0; c < chunks; c++) {
            heads[i].q[c] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * c), scale16);
            heads[i].acc[c] = _mm512_setzero_ps();
        }
        heads[i].max = -INFINITY;
        heads[i].sum = 0.0f;
#if defined(__AVX512BF16__)
        if (dot)
            for (int64_t c = 0; c < chunks / 2; c++)
                heads[i].q_bf16[c] = _mm512_cvtne2ps_pbh(heads[i].q[2 * c + 1], heads[i].q[2 * c]);
#endif
    }
    for (int64_t start = first; start < len; start += FAST_BLOCK) {
        const int64_t n = len - start < FAST_BLOCK ? len - start : FAST_BLOCK;
        const int64_t hidden = lo > start ? lo - start : 0;
        const int64_t block = block_tables[s * table_stride + start / FAST_BLOCK];
        const int64_t base = (block * FAST_BLOCK * num_kv_heads + h0) * head_dim;
        next_block next = {k_cache, v_cache, row * element, (per_part * head_dim * element + 63) / 64, 0};
        if (start + FAST_BLOCK < len) {
            const int64_t later = block_tables[s * table_stride + (start + FAST_BLOCK) / FAST_BLOCK];
            const int64_t offset = ((later * FAST_BLOCK * num_kv_heads + h0) * head_dim) * element;
            const int64_t rows = len - start - FAST_BLOCK < FAST_BLOCK ? len - start - FAST_BLOCK : FAST_BLOCK;
            next.k = (const char *)k_cache + offset;
            next.v = (const char *)v_cache + offset;
            next.lines = rows * 2 * next.row_lines;
        }
        const int64_t share = (next.lines + per_part - 1) / per_part; /* each head's call asks for a share */
        for (int64_t h = 0; h < per_part; h++) {
#if defined(__AVX512BF16__)
            if (dot) {
                attend_block_bf16(heads + h * group, group, k_cache, v_cache, base + h * head_dim, row, n, hidden,
                                  chunks / 2, softcap, &next, h * share, share);
                continue;
            }
#endif
            attend_block(heads + h * group, group, k_cache, v_cache, base + h * head_dim, row, n, hidden,
                         chunks, cache_is_bf16, softcap, &next, h * share, share);
        }
    }
#if defined(__AVX512BF16__)
    if (dot)
        for (int64_t i = 0; i < per_part * group; i++) unpermute_acc(heads[i].acc, chunks / 2);
#endif
    for (int64_t i = 0; i < per_part * group; i++) {
        float *dst = out + (s * num_heads + h0 * group + i) * head_dim;
        const __m512 inv = _mm512_set1_ps(heads[i].sum > 0.0f ? 1.0f / heads[i].sum : 0.0f);
        for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(heads[i].acc[c], inv));
    }
}
#endif

#endif
