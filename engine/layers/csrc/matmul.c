/* The matmul of the CPU kernels, float32, x86-64 with AVX2 and FMA (and AVX-512 where the
 * CPU has it, -mavx512f).
 *
 * gemv_f32: y [M, N] = x [M, K] @ w [N, K]^T (a handful of rows; any M works), w in the
 * layout that weight_panel names (as it is in the AVX2 build, in panels in the AVX-512 one).
 * At a few rows a linear layer is a stream over its weights: every weight is
 * read from memory once and used M times. Each thread takes a contiguous range
 * of output features. Up to SMALL_M rows (a decode step with its drafts), the
 * weight rows are streamed one after another (software prefetch PREFETCH floats
 * ahead, four accumulators so that the FMA latency never stalls the stream) and
 * re-read from L1 for the input rows, three at a time; every row is summed in
 * the same order whatever M is, so a token's result is the same bits alone or
 * beside its drafts. Past SMALL_M (many requests), where arithmetic starts to
 * count, four weight rows at a time meet three input rows: a 3 x 4 tile of
 * accumulators, 12 FMAs for 7 loads (one order for every M > SMALL_M).
 */
#include "common.h"

#define PREFETCH 128
#define ROWS 3 /* input rows per tile */
#define COLS 4 /* weight rows (output features) per tile */
#define SMALL_M 8 /* up to this many input rows: one weight row at a time (one stream per thread) */

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

/* y[r][c] = w[c] . x[r] for R <= ROWS input rows and C <= COLS weight rows: R x C
 * accumulators, each one chain over k in steps of 8, then a horizontal sum and the
 * scalar tail. Every (row, feature) is summed in that order whatever R, C and the
 * row's place in the batch are (for any M > SMALL_M). Each
 * step loads R input vectors and C weight vectors for R x C FMAs (12 for 7 loads at
 * 3 x 4). The first pass over a tile (first) prefetches the weights ahead: it
 * streams them into L1, where the later passes over the next input rows find them. */
static inline __attribute__((always_inline)) void tile(const float *w, const float *x, int64_t K, int R, int C,
                                                        int first, float *y, int64_t N) {
    __m256 a[ROWS][COLS];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) a[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[ROWS];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < C; c++) {
            if (first && (k & 15) == 0) _mm_prefetch((const char *)(w + c * K + k + PREFETCH), _MM_HINT_T0);
            __m256 wv = _mm256_loadu_ps(w + c * K + k);
            for (int r = 0; r < R; r++) a[r][c] = _mm256_fmadd_ps(wv, xv[r], a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(a[r][c]);
            for (int64_t t = k; t < K; t++) s += w[c * K + t] * x[r * K + t];
            y[r * N + c] = s;
        }
}

/* One tile of C weight rows (C known at compile time in each call) against every input row. */
static inline __attribute__((always_inline)) void tile_rows(const float *w, const float *x, float *y, int64_t M,
                                                             int64_t N, int64_t K, int C) {
    int64_t m = 0;
    for (; m + ROWS <= M; m += ROWS) tile(w, x + m * K, K, ROWS, C, m == 0, y + m * N, N);
    if (M - m == 2) tile(w, x + m * K, K, 2, C, m == 0, y + m * N, N);
    if (M - m == 1) tile(w, x + m * K, K, 1, C, m == 0, y + m * N, N);
}

static void gemv_rows(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const float *row = w + n * K;
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS) dot_rows(row, x + m * K, K, ROWS, m == 0, y + m * N + n, N);
        if (M - m == 2) dot_rows(row, x + m * K, K, 2, m == 0, y + m * N + n, N);
        if (M - m == 1) dot_rows(row, x + m * K, K, 1, m == 0, y + m * N + n, N);
    }
}

static void gemv_tiles(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t tiles = (N + COLS - 1) / COLS;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = t * COLS;
        if (n + COLS <= N)
            tile_rows(w + n * K, x, y + n, M, N, K, COLS);
        else
            for (int64_t c = n; c < N; c++) tile_rows(w + c * K, x, y + c, M, N, K, 1);
    }
}

