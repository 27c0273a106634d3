/* Matmuls of float32 activations by weights kept in GGUF's block formats (Q4_0, Q4_1,
 * Q8_0, Q4_K, Q5_K, Q6_K), read in place from the file's bytes; built by engine/layers/quant.py.
 *
 * llama.cpp's way: each input row is quantized to 8 bits per block of 32 (``quantize_q8``:
 * scale = max |x| / 127, round to nearest even), and a 32-weight chunk of a weight row meets
 * it in integer multiply-adds. Every chunk of every format is reduced to the same form,
 *
 *     w_k = scale * q_k + min          (q_k: an unsigned code, or a signed one in Q8_0 / Q6_K)
 *
 * so that its dot product with the row's codes x_k (scale dx, sum of codes isum) is
 *
 *     dx * (scale * sum_k q_k x_k + min * isum)        (Q6_K: per 16 codes an integer factor too)
 *
 * where the integer sum is exact (|sum| < 2^24: no rounding in its conversion to float).
 * Four weight rows go together: their integer sums land in the lanes of one vector
 * [o0 o1 o2 o3 | o0 o1 o2 o3] (two halves of each chunk), scaled and accumulated over the
 * chunks in order. A row's result depends only on that row: the same bits whatever the
 * other rows of the step are, at any row count, on every thread count. AVX2 multiplies
 * with maddubs + madd, AVX-512 VNNI (or AVX-VNNI) with dpbusd: the same integers, so the
 * same bits.
 *
 * Weight rows: ``row_bytes`` apart, each ``K / 32`` chunks of the format's blocks
 * (32 weights a block; the K-quants 256, 8 chunks). K is a multiple of 32 (256 for K-quants).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGMLQuantizationType */

#define ROW_BLOCK 64 /* input rows whose codes stay in L2 while the weights stream past */
#define INLINE static inline __attribute__((always_inline))

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- activations ---------------------------------------------------------------------- */

/* x [M, K] -> codes [M, K] (int8), per block of 32: dx (scale) and isum (sum of its codes). */
void quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *dx, float *isum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * K / 32; i++) {
        const float *v = x + i * 32;
        __m256 a[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(v + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i c[4];
        for (int j = 0; j < 4; j++)
            c[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* undo the lane interleave */
        _mm256_storeu_si256((__m256i *)(q + i * 32), p);
        dx[i] = amax / 127.0f;
        isum[i] = (float)_mm_cvtsi128_si32(s4);
    }
}

/* ---- weight chunks ---------------------------------------------------------------------- */

/* One 32-weight chunk of a weight row: w_k = scale * q_k + min; ``q`` unsigned codes, or, when
 * ``sign`` is set, signed ones (abs in ``q``, the codes themselves in ``sign``); ``mul``: Q6_K's
 * integer factor of each half (16-bit lanes for madd, 32-bit for dpbusd), else 1. */
typedef struct {
    __m256i q, sign, mul;
    float scale, min;
} chunk_t;

INLINE __m256i nibbles(__m128i lo_hi) { /* 16 bytes -> low nibbles, then high nibbles */
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo_hi), _mm_srli_epi16(lo_hi, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* Q4_K / Q5_K: the 6-bit scale and min of chunk j of 8 (llama.cpp's get_scale_min_k4). */
INLINE void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

INLINE chunk_t load_chunk(int fmt, const uint8_t *row, int64_t c) {
    chunk_t r;
    r.min = 0.0f;
    r.mul = _mm256_set1_epi16(1);
    r.sign = _mm256_setzero_si256();
    if (fmt == Q4_0 || fmt == Q4_1) {
        const uint8_t *b = row + c * (fmt == Q4_0 ? 18 : 20);
        r.scale = f16(b);
        r.min = fmt == Q4_0 ? -8.0f * r.scale : f16(b + 2);
        r.q = nibbles(_mm_loadu_si128((const __m128i *)(b + (fmt == Q4_0 ? 2 : 4))));
    } else if (fmt == Q8_0) {
        const uint8_t *b = row + c * 34;
        r.scale = f16(b);
        r.sign = _mm256_loadu_si256((const __m256i *)(b + 2));
        r.q = _mm256_abs_epi8(r.sign);
    } else if (fmt == Q4_K || fmt == Q5_K) {
        const uint8_t *b = row + (c / 8) * (fmt == Q4_K ? 144 : 176);
        int j = (int)(c % 8), sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        r.scale = f16(b) * (float)sc;
        r.min = -f16(b + 2) * (float)m;
        const uint8_t *qs = b + (fmt == Q4_K ? 16 : 48) + 32 * (j / 2);
        __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        r.q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
        if (fmt == Q5_K) { /* the fifth bit: bit j of each of the 32 bytes of qh */
            __m256i h = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), j);
            r.q = _mm256_or_si256(r.q, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
    } else { /* Q6_K: ql[128] qh[64] scales[16] d; chunk j of 8: half h = j / 4, quarter j % 4 */
        const uint8_t *b = row + (c / 8) * 210;
        int j = (int)(c % 8), h = j / 4, t = j % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t % 2)));
        lo = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
        __m256i hi = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 2 * t);
        hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
        r.sign = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        r.q = _mm256_abs_epi8(r.sign);
        r.scale = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192 + 2 * j);
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
        r.mul = _mm256_setr_epi32(sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1]);
