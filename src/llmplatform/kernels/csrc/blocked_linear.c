/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for the 17-64 rows of a batched decode step, on a CPU
 * with AVX2 + FMA but no bf16 matrix instructions (kernels/ops.py chooses it; any m works).
 *
 * Past ~16 rows a projection stops being bound by streaming its weights and becomes bound by the
 * multiply-adds. small_linear.c multiplies one weight row into up to 8 input rows at a time: each
 * widened weight vector feeds 8 FMAs, but each input vector only one, so the loop is bound by
 * input loads, not FMAs. Here a tile of MR input rows x NR weight rows is computed at once, in
 * MR * NR fp32 vector accumulators: every weight vector loaded and widened (in registers: the
 * weights stay bf16 in memory, half the bytes of the fp32 copy the CPU would otherwise multiply)
 * serves MR rows and every input vector NR columns, so a k-step is NR + MR loads for MR * NR FMAs.
 *
 * bf16 weights are widened 16 at a time, even and odd elements apart (load16_bf16: two
 * single-cycle ops, no shuffle); the inputs, widened once per call into an fp32 buffer [m, k],
 * are stored in the same order, so each product pairs the right elements.
 *
 * Cache blocking: work is split over blocks of BLOCK_N weight rows across the calling thread's
 * OpenMP team. Within a block every row tile passes over all of the block's weight rows (NR at a
 * time); the block (BLOCK_N * k * 2 bytes: 96-192 KiB at k 1536) stays in L2 while each tile's
 * input rows (MR * k * 4 bytes) stay in L1, so memory sees each weight once per call.
 *
 * Layout: x, w, y row-major and contiguous. x and y are bf16 or fp32 (flags); w is bf16 or fp32;
 * bias is fp32 or NULL.
 *
 * Results are fp32 sums (8 lanes, then the lanes added) rounded once (to nearest even) when y is
 * bf16: the arithmetic of widening the operands and multiplying in fp32, in another order.
 */
#include <stdlib.h>

#include "row_dot.h"

/* The tile: MR * NR accumulators, the weight vectors, one input vector and the bf16 mask must fit
 * the vector registers without spilling: 16 with AVX2 (5 x 2: 10 accumulators; 4 x 3 spilled),
 * 32 where AVX-512 VL encodes ymm16-31 (4 x 4). Measured on one core of a Zen 4 EPYC, SmolLM2's
 * projections at 17-64 rows: 5 x 2 reaches 77% of the FMA peak built for AVX2 only, 4 x 3 60%;
 * 4 x 4 88% with AVX-512 VL's registers (benchmarks/linear_ceiling.py). */
#ifndef MR
#ifdef __AVX512VL__
#define MR 4 /* input rows per tile */
#define NR 4 /* weight rows (output columns) per tile */
#else
#define MR 5
#define NR 2
#endif
#endif
#if NR > 4
#error "the epilogue (row_sums) adds up at most 4 columns at once"
#endif
#define BLOCK_N (16 * NR) /* weight rows per parallel work item */

/* Bit 1: this library and this CPU run the vector kernel (the library is built -march=native, so
 * both hold together; asked at run time all the same: the plan never assumes an ISA). Bit 2: the
 * CPU has AVX-512F, whose 16-wide FMAs oneDNN's fp32 GEMM uses (kernels/ops.py weighs that). */
int blocked_linear_features(void) {
    __builtin_cpu_init();
    int features = __builtin_cpu_supports("avx512f") ? 2 : 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) features |= 1;
#endif
    return features;
}

#if defined(__AVX2__) && defined(__FMA__)

/* Keeps v in a register: without it the compiler folds each input load into every multiply-add
 * that uses it (NR loads instead of one), and the loop is bound by loads, not FMAs. */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* The even and the odd elements of 16 bf16 weights, each as 8 fp32: bf16 is the top half of an
 * fp32, so the odd ones are the 32-bit lanes with their low half cleared and the even ones the
 * lanes shifted left by 16. One load and two single-cycle ops for 16 weights (widening them in
 * order costs a shuffle and a shift per 8); the inputs are stored in the same even/odd order. */
