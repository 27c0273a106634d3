/* Matmuls of float32 activations by weights in GGUF's block formats (Q4_0, Q4_1, Q8_0, Q4_K,
 * Q5_K, Q6_K): the file's own codes and scales, laid out once in panels of 8 rows ("weight
 * panels" below); built by engine/layers/quant.py.
 *
 * llama.cpp's way: each input row is quantized to 8 bits per block of 32 (``quantize_q8``:
 * scale = max |x| / 127, round to nearest even), and a 32-weight chunk of a weight row meets
 * it in integer multiply-adds. Every chunk of every format is read in the same form,
 *
 *     w_k = scale * q_k + min          (q_k: an unsigned code, or a signed one in Q8_0 / Q6_K)
 *
 * so that its dot product with the row's codes x_k (scale dx, sum of codes isum) is
 *
 *     dx * (scale * sum_k q_k x_k + min * isum)        (Q6_K: a scale per half of 16 codes)
 *
 * where the integer sum is exact (|sum| < 2^24: no rounding in its conversion to float). The
 * 8 rows of a panel land in the 8 lanes of one vector, each lane accumulating its chunks in
 * order: a row's result depends only on that row, the same bits whatever the other rows of
 * the step are, at any row count and thread count. AVX2 multiplies with maddubs + madd,
 * AVX-512 VNNI (or AVX-VNNI) with dpbusd: the same integers, so the same bits.
 * K is a multiple of 32 (256 for the K-quants).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specserve_kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGMLQuantizationType */

#define ROW_BLOCK 64 /* input rows whose codes stay in L2 while the weights stream past */
#define INLINE static inline __attribute__((always_inline))
#ifndef UNROLL_ROWS
#define UNROLL_ROWS 8
#endif
#define PRAGMA(x) _Pragma(#x)
#define UNROLL(n) PRAGMA(GCC unroll n) /* a tile's rows: their accumulators stay in registers */

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

/* ---- weight panels ------------------------------------------------------------------------
 *
 * A weight's rows, eight at a time (a group; rows past N are zero), in the file's codes and
 * scales, interleaved (engine/layers/quant.py, ``panel``): a chunk of 32 weights of the 8
 * rows is 8 quads, quad j = 32 bytes holding codes 4j .. 4j + 3 of row 0, then of row 1, ...
 *
 *   Q4_0  chunk: codes 128 B (quad j in the low nibbles of 32 bytes, quad j + 4 in the high
 *         ones, j < 4), d (f16 x 8)                                    w = d q - 8 d
 *   Q4_1  chunk: codes 128 B, d (f16 x 8), m (f16 x 8)                 w = d q + m
 *   Q8_0  chunk: codes 256 B (int8), d (f16 x 8)                       w = d q
 *   Q4_K  per 256 weights: d, dmin (f16 x 8 each), then 8 chunks: codes 128 B, sc, m (u8 x 8)
 *                                                                      w = d sc q - dmin m
 *   Q5_K  the same with codes of one byte (0 .. 31): 256 B a chunk
 *   Q6_K  per 256 weights: d (f16 x 8), then 8 chunks: codes 256 B (int8, q - 32), sc (int8 x 8)
 *         of each half of 16 codes                                     w = d sc q
 *
 * A row's codes meet the 8 rows' quads as one broadcast 4 bytes per quad: the 8 integer sums
 * land in the 8 lanes of one vector, one lane per weight row, and are scaled and accumulated
 * over the chunks in order, lane by lane. */

enum { U4, U8, S8 }; /* codes: unsigned nibbles, unsigned bytes, signed bytes */

static inline int codes_of(int fmt) {
    return fmt == Q8_0 || fmt == Q6_K ? S8 : fmt == Q5_K ? U8 : U4;
}

static inline int64_t chunk_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 144;
    case Q4_1: return 160;
    case Q8_0: return 272;
    case Q4_K: return 144;
    default: return 272; /* Q5_K, Q6_K */
    }
}

static inline int64_t header_bytes(int fmt) { return fmt == Q4_K || fmt == Q5_K ? 32 : fmt == Q6_K ? 16 : 0; }

/* The bytes of one group of 8 rows over K inputs. */
int64_t panel_bytes(int fmt, int64_t K) {
    int64_t chunks = K / 32, supers = header_bytes(fmt) ? K / 256 : 0;
    return chunks * chunk_bytes(fmt) + supers * header_bytes(fmt);
}

