/* The attention kernels of the CPU kernels, float32, x86-64 with AVX2 and FMA (AVX-512
 * paths where the CPU has it, -mavx512f). */
#include "common.h"

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
