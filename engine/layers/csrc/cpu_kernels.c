/* CPU kernels for the few rows of a decode or verification step, float32,
 * x86-64 with AVX2 and FMA; the matmul and the attention have AVX-512 paths,
 * compiled where the CPU has it (-mavx512f). Built at run time by
 * engine/layers/cpu_kernels.py.
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
 *
 * rms_norm_f32: RMSNorm of each row.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH 128
#define ROWS 3 /* input rows per tile */
#define COLS 4 /* weight rows (output features) per tile */
#define SMALL_M 8 /* up to this many input rows: one weight row at a time (one stream per thread) */

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

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Attention of listed tokens over the paged KV cache.
 *
 * Token i (of n) is row rows[i] of q (row stride q_stride floats, H heads of D) and
 * of out ([*, H, D], contiguous); it sees the keys and values at the slots
 * slots[start[i]] .. slots[start[i] + len[i] - 1] of the caches ([num_slots, KVH, D]).
 * Query head h reads KV head h / (H / KVH).
 *
 * A query vector is one (token, query head). The vectors that read the same KV head
 * over the same list (the H / KVH heads of a token; with AVX-512, also the consecutive
 * tokens listed with the same start: a draft chain's rows, or a tree path's nodes, with
 * lengths c + 1, c + 2, ...) are attended together: up to 4 in registers (D = 64; 2 for
 * D = 128), each key and value read once for all of them; past that, up to 16 in a work
 * item (attend_blocked512), the keys in blocks that every group of 4 reads from L1. A
 * chain of 16 drafts (17 rows) read each KV head's keys 51 times a layer, one vector at
 * a time; then 13; now 4 (fewer items would leave a core idle at batch 1). A vector's
 * arithmetic is the same whoever shares its work item (keys past its own length get
 * weight 0), in list order, so a token's result never depends on the other tokens of
 * the step. */
#ifdef __AVX512F__
#define MAXV 4 /* query vectors attended in registers together (D = 64; 2 for D = 128) */
#define MAXR 16 /* query vectors per work item, attended in groups of MAXV, keys in blocks */
#define KB 64 /* keys per block (16 KB of keys at D = 64): in L1 for every group of a work item */
#define PF 8 /* keys ahead to prefetch */

/* One query vector's scores sr [Lmax] -> exp(score - mx) over its own L keys, 0 past
 * them; returns their sum (the softmax's denominator, applied once at the end). */
static inline float softmax_row(float *sr, int64_t L, int64_t Lmax, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 t = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
        _mm512_storeu_ps(sr + j, e);
        t = _mm512_add_ps(t, e);
    }
    if (j < L) {
        const __mmask16 tail = (__mmask16)((1u << (L - j)) - 1);
        __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + j), m)));
        _mm512_mask_storeu_ps(sr + j, tail, e);
        t = _mm512_add_ps(t, e);
    }
    for (j = L; j < Lmax; j++) sr[j] = 0.0f; /* keys past its own length: weight 0 */
    return _mm512_reduce_add_ps(t);
}

/* RH query vectors q[r] (D floats each) of one KV head g; vector r sees the first L[r]
 * keys at slots sl, Lmax the longest: out o[r]. D = 16 * DV; RH and DV are constants in
 * each instantiation, so the queries and the output accumulators live in registers.
 * scores: RH rows of stride ss floats. Softmax in two passes (scores and their max,
 * then exp and the weighted sum of values), the sum normalised once at the end. */
