/* The attention kernels of the CPU kernels, float32, x86-64 with AVX2 and FMA (AVX-512
 * paths where the CPU has it, -mavx512f): a template, whose definitions each file that
 * includes it compiles once for its KV cache's element type (no include guard).
 *
 * The cache holds kv_t: float (attention_f32.c: paged_attention_f32), or, with
 * ATTENTION_KV_BF16 defined, bfloat16 (attention_bf16.c: paged_attention_kv_bf16). Keys and
 * values are loaded as float32 (kv1, kv8, kv16: exact for bfloat16) and everything after the
 * load is the same arithmetic in the same order, so both twins keep the same batch invariance. */
#include "common.h"
#include "specserve_kernels.h"

#ifdef ATTENTION_KV_BF16
typedef uint16_t kv_t;
#define PAGED_ATTENTION paged_attention_kv_bf16
#define kv1 bf16_to_f32
#define kv8 bf16x8_to_f32
#define kv16 bf16x16_to_f32
#else
typedef float kv_t;
#define PAGED_ATTENTION paged_attention_f32
static inline float kv1(float x) { return x; }
static inline __m256 kv8(const float *p) { return _mm256_loadu_ps(p); }
#ifdef __AVX512F__
static inline __m512 kv16(const float *p) { return _mm512_loadu_ps(p); }
#endif
#endif
#define KV_LINES(DV) ((DV) * (int)sizeof(kv_t) / 4) /* 64-byte lines of one key of 16 * DV */

/* Attention of listed tokens over the paged KV cache.
 *
 * Token i (of n) is row rows[i] of q (row stride q_stride floats, H heads of D) and
 * of out ([*, H, D], contiguous); it sees the keys and values at the slots
 * slots[start[i]] .. slots[start[i] + len[i] - 1] of the caches ([num_slots, KVH, D]).
 * Query head h reads KV head h / (H / KVH).
 *
 * A query vector is one (token, query head). The vectors that read the same KV head
 * over the same list (the H / KVH heads of a token, and the consecutive tokens listed
 * with the same start: a prefill chunk's or a draft chain's rows, or a tree path's nodes,
 * with lengths c + 1, c + 2, ...) are attended together, up to MAXR in a work item, each
 * key and value read once for several of them (with AVX-512 and D = 64 or 128: up to 4
 * in registers, attend512, or blocks of keys that every group of 4 reads from L1,
 * attend_blocked512; otherwise attend256, groups of 4). Fewer vectors a work item keep
 * both cores busy at batch 1. In the AVX2 build a list's keys are cut in parts of PART,
 * each part of a group of vectors a work item of its own, and a vector whose keys span
 * several parts has its parts merged at the end (merge_parts): one long request's
 * attention spreads over both cores and its chain's rows read each key once. A vector's
 * arithmetic (its parts included: they depend only on its own length) is the same whoever
 * shares its work item (keys past its own length get weight 0), in list order, so a
 * token's result never depends on the other tokens of the step. */
