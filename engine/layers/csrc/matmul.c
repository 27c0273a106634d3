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
 * Speed: up to FEW_ROWS rows (decode steps, draft chains) a work item is a group of up to
 * STREAMS panels read side by side, one stream each, once for all its rows: an AMD core reads
 * memory faster from several streams than from one (1.6x with 4 on a Zen 2 EPYC), so a step
 * of one row runs at close to the machine's read speed and its draft rows cost little more
 * than one row. The AVX-512 build does so on AMD CPUs; on Intel ones it reads one panel at a
 * time, prefetched PREFETCH_AHEAD ahead into L2, as fast at 1 to 4 rows on an Emerald Rapids
 * Xeon as 4 streams and faster at 8. With more rows K goes in chunks that every group of RB rows takes in
 * turn from L1 while the groups together prefetch what follows, so the weights' read
 * overlaps the arithmetic (the first group read them alone, at memory speed, before the
 * others computed); RB x PV FMAs for PV + RB loads. */
#include "common.h"
#include "specserve_kernels.h"

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
#ifdef AVX512_AMD /* cpu_kernels.compile_flags, on an AMD CPU */
#define STREAMS 4
#else
#define STREAMS 1 /* one panel at a time, prefetched: as fast at 1 to 4 rows on a Xeon, faster at 8 */
#endif
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
#define STREAMS 4 /* panels read side by side by an item of up to FEW_ROWS rows */
#endif
#define PANEL (VW * PV)
#define PREFETCH_AHEAD 1536 /* floats ahead in a single group's stream (6 KiB), into L2 at every k step */
#define RB 4 /* input rows per group */
#define ROW_BLOCK 64 /* input rows per work item: items of one panel share it from L2 */
#define FEW_ROWS 8 /* rows of a step whose items are groups of panels (with STREAMS > 1) */
#define K_STEP 8 /* k per turn of each panel where an item's panels take turns */

/* The first `cols` of a vector's lanes stored at y (0 < cols < VW). */
static inline void store_part(float *y, vec v, int64_t cols) {
#ifdef __AVX512F__
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), v);
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane), v);
#endif
}

/* y[r][c] over k in [k0, k1) for R input rows x (row stride K) and S panels side by side
 * from p (R S <= RB; panel stride K PANEL), whose first feature is y's (row stride N),
 * `cols` features in all: the chains start at zero where k0 = 0, else from the partial sums
 * in acc [S][FEW_ROWS][PANEL]; they end in y where k1 = K, else back in acc (a float stored and
 * loaded is the same float: the chain, and its bits, are those of one pass).
 * Prefetch: with `ahead`, the panel that many floats ahead; else the floats [pf, pf_end)
 * into L2, spread evenly over the k steps. */