static inline __attribute__((always_inline)) void attend512(const float *const *q, const int64_t *L, int64_t Lmax,
                                                             const float *k_cache, const float *v_cache,
                                                             const int64_t *sl, int64_t KVH, int64_t g, float scale,
                                                             float *scores, int64_t ss, float *const *o, const int DV,
                                                             const int RH) {
    __m512 qv[MAXV][8], acc[MAXV][8];
    float mx[MAXV], total[MAXV];
    for (int r = 0; r < RH; r++) {
        mx[r] = -INFINITY;
        for (int d = 0; d < DV; d++) qv[r][d] = _mm512_mul_ps(_mm512_loadu_ps(q[r] + 16 * d), _mm512_set1_ps(scale));
    }
    for (int64_t j = 0; j < Lmax; j++) {
        const float *kj = k_cache + (sl[j] * KVH + g) * 16 * DV;
        if (j + PF < Lmax) {
            const char *next = (const char *)(k_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < DV; d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 kv[8];
        for (int d = 0; d < DV; d++) kv[d] = _mm512_loadu_ps(kj + 16 * d);
        for (int r = 0; r < RH; r++) {
            __m512 s = _mm512_mul_ps(qv[r][0], kv[0]);
            for (int d = 1; d < DV; d++) s = _mm512_fmadd_ps(qv[r][d], kv[d], s);
            const float x = _mm512_reduce_add_ps(s);
            scores[r * ss + j] = x;
            mx[r] = j < L[r] && x > mx[r] ? x : mx[r];
        }
    }
    for (int r = 0; r < RH; r++) {
        total[r] = softmax_row(scores + r * ss, L[r], Lmax, mx[r]);
        for (int d = 0; d < DV; d++) acc[r][d] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < Lmax; j++) {
        const float *vj = v_cache + (sl[j] * KVH + g) * 16 * DV;
        if (j + PF < Lmax) {
            const char *next = (const char *)(v_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < DV; d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 vv[8];
        for (int d = 0; d < DV; d++) vv[d] = _mm512_loadu_ps(vj + 16 * d);
        for (int r = 0; r < RH; r++) {
            const __m512 w = _mm512_set1_ps(scores[r * ss + j]);
            for (int d = 0; d < DV; d++) acc[r][d] = _mm512_fmadd_ps(w, vv[d], acc[r][d]);
        }
    }
    for (int r = 0; r < RH; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[r]);
        for (int d = 0; d < DV; d++) _mm512_storeu_ps(o[r] + 16 * d, _mm512_mul_ps(acc[r][d], inv));
    }
}

/* Scores of RH query vectors (a group of a work item) against keys j0 .. j1 - 1: the same
 * arithmetic per vector as attend512's first pass; mx[r] the running max over its own keys. */
static inline __attribute__((always_inline)) void score_group(const float *const *q, const int64_t *L, int64_t j0,
                                                               int64_t j1, int64_t Lmax, const float *k_cache,
                                                               const int64_t *sl, int64_t KVH, int64_t g, float scale,
                                                               float *scores, int64_t ss, float *mx, int prefetch,
                                                               const int DV, const int RH) {
    __m512 qv[MAXV][8];
    for (int r = 0; r < RH; r++)
        for (int d = 0; d < DV; d++) qv[r][d] = _mm512_mul_ps(_mm512_loadu_ps(q[r] + 16 * d), _mm512_set1_ps(scale));
    for (int64_t j = j0; j < j1; j++) {
        const float *kj = k_cache + (sl[j] * KVH + g) * 16 * DV;
        if (prefetch && j + PF < Lmax) {
            const char *next = (const char *)(k_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < DV; d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 kv[8];
        for (int d = 0; d < DV; d++) kv[d] = _mm512_loadu_ps(kj + 16 * d);
        for (int r = 0; r < RH; r++) {
            __m512 s = _mm512_mul_ps(qv[r][0], kv[0]);
            for (int d = 1; d < DV; d++) s = _mm512_fmadd_ps(qv[r][d], kv[d], s);
            const float x = _mm512_reduce_add_ps(s);
            scores[r * ss + j] = x;
            mx[r] = j < L[r] && x > mx[r] ? x : mx[r];
        }
    }
}

/* The weighted values of keys j0 .. j1 - 1 added to the accumulators acc (RH rows of D
 * floats, zero before the first block): attend512's second pass, block by block. */
static inline __attribute__((always_inline)) void value_group(int64_t j0, int64_t j1, int64_t Lmax,
                                                               const float *v_cache, const int64_t *sl, int64_t KVH,
                                                               int64_t g, const float *scores, int64_t ss, float *acc,
                                                               int prefetch, const int DV, const int RH) {
    __m512 a[MAXV][8];
    for (int r = 0; r < RH; r++)
        for (int d = 0; d < DV; d++) a[r][d] = j0 ? _mm512_loadu_ps(acc + r * 16 * DV + 16 * d) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const float *vj = v_cache + (sl[j] * KVH + g) * 16 * DV;
        if (prefetch && j + PF < Lmax) {
            const char *next = (const char *)(v_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < DV; d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 vv[8];
        for (int d = 0; d < DV; d++) vv[d] = _mm512_loadu_ps(vj + 16 * d);
        for (int r = 0; r < RH; r++) {
            const __m512 w = _mm512_set1_ps(scores[r * ss + j]);
            for (int d = 0; d < DV; d++) a[r][d] = _mm512_fmadd_ps(w, vv[d], a[r][d]);
        }
    }
    for (int r = 0; r < RH; r++)
        for (int d = 0; d < DV; d++) _mm512_storeu_ps(acc + r * 16 * DV + 16 * d, a[r][d]);
}

/* One group of a blocked work item: score_group / value_group with RH = rn (<= GR). */
#define GROUP_CASES(CALL, DV)        \
    switch (rn) {                    \
    case 1: CALL(DV, 1); break;      \
    case 2: CALL(DV, 2); break;      \
    case 3: CALL(DV, 3); break;      \
    default: CALL(DV, 4); break;     \
    }

/* nv (> MAXV, at most MAXR) query vectors of KV head g over one list, the keys in blocks
 * of KB: each block of keys, then of values, is read from memory once and from L1 by
 * every group of GR vectors (4 for D = 64, 2 for D = 128). Per vector the arithmetic,
 * and its order, are attend512's: the same bits whichever vectors share the item. At 64
 * requests of 500 tokens a step's attention read each request's keys once per 4 vectors
 * from memory: a request's draft doubled its attention time. acc: MAXR * D floats. */
static void attend_blocked512(const float *const *q, const int64_t *L, int64_t Lmax, int nv, const float *k_cache,
                              const float *v_cache, const int64_t *sl, int64_t KVH, int64_t g, float scale,
                              float *scores, int64_t ss, float *acc, float *const *o, int64_t D) {
    const int GR = D == 64 ? 4 : 2, DVN = (int)(D / 16);
    float mx[MAXR], total[MAXR];
    for (int r = 0; r < nv; r++) mx[r] = -INFINITY;
    for (int64_t j0 = 0; j0 < Lmax; j0 += KB) {
        const int64_t j1 = j0 + KB < Lmax ? j0 + KB : Lmax;
        for (int r0 = 0; r0 < nv; r0 += GR) {
            const int rn = nv - r0 < GR ? nv - r0 : GR;
#define SCORE(DV, RH) score_group(q + r0, L + r0, j0, j1, Lmax, k_cache, sl, KVH, g, scale, scores + r0 * ss, ss, \
                                  mx + r0, r0 == 0, DV, RH)
            if (DVN == 4) { GROUP_CASES(SCORE, 4) } else { GROUP_CASES(SCORE, 8) }
#undef SCORE
        }
    }
    for (int r = 0; r < nv; r++) {
        total[r] = softmax_row(scores + r * ss, L[r], Lmax, mx[r]);
    }
    for (int64_t j0 = 0; j0 < Lmax; j0 += KB) {
        const int64_t j1 = j0 + KB < Lmax ? j0 + KB : Lmax;
        for (int r0 = 0; r0 < nv; r0 += GR) {
            const int rn = nv - r0 < GR ? nv - r0 : GR;
#define VALUE(DV, RH) value_group(j0, j1, Lmax, v_cache, sl, KVH, g, scores + r0 * ss, ss, acc + r0 * D, r0 == 0, DV, RH)
            if (DVN == 4) { GROUP_CASES(VALUE, 4) } else { GROUP_CASES(VALUE, 8) }
#undef VALUE
        }
    }
    for (int r = 0; r < nv; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o[r] + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv));
    }
}

/* attend512 for nv vectors (at most 4 for D = 64, 2 for D = 128). */
static void attend512_vectors(const float *const *q, const int64_t *L, int64_t Lmax, int nv, const float *k_cache,
                              const float *v_cache, const int64_t *sl, int64_t KVH, int64_t g, float scale,
                              float *scores, int64_t ss, float *const *o, int64_t D) {
    if (D == 64) {
        switch (nv) {
        case 1: attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 4, 1); return;
        case 2: attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 4, 2); return;
        case 3: attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 4, 3); return;
        default: attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 4, 4); return;
        }
    }
    if (nv == 1) attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 8, 1);
    else attend512(q, L, Lmax, k_cache, v_cache, sl, KVH, g, scale, scores, ss, o, 8, 2);
}
#endif

