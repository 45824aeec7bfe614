/* y[rows of group g] += (x[rows] . A_g^T) . B_g^T for every group g of a step's rows that run one
 * LoRA adapter (the adapter in slot slots[g]): the segmented ("grouped gather") LoRA product of
 * many adapters in one call, models/lora.py's layout.
 *
 * A decode step's LoRA work is tiny in arithmetic (each row meets only its own adapter's rank-r
 * matrices) but reads every resident adapter's A and B once: with 16 adapters of rank 16 on a
 * 135M-parameter model that is ~60% of the base model's own weight bytes. Batched torch products
 * of [groups, 2 rows, 576] shapes stream those bytes at a fraction of the memory's speed, so the
 * step cost twice the base model's. Here each weight row is read once, widened in registers
 * (bf16 weights stay bf16 in memory) and multiplied into all of its group's rows, so the cost is
 * what streaming the adapters' weights costs (benchmarks/lora.py, docs/performance.md).
 *
 * Layout (row-major, contiguous; models/lora.py's LoRALinear):
 *   x [T, in], y [T, out] (bf16 or fp32 each); a [L, S * R, in], bt [L, S * R, out] (bf16 or fp32):
 *   slice s (q, k, v of a fused projection; one slice otherwise) owns rank rows s*R .. s*R + R
 *   of a and bt, and output columns slice_offsets[s] .. slice_offsets[s + 1] of bt and y (bt is
 *   block diagonal: its other columns are zeros, never read here). ranks[slot] <= R: the rows
 *   beyond it are zero padding, never read.
 *   rows [N]: the rows of x and y in group order; group_starts [G + 1]: group g is
 *   rows[group_starts[g] .. group_starts[g + 1]); slots [G].
 * Phase 1 widens the grouped rows of x once and computes shrunk[N, S * R] (fp32); phase 2 adds
 * the expansion to y, rounded once to y's dtype. Groups own disjoint rows, so the parallel work
 * items of each phase never write the same element.
 */
#include <stdlib.h>

#include "row_dot.h"

#define BLOCK_OUT 64

/* dst[0:n] = src[first:first + n] widened to fp32 (a loop the compiler vectorizes per dtype). */
static inline void widen(float *dst, const void *src, int64_t first, int64_t n, int is_bf16) {
    if (is_bf16) {
        const uint16_t *h = (const uint16_t *)src + first;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(h[i]);
    } else {
        memcpy(dst, (const float *)src + first, (size_t)n * sizeof(float));
    }
}

/* Adds the expansion of up to GROUP_M rows' shrunk values over output columns [o0, o1). */
static void expand_block(const float *shrunk, int64_t shrunk_stride, const int64_t *row_ids, int64_t num_rows,
                         const void *bt, int w_bf16, int64_t out, int64_t first_rank, int64_t rank,
                         int64_t o0, int64_t o1, void *y, int y_bf16) {
    float acc[GROUP_M][BLOCK_OUT], b[BLOCK_OUT];
    const int64_t width = o1 - o0;
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t o = 0; o < width; o++) acc[r][o] = 0.0f;
    for (int64_t j = first_rank; j < first_rank + rank; j++) {
        widen(b, bt, j * out + o0, width, w_bf16);
        for (int64_t r = 0; r < num_rows; r++) {
            const float s = shrunk[r * shrunk_stride + j];
            for (int64_t o = 0; o < width; o++) acc[r][o] += s * b[o];
        }
    }
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t at = row_ids[r] * out + o0;
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + at;
            for (int64_t o = 0; o < width; o++) yr[o] = float_to_bf16(bf16_to_float(yr[o]) + acc[r][o]);
        } else {
            float *yr = (float *)y + at;
            for (int64_t o = 0; o < width; o++) yr[o] += acc[r][o];
        }
    }
}

/* Returns 0, or -1 when out of memory. */
int lora_apply(const void *x, int x_bf16, void *y, int y_bf16, int64_t in, int64_t out,
               const void *a, const void *bt, int w_bf16, int64_t max_rank,
               const int64_t *slice_offsets, int64_t num_slices, const int64_t *ranks,
               const int64_t *rows, const int64_t *group_starts, const int64_t *slots, int64_t num_groups,
               int num_threads) {
    const int64_t n = group_starts[num_groups];
    const int64_t width = num_slices * max_rank;  /* of a slot's a and bt, and of shrunk */
    float *x32 = (float *)malloc((size_t)(n * in) * sizeof(float));
    float *shrunk = (float *)calloc((size_t)(n * width), sizeof(float));
    if (x32 == NULL || shrunk == NULL) {
        free(x32);
        free(shrunk);
        return -1;
    }
    const int64_t a_slot = width * in, bt_slot = width * out;  /* elements per slot */
    const int64_t w_size = w_bf16 ? 2 : 4;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) widen(x32 + i * in, x, rows[i] * in, in, x_bf16);

        /* Phase 1: one work item per (group, slice): the rank rows of A the slot's adapter fills. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_groups * num_slices; item++) {
            const int64_t g = item / num_slices, s = item % num_slices;
            for (int64_t j = s * max_rank; j < s * max_rank + ranks[slots[g]]; j++) {
                const char *arow = (const char *)a + (slots[g] * a_slot + j * in) * w_size;
                for (int64_t r0 = group_starts[g]; r0 < group_starts[g + 1]; r0 += GROUP_M) {
                    const int64_t count = group_starts[g + 1] - r0 < GROUP_M ? group_starts[g + 1] - r0 : GROUP_M;
                    float dots[GROUP_M];
                    dot_rows(x32 + r0 * in, count, arow, w_bf16, in, dots);
                    for (int64_t r = 0; r < count; r++) shrunk[(r0 + r) * width + j] = dots[r];
                }
            }
        }

        /* Phase 2: one work item per (group, block of one slice's output columns). */
        const int64_t blocks_per_group = (out + BLOCK_OUT - 1) / BLOCK_OUT + num_slices;  /* an upper bound */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_groups * blocks_per_group; item++) {
            const int64_t g = item / blocks_per_group;
            int64_t block = item % blocks_per_group, s = 0, o0 = -1;
            for (; s < num_slices; s++) {  /* which slice's which block: blocks never cross slices */
                const int64_t in_slice = (slice_offsets[s + 1] - slice_offsets[s] + BLOCK_OUT - 1) / BLOCK_OUT;
                if (block < in_slice) {
                    o0 = slice_offsets[s] + block * BLOCK_OUT;
                    break;
                }
                block -= in_slice;
            }
            if (o0 < 0) continue;  /* past the last block */
            const int64_t o1 = o0 + BLOCK_OUT < slice_offsets[s + 1] ? o0 + BLOCK_OUT : slice_offsets[s + 1];
            const void *slot_bt = (const char *)bt + slots[g] * bt_slot * w_size;
            for (int64_t r0 = group_starts[g]; r0 < group_starts[g + 1]; r0 += GROUP_M) {
                const int64_t count = group_starts[g + 1] - r0 < GROUP_M ? group_starts[g + 1] - r0 : GROUP_M;
                expand_block(shrunk + r0 * width, width, rows + r0, count, slot_bt, w_bf16, out,
                             s * max_rank, ranks[slots[g]], o0, o1, y, y_bf16);
            }
        }
    }
    free(x32);
    free(shrunk);
    return 0;
}
