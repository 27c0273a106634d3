/* The CPU kernels' per-row ops and the whole decoder layer, float32,
 * x86-64 with AVX2 and FMA; the matmul and the attention have AVX-512 paths,
 * compiled where the CPU has it (-mavx512f). Built at run time by
 * engine/layers/cpu_kernels.py.
 *
 * The matmul is in matmul.c, the attention in attention.c.
 *
 * rms_norm_f32: RMSNorm of each row.
 */
#include "common.h"

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

/* One Llama decoder layer (pre-norm attention, a gated SiLU MLP or a mixture of experts, no
 * output biases) for the T tokens of a step (prefill chunks, decodes, drafts), every one of
 * them attended through its own list of KV slots; in place on x [T, Hd]. It makes the kernel calls of the
 * model's layer-by-layer forward (engine/models/llama.py) in the same order, so its
 * results are the same bits, without the Python and torch dispatch between them.
 * Weights [out, in], each in matmul_f32's layout: w_qkv [(H + 2 KVH) D, In], w_o [Hd, H D],
 * w_gu [2 I, Hd] (gate rows, then up rows), w_down [Hd, I]; cos, sin [T, D]; the new keys
 * (rotated) and values are written at slot_mapping[t] of k_cache, v_cache [num_slots, KVH, D], whose
 * elements are float (kv_type KV_F32) or bfloat16 (KV_BF16: rounded to nearest even at the write).
 * attn_in: NULL for a decoder layer (the attention reads rms_norm(x) * ln1, In = Hd), or
 * the attention's input [T, In] given whole (an EAGLE head: its normed embeddings and
 * features side by side, In = 2 Hd, while x, the residual, is the features; ln1 unused).
 * b_qkv [(H + 2 KVH) D] (Qwen2's biases) is added to the qkv product, and q_norm, k_norm [D]
 * (Qwen3's) rms-normalize each query and key head before rope; NULL where the model has none.
 * mm: NULL for weights in matmul_f32's layout; otherwise the matmul that reads the four
 * weight pointers as its own handles (GGUF blocks: quant_kernels.c, quant_layer_matmul).
 * moe: NULL for the gated MLP of w_gu and w_down; otherwise the sparse mixture of experts
 * in its place (moe.c; w_gu, w_down and mm unused by it, I = 0).
 * scratch: at least T * (2 Hd + (2 H + 3 KVH) D + H D + 3 I) floats.
 * Returns 0, or the first failing kernel's negative code (mm's, KERNEL_NO_MEMORY), x then
 * partly updated. */
typedef int (*layer_matmul_fn)(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                               int num_threads);

static int layer_matmul(layer_matmul_fn mm, const float *x, const float *w, float *y, int64_t M, int64_t N,
                        int64_t K, int num_threads) {
    if (mm)
        return mm(w, x, y, M, N, K, num_threads);
    matmul_f32(x, w, y, M, N, K, num_threads);
    return 0;
}

/* src [n] into the cache from its element at (kv_type KV_BF16: rounded to nearest even). */
static void write_kv(void *cache, int kv_type, int64_t at, const float *src, int64_t n) {
    if (kv_type == KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * n);
    }
}

int decoder_layer_f32(float *x, const float *attn_in, int64_t In, int64_t T, int64_t Hd, int64_t H, int64_t KVH,
                       int64_t D, int64_t I, float eps, float scale, const float *ln1, const float *w_qkv,
                       const float *w_o, const float *ln2, const float *w_gu, const float *w_down,
                       const float *b_qkv, const float *q_norm, const float *k_norm, layer_matmul_fn mm,
                       const moe_t *moe, void *k_cache, void *v_cache, int kv_type, const float *cos, const float *sin, const int64_t *slot_mapping,
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
    int rc = layer_matmul(mm, attn_in, w_qkv, qkv, T, QKV, In, num_threads);
    if (rc) return rc;
    for (int64_t t = 0; b_qkv != NULL && t < T; t++)
        for (int64_t i = 0; i < QKV; i++) qkv[t * QKV + i] += b_qkv[i];
    for (int64_t t = 0; q_norm != NULL && t < T; t++) { /* in place: each row is read before it is written */
        rms_norm_f32(qkv + t * QKV, q_norm, qkv + t * QKV, H, D, eps, 1);
        rms_norm_f32(qkv + t * QKV + H * D, k_norm, qkv + t * QKV + H * D, KVH, D, eps, 1);
    }
    rope_f32(qkv, QKV, cos, sin, qk, T, H + KVH, D);
    for (int64_t t = 0; t < T; t++) {
        write_kv(k_cache, kv_type, slot_mapping[t] * KVH * D, qk + t * QK + H * D, KVH * D);
        write_kv(v_cache, kv_type, slot_mapping[t] * KVH * D, qkv + t * QKV + QK, KVH * D);
    }
    if (kv_type == KV_BF16)
        rc = paged_attention_kv_bf16(qk, QK, k_cache, v_cache, rows, start, len, slots, att, T, H, KVH, D, scale,
                                     num_threads);
    else
        rc = paged_attention_f32(qk, QK, k_cache, v_cache, rows, start, len, slots, att, T, H, KVH, D, scale,
                                 num_threads);
    if (rc || (rc = layer_matmul(mm, att, w_o, o, T, Hd, H * D, num_threads))) return rc;
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
    rms_norm_f32(x, ln2, h, T, Hd, eps, num_threads);
    if (moe) {
        rc = moe_f32(moe, h, o, T, Hd, num_threads);
    } else if (!(rc = layer_matmul(mm, h, w_gu, gu, T, 2 * I, Hd, num_threads))) {
        silu_mul_f32(gu, a, T, I, num_threads);
        rc = layer_matmul(mm, a, w_down, o, T, Hd, I, num_threads);
    }
    if (rc) return rc;
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
    return 0;
}