/* One work item: the KV head g of the vectors v0 .. v0 + nv - 1 of the tokens from
 * ``first`` on (vector v: token first + v / rep, query head g * rep + v % rep). */
typedef struct {
    int64_t first, g, v0, nv;
} AttnItem;

/* The work items: tokens that share a list (same start) grouped when ``grouped``, their
 * vectors cut into items of at most ``per_item``; returns how many (at most n * H). */
static int64_t attention_items(const int64_t *start, int64_t n, int64_t KVH, int64_t rep, int grouped,
                               int64_t per_item, AttnItem *items) {
    int64_t count = 0;
    for (int64_t i = 0, e; i < n; i = e) {
        for (e = i + 1; grouped && e < n && start[e] == start[i];) e++;
        const int64_t nvec = (e - i) * rep;
        for (int64_t g = 0; g < KVH; g++)
            for (int64_t v0 = 0; v0 < nvec; v0 += per_item)
                items[count++] = (AttnItem){i, g, v0, nvec - v0 < per_item ? nvec - v0 : per_item};
    }
    return count;
}

void paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         const int64_t *rows, const int64_t *start, const int64_t *len, const int64_t *slots,
                         float *out, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale, int num_threads) {
    const int64_t rep = H / KVH;
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = len[i] > max_len ? len[i] : max_len;
    int grouped = 0;
    int64_t per_item = rep; /* the portable path: one token's query heads of a KV head */
#ifdef __AVX512F__
    const int in_regs = D == 64 ? MAXV : 2; /* vectors attend512 holds in registers */
    if (D == 64 || D == 128) {
        grouped = 1;
        /* Blocked items of up to MAXR vectors read the keys once for all of them, but are
         * fewer: keep at least four items a thread (a request's 17-row chain, 51 vectors a
         * KV head, gives 12 items of 16 at batch 1; one row, 3 vectors, one item as before). */
        const int64_t vectors = n * rep * KVH;
        per_item = MAXR;
        while (per_item > in_regs && vectors / per_item < 4 * num_threads) per_item /= 2;
        per_item = per_item < in_regs ? in_regs : per_item;
    }
#endif
    AttnItem *items = malloc(sizeof(AttnItem) * n * H);
    const int64_t count = attention_items(start, n, KVH, rep, grouped, per_item, items);
    const int64_t rows_per_item = per_item > rep ? per_item : rep, ss = max_len + 16;
    #pragma omp parallel num_threads(count > 1 ? num_threads : 1)
    {
        float *scores = malloc(sizeof(float) * (rows_per_item * ss + rows_per_item * D));
        float *acc = scores + rows_per_item * ss;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < count; it++) {
            const AttnItem w = items[it];
            const int64_t g = w.g;
            const int64_t *sl = slots + start[w.first];
#ifdef __AVX512F__
            if (grouped) {
                const float *qp[MAXR];
                float *op[MAXR];
                int64_t L[MAXR], Lmax = 0;
                for (int64_t v = 0; v < w.nv; v++) {
                    const int64_t i = w.first + (w.v0 + v) / rep, h = g * rep + (w.v0 + v) % rep;
                    qp[v] = q + rows[i] * q_stride + h * D;
                    op[v] = out + (rows[i] * H + h) * D;
                    L[v] = len[i];
                    Lmax = L[v] > Lmax ? L[v] : Lmax;
                }
                if (w.nv > in_regs)
                    attend_blocked512(qp, L, Lmax, (int)w.nv, k_cache, v_cache, sl, KVH, g, scale, scores, ss, acc,
                                      op, D);
                else
                    attend512_vectors(qp, L, Lmax, (int)w.nv, k_cache, v_cache, sl, KVH, g, scale, scores, ss, op,
                                      D);
                continue;
            }
#endif
            const int64_t i = w.first, L = len[i];
            const float *qi = q + rows[i] * q_stride + g * rep * D;
            for (int64_t j = 0; j < L; j++) {
                const float *kj = k_cache + (sl[j] * KVH + g) * D;
                for (int64_t r = 0; r < rep; r++) scores[r * ss + j] = dot(qi + r * D, kj, D) * scale;
            }
            for (int64_t r = 0; r < rep; r++) {
                float *s = scores + r * ss;
                float m = -INFINITY, total = 0.0f;
                for (int64_t j = 0; j < L; j++) m = s[j] > m ? s[j] : m;
                int64_t j = 0;
                __m256 vm = _mm256_set1_ps(m), vt = _mm256_setzero_ps();
                for (; j + 8 <= L; j += 8) {
                    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
                    _mm256_storeu_ps(s + j, e);
                    vt = _mm256_add_ps(vt, e);
                }
                total = hsum(vt);
                for (; j < L; j++) {
                    s[j] = exp1(s[j] - m);
                    total += s[j];
                }
                for (j = 0; j < L; j++) s[j] /= total;
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
            }
            for (int64_t j = 0; j < L; j++) {
                const float *vj = v_cache + (sl[j] * KVH + g) * D;
                for (int64_t r = 0; r < rep; r++) {
                    const float wgt = scores[r * ss + j];
                    float *a = acc + r * D;
                    int64_t d = 0;
                    __m256 vw = _mm256_set1_ps(wgt);
                    for (; d + 8 <= D; d += 8)
                        _mm256_storeu_ps(a + d, _mm256_fmadd_ps(vw, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(a + d)));
                    for (; d < D; d++) a[d] += wgt * vj[d];
                }
            }
            float *o = out + (rows[i] * H + g * rep) * D;
            for (int64_t d = 0; d < rep * D; d++) o[d] = acc[d];
        }
        free(scores);
    }
    free(items);
}