typedef struct {
    __m256i q[8], sign[8]; /* codes (S8: their absolute values, ``sign`` the codes) */
    __m256 scale, scale_b, min; /* per row; scale_b: Q6_K's second half */
} chunk_t;

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Chunk c of a group: its K-quant header (per 256 weights; the group itself for the others) and its codes. */
static inline const uint8_t *chunk_head(int fmt, const uint8_t *group, int64_t c) {
    int64_t h = header_bytes(fmt);
    return group + (h ? (c / 8) * (h + 8 * chunk_bytes(fmt)) : 0);
}

static inline const uint8_t *chunk_codes(int fmt, const uint8_t *group, int64_t c) {
    int64_t h = header_bytes(fmt);
    return h ? chunk_head(fmt, group, c) + h + (c % 8) * chunk_bytes(fmt) : group + c * chunk_bytes(fmt);
}

INLINE void load_chunk(int fmt, const uint8_t *group, int64_t c, chunk_t *w) {
    const uint8_t *head = chunk_head(fmt, group, c), *p = chunk_codes(fmt, group, c);
    int kind = codes_of(fmt);
    if (kind == U4) {
        const __m256i low = _mm256_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            w->q[j] = _mm256_and_si256(v, low);
            w->q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    } else {
        for (int j = 0; j < 8; j++) {
            w->q[j] = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            if (kind == S8) {
                w->sign[j] = w->q[j];
                w->q[j] = _mm256_abs_epi8(w->q[j]);
            }
        }
    }
    const uint8_t *s = p + (kind == U4 ? 128 : 256);
    w->min = _mm256_setzero_ps();
    if (fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0) {
        w->scale = f16x8(s);
        if (fmt == Q4_0) w->min = _mm256_mul_ps(w->scale, _mm256_set1_ps(-8.0f));
        if (fmt == Q4_1) w->min = f16x8(s + 16);
    } else if (fmt == Q6_K) {
        __m256 d = f16x8(head);
        w->scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s))));
        w->scale_b = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8)))));
    } else { /* Q4_K, Q5_K */
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)));
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8))));
        w->scale = _mm256_mul_ps(f16x8(head), sc);
        w->min = _mm256_mul_ps(_mm256_mul_ps(f16x8(head + 16), m), _mm256_set1_ps(-1.0f));
    }
}

/* One quad: per lane (weight row), sum of its 4 codes times the row's 4 (exact integers). */
INLINE __m256i quad(int kind, const chunk_t *w, int j, __m256i x, __m256i acc) {
    if (kind == S8) x = _mm256_sign_epi8(x, w->sign[j]);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w->q[j], x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w->q[j], x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w->q[j], x), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i broadcast4(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return _mm256_set1_epi32(four);
}

/* Quads lo .. hi - 1 against a row's 32 codes ``x``, in ``split`` independent sums (a short
 * dependency chain where few rows run; any split gives the same exact integers). Without
 * VNNI, nibbles' products add up in 16 bits first (8 quads: at most 8 * 2 * 15 * 127 = 30480
 * a lane), one madd for them all. */
INLINE __m256i quads(int kind, const chunk_t *w, const int8_t *x, int lo, int hi, int split) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
    if (kind == U4) {
        for (int j = lo; j < hi; j++)
            acc[j % split] = _mm256_add_epi16(acc[j % split], _mm256_maddubs_epi16(w->q[j], broadcast4(x + 4 * j)));
        for (int i = 1; i < split; i++) acc[0] = _mm256_add_epi16(acc[0], acc[i]);
        return _mm256_madd_epi16(acc[0], _mm256_set1_epi16(1));
    }
#endif
    for (int j = lo; j < hi; j++) acc[j % split] = quad(kind, w, j, broadcast4(x + 4 * j), acc[j % split]);
    if (split == 4) acc[0] = _mm256_add_epi32(acc[0], acc[2]), acc[1] = _mm256_add_epi32(acc[1], acc[3]);
    return split > 1 ? _mm256_add_epi32(acc[0], acc[1]) : acc[0];
}

#define TILE 8 /* rows a tile holds */
#if defined(__AVX512F__)
#define CHUNK_ROWS 8 /* ... with a whole chunk unpacked in registers: 32 of them */
#else
#define CHUNK_ROWS 4 /* 16 */
#endif
#ifndef PREFETCH
#define PREFETCH 8192
#endif /* PREFETCH: bytes ahead of the chunk read, into L1: the panels stream from memory (or L3), and
        * a far distance keeps more lines in flight than the core's own streamer does (docs/cpu.md) */

