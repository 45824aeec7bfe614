/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for the few rows of a decode step.
 *
 * Two paths: on a CPU with AVX512-BF16, bf16 weights are multiplied by bf16 dot products in
 * 4 x 4 tiles (below: every decode step of up to 64 rows, kernels.ops.DPBF16_ROWS); elsewhere,
 * and for fp32 weights, by the widening path described here.
 *
 * At 1-16 rows a projection is memory bound: every weight is used m times and read once, so the
 * step costs what streaming the weights costs. This kernel reads each weight row once, widens it
 * (bf16 -> fp32 is a 16-bit shift) in registers and multiplies it into up to 8 input rows at a
 * time, accumulating in fp32; bf16 weights are never widened in memory, so a bf16 model streams
 * half the bytes of the fp32 copy a CPU without bf16 matrix instructions otherwise multiplies.
 *
 * Layout: x, w, y row-major and contiguous. x and y are bf16 or fp32 (flags); w is bf16 or fp32;
 * bias is fp32 or NULL. The input rows are widened once into a per-call fp32 buffer [m, k].
 * Work is split over output columns (weight rows) in blocks of BLOCK_N across the calling
 * thread's OpenMP team; for m > 8 each weight row is reused from L1 for every group of 8 rows.
 *
 * Results are fp32 sums rounded once (to nearest even) when y is bf16: the same arithmetic as
 * widening the operands and multiplying in fp32, in another summation order.
 */
#include <stdlib.h>

#include "row_dot.h"

#define BLOCK_N 16

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 input rows over bf16 weights on a CPU with AVX512-BF16 (decode steps of 1-64 sequences,
 * speculative verification): vdpbf16ps multiplies 32 bf16 pairs (exact products) into 16 fp32
 * sums in one instruction, no widening, where the AVX2 path below widens every weight and
 * multiplies it into each row with fp32 FMAs (bound by arithmetic past two rows).
 *
 * The product is cut into tiles of TILE_ROWS input rows x TILE_COLS weight rows: per 32-wide
 * chunk of k, 4 weight vectors and 4 input vectors feed 16 dot-product accumulators (one per
 * (row, weight row) pair), so each load serves 4 multiply-adds (one weight row at a time, as this
 * kernel first did, needs 5 loads for 4 and a horizontal sum per pair: ~55% of the CPU's bf16
 * peak at 32 rows against ~85% here with the weights in cache). The 16 sums are reduced together
 * by a transposing tree (sum16: 4 shuffle + add levels for all 16, not 4 per pair), which leaves the
 * tile's results in one vector: lane 4r + c = (row r, weight row c), stored as four rows of four.
 *
 * Streaming the weights from memory: each thread walks its weight rows in order, one tile of 4
 * rows (contiguous) at a time, and runs every group of 4 input rows over it before the next; the
 * hardware prefetcher does not keep 4 interleaved streams ahead, so the tile PREFETCH_TILES ahead
 * is asked into L2 during the current one, its lines spread evenly over all of the current tile's
 * chunks (all input-row groups): issued at once they queue and stall the loads. At 32 rows this
 * took SmolLM2's 30 layers of products from 24 to 18 ms, at 1 row from ~9 to ~7 (2-core EPYC).
 *
 * Same bits whatever the batch: every (row, weight row) pair is summed by one accumulator over
 * the chunks in order (the last one masked) and reduced by the same tree, and a tile past the
 * last row or weight row reads the last valid one again (its results dropped). So a row's
 * result is the same in a call of 1 row as in one of 64. */
#define HAVE_DPBF16 1
#define TILE_ROWS 4
#define TILE_COLS 4
#define PREFETCH_TILES 4
#define DPBF16_MIN_ROWS 1

/* Prefetching the next tiles' lines, a fraction per chunk: `due` grows by `lines` per chunk and
 * a line is asked for each `chunks` of it (all of a tile's lines over its chunks of every group). */