/* out [T, I] = silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I]: the gated MLP's activation. */
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(T >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* y [T, nh, D] = x rotated by rope ("rotate half": the first and second halves of each
 * head are the pair), x row t at x + t * x_stride, cos and sin [T, D] per token. */
void rope_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, float *y,
              int64_t T, int64_t nh, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < nh; h++) {
            const float *a = x + t * x_stride + h * D;
            float *b = y + (t * nh + h) * D;
            for (int64_t i = 0; i < half; i++) {
                b[i] = a[i] * c[i] - a[i + half] * s[i];
                b[i + half] = a[i + half] * c[i + half] + a[i] * s[i + half];
            }
        }
    }
}

/* One Llama decoder layer (pre-norm attention, gated SiLU MLP, no output biases) for the T
 * tokens of a decode or verification step, every one of them attended through its
 * own list of KV slots; in place on x [T, Hd]. It makes the kernel calls of the
 * model's layer-by-layer forward (engine/models/llama.py) in the same order, so its
 * results are the same bits, without the Python and torch dispatch between them.
 * Weights [out, in], each in gemv_f32's layout: w_qkv [(H + 2 KVH) D, In], w_o [Hd, H D],
 * w_gu [2 I, Hd] (gate rows, then up rows), w_down [Hd, I]; cos, sin [T, D]; the new keys
 * (rotated) and values are written at slot_mapping[t] of k_cache, v_cache [num_slots, KVH, D].
 * attn_in: NULL for a decoder layer (the attention reads rms_norm(x) * ln1, In = Hd), or
 * the attention's input [T, In] given whole (an EAGLE head: its normed embeddings and
 * features side by side, In = 2 Hd, while x, the residual, is the features; ln1 unused).
 * b_qkv [(H + 2 KVH) D] (Qwen2's biases) is added to the qkv product, and q_norm, k_norm [D]
 * (Qwen3's) rms-normalize each query and key head before rope; NULL where the model has none.
 * scratch: at least T * (2 Hd + (2 H + 3 KVH) D + H D + 3 I) floats. */