static inline __attribute__((always_inline)) void panel_chains(const float *p, int S, const float *x, int64_t K, int R,
                                                                int64_t k0, int64_t k1, float *acc, int64_t ahead,
                                                                const float *pf, const float *pf_end,
                                                                float *y, int64_t N, int64_t cols) {
    vec a[RB][PV]; /* a[r S + s]: row r, panel s */
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S; s++)
            for (int c = 0; c < PV; c++)
                a[r * S + s][c] = k0 ? vload(acc + (s * FEW_ROWS + r) * PANEL + VW * c) : vzero();
    const int64_t pf_step = (pf_end - pf) / (k1 - k0) + 1; /* floats of the range per k step, rounded up */
    for (int64_t k = k0; k < k1; k++) {
        const float *pk = p + k * PANEL;
        if (ahead) {
            for (int c = 0; c < (PANEL + 15) / 16; c++) /* a prefetch per cache line of the step */
                _mm_prefetch((const char *)(pk + ahead + 16 * c), _MM_HINT_T1);
        } else if (pf < pf_end) {
            for (const float *q = pf + pf_step; pf < q; pf += 16) _mm_prefetch((const char *)pf, _MM_HINT_T1);
        }
        vec wv[PV];
        if (S == 1)
            for (int c = 0; c < PV; c++) wv[c] = vload(pk + VW * c);
        for (int r = 0; r < R; r++) {
            const vec xb = vbroadcast(x[r * K + k]);
            for (int s = 0; s < S; s++)
                for (int c = 0; c < PV; c++)
                    a[r * S + s][c] = vfma(xb, S == 1 ? wv[c] : vload(pk + s * K * PANEL + VW * c), a[r * S + s][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S; s++)
            for (int c = 0; c < PV; c++) {
                const int64_t left = cols - s * PANEL - VW * c;
                if (k1 < K)
                    vstore(acc + (s * FEW_ROWS + r) * PANEL + VW * c, a[r * S + s][c]);
                else if (left >= VW)
                    vstore(y + r * N + s * PANEL + VW * c, a[r * S + s][c]);
                else if (left > 0)
                    store_part(y + r * N + s * PANEL + VW * c, a[r * S + s][c], left);
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
    panel_chains(p, 1, x + m * K, K, R, k0, k1, acc + (m - m0) * PANEL, whole && m == m0 ? PREFETCH_AHEAD : 0, \
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

/* The M (<= FEW_ROWS) rows of y for the panels [i0, i1) of w (at most STREAMS), read side by
 * side, one stream each. One row takes up to STREAMS panels at once in its accumulators, 2
 * rows up to STREAMS / 2, more rows 1 (in groups of RB); where the item has more panels than
 * that, the panels (or their groups) take turns, K_STEP k at a time, the partial sums parked
 * in acc. */
static void few_rows_item(const float *w, const float *x, float *y, int64_t M, int64_t i0, int64_t i1, int64_t N,
                          int64_t K) {
    float acc[STREAMS * FEW_ROWS * PANEL] __attribute__((aligned(64)));
    const int S = M == 1 ? STREAMS : M == 2 ? STREAMS / 2 : 1, n = i1 - i0;
    const int64_t turn = n <= S ? K : K_STEP; /* k per turn: one pass where one call takes the item */
    for (int64_t k0 = 0; k0 < K; k0 += turn) {
        const int64_t k1 = K - k0 <= turn ? K : k0 + turn;
        for (int64_t i = i0; i < i1;) {
            const float *p = w + i * K * PANEL;
            float *a = acc + (i - i0) * FEW_ROWS * PANEL, *yi = y + i * PANEL;
            const int64_t cols = N - i * PANEL;
            const int s = i1 - i < S ? (int)(i1 - i) : S; /* panels of this call */
#define SIDE(S_, R) panel_chains(p, S_, x, K, R, k0, k1, a, 0, NULL, NULL, yi, N, cols)
            if (M == 1 && s >= 4) SIDE(4, 1);
            else if (M == 1 && s == 3) SIDE(3, 1);
            else if (M <= 2 && s >= 2) {
                if (M == 1) SIDE(2, 1); else SIDE(2, 2);
            } else {
                int64_t m = 0;
#define GROUP(R) panel_chains(p, 1, x + m * K, K, R, k0, k1, a + m * PANEL, 0, NULL, NULL, yi + m * N, N, cols)
                for (; m + RB <= M; m += RB) GROUP(RB);
                if (M - m == 3) GROUP(3);
                if (M - m == 2) GROUP(2);
                if (M - m == 1) GROUP(1);
#undef GROUP
            }
#undef SIDE
            i += M == 1 ? (s >= 4 ? 4 : s) : M == 2 ? (s >= 2 ? 2 : 1) : 1;
        }
    }
}

/* y [M, N] = x [M, K] @ w^T, w in panels (weight_panel). Up to FEW_ROWS rows: work items of up to
 * STREAMS panels, as many items as threads (or a multiple). More rows: work items of a panel
 * and a block of up to ROW_BLOCK rows, those of one panel side by side. Either way a thread's
 * run of items reads its panels once from memory. */
void matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    if (STREAMS > 1 && M <= FEW_ROWS) {
        int64_t groups = (panels + STREAMS - 1) / STREAMS;
        groups = (groups + num_threads - 1) / num_threads * num_threads;
        if (groups > panels) groups = panels;
        #pragma omp parallel for schedule(static) num_threads(groups > 1 ? num_threads : 1)
        for (int64_t g = 0; g < groups; g++)
            few_rows_item(w, x, y, M, g * panels / groups, (g + 1) * panels / groups, N, K);
        return;
    }
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
int grouped_matmul_f32(int64_t G, const float *const *x, const float *const *w, float *const *y, const int64_t *M,
                        int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int64_t *first = malloc(sizeof(int64_t) * (G + 1)); /* product g's items: first[g] .. first[g + 1] - 1 */
    if (!first) return KERNEL_NO_MEMORY;
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
    return 0;
}