struct line_feed {
    const char *next;  /* NULL: nothing to prefetch */
    int64_t due, lines, chunks;
};

static inline __attribute__((always_inline)) void feed_lines(struct line_feed *f) {
    if (f->next == NULL) return;
    for (f->due += f->lines; f->due >= f->chunks; f->due -= f->chunks, f->next += 64)
        _mm_prefetch(f->next, _MM_HINT_T1);
}

/* The 16 dot products of input rows x[0..3] (m_left valid) and weight rows w[0..3] (n_left
 * valid), lane 4r + c = (r, c). */
static inline __attribute__((always_inline)) __m512 dpbf16_tile(const uint16_t *x, int64_t m_left, const uint16_t *w,
                                                                int64_t n_left, int64_t k, struct line_feed *feed) {
    const uint16_t *xr[TILE_ROWS], *wr[TILE_COLS];
    for (int r = 0; r < TILE_ROWS; r++) xr[r] = x + (r < m_left ? r : m_left - 1) * k;
    for (int c = 0; c < TILE_COLS; c++) wr[c] = w + (c < n_left ? c : n_left - 1) * k;
    __m512 acc[TILE_ROWS * TILE_COLS];  /* (r, c) at r * TILE_COLS + c: sum16 puts it in lane 4r + c */
    for (int i = 0; i < TILE_ROWS * TILE_COLS; i++) acc[i] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh wv[TILE_COLS];
        for (int c = 0; c < TILE_COLS; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(wr[c] + i));
        feed_lines(feed);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i));
            for (int c = 0; c < TILE_COLS; c++)
                acc[r * TILE_COLS + c] = _mm512_dpbf16_ps(acc[r * TILE_COLS + c], xv, wv[c]);
        }
    }
    if (i < k) {  /* the last, partial chunk (zeros past k) */
        __mmask32 mask = (__mmask32)((1u << (k - i)) - 1);
        __m512bh wv[TILE_COLS];
        for (int c = 0; c < TILE_COLS; c++) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[c] + i);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[r] + i);
            for (int c = 0; c < TILE_COLS; c++)
                acc[r * TILE_COLS + c] = _mm512_dpbf16_ps(acc[r * TILE_COLS + c], xv, wv[c]);
        }
    }
    return sum16(acc);
}

/* Stores a tile's results (plus the bias) at rows m0.., columns n0.. of y: a whole tile as four
 * rows of four, an edge tile's valid part from the same vector (the same roundings either way). */
static inline __attribute__((always_inline)) void store_tile(__m512 v, const float *bias, void *y, int y_bf16,
                                                             int64_t m0, int64_t m, int64_t n0, int64_t n) {
    const int64_t rows = m - m0 < TILE_ROWS ? m - m0 : TILE_ROWS, cols = n - n0 < TILE_COLS ? n - n0 : TILE_COLS;
    if (bias) v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((__mmask8)((1u << cols) - 1), bias + n0)));
    if (y_bf16) {  /* rounded to nearest even, as store_value */
        __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        uint16_t *row = (uint16_t *)y + m0 * n + n0;
        if (rows == TILE_ROWS && cols == TILE_COLS) {
            __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
            _mm_storel_epi64((__m128i *)row, lo);
            _mm_storeh_pd((double *)(row + n), _mm_castsi128_pd(lo));
            _mm_storel_epi64((__m128i *)(row + 2 * n), hi);
            _mm_storeh_pd((double *)(row + 3 * n), _mm_castsi128_pd(hi));
            return;
        }
        uint16_t out[TILE_ROWS * TILE_COLS];
        _mm256_storeu_si256((__m256i *)out, h);
        for (int64_t r = 0; r < rows; r++) memcpy(row + r * n, out + r * TILE_COLS, (size_t)cols * sizeof(uint16_t));
        return;
    }
    float out[TILE_ROWS * TILE_COLS], *row = (float *)y + m0 * n + n0;
    if (rows == TILE_ROWS && cols == TILE_COLS) {
        _mm_storeu_ps(row, _mm512_castps512_ps128(v));
        _mm_storeu_ps(row + n, _mm512_extractf32x4_ps(v, 1));
        _mm_storeu_ps(row + 2 * n, _mm512_extractf32x4_ps(v, 2));
        _mm_storeu_ps(row + 3 * n, _mm512_extractf32x4_ps(v, 3));
        return;
    }
    _mm512_storeu_ps(out, v);
    for (int64_t r = 0; r < rows; r++) memcpy(row + r * n, out + r * TILE_COLS, (size_t)cols * sizeof(float));
}