#define MAXR 16 /* query vectors per work item, attended in groups, keys in blocks */
#define KB 64 /* keys per block (16 KB of keys at D = 64): in L1 for every group of a work item */
#ifdef __AVX512F__
#define MAXV 4 /* query vectors attended in registers together (D = 64; 2 for D = 128) */
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
                                                             const kv_t *k_cache, const kv_t *v_cache,
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
        const kv_t *kj = k_cache + (sl[j] * KVH + g) * 16 * DV;
        if (j + PF < Lmax) {
            const char *next = (const char *)(k_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < KV_LINES(DV); d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 kv[8];
        for (int d = 0; d < DV; d++) kv[d] = kv16(kj + 16 * d);
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
        const kv_t *vj = v_cache + (sl[j] * KVH + g) * 16 * DV;
        if (j + PF < Lmax) {
            const char *next = (const char *)(v_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < KV_LINES(DV); d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 vv[8];
        for (int d = 0; d < DV; d++) vv[d] = kv16(vj + 16 * d);
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
                                                               int64_t j1, int64_t Lmax, const kv_t *k_cache,
                                                               const int64_t *sl, int64_t KVH, int64_t g, float scale,
                                                               float *scores, int64_t ss, float *mx, int prefetch,
                                                               const int DV, const int RH) {
    __m512 qv[MAXV][8];
    for (int r = 0; r < RH; r++)
        for (int d = 0; d < DV; d++) qv[r][d] = _mm512_mul_ps(_mm512_loadu_ps(q[r] + 16 * d), _mm512_set1_ps(scale));
    for (int64_t j = j0; j < j1; j++) {
        const kv_t *kj = k_cache + (sl[j] * KVH + g) * 16 * DV;
        if (prefetch && j + PF < Lmax) {
            const char *next = (const char *)(k_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < KV_LINES(DV); d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 kv[8];
        for (int d = 0; d < DV; d++) kv[d] = kv16(kj + 16 * d);
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
                                                               const kv_t *v_cache, const int64_t *sl, int64_t KVH,
                                                               int64_t g, const float *scores, int64_t ss, float *acc,
                                                               int prefetch, const int DV, const int RH) {
    __m512 a[MAXV][8];
    for (int r = 0; r < RH; r++)
        for (int d = 0; d < DV; d++) a[r][d] = j0 ? _mm512_loadu_ps(acc + r * 16 * DV + 16 * d) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const kv_t *vj = v_cache + (sl[j] * KVH + g) * 16 * DV;
        if (prefetch && j + PF < Lmax) {
            const char *next = (const char *)(v_cache + (sl[j + PF] * KVH + g) * 16 * DV);
            for (int d = 0; d < KV_LINES(DV); d++) _mm_prefetch(next + 64 * d, _MM_HINT_T0);
        }
        __m512 vv[8];
        for (int d = 0; d < DV; d++) vv[d] = kv16(vj + 16 * d);
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
static void attend_blocked512(const float *const *q, const int64_t *L, int64_t Lmax, int nv, const kv_t *k_cache,
                              const kv_t *v_cache, const int64_t *sl, int64_t KVH, int64_t g, float scale,
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
static void attend512_vectors(const float *const *q, const int64_t *L, int64_t Lmax, int nv, const kv_t *k_cache,
                              const kv_t *v_cache, const int64_t *sl, int64_t KVH, int64_t g, float scale,
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

/* The AVX2 path (any head size; with AVX-512, head sizes other than 64 and 128): a work item's
 * nv (<= MAXR) query vectors of KV head g over one list, in three passes over the keys, in
 * blocks of KB that stay in L1 for every vector of the item: the scores, their softmax, the
 * weighted values; where the item's keys and values take at most TOUCH_BYTES, one read of
 * them all goes first (touch_item). Per vector the arithmetic and its order are fixed: a
 * score is an 8-lane FMA chain over d, its lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)), then
 * a scalar FMA tail (d past the last multiple of 8); the max over its own keys, exp and their
 * sum 8 keys at a time; the values' FMA chain over j per dimension; one division at the end.
 * So a vector's bits never depend on who shares its item, and 8 keys' scores are summed
 * together by a transposing reduction (reduce8) rather than one horizontal sum each. */
#define AVX2_GROUP 4 /* query vectors per item at least, when there are that many */
#if defined(__AVX512F__)
#define PART_KEYS 0 /* the AVX-512 kernels attend whole lists */
#define PART INT64_MAX
#else
#define PART_KEYS 1
#ifndef PART
#define PART 256 /* keys of a part: a list's keys split in parts of PART, attended as separate items */
#endif
#endif
#if defined(__AVX512F__) && !defined(AVX512_AMD)
#define TOUCH_BYTES 0 /* none: on an Intel CPU the passes read as fast alone (an Emerald Rapids Xeon) */
#else
#define TOUCH_BYTES (2 << 20) /* an item's keys and values read ahead of its passes up to this size */
#endif

/* The sum of v's lanes in the order of reduce8: ((0+1)+(2+3))+((4+5)+(6+7)). */
static inline float sum_tree(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 t = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* Lane j: sum_tree(s[j]), for 8 vectors at once. */
static inline __m256 reduce8(const __m256 *s) {
    const __m256 h01 = _mm256_hadd_ps(s[0], s[1]), h23 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 h45 = _mm256_hadd_ps(s[4], s[5]), h67 = _mm256_hadd_ps(s[6], s[7]);
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The score of the scaled query qs against key kj (D floats): see the path's comment. */
static inline float score1(const float *qs, const float *kj, int64_t D) {
    __m256 s = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), _mm256_loadu_ps(kj + d), s);
    float x = sum_tree(s);
    for (; d < D; d++) x = fmaf(qs[d], kj[d], x);
    return x;
}

/* out[0..7] = score1(qs, k[i]) for the 8 keys k[i]. */
static inline void score8(const float *qs, const float *const *k, int64_t D, float *out) {
    __m256 s[8];
    for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 q = _mm256_loadu_ps(qs + d);
        for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[i] + d), s[i]);
    }
    _mm256_storeu_ps(out, reduce8(s));
    for (int i = 0; i < 8; i++)
        for (int64_t t = d; t < D; t++) out[i] = fmaf(qs[t], k[i][t], out[i]);
}

/* rows[j - j0] = keys (or values) j0 .. j1 - 1 of KV head g as D floats: the cache's own
 * rows for a float32 cache; a bfloat16 block widened once into buf (KB * D floats), which
 * every vector of the item then reads from L1. */
static inline void block_rows(const kv_t *cache, const int64_t *sl, int64_t j0, int64_t j1, int64_t KVH, int64_t g,
                              int64_t D, float *buf, const float **rows) {
    for (int64_t j = j0; j < j1; j++) {
        const kv_t *src = cache + (sl[j] * KVH + g) * D;
#ifdef ATTENTION_KV_BF16
        float *dst = buf + (j - j0) * D;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, kv8(src + d));
        for (; d < D; d++) dst[d] = kv1(src[d]);
        rows[j - j0] = dst;
#else
        (void)buf;
        rows[j - j0] = src;
#endif
    }
}

/* exp(score - max) in place over a vector's own L keys (the max over them, to *mx), 0 from
 * there to Lmax; returns their sum. */
static float softmax256(float *sr, int64_t L, int64_t Lmax, float *mx) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), ninf = _mm256_set1_ps(-INFINITY);
    __m256 mv = ninf;
    for (int64_t j = 0; j < L; j += 8) {
        const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(L - j)), _CMP_LT_OQ);
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + j), keep));
    }
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m256 m = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, _MM_SHUFFLE(2, 3, 0, 1)));
    __m256 t = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j += 8) {
        const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(L - j)), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(keep, exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), m)));
        _mm256_storeu_ps(sr + j, e);
        t = _mm256_add_ps(t, e);
    }
    for (int64_t j = L; j < Lmax; j++) sr[j] = 0.0f;
    *mx = _mm256_cvtss_f32(m);
    return hsum(t);
}

