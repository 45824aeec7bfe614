/* Helpers shared by the CPU kernels: bf16 <-> fp32, a vectorizable e^x for x <= 0, an AVX2 lane sum,
 * the lane sums of 16 AVX-512 vectors at once.
 * (cbuild hashes every header here with each source, so a change rebuilds every kernel.) */
#ifndef LLMPLATFORM_CPU_MATH_H
#define LLMPLATFORM_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* bf16 is the top half of an fp32. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f); /* a bit copy, not a pointer pun (strict aliasing) */
    return f;
}

/* fp32 -> bf16 bits, rounded to nearest even; a NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to the model dtype (bf16 when is_bf16), kept as an fp32. */
static inline float round_to(float f, int is_bf16) {
    return is_bf16 ? bf16_to_float(float_to_bf16(f)) : f;
}

/* Element i of a bf16 or fp32 array, as an fp32. */
static inline float load_value(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Store f (rounded to nearest even for bf16) as element i. */
static inline void store_value(void *p, int64_t i, float f, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = float_to_bf16(f);
    else ((float *)p)[i] = f;
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

#ifdef __AVX2__
#include <immintrin.h>

/* The sum of v's eight lanes. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef __AVX512F__
/* Lane j of the result = the sum of v[j]'s 16 lanes. 15 adds and 30 shuffles for 16 rows,
 * where 16 separate horizontal sums take about 4 times as many instructions. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partial sums */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: rows 4i..4i+3, that lane's share */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* 128-bit lanes: pairs of lanes of b[2i], then of b[2i+1], added */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#endif