static void small_linear_dpbf16(const uint16_t *x, const uint16_t *w, const float *bias, void *y,
                                int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t num_tiles = (n + TILE_COLS - 1) / TILE_COLS;
    const int64_t row_groups = (m + TILE_ROWS - 1) / TILE_ROWS, chunks = (k + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t n0 = t * TILE_COLS;
        struct line_feed feed = {NULL, 0, TILE_COLS * k * 2 / 64, row_groups * chunks};
        if (n0 + (PREFETCH_TILES + 1) * TILE_COLS <= n)
            feed.next = (const char *)(w + (n0 + PREFETCH_TILES * TILE_COLS) * k);
        for (int64_t m0 = 0; m0 < m; m0 += TILE_ROWS) {
            __m512 v = dpbf16_tile(x + m0 * k, m - m0, w + n0 * k, n - n0, k, &feed);
            store_tile(v, bias, y, y_bf16, m0, m, n0, n);
        }
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* The fewest rows that run on AVX512-BF16 dot products here, or 0 where this build has none. */
int small_linear_dpbf16_rows(void) {
#if HAVE_DPBF16
    return DPBF16_MIN_ROWS;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when out of memory. */
int small_linear(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *y,
                 int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
#if HAVE_DPBF16
    if (w_bf16 && m >= DPBF16_MIN_ROWS) {
        if (x_bf16) {
            small_linear_dpbf16((const uint16_t *)x, (const uint16_t *)w, bias, y, y_bf16, m, n, k, num_threads);
            return 0;
        }
        /* fp32 rows over bf16 weights (a bf16 model's attention output into o_proj): rounded to
         * bf16 once (nearest even), as a bf16 model's reference holds that output, then the
         * same dot products; the widening path below would multiply-add every pair in fp32. */
        uint16_t *x16 = (uint16_t *)malloc((size_t)(m * k) * sizeof(uint16_t));
        if (x16 == NULL) return -1;
        for (int64_t i = 0; i < m * k; i++) x16[i] = float_to_bf16(((const float *)x)[i]);
        small_linear_dpbf16(x16, (const uint16_t *)w, bias, y, y_bf16, m, n, k, num_threads);
        free(x16);
        return 0;
    }
#endif
    float *x32 = (float *)malloc((size_t)(m * k) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++)
        x32[i] = load_value(x, i, x_bf16);
    int64_t num_blocks = (n + BLOCK_N - 1) / BLOCK_N;
    int64_t w_row_bytes = k * (w_bf16 ? 2 : 4);

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n_end = (b + 1) * BLOCK_N < n ? (b + 1) * BLOCK_N : n;
        for (int64_t j = b * BLOCK_N; j < n_end; j++) {
            const void *wrow = (const char *)w + j * w_row_bytes;
            float add = bias ? bias[j] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += GROUP_M) {
                int64_t rows = m - r0 < GROUP_M ? m - r0 : GROUP_M;
                float dots[GROUP_M];
                dot_rows(x32 + r0 * k, rows, wrow, w_bf16, k, dots);
                for (int64_t r = 0; r < rows; r++) {
                    float v = dots[r] + add;
                    store_value(y, (r0 + r) * n + j, v, y_bf16);
                }
            }
        }
    }
    free(x32);
    return 0;
}