#ifdef __AVX512F__
/* AVX-512 (built where the CPU has it): one order for every M, on weights in panels.
 *
 * The weights are read in panels of PANEL = 16 * PV output features (weight_panel;
 * engine/layers/cpu_kernels.py lays them out once at start-up): w [N, K] as
 * [ceil(N / PANEL)][K][PANEL], zero padded, so that a panel is one contiguous stream and
 * its PANEL weights for one k lie side by side. Each step over k broadcasts x[r][k] for R
 * input rows and multiplies it into PV vectors of 16 features: R x PV accumulators that
 * hold y's own entries, with no horizontal sum at the end. Every y[r][c] is one chain
 * over k = 0, 1, ..., K - 1, the same order for every R and place in the batch, so a row's
 * result is the same bits whatever else is in the batch, at any M.
 *
 * On a 2-core Zen 4, the 30 layers of SmolLM2-135M (python -m bench.kernels): 9.4 ms at
 * 1 row, 9.2 at 4, 20.4 at 16, where oneDNN takes 18.7, 15.4 and 24.9; the earlier tiles
 * (3 x 8 or 4 x 6 weight rows, each output summed 16 lanes at a time and then across,
 * the weights read in place as 6-8 streams 4*K bytes apart) took 16-19, 19.5-21.4 and
 * 31.5-36.8 in a C benchmark of the same hours. The first pass over a panel (first)
 * prefetches it ahead into L2; the passes for the next input rows find it there. */
#define PV 6 /* vectors of 16 features per panel: 4 x 6 accumulators, 4 inputs and a weight in 32 registers */
#define PANEL (16 * PV)
#define PANEL_PREFETCH 1024 /* floats ahead in a panel's stream */
static inline __attribute__((always_inline)) void panel512(const float *p, const float *x, int64_t K, int R,
                                                            int first, float *y, int64_t N, int64_t cols) {
    __m512 a[4][PV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PV; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++, p += PANEL) {
        if (first && (k & 1) == 0)
            for (int c = 0; c < PV; c++) _mm_prefetch((const char *)(p + PANEL_PREFETCH + 16 * c), _MM_HINT_T1);
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_set1_ps(x[r * K + k]);
        for (int c = 0; c < PV; c++) {
            __m512 wv = _mm512_loadu_ps(p + 16 * c);
            for (int r = 0; r < R; r++) a[r][c] = _mm512_fmadd_ps(xv[r], wv, a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PV; c++) {
            const int64_t left = cols - 16 * c;
            if (left >= 16)
                _mm512_storeu_ps(y + r * N + 16 * c, a[r][c]);
            else if (left > 0)
                _mm512_mask_storeu_ps(y + r * N + 16 * c, (__mmask16)((1u << left) - 1), a[r][c]);
        }
}

/* One panel (weights p, output features n ..) against every input row, 4 at a time. */
#define PANEL512(R) panel512(p, x + m * K, K, R, m == 0, y + m * N + n, N, cols)
static void gemm512(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < panels; i++) {
        const float *p = w + i * K * PANEL;
        const int64_t n = i * PANEL, cols = N - n < PANEL ? N - n : PANEL;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) PANEL512(4);
        if (M - m == 3) PANEL512(3);
        if (M - m == 2) PANEL512(2);
        if (M - m == 1) PANEL512(1);
    }
}
#endif

/* The weight layout gemv_f32 reads: panels of this many output features (see gemm512),
 * or 0 for [N, K] as it is (the AVX2 build). */
int weight_panel(void) {
#ifdef __AVX512F__
    return PANEL;
#else
    return 0;
#endif
}

void gemv_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
#ifdef __AVX512F__
    gemm512(x, w, y, M, N, K, num_threads);
    return;
#endif
    if (M <= SMALL_M)
        gemv_rows(x, w, y, M, N, K, num_threads);
    else
        gemv_tiles(x, w, y, M, N, K, num_threads);
}