static inline void load16_bf16(const void *w, int64_t i, __m256 *even, __m256 *odd) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The lane sums of up to 4 accumulators (one row's columns; the others zero) as one vector
 * [sum(a0), sum(a1), sum(a2), sum(a3)]: a tree of horizontal adds, where four separate lane sums
 * would cost about 4x the instructions (they are the tile's epilogue, once per 36-96 k-steps). */
static inline __m128 row_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* out[r][c] = x32[r] . w[c] for r < mr, c < nr; called with constant mr, nr, w_bf16 so that each
 * call site unrolls into register accumulators. For bf16 weights, x32's rows hold each chunk of
 * 16 inputs as its 8 even then its 8 odd elements (permute_inputs), the tail past the last full
 * chunk in order. */
static inline __attribute__((always_inline)) void tile(const float *x32, const void *w, int64_t k,
                                                       const int mr, const int nr, const int w_bf16,
                                                       float out[MR][4]) {
    const int64_t w_row = w_bf16 ? k * 2 : k * 4;
    const void *wrows[NR];
    for (int c = 0; c < nr; c++) wrows[c] = (const char *)w + c * w_row;
    __m256 acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t i = 0;
    if (w_bf16) {
        const int64_t k16 = k & ~(int64_t)15;
        for (; i < k16; i += 16) {
            __m256 even[NR], odd[NR];
            for (int c = 0; c < nr; c++) load16_bf16(wrows[c], i, &even[c], &odd[c]);
            for (int r = 0; r < mr; r++) {
                __m256 xv = _mm256_loadu_ps(x32 + r * k + i);
                IN_REGISTER(xv);
                for (int c = 0; c < nr; c++) acc[r][c] = _mm256_fmadd_ps(xv, even[c], acc[r][c]);
            }
            for (int r = 0; r < mr; r++) {
                __m256 xv = _mm256_loadu_ps(x32 + r * k + i + 8);
                IN_REGISTER(xv);
                for (int c = 0; c < nr; c++) acc[r][c] = _mm256_fmadd_ps(xv, odd[c], acc[r][c]);
            }
        }
    }
    const int64_t k8 = k & ~(int64_t)7;
    for (; i < k8; i += 8) {
        __m256 wv[NR];
        for (int c = 0; c < nr; c++) wv[c] = load8(wrows[c], w_bf16, i);
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_loadu_ps(x32 + r * k + i);
            IN_REGISTER(xv);
            for (int c = 0; c < nr; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    const __m256 zero = _mm256_setzero_ps();
    for (int r = 0; r < mr; r++)
        _mm_storeu_ps(out[r], row_sums(acc[r][0], nr > 1 ? acc[r][1 % NR] : zero, nr > 2 ? acc[r][2 % NR] : zero,
                                       nr > 3 ? acc[r][3 % NR] : zero));
    for (; i < k; i++)
        for (int c = 0; c < nr; c++) {
            const float wv = load_value(wrows[c], i, w_bf16);
            for (int r = 0; r < mr; r++) out[r][c] += x32[r * k + i] * wv;
        }
}

/* x (bf16 or fp32) [m, k] as fp32, each full chunk of 16 as its even then its odd elements. */
static void permute_inputs(const void *x, int x_bf16, int64_t m, int64_t k, float *x32) {
    const int64_t k16 = k & ~(int64_t)15;
    for (int64_t r = 0; r < m; r++) {
        float *row = x32 + r * k;
        int64_t i = 0;
        if (x_bf16) {
            const uint16_t *xrow = (const uint16_t *)x + r * k;
            for (; i < k16; i += 16) {
                __m256 even, odd;
                load16_bf16(xrow, i, &even, &odd);
                _mm256_storeu_ps(row + i, even);
                _mm256_storeu_ps(row + i + 8, odd);
            }
        } else {
            const float *xrow = (const float *)x + r * k;
            for (; i < k16; i += 16) {
                const __m256 a = _mm256_loadu_ps(xrow + i), b = _mm256_loadu_ps(xrow + i + 8);
                /* per 128-bit lane [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit pairs put in order */
                const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
                const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
                _mm256_storeu_ps(row + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8)));
                _mm256_storeu_ps(row + i + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8)));
            }
        }
        for (; i < k; i++) row[i] = load_value(x, r * k + i, x_bf16);
    }
}

