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
 * whatever M is, wherever the row sits in x, however the rows are grouped, K is cut into
 * chunks or the work is cut between threads, and in the AVX2 and AVX-512 builds alike. A
 * token's result never depends on the other tokens of its step.
 *
 * Speed: at a few rows the weights are one stream per thread, read from memory once for all
 * rows of a group, so a verification step's draft rows cost almost what one row does. With
 * more groups K goes in chunks that every group takes in turn from L1 while the
 * groups together prefetch what follows, so the weights' read overlaps the arithmetic (the
 * first group read them alone, at memory speed, before the others computed); RB x PV FMAs
 * for PV + RB loads. */
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
#define K_CHUNK 64 /* k per chunk: 24 KiB of a panel, in L1 beside a group's inputs and sums */
#else
#define VW 8
#define PV 3 /* 4 x 3 accumulators and 3 weights in 16 registers (the inputs broadcast from memory) */
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vbroadcast _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define K_CHUNK 128 /* k per chunk: 12 KiB of a panel, in L1 beside a group's inputs and sums */
#endif
#define PANEL (VW * PV)
#define PREFETCH_AHEAD 1536 /* floats ahead in a single group's stream (6 KiB), into L2 at every k step */
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

/* y[r][c] over k in [k0, k1) for R (<= RB) input rows x (row stride K) and the panel p's
 * first `cols` features: the chains start at zero where k0 = 0, else from the partial sums
 * in acc [RB][PANEL]; they end in y (row stride N) where k1 = K, else back in acc (a float
 * stored and loaded is the same float: the chain, and its bits, are those of one pass).
 * Prefetch: with `ahead`, the panel that many floats ahead; else the floats [pf, pf_end)
 * into L2, spread evenly over the k steps. */
static inline __attribute__((always_inline)) void panel_rows(const float *p, const float *x, int64_t K, int R,
                                                              int64_t k0, int64_t k1, float *acc, int64_t ahead,
                                                              const float *pf, const float *pf_end,
                                                              float *y, int64_t N, int64_t cols) {
    vec a[RB][PV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PV; c++) a[r][c] = k0 ? vload(acc + r * PANEL + VW * c) : vzero();
    p += k0 * PANEL;
    const int64_t pf_step = (pf_end - pf) / (k1 - k0) + 1; /* floats of the range per k step, rounded up */
    for (int64_t k = k0; k < k1; k++, p += PANEL) {
        if (ahead) {
            for (int c = 0; c < (PANEL + 15) / 16; c++) /* a prefetch per cache line of the step */
                _mm_prefetch((const char *)(p + ahead + 16 * c), _MM_HINT_T1);
        } else if (pf < pf_end) {
            for (const float *q = pf + pf_step; pf < q; pf += 16) _mm_prefetch((const char *)pf, _MM_HINT_T1);
        }
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
            if (k1 < K)
                vstore(acc + r * PANEL + VW * c, a[r][c]);
            else if (left >= VW)
                vstore(y + r * N + VW * c, a[r][c]);
            else if (left > 0)
                store_part(y + r * N + VW * c, a[r][c], left);
        }
}

/* The weight layout matmul_f32 reads: panels of this many output features. */
int weight_panel(void) { return PANEL; }

/* One work item: rows [m0, m1) of y (at most ROW_BLOCK) for the panel p (features n ..
 * n + cols). A single group of rows streams the panel once over the whole K. More groups go
 * over K in chunks of K_CHUNK, every group through a chunk while it sits in L1, each
 * prefetching its share of what follows the chunk in memory (the next chunk, or the next
 * panel's first): the weights' read from memory overlaps the groups' arithmetic instead of
 * preceding it. */
#define PANEL_ROWS(R)                                                                                  \
    panel_rows(p, x + m * K, K, R, k0, k1, acc + (m - m0) * PANEL, whole && m == m0 ? PREFETCH_AHEAD : 0, \
               whole ? NULL : next + (m - m0) / RB * share, whole ? NULL : next + ((m - m0) / RB + 1) * share, \
               y + m * N + n, N, cols)
static void panel_item(const float *p, const float *x, float *y, int64_t m0, int64_t m1, int64_t n, int64_t cols,
                       int64_t N, int64_t K) {
    float acc[ROW_BLOCK * PANEL] __attribute__((aligned(64)));
    const int whole = m1 - m0 <= RB || K <= K_CHUNK; /* one pass over K: the first group prefetches */
    const int64_t chunk = whole ? K : K_CHUNK, groups = (m1 - m0 + RB - 1) / RB;
    const int64_t share = (chunk * PANEL + groups - 1) / groups; /* floats each group prefetches */
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t k1 = K - k0 < chunk ? K : k0 + chunk;
        const float *next = p + k1 * PANEL; /* what follows the chunk in memory */
        int64_t m = m0;
        for (; m + RB <= m1; m += RB) PANEL_ROWS(RB);
        if (m1 - m == 3) PANEL_ROWS(3);
        if (m1 - m == 2) PANEL_ROWS(2);
        if (m1 - m == 1) PANEL_ROWS(1);
    }
}

/* y [M, N] = x [M, K] @ w^T, w in panels (weight_panel). Work items: a panel and a block of
 * up to ROW_BLOCK rows, those of one panel side by side (a thread's run of items reads its
 * panels once from memory). */
void matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(panels * blocks > 1 ? num_threads : 1)
    for (int64_t item = 0; item < panels * blocks; item++) {
        const int64_t i = item / blocks, m0 = item % blocks * ROW_BLOCK;
        const int64_t n = i * PANEL, cols = N - n < PANEL ? N - n : PANEL;
        panel_item(w + i * K * PANEL, x, y, m0, M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK, n, cols, N, K);
    }
}

/* y[g] [M[g], N] = x[g] [M[g], K] @ w[g]^T for G products of the same N and K (the experts of
 * a mixture), the work items of all of them in one parallel loop: those of G matmul_f32
 * calls, so the same bits, with one fork and join for all of them. */
void grouped_matmul_f32(int64_t G, const float *const *x, const float *const *w, float *const *y, const int64_t *M,
                        int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int64_t *first = malloc(sizeof(int64_t) * (G + 1)); /* product g's items: first[g] .. first[g + 1] - 1 */
    first[0] = 0;
    for (int64_t g = 0; g < G; g++) first[g + 1] = first[g] + panels * ((M[g] + ROW_BLOCK - 1) / ROW_BLOCK);
    #pragma omp parallel for schedule(static) num_threads(first[G] > 1 ? num_threads : 1)
    for (int64_t item = 0; item < first[G]; item++) {
        int64_t g = 0;
        while (first[g + 1] <= item) g++;
        const int64_t blocks = (M[g] + ROW_BLOCK - 1) / ROW_BLOCK, local = item - first[g];
        const int64_t i = local / blocks, m0 = local % blocks * ROW_BLOCK;
        const int64_t n = i * PANEL, cols = N - n < PANEL ? N - n : PANEL;
        panel_item(w[g] + i * K * PANEL, x[g], y[g], m0, M[g] - m0 < ROW_BLOCK ? M[g] : m0 + ROW_BLOCK, n, cols, N, K);
    }
    free(first);
}
