/* What the cpu_kernels library's C files share and the Python side never calls (that is
 * specserve_kernels.h): the vector helpers, and grouped_matmul_f32. */
#ifndef SPECSERVE_COMMON_H
#define SPECSERVE_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) of a vector of floats (Cephes' expf: x = n ln2 + r, e^r by a degree-6 polynomial,
 * 2^n through the exponent bits); relative error below 2e-7, x clamped to [-87, 88].
 * One definition for both widths: exp256 (8 floats) and, with AVX-512, exp512 (16). */
#define DEFINE_EXP(name, V, VI, P, BITS, ROUND)                                                  \
    static inline V name(V x) {                                                                  \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                  \
        V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                            \
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                              \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                    \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                   \
        V p = P##_set1_ps(1.9875691500e-4f);                                                     \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                   \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                   \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                   \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                   \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                   \
        p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));                 \
        VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);       \
        return P##_mul_ps(p, P##_castsi##BITS##_ps(e));                                          \
    }
DEFINE_EXP(exp256, __m256, __m256i, _mm256, 256, _mm256_round_ps)
#ifdef __AVX512F__
DEFINE_EXP(exp512, __m512, __m512i, _mm512, 512, _mm512_roundscale_ps)
#endif

static inline float exp1(float x) { /* the same function on one float: vector lane 0 */
    return _mm_cvtss_f32(_mm256_castps256_ps128(exp256(_mm256_set1_ps(x))));
}

/* bfloat16, the high half of a float32: f32_to_bf16 rounds to nearest even (a NaN becomes
 * 0x7fc0), as torch's conversion does; bfloat16 -> float32 is exact (a shift by 16). */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#ifdef __AVX512F__
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* y[g] [M[g], N] = x[g] [M[g], K] @ w[g]^T for G products of the same N and K (matmul.c; moe.c's
 * experts); 0 or KERNEL_NO_MEMORY. */
int grouped_matmul_f32(int64_t G, const float *const *x, const float *const *w, float *const *y, const int64_t *M,
                       int64_t N, int64_t K, int num_threads);
#endif