void decoder_layer_f32(float *x, const float *attn_in, int64_t In, int64_t T, int64_t Hd, int64_t H, int64_t KVH,
                       int64_t D, int64_t I, float eps, float scale, const float *ln1, const float *w_qkv,
                       const float *w_o, const float *ln2, const float *w_gu, const float *w_down,
                       const float *b_qkv, const float *q_norm, const float *k_norm, float *k_cache,
                       float *v_cache, const float *cos, const float *sin, const int64_t *slot_mapping,
                       const int64_t *rows, const int64_t *start, const int64_t *len, const int64_t *slots,
                       float *scratch, int num_threads) {
    const int64_t QKV = (H + 2 * KVH) * D, QK = (H + KVH) * D;
    float *h = scratch;          /* [T, Hd]: a normed input */
    float *qkv = h + T * Hd;     /* [T, QKV] */
    float *qk = qkv + T * QKV;   /* [T, H + KVH, D]: rotated queries and keys */
    float *att = qk + T * QK;    /* [T, H D] */
    float *o = att + T * H * D;  /* [T, Hd]: a projection's output */
    float *gu = o + T * Hd;      /* [T, 2 I] */
    float *a = gu + T * 2 * I;   /* [T, I] */
    if (attn_in == NULL) {
        rms_norm_f32(x, ln1, h, T, Hd, eps, num_threads);
        attn_in = h, In = Hd;
    }
    gemv_f32(attn_in, w_qkv, qkv, T, QKV, In, num_threads);
    for (int64_t t = 0; b_qkv != NULL && t < T; t++)
        for (int64_t i = 0; i < QKV; i++) qkv[t * QKV + i] += b_qkv[i];
    for (int64_t t = 0; q_norm != NULL && t < T; t++) { /* in place: each row is read before it is written */
        rms_norm_f32(qkv + t * QKV, q_norm, qkv + t * QKV, H, D, eps, 1);
        rms_norm_f32(qkv + t * QKV + H * D, k_norm, qkv + t * QKV + H * D, KVH, D, eps, 1);
    }
    rope_f32(qkv, QKV, cos, sin, qk, T, H + KVH, D);
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slot_mapping[t] * KVH * D, qk + t * QK + H * D, sizeof(float) * KVH * D);
        memcpy(v_cache + slot_mapping[t] * KVH * D, qkv + t * QKV + QK, sizeof(float) * KVH * D);
    }
    paged_attention_f32(qk, QK, k_cache, v_cache, rows, start, len, slots, att, T, H, KVH, D, scale, num_threads);
    gemv_f32(att, w_o, o, T, Hd, H * D, num_threads);
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
    rms_norm_f32(x, ln2, h, T, Hd, eps, num_threads);
    gemv_f32(h, w_gu, gu, T, 2 * I, Hd, num_threads);
    silu_mul_f32(gu, a, T, I, num_threads);
    gemv_f32(a, w_down, o, T, Hd, I, num_threads);
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
}