/* acc [D] += sum over the n values v[j] (D floats each) of e[j] * v[j]: an FMA chain over j
 * per dimension. */
static void values256(const float *e, int64_t n, const float *const *v, int64_t D, float *acc) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + d + 8 * c);
        for (int64_t j = 0; j < n; j++) {
            const float *vj = v[j] + d;
            const __m256 w = _mm256_set1_ps(e[j]);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + d + 8 * c, a[c]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (int64_t j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_loadu_ps(v[j] + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
    for (; d < D; d++)
        for (int64_t j = 0; j < n; j++) acc[d] = fmaf(e[j], v[j][d], acc[d]);
}

/* The n keys and values of KV head g at slots sl, read once in a tight loop (their bits
 * xor-ed into nothing) so that the passes that follow find them in L2 or L3: the passes'
 * own loads, spread among their arithmetic, keep too few reads in flight, and prefetch
 * instructions among them gained nothing (measured on a Zen 2 EPYC, where this read made a
 * step's attention 1.2x faster at 16 and 64 requests). */
static void touch_item(const kv_t *k_cache, const kv_t *v_cache, const int64_t *sl, int64_t n, int64_t KVH,
                       int64_t g, int64_t D) {
    __m256 t = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *kp = (const float *)(k_cache + (sl[j] * KVH + g) * D);
        const float *vp = (const float *)(v_cache + (sl[j] * KVH + g) * D);
        for (int64_t c = 0; c + 8 <= D * (int64_t)sizeof(kv_t) / 4; c += 16) /* 32 bytes of every line */
            t = _mm256_xor_ps(t, _mm256_xor_ps(_mm256_loadu_ps(kp + c), _mm256_loadu_ps(vp + c)));
    }
    volatile int keep = _mm256_movemask_ps(t); /* the loads are not optimized away */
    (void)keep;
}

/* Keys jb .. je - 1 (a part: jb a multiple of PART, je at most jb + PART) of the nv vectors
 * q[r], vector r seeing its first L[r] keys (more than jb). A vector whose keys all lie in
 * this part writes its output o[r]; the others write their part's record part[r]:
 * {max score, sum of exp(score - max), the D weighted values' sums}, which merge_parts
 * combines. scores: nv rows of stride ss (at least PART) floats, relative to jb. */
static void attend256(const float *const *q, const int64_t *L, int64_t jb, int64_t je, int nv, const kv_t *k_cache,
                      const kv_t *v_cache, const int64_t *sl, int64_t KVH, int64_t g, float scale, float *scores,
                      int64_t ss, float *qs, float *acc, float *buf, float *const *o, float *const *part, int64_t D) {
    float total[MAXR], mx[MAXR];
    const float *rows[KB];
    for (int r = 0; r < nv; r++) {
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = q[r][d] * scale;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
    }
    for (int64_t j0 = jb; j0 < je; j0 += KB) { /* a block of keys, read from L1 by every vector */
        const int64_t j1 = j0 + KB < je ? j0 + KB : je;
        block_rows(k_cache, sl, j0, j1, KVH, g, D, buf, rows);
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8)
            for (int r = 0; r < nv; r++)
                if (j < L[r]) score8(qs + r * D, rows + (j - j0), D, scores + r * ss + (j - jb));
        for (; j < j1; j++)
            for (int r = 0; r < nv; r++)
                if (j < L[r]) scores[r * ss + (j - jb)] = score1(qs + r * D, rows[j - j0], D);
    }
    for (int r = 0; r < nv; r++)
        total[r] = softmax256(scores + r * ss, (L[r] < je ? L[r] : je) - jb, je - jb, mx + r);
    for (int64_t j0 = jb; j0 < je; j0 += KB) {
        const int64_t j1 = j0 + KB < je ? j0 + KB : je;
        block_rows(v_cache, sl, j0, j1, KVH, g, D, buf, rows);
        for (int r = 0; r < nv; r++) {
            const int64_t e1 = j1 < L[r] ? j1 : L[r];
            if (e1 > j0) values256(scores + r * ss + (j0 - jb), e1 - j0, rows, D, acc + r * D);
        }
    }
    for (int r = 0; r < nv; r++) {
        if (part[r]) {
            part[r][0] = mx[r], part[r][1] = total[r];
            memcpy(part[r] + 2, acc + r * D, sizeof(float) * D);
            continue;
        }
        const float inv = 1.0f / total[r];
        for (int64_t d = 0; d < D; d++) o[r][d] = acc[r * D + d] * inv;
    }
}

