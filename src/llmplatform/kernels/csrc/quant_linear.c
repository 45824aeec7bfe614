/* Projections over weights that stay in GGUF's block formats (weight-only quantization):
 *   quant_linear:     y[m, n] = x[m, k] . W[n, k]^T (+ bias[n]) for the few rows of a decode step
 *   quant_dequantize: W[n, k] itself in bf16 or fp32, for the many rows of a prefill (F.linear)
 *
 * Formats (ggml's, little-endian; a block covers 32 consecutive weights of one row, a row of k
 * weights is k / 32 blocks, rows back to back):
 *   Q8_0: 34 bytes = fp16 scale d, int8 q[32]              w[i] = d * q[i]
 *   Q4_1: 20 bytes = fp16 scale d, fp16 min m, u8 qs[16]   w[i] = d * (qs[i] & 15) + m,
 *                                                           w[i + 16] = d * (qs[i] >> 4) + m
 *
 * At 1-16 rows a projection is memory bound: every weight is used m times and read once, so the
 * step costs what streaming the weights costs. quant_linear reads each block once (1.06 bytes a
 * weight for Q8_0, 0.625 for Q4_1, against 2 for bf16), turns it into 32 fp32 weights in
 * registers and multiplies them into up to 8 input rows at a time, accumulating in fp32: the
 * arithmetic of dequantizing to fp32 and multiplying, in another summation order (the Q4_1
 * weight d * q + m is one fused multiply-add, so it can differ from a two-rounding dequantizer
 * in its last bit). Input rows are widened once into a per-call fp32 buffer [m, k]. Work is split
 * over weight rows in blocks of BLOCK_N across the calling thread's OpenMP team.
 */
#include <stdlib.h>

#include "cpu_math.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define FORMAT_Q8_0 0
#define FORMAT_Q4_1 1
#define GROUP_M 8
#define BLOCK_N 16

static inline int64_t block_bytes(int format) { return format == FORMAT_Q8_0 ? 34 : 20; }

/* IEEE half -> float, subnormals, infinities and NaNs included. */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);  /* rebias 15 -> 127 */
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: mantissa * 2^-24, renormalized */
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* The 32 weights of one block, as fp32. */
static inline void block_to_floats(const uint8_t *block, int format, float *w) {
    const float d = half_to_float(block);
    if (format == FORMAT_Q8_0) {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int i = 0; i < QK; i++) w[i] = d * (float)q[i];
    } else {
        const float m = half_to_float(block + 2);
        const uint8_t *qs = block + 4;
        for (int i = 0; i < QK / 2; i++) {
            w[i] = d * (float)(qs[i] & 15) + m;
            w[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
        }
    }
}

#ifdef __AVX2__
/* The 32 weights of one block in four vectors: elements 0-7, 8-15, 16-23, 24-31. */
static inline __attribute__((always_inline)) void block_to_vectors(const uint8_t *block, const int format,
                                                                  __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    if (format == FORMAT_Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(block + 2));  /* 32 int8 */
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
    } else {
        const __m256 m = _mm256_set1_ps(half_to_float(block + 2));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(block + 4));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, mask);                    /* weights 0-15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  /* weights 16-31 */
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
    }
}

#endif

/* dots[r] = x32[r] . (weight row) for r < rows (rows <= GROUP_M). Inlined with constant rows and
 * format (see dot_rows_dispatch), so the accumulators live in registers. Few rows keep several
 * independent sums per row: one chain of multiply-adds per row would wait on the FMA latency,
 * not on the memory. */
