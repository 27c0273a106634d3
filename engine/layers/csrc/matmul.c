/* The matmul of the CPU kernels, float32, x86-64 with AVX2 and FMA (AVX-512 where the CPU
 * has it, -mavx512f): y [M, N] = x [M, K] @ w [N, K]^T for any M, from decode steps of one
 * row to prefill chunks of hundreds.
 *
 * The weights are read in panels of PANEL = VW * PV output features (weight_panel;
 * engine/layers/cpu_kernels.py lays them out once at start-up): w [N, K] as
 * [ceil(N / PANEL)][K][PANEL], zero padded, so that a panel is one contiguous stream and
 * its PANEL weights for one k lie side by side. Each step over k broadcasts x[r][k] for RB
 * input rows and multiplies it into the PV vectors of the panel: RB x PV accumulators that
 * hold y's own entries, with no horizontal sum at the end.
 *
 * Every y[r][c] is one chain of FMAs over k = 0, 1, ..., K - 1 from zero: the same bits
 * whatever M is, wherever the row sits in x, however the rows are grouped or the work is
 * cut between threads, and in the AVX2 and AVX-512 builds alike. A token's result never
 * depends on the other tokens of its step.
 *
 * Speed: at a few rows the weights are one stream per thread, read from memory once for all
 * rows of a group, so a verification step's draft rows cost almost what one row does; at
 * many rows the panel stays in L2 for every group of RB rows, RB x PV FMAs for PV + RB loads. */
#include "common.h"

#ifdef __AVX512F__
#define VW 16
#define PV 6 /* vectors per panel: 4 x 6 accumulators, 4 inputs and a weight in 32 registers */
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vbroadcast _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define PREFETCH_AHEAD 1024 /* floats ahead in a panel's stream, into L2 */
#define PREFETCH_HINT _MM_HINT_T1
#else
#define VW 8
#define PV 3 /* 4 x 3 accumulators and 3 weights in 16 registers (the inputs broadcast from memory) */
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vbroadcast _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define PREFETCH_AHEAD 512
#define PREFETCH_HINT _MM_HINT_T0
#endif
#define PANEL (VW * PV)
#define RB 4 /* input rows per group */
#define ROW_BLOCK 64 /* input rows per work item: items of one panel share it from L2 */

/* The first `cols` of a vector's lanes stored at y (0 < cols < VW). */
static inline void store_part(float *y, vec v, int64_t cols) {
#ifdef __AVX512F__
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), v);
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane), v);
#endif
}

/* y[r][c] for R (<= RB) input rows x (row stride K) and the panel p's first `cols` features
 * (y row stride N). The first group of rows of a work item (first) prefetches the panel
 * ahead; the later groups find it in L2. */
static inline __attribute__((always_inline)) void panel_rows(const float *p, const float *x, int64_t K, int R,
                                                              int first, float *y, int64_t N, int64_t cols) {
    vec a[RB][PV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PV; c++) a[r][c] = vzero();
    for (int64_t k = 0; k < K; k++, p += PANEL) {
        if (first && (k & 1) == 0)
            for (int c = 0; c < PV; c++) _mm_prefetch((const char *)(p + PREFETCH_AHEAD + VW * c), PREFETCH_HINT);
        vec wv[PV];
        for (int c = 0; c < PV; c++) wv[c] = vload(p + VW * c);
        for (int r = 0; r < R; r++) {
            const vec xb = vbroadcast(x[r * K + k]);
            for (int c = 0; c < PV; c++) a[r][c] = vfma(xb, wv[c], a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PV; c++) {
            const int64_t left = cols - VW * c;
            if (left >= VW)
                vstore(y + r * N + VW * c, a[r][c]);
            else if (left > 0)
                store_part(y + r * N + VW * c, a[r][c], left);
        }
}

/* The weight layout matmul_f32 reads: panels of this many output features. */
int weight_panel(void) { return PANEL; }

/* y [M, N] = x [M, K] @ w^T, w in panels (weight_panel). Work items: a panel and a block of
 * up to ROW_BLOCK rows, those of one panel side by side (a thread's run of items reads its
 * panels once from memory). */
#define PANEL_ROWS(R) panel_rows(p, x + m * K, K, R, m == m0, y + m * N + n, N, cols)
void matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(panels * blocks > 1 ? num_threads : 1)
    for (int64_t item = 0; item < panels * blocks; item++) {
        const int64_t i = item / blocks, m0 = item % blocks * ROW_BLOCK;
        const int64_t m1 = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
        const float *p = w + i * K * PANEL;
        const int64_t n = i * PANEL, cols = N - n < PANEL ? N - n : PANEL;
        int64_t m = m0;
        for (; m + RB <= m1; m += RB) PANEL_ROWS(RB);
        if (m1 - m == 3) PANEL_ROWS(3);
        if (m1 - m == 2) PANEL_ROWS(2);
        if (m1 - m == 1) PANEL_ROWS(1);
    }
}