/* The panel's lines PREFETCH bytes past chunk c of a group (a chunk's bytes and its share of a header apart). */
INLINE void prefetch_ahead(int fmt, const uint8_t *group, int64_t c) {
    int64_t stride = chunk_bytes(fmt) + header_bytes(fmt) / 8;
    _mm_prefetch((const char *)group + c * stride + PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char *)group + c * stride + PREFETCH + 64, _MM_HINT_T0);
    if (stride > 128) _mm_prefetch((const char *)group + c * stride + PREFETCH + 128, _MM_HINT_T0);
    if (stride > 192) _mm_prefetch((const char *)group + c * stride + PREFETCH + 192, _MM_HINT_T0);
}

/* acc[r] (8 lanes: weight rows) to y[r * ldy ..], its first ``valid`` lanes, r < R. */
INLINE void store_rows(const __m256 *acc, int R, float *y, int64_t ldy, int valid) {
    for (int r = 0; r < R; r++) {
        if (valid == 8) {
            _mm256_storeu_ps(y + r * ldy, acc[r]);
        } else {
            float out[8];
            _mm256_storeu_ps(out, acc[r]);
            memcpy(y + r * ldy, out, sizeof(float) * valid);
        }
    }
}

/* Rows r0 .. r0 + R - 1 (R <= CHUNK_ROWS, a constant where it is inlined) against one group
 * of 8 weight rows, written to y[r * ldy + o] for its first ``valid`` rows: each chunk is
 * unpacked once and meets every row of the tile while it sits in registers. */
INLINE void tile_chunks(int fmt, const uint8_t *group, int64_t K, const int8_t *xq, const float *dx, const float *isum,
                 int R, float *y, int64_t ldy, int valid) {
    __m256 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int kind = codes_of(fmt), split = R == 1 ? 4 : R == 2 ? 2 : 1;
    for (int64_t c = 0; c < K / 32; c++) {
        prefetch_ahead(fmt, group, c);
        chunk_t w;
        load_chunk(fmt, group, c, &w);
        UNROLL(UNROLL_ROWS)
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * K + c * 32;
            __m256 t;
            if (fmt == Q6_K) {
                t = _mm256_mul_ps(_mm256_cvtepi32_ps(quads(kind, &w, x, 0, 4, split)), w.scale);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads(kind, &w, x, 4, 8, split)), w.scale_b, t);
            } else {
                t = _mm256_mul_ps(_mm256_cvtepi32_ps(quads(kind, &w, x, 0, 8, split)), w.scale);
                t = _mm256_fmadd_ps(w.min, _mm256_set1_ps(isum[r * (K / 32) + c]), t);
            }
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * (K / 32) + c]), acc[r]);
        }
    }
    store_rows(acc, R, y, ldy, valid);
}

#if !defined(__AVX512F__) && !defined(__AVXVNNI__)
/* AVX2, 4-bit codes or Q8_0, 2 to 8 rows: ``tile_chunks`` with its loops turned, one load of
 * 32 bytes at a time (4-bit: quads j and j + 4; Q8_0: quad j) against every row, each row's
 * products adding up as in ``quads`` (the same exact integers, so the same bits) while only
 * that load is live: the 16 registers hold 8 rows' sums where a whole unpacked chunk would
 * leave room for 4. */