#ifdef __AVX512F__
#define PQ 16 /* query rows per work item of prefill_attention_f32 */
#define PK 64 /* keys per block */

/* A tile of prefill attention: rows [0, nq) of one query head (queries qt [nq, D], already
 * scaled, query row i at position pos0 + i and seeing keys 0 .. pos0 + i) over the keys,
 * transposed by blocks of PK (kT[(j / PK) * D * PK + d * PK + j % PK]: dimension d of key j,
 * so that a block's keys are one stream of 16 KB, not D rows far apart), and the values (value j at
 * v + j * v_stride), flash-attention style: key blocks of PK,
 * the running max and sum per row, the output rows (o [PQ, D]) rescaled as the max grows.
 * D = 16 DV; RB query rows at a time (registers: RB x 4 score vectors, RB x DV outputs). */
static inline __attribute__((always_inline)) void prefill_tile(const float *qt, int64_t nq, int64_t pos0,
                                                                const float *kT, const float *v,
                                                                int64_t v_stride, float *o, const int DV, const int RB) {
    const int64_t D = 16 * DV;
    float s[PQ * PK], mx[PQ], sum[PQ];
    for (int64_t i = 0; i < nq; i++) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
        for (int64_t d = 0; d < D; d++) o[i * D + d] = 0.0f;
    }
    const int64_t keys = pos0 + nq; /* the last row sees keys 0 .. keys - 1 */
    for (int64_t j0 = 0; j0 < keys; j0 += PK) {
        const int64_t nk = keys - j0 < PK ? keys - j0 : PK;
        const float *kt = kT + j0 * D; /* kt[d * PK + j]: key j0 + j, zeros past the last key */
        for (int64_t i0 = 0; i0 < nq; i0 += RB) { /* s = q . k for RB rows: RB x 4 accumulators */
            __m512 acc[4][4];
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                __m512 kv4[4];
                for (int c = 0; c < 4; c++) kv4[c] = _mm512_loadu_ps(kt + d * PK + 16 * c);
                for (int r = 0; r < RB; r++) {
                    const __m512 qv = _mm512_set1_ps(i0 + r < nq ? qt[(i0 + r) * D + d] : 0.0f);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(qv, kv4[c], acc[r][c]);
                }
            }
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (i0 + r) * PK + 16 * c, acc[r][c]);
        }
        for (int64_t i = 0; i < nq; i++) { /* mask, online softmax, rescale the output row */
            float *si = s + i * PK;
            const int64_t visible = pos0 + i + 1 - j0; /* keys of this block row i sees */
            const int64_t n = visible < nk ? visible : nk;
            if (n <= 0) {
                for (int64_t j = 0; j < PK; j++) si[j] = 0.0f;
                continue;
            }
            __m512 mv16 = _mm512_set1_ps(mx[i]);
            for (int64_t j = 0; j < n; j += 16) {
                const __mmask16 keep = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                mv16 = _mm512_mask_max_ps(mv16, keep, mv16, _mm512_loadu_ps(si + j));
            }
            const float m = _mm512_reduce_max_ps(mv16);
            const float factor = exp1(mx[i] - m); /* 0 on the first block (mx = -inf) */
            __m512 t = _mm512_setzero_ps();
            const __m512 mv = _mm512_set1_ps(m);
            for (int64_t j = 0; j < PK; j += 16) {
                const __mmask16 keep = j >= n ? 0 : (n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1));
                __m512 e = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv)));
                _mm512_storeu_ps(si + j, e);
                t = _mm512_add_ps(t, e);
            }
            sum[i] = sum[i] * factor + _mm512_reduce_add_ps(t);
            mx[i] = m;
            if (factor != 1.0f) {
                const __m512 f = _mm512_set1_ps(factor);
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), f));
            }
        }
        for (int64_t i0 = 0; i0 < nq; i0 += RB) { /* o += p . v for RB rows */
            const int R = nq - i0 < RB ? (int)(nq - i0) : RB;
            __m512 acc[4][8];
            for (int r = 0; r < RB; r++)
                for (int d = 0; d < DV; d++) acc[r][d] = r < R ? _mm512_loadu_ps(o + (i0 + r) * D + 16 * d) : _mm512_setzero_ps();
            for (int64_t j = 0; j < nk; j++) {
                __m512 vv[8];
                const float *vj = v + (j0 + j) * v_stride;
                for (int d = 0; d < DV; d++) vv[d] = _mm512_loadu_ps(vj + 16 * d);
                for (int r = 0; r < RB; r++) {
                    const __m512 p = _mm512_set1_ps(r < R ? s[(i0 + r) * PK + j] : 0.0f);
                    for (int d = 0; d < DV; d++) acc[r][d] = _mm512_fmadd_ps(p, vv[d], acc[r][d]);
                }
            }
            for (int r = 0; r < R; r++)
                for (int d = 0; d < DV; d++) _mm512_storeu_ps(o + (i0 + r) * D + 16 * d, acc[r][d]);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[i]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), inv));
    }
}
#endif