/* One specialised tile per (rows, columns, weight dtype). */
static void any_tile(const float *x32, const void *w, int64_t k, int mr, int nr, int w_bf16,
                     float out[MR][4]) {
#define TILE_CASE(R, C)                                    \
    case (R) * 8 + (C):                                    \
        if (w_bf16) tile(x32, w, k, R, C, 1, out);         \
        else tile(x32, w, k, R, C, 0, out);                \
        return;
#if NR >= 4
#define TILE_COLUMNS(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3) TILE_CASE(R, 4)
#elif NR == 3
#define TILE_COLUMNS(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3)
#else
#define TILE_COLUMNS(R) TILE_CASE(R, 1) TILE_CASE(R, 2)
#endif
    switch (mr * 8 + nr) {
        TILE_COLUMNS(1) TILE_COLUMNS(2) TILE_COLUMNS(3) TILE_COLUMNS(4)
#if MR >= 5
        TILE_COLUMNS(5)
#endif
#if MR >= 6
        TILE_COLUMNS(6)
#endif
    }
#undef TILE_COLUMNS
#undef TILE_CASE
}

#endif

/* Returns 0; -1 when out of memory; -2 when this CPU cannot run the kernel (blocked_linear_features). */
int blocked_linear(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *y,
                   int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m <= 0 || n <= 0) return 0;
    float *x32 = NULL;
    if (x_bf16 || w_bf16) {  /* fp32 inputs with fp32 weights are read in place */
        x32 = (float *)malloc((size_t)(m * k) * sizeof(float));
        if (x32 == NULL) return -1;
        if (w_bf16) permute_inputs(x, x_bf16, m, k, x32);
        else for (int64_t i = 0; i < m * k; i++) x32[i] = load_value(x, i, 1);
    }
    const float *xf = x32 ? x32 : (const float *)x;
    const int64_t w_row = k * (w_bf16 ? 2 : 4);
    /* Row tiles of nearly equal sizes (17 rows in tiles of up to 5: 5, 4, 4, 4), never one thin
     * tile at the end. */
    const int64_t num_row_tiles = (m + MR - 1) / MR;
    const int64_t base_rows = m / num_row_tiles, extra_rows = m % num_row_tiles;
    /* Smaller blocks when there are too few to keep every thread busy (at least NR * 4 rows). */
    int64_t block_n = BLOCK_N;
    while (block_n > 4 * NR && (n + block_n - 1) / block_n < 4 * (int64_t)num_threads) block_n -= NR;
    const int64_t num_blocks = (n + block_n - 1) / block_n;

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * block_n, n_end = n0 + block_n < n ? n0 + block_n : n;
        /* The next block's weights (this thread's next work item under the static schedule) are
         * fetched into L2 a few lines per tile while this one computes: streamed from memory
         * by its first row tile alone, a block at 17 rows waited on DRAM for a third of its time. */
        const char *next = (const char *)w + n_end * w_row;
        const int64_t next_end = n_end + block_n < n ? n_end + block_n : n;
        const int64_t next_lines = (next_end - n_end) * w_row / 64;
        const int64_t num_tiles = num_row_tiles * ((n_end - n0 + NR - 1) / NR);
        const int64_t lines_per_tile = (next_lines + num_tiles - 1) / num_tiles;
        int64_t prefetched = 0;
        int64_t r0 = 0;
        for (int64_t t = 0; t < num_row_tiles; t++) {
            const int mr = (int)(base_rows + (t < extra_rows));
            for (int64_t j = n0; j < n_end; j += NR) {
                for (int64_t p = 0; p < lines_per_tile && prefetched < next_lines; p++, prefetched++)
                    _mm_prefetch(next + prefetched * 64, _MM_HINT_T1);
                const int nr = (int)(n_end - j < NR ? n_end - j : NR);
                float out[MR][4];
                any_tile(xf + r0 * k, (const char *)w + j * w_row, k, mr, nr, w_bf16, out);
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < nr; c++)
                        store_value(y, (r0 + r) * n + j + c, out[r][c] + (bias ? bias[j + c] : 0.0f), y_bf16);
            }
            r0 += mr;
        }
    }
    free(x32);
    return 0;
#else
    (void)x; (void)x_bf16; (void)w; (void)w_bf16; (void)bias; (void)y; (void)y_bf16;
    (void)m; (void)n; (void)k; (void)num_threads;
    return -2;
#endif
}