INLINE void tile_quads(int fmt, const uint8_t *group, int64_t K, const int8_t *xq, const float *dx,
                       const float *isum, int R, float *y, int64_t ldy, int valid) {
    __m256 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    int64_t nb = K / 32;
    for (int64_t c = 0; c < nb; c++) {
        prefetch_ahead(fmt, group, c);
        const uint8_t *p = chunk_codes(fmt, group, c);
        __m256i sum[TILE];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        if (fmt == Q8_0) {
            UNROLL(1)
            for (int j = 0; j < 8; j++) { /* a quad at a time, in 32 bits (as ``quad``) */
                __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 * j)), a = _mm256_abs_epi8(q);
                UNROLL(UNROLL_ROWS)
                for (int r = 0; r < R; r++) {
                    __m256i x = _mm256_sign_epi8(broadcast4(xq + r * K + c * 32 + 4 * j), q);
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones));
                }
            }
        } else {
            UNROLL(1) /* one pair's products at a time: unrolled, the compiler spills them all first */
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                UNROLL(UNROLL_ROWS)
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + r * K + c * 32;
                    sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(lo, broadcast4(x + 4 * j)));
                    sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(hi, broadcast4(x + 4 * (j + 4))));
                }
            }
            for (int r = 0; r < R; r++) sum[r] = _mm256_madd_epi16(sum[r], ones);
        }
        chunk_t w;
        load_chunk(fmt, group, c, &w); /* its scales (the codes it unpacks again are dead) */
        UNROLL(UNROLL_ROWS)
        for (int r = 0; r < R; r++) {
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[r]), w.scale);
            t = _mm256_fmadd_ps(w.min, _mm256_set1_ps(isum[r * nb + c]), t);
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * nb + c]), acc[r]);
        }
    }
    store_rows(acc, R, y, ldy, valid);
}
#define QUAD_TILES 1
#else
#define QUAD_TILES 0
#endif

/* ``tile_chunks`` for up to TILE rows; where a chunk's codes fill the registers (AVX2), by
 * ``tile_quads`` for the formats it takes, else in two halves of 4 rows. */
INLINE void tile(int fmt, const uint8_t *group, int64_t K, const int8_t *xq, const float *dx, const float *isum,
                 int R, float *y, int64_t ldy, int valid) {
#if QUAD_TILES
    if ((codes_of(fmt) == U4 || fmt == Q8_0) && R > 1) {
        tile_quads(fmt, group, K, xq, dx, isum, R, y, ldy, valid);
        return;
    }
#endif
    if (R > CHUNK_ROWS) {
        int64_t nb = K / 32;
        tile_chunks(fmt, group, K, xq, dx, isum, CHUNK_ROWS, y, ldy, valid);
        tile_chunks(fmt, group, K, xq + CHUNK_ROWS * K, dx + CHUNK_ROWS * nb, isum + CHUNK_ROWS * nb, R - CHUNK_ROWS,
                    y + CHUNK_ROWS * ldy, ldy, valid);
        return;
    }
    tile_chunks(fmt, group, K, xq, dx, isum, R, y, ldy, valid);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Two groups side by side in the 16 lanes of 512-bit vectors: one broadcast of a row's codes
 * and one dpbusd per quad serve 16 weight rows. Each lane runs the 8-lane path's operations in
 * its order, so a group gives the same bits here as alone. */
#define WIDE 1

typedef struct {
    __m512i q[8], sign[8];
    __m512 scale, scale_b, min;
} chunk2_t;

static inline __m512i join_i(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

static inline __m512 join_f(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}

INLINE void load_chunk2(int fmt, const uint8_t *g0, const uint8_t *g1, int64_t c, chunk2_t *w) {
    chunk_t a, b;
    load_chunk(fmt, g0, c, &a);
    load_chunk(fmt, g1, c, &b);
    for (int j = 0; j < 8; j++) {
        if (fmt == Q8_0) { /* the codes plus 128, unsigned: no per-row sign flips (tile2 takes 128 isum off) */
            w->q[j] = _mm512_xor_si512(join_i(a.sign[j], b.sign[j]), _mm512_set1_epi8((char)0x80));
            continue;
        }
        w->q[j] = join_i(a.q[j], b.q[j]);
        if (codes_of(fmt) == S8) w->sign[j] = join_i(a.sign[j], b.sign[j]);
    }
    w->scale = join_f(a.scale, b.scale);
    w->min = join_f(a.min, b.min);
    if (fmt == Q6_K) w->scale_b = join_f(a.scale_b, b.scale_b);
}

INLINE __m512i quads2(int kind, const chunk2_t *w, const int8_t *x, int lo, int hi, int split) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int j = lo; j < hi; j++) {
        int32_t four;
        memcpy(&four, x + 4 * j, 4);
        __m512i v = _mm512_set1_epi32(four);
        if (kind == S8) v = _mm512_mask_sub_epi8(v, _mm512_movepi8_mask(w->sign[j]), _mm512_setzero_si512(), v);
        acc[j % split] = _mm512_dpbusd_epi32(acc[j % split], w->q[j], v);
    }
    if (split == 4) acc[0] = _mm512_add_epi32(acc[0], acc[2]), acc[1] = _mm512_add_epi32(acc[1], acc[3]);
    return split > 1 ? _mm512_add_epi32(acc[0], acc[1]) : acc[0];
}