#else
        r.mul = _mm256_setr_m128i(_mm_set1_epi16(sc[0]), _mm_set1_epi16(sc[1]));
#endif
    }
    return r;
}

/* sum over 4 consecutive k of q_k * x_k (times ``mul``), 8 lanes: exact integers. */
INLINE __m256i dot_chunk(int fmt, const chunk_t *w, __m256i x) {
    int is_signed = fmt == Q8_0 || fmt == Q6_K;
    if (is_signed) x = _mm256_sign_epi8(x, w->sign);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w->q, x);
    return fmt == Q6_K ? _mm256_mullo_epi32(p, w->mul) : p;
#elif defined(__AVXVNNI__)
    __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w->q, x);
    return fmt == Q6_K ? _mm256_mullo_epi32(p, w->mul) : p;
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w->q, x), w->mul);
#endif
}

/* ---- the matmul ----------------------------------------------------------------------------- */

/* Rows r0 .. r0 + R - 1 (R <= 4, a constant where it is inlined) against the 4 weight rows
 * ``w``, written to y[r * ldy + o] for the first ``valid`` of them. */
INLINE void tile(int fmt, const uint8_t *const w[4], int64_t chunks, const int8_t *xq, const float *dx,
                        const float *isum, int64_t K, int R, float *y, int64_t ldy, int valid) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < chunks; c++) {
        chunk_t ch[4];
        for (int o = 0; o < 4; o++) ch[o] = load_chunk(fmt, w[o], c);
        __m256 scale = _mm256_setr_ps(ch[0].scale, ch[1].scale, ch[2].scale, ch[3].scale,
                                      ch[0].scale, ch[1].scale, ch[2].scale, ch[3].scale);
        __m256 min = _mm256_setr_ps(ch[0].min, ch[1].min, ch[2].min, ch[3].min, 0, 0, 0, 0);
        for (int r = 0; r < R; r++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + c * 32));
            __m256i s01 = _mm256_hadd_epi32(dot_chunk(fmt, &ch[0], x), dot_chunk(fmt, &ch[1], x));
            __m256i s23 = _mm256_hadd_epi32(dot_chunk(fmt, &ch[2], x), dot_chunk(fmt, &ch[3], x));
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(s01, s23)), scale);
            t = _mm256_fmadd_ps(min, _mm256_set1_ps(isum[r * (K / 32) + c]), t);
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * (K / 32) + c]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[4];
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)));
        for (int o = 0; o < valid; o++) y[r * ldy + o] = out[o];
    }
}

/* Every row of one row block against the 4 weight rows from ``n``. */
INLINE void group(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t N, const int8_t *xq,
                         const float *dx, const float *isum, int64_t rows, int64_t K, float *y, int64_t ldy) {
    const uint8_t *wr[4];
    int valid = N - n < 4 ? (int)(N - n) : 4;
    for (int o = 0; o < 4; o++) wr[o] = w + (n + (o < valid ? o : valid - 1)) * row_bytes;
    int64_t r = 0, nb = K / 32;
    for (; r + 4 <= rows; r += 4)
        tile(fmt, wr, nb, xq + r * K, dx + r * nb, isum + r * nb, K, 4, y + r * ldy + n, ldy, valid);
    switch (rows - r) {
    case 3: tile(fmt, wr, nb, xq + r * K, dx + r * nb, isum + r * nb, K, 3, y + r * ldy + n, ldy, valid); break;
    case 2: tile(fmt, wr, nb, xq + r * K, dx + r * nb, isum + r * nb, K, 2, y + r * ldy + n, ldy, valid); break;
    case 1: tile(fmt, wr, nb, xq + r * K, dx + r * nb, isum + r * nb, K, 1, y + r * ldy + n, ldy, valid); break;
    }
}