static inline __attribute__((always_inline)) void dot_rows(const float *x32, int64_t k, const uint8_t *wrow,
                                                          const int format, const int rows, float *dots) {
    const int64_t num_blocks = k / QK, bytes = block_bytes(format);
#ifdef __AVX2__
    const int sums = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;  /* independent sums per row */
    __m256 acc[GROUP_M][4];
    for (int r = 0; r < rows; r++)
        for (int s = 0; s < sums; s++) acc[r][s] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        __m256 w[4];
        block_to_vectors(wrow + b * bytes, format, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x32 + r * k + b * QK;
            for (int u = 0; u < 4; u++)
                acc[r][u % sums] = _mm256_fmadd_ps(w[u], _mm256_loadu_ps(xb + 8 * u), acc[r][u % sums]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 total = acc[r][0];
        for (int s = 1; s < sums; s++) total = _mm256_add_ps(total, acc[r][s]);
        dots[r] = hsum(total);
    }
#else
    for (int r = 0; r < rows; r++) dots[r] = 0.0f;
    for (int64_t b = 0; b < num_blocks; b++) {
        float w[QK];
        block_to_floats(wrow + b * bytes, format, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x32 + r * k + b * QK;
            float sum = 0.0f;
            for (int i = 0; i < QK; i++) sum += w[i] * xb[i];
            dots[r] += sum;
        }
    }
#endif
}

#define DOT_CASE(R)                                                                    \
    case R:                                                                            \
        if (format == FORMAT_Q8_0) dot_rows(x32, k, wrow, FORMAT_Q8_0, R, dots);        \
        else dot_rows(x32, k, wrow, FORMAT_Q4_1, R, dots);                              \
        break;

static void dot_rows_dispatch(const float *x32, int64_t k, const uint8_t *wrow, int format, int64_t rows,
                              float *dots) {
    switch (rows) {
        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
        default: break;
    }
}

/* Returns 0; -1 when out of memory; -2 for an unknown format or k not a multiple of 32. */
int quant_linear(const void *x, int x_bf16, const uint8_t *w, int format, const float *bias, void *y,
                 int y_bf16, int64_t m, int64_t n, int64_t k, int num_threads) {
    if ((format != FORMAT_Q8_0 && format != FORMAT_Q4_1) || k % QK != 0) return -2;
    float *x32 = (float *)malloc((size_t)(m * k) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) x32[i] = load_value(x, i, x_bf16);
    const int64_t num_col_blocks = (n + BLOCK_N - 1) / BLOCK_N;
    const int64_t row_bytes = k / QK * block_bytes(format);

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t cb = 0; cb < num_col_blocks; cb++) {
        const int64_t n_end = (cb + 1) * BLOCK_N < n ? (cb + 1) * BLOCK_N : n;
        for (int64_t j = cb * BLOCK_N; j < n_end; j++) {
            const uint8_t *wrow = w + j * row_bytes;
            const float add = bias ? bias[j] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += GROUP_M) {
                const int64_t rows = m - r0 < GROUP_M ? m - r0 : GROUP_M;
                float dots[GROUP_M];
                dot_rows_dispatch(x32 + r0 * k, k, wrow, format, rows, dots);
                for (int64_t r = 0; r < rows; r++) store_value(y, (r0 + r) * n + j, dots[r] + add, y_bf16);
            }
        }
    }
    free(x32);
    return 0;
}

/* out[n, k] = the weights of w, fp32 or bf16 (rounded to nearest even). Returns 0, or -2 as above. */
int quant_dequantize(const uint8_t *w, int format, void *out, int out_bf16, int64_t n, int64_t k,
                     int num_threads) {
    if ((format != FORMAT_Q8_0 && format != FORMAT_Q4_1) || k % QK != 0) return -2;
    const int64_t num_blocks = k / QK, bytes = block_bytes(format);

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *block = w + (j * num_blocks + b) * bytes;
            const int64_t first = j * k + b * QK;
#ifdef __AVX2__
            if (!out_bf16) {
                __m256 v[4];
                block_to_vectors(block, format, v);
                for (int u = 0; u < 4; u++) _mm256_storeu_ps((float *)out + first + 8 * u, v[u]);
                continue;
            }
#endif
            float values[QK];
            block_to_floats(block, format, values);
            for (int i = 0; i < QK; i++) store_value(out, first + i, values[i], out_bf16);
        }
    }
    return 0;
}