/* ``tile`` for groups g0 and g0 + 1 (its first ``valid`` rows), g0 a whole group. */
INLINE void tile2(int fmt, const uint8_t *g0, const uint8_t *g1, int64_t K, const int8_t *xq, const float *dx,
                  const float *isum, int R, float *y, int64_t ldy, int valid) {
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int kind = fmt == Q8_0 ? U8 : codes_of(fmt), split = R == 1 ? 4 : R == 2 ? 2 : 1; /* Q8_0: load_chunk2 */
    int64_t stride = chunk_bytes(fmt) + header_bytes(fmt) / 8;
    for (int64_t c = 0; c < K / 32; c++) {
        for (int64_t b = 0; b < stride; b += 64) {
            _mm_prefetch((const char *)g0 + c * stride + PREFETCH + b, _MM_HINT_T0);
            _mm_prefetch((const char *)g1 + c * stride + PREFETCH + b, _MM_HINT_T0);
        }
        chunk2_t w;
        load_chunk2(fmt, g0, g1, c, &w);
        UNROLL(UNROLL_ROWS)
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * K + c * 32;
            __m512 t;
            if (fmt == Q6_K) {
                t = _mm512_mul_ps(_mm512_cvtepi32_ps(quads2(kind, &w, x, 0, 4, split)), w.scale);
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(quads2(kind, &w, x, 4, 8, split)), w.scale_b, t);
            } else {
                __m512i dot = quads2(kind, &w, x, 0, 8, split);
                if (fmt == Q8_0) /* sum (q + 128) x - 128 sum x: the signed codes' exact sum */
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * (int32_t)isum[r * (K / 32) + c]));
                t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), w.scale);
                t = _mm512_fmadd_ps(w.min, _mm512_set1_ps(isum[r * (K / 32) + c]), t);
            }
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[r * (K / 32) + c]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, (__mmask16)((1u << (8 + valid)) - 1), acc[r]);
}
#else
#define WIDE 0
#endif

#define TILE_CASE(n) \
    case n: TILE_CALL(n); break;

/* Every row of one row block against group g (and g + 1 where ``pair``): tiles of TILE rows,
 * then the rest. */
INLINE void group(int fmt, const uint8_t *w, int64_t g, int pair, int64_t N, const int8_t *xq, const float *dx,
                  const float *isum, int64_t rows, int64_t K, float *y, int64_t ldy) {
    const uint8_t *p = w + g * panel_bytes(fmt, K);
    int64_t last = pair ? g + 1 : g;
    int valid = N - 8 * last < 8 ? (int)(N - 8 * last) : 8;
    int64_t r = 0, nb = K / 32;
    float *out = y + 8 * g;
#if WIDE
#define TILE_CALL(n)                                                                                                    \
    (pair ? tile2(fmt, p, p + panel_bytes(fmt, K), K, xq + r * K, dx + r * nb, isum + r * nb, n, out + r * ldy, ldy, valid) \
          : tile(fmt, p, K, xq + r * K, dx + r * nb, isum + r * nb, n, out + r * ldy, ldy, valid))
#else
#define TILE_CALL(n) tile(fmt, p, K, xq + r * K, dx + r * nb, isum + r * nb, n, out + r * ldy, ldy, valid)
#endif
    for (; r + TILE <= rows; r += TILE) TILE_CALL(TILE);
    switch (rows - r) {
    TILE_CASE(7) TILE_CASE(6) TILE_CASE(5) TILE_CASE(4)
    TILE_CASE(3) TILE_CASE(2) TILE_CASE(1)
    }
}

