/* One Llama decoder layer in one call (pre-norm attention, a gated SiLU MLP or a mixture of
 * experts, no output biases), float32: the kernel calls of the model's layer-by-layer forward
 * (engine/models/decoder.py), in the same order, so its results are the same bits, without the
 * Python and torch dispatch between them. */
#include "common.h"
#include "specserve_kernels.h"

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

/* qkv [T, (H + 2 KVH) D] = the qkv product of attn_in [T, In] (+ b_qkv), each query and key head
 * rms-normalized by q_norm, k_norm where the layer has them. */
static int layer_qkv(const layer_t *l, const float *attn_in, int64_t In, int64_t T, float *qkv, int num_threads) {
    const int64_t H = l->heads, KVH = l->kv_heads, D = l->head_dim, QKV = (H + 2 * KVH) * D;
    int rc = layer_matmul(l->mm, attn_in, l->w_qkv, qkv, T, QKV, In, num_threads);
    if (rc) return rc;
    for (int64_t t = 0; l->b_qkv != NULL && t < T; t++)
        for (int64_t i = 0; i < QKV; i++) qkv[t * QKV + i] += l->b_qkv[i];
    for (int64_t t = 0; l->q_norm != NULL && t < T; t++) { /* in place: each row is read before it is written */
        rms_norm_f32(qkv + t * QKV, l->q_norm, qkv + t * QKV, H, D, l->eps, 1);
        rms_norm_f32(qkv + t * QKV + H * D, l->k_norm, qkv + t * QKV + H * D, KVH, D, l->eps, 1);
    }
    return 0;
}

/* out [T, Hd] = the MLP (or the mixture of experts) of x's post-attention norm; normed [T, Hd],
 * gu [T, 2 I] and a [T, I] its scratch. */
static int layer_mlp(const layer_t *l, const float *x, int64_t T, float *out, float *normed, float *gu, float *a,
                     int num_threads) {
    const int64_t Hd = l->hidden, I = l->inter;
    rms_norm_f32(x, l->ln2, normed, T, Hd, l->eps, num_threads);
    if (l->moe)
        return moe_f32(l->moe, normed, out, T, Hd, num_threads);
    int rc = layer_matmul(l->mm, normed, l->w_gu, gu, T, 2 * I, Hd, num_threads);
    if (rc) return rc;
    silu_mul_f32(gu, a, T, I, num_threads);
    return layer_matmul(l->mm, a, l->w_down, out, T, Hd, I, num_threads);
}

/* The layer `l` in place on x [T, Hd] for the T tokens of a step (prefill chunks, decodes,
 * drafts), every one of them attended through its own list of KV slots (`s`). The new keys
 * (rotated) and values are written at slot_mapping[t] of k_cache, v_cache [num_slots, KVH, D],
 * whose elements are float (kv_type KV_F32) or bfloat16 (KV_BF16: rounded to nearest even at
 * the write). attn_in: NULL for a decoder layer (the attention reads rms_norm(x) * ln1, In = Hd),
 * or the attention's input [T, In] given whole (an EAGLE head: its normed embeddings and
 * features side by side, In = 2 Hd, while x, the residual, is the features; ln1 unused).
 * s->scratch: at least T * (2 Hd + (2 H + 3 KVH) D + H D + 3 I) floats.
 * Returns 0, or the first failing kernel's negative code (mm's, KERNEL_NO_MEMORY), x then
 * partly updated. */
int decoder_layer_f32(const layer_t *l, const step_t *s, float *x, const float *attn_in, int64_t In, int64_t T,
                      void *k_cache, void *v_cache, int kv_type, int num_threads) {
    const int64_t Hd = l->hidden, H = l->heads, KVH = l->kv_heads, D = l->head_dim, I = l->inter;
    const int64_t QKV = (H + 2 * KVH) * D, QK = (H + KVH) * D;
    float *h = s->scratch;       /* [T, Hd]: a normed input */
    float *qkv = h + T * Hd;     /* [T, QKV] */
    float *qk = qkv + T * QKV;   /* [T, H + KVH, D]: rotated queries and keys */
    float *att = qk + T * QK;    /* [T, H D] */
    float *o = att + T * H * D;  /* [T, Hd]: a projection's output */
    float *gu = o + T * Hd;      /* [T, 2 I] */
    float *a = gu + T * 2 * I;   /* [T, I] */
    if (attn_in == NULL) {
        rms_norm_f32(x, l->ln1, h, T, Hd, l->eps, num_threads);
        attn_in = h, In = Hd;
    }
    int rc = layer_qkv(l, attn_in, In, T, qkv, num_threads);
    if (rc) return rc;
    rope_f32(qkv, QKV, s->cos, s->sin, qk, T, H + KVH, D);
    for (int64_t t = 0; t < T; t++) {
        write_kv(k_cache, kv_type, s->slot_mapping[t] * KVH * D, qk + t * QK + H * D, KVH * D);
        write_kv(v_cache, kv_type, s->slot_mapping[t] * KVH * D, qkv + t * QKV + QK, KVH * D);
    }
    if (kv_type == KV_BF16)
        rc = paged_attention_kv_bf16(qk, QK, k_cache, v_cache, s->rows, s->start, s->len, s->slots, att, T, H, KVH,
                                     D, l->scale, num_threads);
    else
        rc = paged_attention_f32(qk, QK, k_cache, v_cache, s->rows, s->start, s->len, s->slots, att, T, H, KVH, D,
                                 l->scale, num_threads);
    if (rc || (rc = layer_matmul(l->mm, att, l->w_o, o, T, Hd, H * D, num_threads))) return rc;
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
    if ((rc = layer_mlp(l, x, T, o, h, gu, a, num_threads))) return rc;
    for (int64_t i = 0; i < T * Hd; i++) x[i] += o[i];
    return 0;
}