/* out [D] from a vector's np part records (each 2 + D floats, in key order): the parts'
 * sums rescaled to the largest max and added in order, one division at the end. */
static void merge_parts(const float *part, int64_t np, int64_t D, float *out) {
    float m = -INFINITY, total = 0.0f;
    for (int64_t p = 0; p < np; p++) m = part[p * (D + 2)] > m ? part[p * (D + 2)] : m;
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t p = 0; p < np; p++) {
        const float *rec = part + p * (D + 2), w = exp1(rec[0] - m);
        total = fmaf(w, rec[1], total);
        for (int64_t d = 0; d < D; d++) out[d] = fmaf(w, rec[2 + d], out[d]);
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* One work item: the KV head g of the vectors v0 .. v0 + nv - 1 of the tokens from
 * ``first`` on (vector v: token first + v / rep, query head g * rep + v % rep), over their
 * keys of part p (keys p PART .. (p + 1) PART - 1). */
typedef struct {
    int64_t first, g, v0, nv, p;
} AttnItem;

/* Parts of a vector with L keys. */
static inline int64_t parts_of(int64_t L) { return PART_KEYS ? (L + PART - 1) / PART : 1; }

/* The work items (to ``items``; NULL: only counted): tokens that share a list (same start)
 * grouped, their vectors cut into items of at most ``per_item``, each for every part of
 * its keys; returns how many. */
static int64_t attention_items(const int64_t *start, const int64_t *len, int64_t n, int64_t KVH, int64_t rep,
                               int64_t per_item, AttnItem *items) {
    int64_t count = 0;
    for (int64_t i = 0, e; i < n; i = e) {
        for (e = i + 1; e < n && start[e] == start[i];) e++;
        const int64_t nvec = (e - i) * rep;
        for (int64_t g = 0; g < KVH; g++)
            for (int64_t v0 = 0; v0 < nvec; v0 += per_item) {
                const int64_t nv = nvec - v0 < per_item ? nvec - v0 : per_item;
                int64_t longest = 0;
                for (int64_t t = i + v0 / rep; t <= i + (v0 + nv - 1) / rep; t++) longest = len[t] > longest ? len[t] : longest;
                for (int64_t p = 0; items && p < parts_of(longest); p++) items[count + p] = (AttnItem){i, g, v0, nv, p};
                count += parts_of(longest);
            }
    }
    return count;
}

/* Vectors per item: up to MAXR read the keys once for all of them, but make fewer items; keep
 * at least four items a thread (a request's 17-row chain, 51 vectors a KV head, gives 12 items
 * of 16 at batch 1; one row, 3 vectors, one item). ``in_regs``: vectors read in one pass. */
static int64_t vectors_per_item(const int64_t *start, const int64_t *len, int64_t n, int64_t KVH, int64_t rep,
                                int64_t in_regs, int num_threads) {
    int64_t per_item = MAXR;
#if PART_KEYS
    while (per_item > in_regs && attention_items(start, len, n, KVH, rep, per_item, NULL) < 4 * num_threads)
        per_item /= 2;
#else
    (void)start, (void)len;
    while (per_item > in_regs && n * rep * KVH / per_item < 4 * num_threads) per_item /= 2;
#endif
    return per_item < in_regs ? in_regs : per_item;
}

/* One work item: its query and output vectors (and part records), then the kernel for its
 * head size and count. ``scores``: the thread's scratch (scores, then acc, qs and buf, as
 * PAGED_ATTENTION lays out); ``parts``: token i's records from parts + at[i] (none where
 * its keys fit one part): query head h's part p at ((h * parts_of(len[i]) + p) * (D + 2)). */
static inline __attribute__((always_inline)) void attend_item(
    AttnItem w, const float *q, int64_t q_stride, const kv_t *k_cache, const kv_t *v_cache, const int64_t *rows,
    const int64_t *start, const int64_t *len, const int64_t *slots, float *out, float *parts, const int64_t *at,
    int64_t H, int64_t KVH, int64_t D, float scale, int64_t in_regs, float *scores, int64_t ss) {
    const int64_t rep = H / KVH, g = w.g;
    const int64_t *sl = slots + start[w.first];
    float *acc = scores + MAXR * ss, *qs = acc + MAXR * D, *buf = qs + MAXR * D;
    const float *qp[MAXR];
    float *op[MAXR], *pp[MAXR];
    int64_t L[MAXR], Lmax = 0, nv = 0;
    for (int64_t v = 0; v < w.nv; v++) {
        const int64_t i = w.first + (w.v0 + v) / rep, h = g * rep + (w.v0 + v) % rep;
        if (len[i] <= w.p * PART) continue; /* no keys in this part */
        qp[nv] = q + rows[i] * q_stride + h * D;
        op[nv] = out + (rows[i] * H + h) * D;
        pp[nv] = parts_of(len[i]) > 1 ? parts + at[i] + (h * parts_of(len[i]) + w.p) * (D + 2) : NULL;
        L[nv] = len[i];
        Lmax = L[nv] > Lmax ? L[nv] : Lmax;
        nv++;
    }
    const int64_t jb = w.p * PART, je = Lmax - jb > PART ? jb + PART : Lmax;
    if ((je - jb) * D * (int64_t)sizeof(kv_t) * 2 <= TOUCH_BYTES) touch_item(k_cache, v_cache, sl + jb, je - jb, KVH, g, D);
#ifdef __AVX512F__
    const int wide = D == 64 || D == 128; /* attend512 and attend_blocked512: whole lists (PART_KEYS 0) */
    if (wide && nv > in_regs) {
        attend_blocked512(qp, L, Lmax, (int)nv, k_cache, v_cache, sl, KVH, g, scale, scores, ss, acc, op, D);
        return;
    }
    if (wide) {
        attend512_vectors(qp, L, Lmax, (int)nv, k_cache, v_cache, sl, KVH, g, scale, scores, ss, op, D);
        return;
    }
#else
    (void)in_regs;
#endif
    attend256(qp, L, jb, je, (int)nv, k_cache, v_cache, sl, KVH, g, scale, scores, ss, qs, acc, buf, op, pp, D);
}

int PAGED_ATTENTION(const float *q, int64_t q_stride, const kv_t *k_cache, const kv_t *v_cache,
                         const int64_t *rows, const int64_t *start, const int64_t *len, const int64_t *slots,
                         float *out, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale, int num_threads) {
    const int64_t rep = H / KVH;
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = len[i] > max_len ? len[i] : max_len;
    int64_t in_regs = AVX2_GROUP; /* vectors whose keys are read once in one pass */
#ifdef __AVX512F__
    if (D == 64 || D == 128) in_regs = D == 64 ? MAXV : 2;
#endif
    const int64_t per_item = vectors_per_item(start, len, n, KVH, rep, in_regs, num_threads);
    const int64_t count = attention_items(start, len, n, KVH, rep, per_item, NULL);
    const int64_t ss = (max_len < PART ? max_len : PART) + 16;
    int64_t *at = malloc(sizeof(int64_t) * (n + 1)); /* token i's part records: from parts + at[i] */
    AttnItem *items = malloc(sizeof(AttnItem) * (count ? count : 1));
    if (!at || !items) {
        free(at), free(items);
        return KERNEL_NO_MEMORY;
    }
    at[0] = 0;
    for (int64_t i = 0; i < n; i++) at[i + 1] = at[i] + (parts_of(len[i]) > 1 ? H * parts_of(len[i]) * (D + 2) : 0);
    float *parts = at[n] ? malloc(sizeof(float) * at[n]) : NULL;
    if (at[n] && !parts) {
        free(at), free(items);
        return KERNEL_NO_MEMORY;
    }
    attention_items(start, len, n, KVH, rep, per_item, items);
    int failed = 0;
    #pragma omp parallel num_threads(count > 1 ? num_threads : 1)
    {
        float *scores = malloc(sizeof(float) * (MAXR * ss + 2 * MAXR * D + KB * D));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < count; it++)
            if (scores)
                attend_item(items[it], q, q_stride, k_cache, v_cache, rows, start, len, slots, out, parts, at, H, KVH,
                            D, scale, in_regs, scores, ss);
        free(scores);
        if (at[n]) { /* the tokens whose keys span several parts: their records merged */
            #pragma omp for schedule(static)
            for (int64_t v = 0; v < n * H; v++) {
                const int64_t i = v / H, h = v % H, np = parts_of(len[i]);
                if (np > 1) merge_parts(parts + at[i] + h * np * (D + 2), np, D, out + (rows[i] * H + h) * D);
            }
        }
    }
    free(parts), free(at), free(items);
    return failed ? KERNEL_NO_MEMORY : 0;
}
