/* CPU kernels for the few rows of a decode or verification step, float32,
 * x86-64 with AVX2 and FMA. Built at run time by engine/layers/cpu_kernels.py.
 *
 * gemv_f32: y [M, N] = x [M, K] @ w [N, K]^T (a handful of rows; any M works).
 * At a few rows a linear layer is a stream over its weights: every weight is
 * read from memory once and used M times. Each thread takes a contiguous range
 * of output features; for each, the weight row is streamed once (software
 * prefetch PREFETCH floats ahead, four independent accumulators so that the
 * FMA latency never stalls the stream) and re-read from L1 for the other input
 * rows, three at a time. Every row is summed in the same order, so a token's
 * result is the same bits alone or among drafts and other requests.
 *
 * rms_norm_f32: RMSNorm of each row.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PREFETCH 128
#define ROWS 3 /* input rows per pass over a weight row */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m] = sum_k w[k] * x[m][k] for R = 1 to 3 rows of x, each with four accumulators
 * over k (stride 32), summed in the same order whatever R is and wherever the row
 * sits: a row's result never depends on the other rows of the batch. The first
 * call for a weight row prefetches its next lines (it streams the row into L1). */
static inline __attribute__((always_inline)) void dot_rows(const float *w, const float *x, int64_t K, int R,
                                                            int prefetch, float *y, int64_t y_stride) {
    __m256 a[ROWS][4];  /* ROWS x 4 accumulators + a weight and an input vector: 14 of 16 registers */
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (prefetch) {
            _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k + PREFETCH + 16), _MM_HINT_T0);
        }
        for (int j = 0; j < 4; j++) {
            __m256 v = _mm256_loadu_ps(w + k + 8 * j);
            for (int r = 0; r < R; r++) a[r][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + r * K + k + 8 * j), a[r][j]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
        for (int64_t t = k; t < K; t++) s += w[t] * x[r * K + t];
        y[r * y_stride] = s;
    }
}

void gemv_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const float *row = w + n * K;
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS) dot_rows(row, x + m * K, K, ROWS, m == 0, y + m * N + n, N);
        if (M - m == 2) dot_rows(row, x + m * K, K, 2, m == 0, y + m * N + n, N);
        if (M - m == 1) dot_rows(row, x + m * K, K, 1, m == 0, y + m * N + n, N);
    }
}

/* y [T, H] = w * x / sqrt(mean(x^2) + eps) per row. One pass to sum the squares,
 * one to scale: a decode step's 61 norms of 1-8 rows cost ~70 us each as
 * torch ops (several kernels and thread hand-offs), ~1 us here. */
void rms_norm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(T >= 64 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *yr = y + t * H;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t k = 0;
        for (; k + 16 <= H; k += 16) {
            __m256 v0 = _mm256_loadu_ps(xr + k), v1 = _mm256_loadu_ps(xr + k + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        float ss = hsum(_mm256_add_ps(a0, a1));
        for (; k < H; k++) ss += xr[k] * xr[k];
        float scale = 1.0f / sqrtf(ss / (float)H + eps);
        __m256 s = _mm256_set1_ps(scale);
        k = 0;
        for (; k + 8 <= H; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), s), _mm256_loadu_ps(w + k)));
        for (; k < H; k++) yr[k] = xr[k] * scale * w[k];
    }
}