/* Causal attention of a chunk of m new tokens after `offset` tokens of context:
 * query i (row i of q, row stride q_stride floats, H heads of D) sees keys
 * 0 .. offset + i of k and v (key j of KV head g at k + j * k_stride + g * D, its value
 * at v + j * v_stride + g * D); query
 * head h reads KV head h / (H / KVH). out [m, H, D] contiguous. Returns 0 (and does
 * nothing) where there is no kernel for this head size (AVX-512 with D = 64 or 128). */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, float *out, int64_t m, int64_t offset, int64_t H, int64_t KVH, int64_t D, float scale,
                          int num_threads) {
#ifdef __AVX512F__
    if (D != 64 && D != 128) return 0;
    const int64_t blocks = (m + PQ - 1) / PQ, rep = H / KVH, S = offset + m, SP = (S + PK - 1) / PK * PK;
    float *kT = malloc(sizeof(float) * KVH * D * SP); /* the keys transposed once (prefill_tile), zero-padded */
    if (kT == NULL) return 0;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t gb = 0; gb < KVH * (SP / PK); gb++) { /* [KVH, SP / PK, D, PK]: a block's keys in 16 KB */
        const int64_t g = gb / (SP / PK), j0 = gb % (SP / PK) * PK;
        float *blk = kT + gb * D * PK;
        for (int64_t j = 0; j < PK; j++)
            for (int64_t d = 0; d < D; d++) blk[d * PK + j] = j0 + j < S ? k[(j0 + j) * k_stride + g * D + d] : 0.0f;
    }
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < blocks * H; item++) {
        const int64_t b = blocks - 1 - item / H, h = item % H; /* the longest rows first */
        const int64_t i0 = b * PQ, nq = m - i0 < PQ ? m - i0 : PQ;
        float qt[PQ * 128], o[PQ * 128];
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < D; d++) qt[i * D + d] = q[(i0 + i) * q_stride + h * D + d] * scale;
        const float *kh = kT + (h / rep) * D * SP, *vh = v + (h / rep) * D;
        if (D == 64) prefill_tile(qt, nq, offset + i0, kh, vh, v_stride, o, 4, 4);
        else prefill_tile(qt, nq, offset + i0, kh, vh, v_stride, o, 8, 2);
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < D; d++) out[((i0 + i) * H + h) * D + d] = o[i * D + d];
    }
    free(kT);
    return 1;
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)m; (void)offset; (void)H;
    (void)KVH; (void)D; (void)scale; (void)num_threads;
    return 0;
#endif
}