#define DEFINE_MATMUL(name, FMT)                                                                               \
    static void name(const uint8_t *w, int64_t N, const int8_t *xq, const float *dx, const float *isum,        \
                     int64_t M, int64_t K, float *y, int64_t ldy, int num_threads) {                           \
        int64_t groups = (N + 7) / 8, nb = K / 32, units = WIDE ? (groups + 1) / 2 : groups;                    \
        _Pragma("omp parallel num_threads(num_threads)")                                                       \
        for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {                                                        \
            int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;                                            \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t u = 0; u < units; u++) {                                                              \
                int64_t g = WIDE ? 2 * u : u;                                                                  \
                group(FMT, w, g, g + 1 < groups && WIDE, N, xq + r0 * K, dx + r0 * nb, isum + r0 * nb, rows, K,   \
                      y + r0 * ldy, ldy);                                                                      \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_MATMUL(matmul_q4_0, Q4_0)
DEFINE_MATMUL(matmul_q4_1, Q4_1)
DEFINE_MATMUL(matmul_q8_0, Q8_0)
DEFINE_MATMUL(matmul_q4_k, Q4_K)
DEFINE_MATMUL(matmul_q5_k, Q5_K)
DEFINE_MATMUL(matmul_q6_k, Q6_K)

/* y[:, :N] (row stride ldy) = x [M, K] @ W.T for W [N, K] in panels of format ``fmt``, x's
 * codes from ``quantize_q8``. Returns 0, or -1 for a format without a kernel. */
int matmul_q(int fmt, const uint8_t *w, int64_t N, const int8_t *xq, const float *dx, const float *isum, int64_t M,
             int64_t K, float *y, int64_t ldy, int num_threads) {
    switch (fmt) {
    case Q4_0: matmul_q4_0(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q4_1: matmul_q4_1(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q8_0: matmul_q8_0(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q4_K: matmul_q4_k(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q5_K: matmul_q5_k(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    case Q6_K: matmul_q6_k(w, N, xq, dx, isum, M, K, y, ldy, num_threads); return 0;
    }
    return -1;
}

/* x [M, K] float32 times the weight ``parts`` stacked along the outputs: part i in format
 * fmts[i], ns[i] rows in panels from ws[i]; y [M, sum(ns)]. Returns 0, or -1 (y unwritten)
 * for a format without a kernel, -2 when out of memory. */
int quant_linear(const float *x, int64_t M, int64_t K, int parts, const int *fmts, const uint8_t *const *ws,
                 const int64_t *ns, float *y, int num_threads) {
    int64_t ldy = 0, nb = K / 32;
    for (int i = 0; i < parts; i++) ldy += ns[i];
    int8_t *xq = malloc(M * K + 2 * M * nb * sizeof(float));
    if (!xq) return -2;
    float *dx = (float *)(xq + M * K), *isum = dx + M * nb;
    quantize_q8(x, M, K, xq, dx, isum);
    int64_t col = 0;
    for (int i = 0; i < parts; col += ns[i++])
        if (matmul_q(fmts[i], ws[i], ns[i], xq, dx, isum, M, K, y + col, ldy, num_threads)) {
            free(xq);
            return -1;
        }
    free(xq);
    return 0;
}

/* Rows ids[0 .. n - 1] of a weight [N, K] in panels, dequantized: out [n, K] (embedding lookups
 * of a model whose embedding is its quantized output head). */
void panel_rows(int fmt, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out) {
    int kind = codes_of(fmt);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *group = w + (ids[i] / 8) * panel_bytes(fmt, K);
        int o = (int)(ids[i] % 8);
        for (int64_t c = 0; c < K / 32; c++) {
            chunk_t ch;
            load_chunk(fmt, group, c, &ch);
            uint8_t q[8][32];
            int8_t sq[8][32];
            float scale[8], scale_b[8], min[8];
            memcpy(q, ch.q, sizeof q);
            memcpy(sq, kind == S8 ? ch.sign : ch.q, sizeof sq);
            _mm256_storeu_ps(scale, ch.scale);
            _mm256_storeu_ps(scale_b, fmt == Q6_K ? ch.scale_b : ch.scale);
            _mm256_storeu_ps(min, ch.min);
            for (int k = 0; k < 32; k++) {
                int code = kind == S8 ? sq[k / 4][4 * o + k % 4] : q[k / 4][4 * o + k % 4];
                out[i * K + c * 32 + k] = (k < 16 ? scale[o] : scale_b[o]) * (float)code + min[o];
            }
        }
    }
}

/* layer.c's layer_matmul_fn for quantized weights: y [M, N] = x [M, K] @ W.T, W a
 * ``quant_matrix`` (the fused decoder layer calls it for each of its four matrices).
 * Returns quant_linear's code: 0, or negative (y unwritten). */
int quant_layer_matmul(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const quant_matrix *q = w;
    (void)N;
    return quant_linear(x, M, K, q->parts, q->fmts, q->ws, q->ns, y, num_threads);
}