#define DEFINE_MATMUL(name, FMT)                                                                               \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t N, const int8_t *xq, const float *dx,         \
                     const float *isum, int64_t M, int64_t K, float *y, int64_t ldy, int num_threads) {         \
        int64_t groups = (N + 3) / 4, nb = K / 32;                                                             \
        _Pragma("omp parallel num_threads(num_threads)")                                                       \
        for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {                                                        \
            int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;                                            \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t g = 0; g < groups; g++)                                                               \
                group(FMT, w, row_bytes, 4 * g, N, xq + r0 * K, dx + r0 * nb, isum + r0 * nb, rows, K,         \
                      y + r0 * ldy, ldy);                                                                      \
        }                                                                                                      \
    }
DEFINE_MATMUL(matmul_q4_0, Q4_0)
DEFINE_MATMUL(matmul_q4_1, Q4_1)
DEFINE_MATMUL(matmul_q8_0, Q8_0)
DEFINE_MATMUL(matmul_q4_k, Q4_K)
DEFINE_MATMUL(matmul_q5_k, Q5_K)
DEFINE_MATMUL(matmul_q6_k, Q6_K)

/* y[:, :N] (row stride ldy) = x [M, K] @ W.T for W [N, K] in format ``fmt`` (rows ``row_bytes``
 * apart), x's codes from ``quantize_q8``. Returns 0, or -1 for a format without a kernel. */
int matmul_q(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, const int8_t *xq, const float *dx,
             const float *isum, int64_t M, int64_t K, float *y, int64_t ldy, int num_threads) {
    switch (fmt) {
    case Q4_0: matmul_q4_0(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q4_1: matmul_q4_1(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q8_0: matmul_q8_0(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q4_K: matmul_q4_k(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q5_K: matmul_q5_k(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q6_K: matmul_q6_k(w, row_bytes, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    }
    return -1;
}

/* x [M, K] float32 times the weight ``parts`` stacked along the outputs: part i in format
 * fmts[i], ns[i] rows ``row_bytes[i]`` apart from ws[i]; y [M, sum(ns)]. Returns 0, or -1
 * (y unwritten) for a format without a kernel, -2 when out of memory. */
int quant_linear(const float *x, int64_t M, int64_t K, int parts, const int *fmts, const uint8_t *const *ws,
                 const int64_t *row_bytes, const int64_t *ns, float *y, int num_threads) {
    int64_t ldy = 0, nb = K / 32;
    for (int i = 0; i < parts; i++) ldy += ns[i];
    int8_t *xq = malloc(M * K + 2 * M * nb * sizeof(float));
    if (!xq) return -2;
    float *dx = (float *)(xq + M * K), *isum = dx + M * nb;
    quantize_q8(x, M, K, xq, dx, isum);
    int64_t col = 0;
    for (int i = 0; i < parts; col += ns[i++])
        if (matmul_q(fmts[i], ws[i], row_bytes[i], ns[i], xq, dx, isum, M, K, y + col, ldy, num_threads)) {
            free(xq);
            return -1;
        }
    free(xq);
    return 0;
}

/* A weight of ``quant_linear``'s parts behind one pointer: what ``quant_layer_matmul`` reads. */
typedef struct {
    int parts;
    const int *fmts;
    const uint8_t *const *ws;
    const int64_t *row_bytes, *ns;
} quant_matrix;

/* cpu_kernels.c's layer_matmul_fn for quantized weights: y [M, N] = x [M, K] @ W.T, W a
 * ``quant_matrix`` (the fused decoder layer calls it for each of its four matrices). */
void quant_layer_matmul(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const quant_matrix *q = w;
    (void)N;
    quant_linear(x, M, K, q->parts, q->fmts, q->ws, q->row_bytes, q->ns, y, num_threads);
}
