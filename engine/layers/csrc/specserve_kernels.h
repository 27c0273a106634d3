/* The C interface of the CPU kernels: every function the Python side calls and the structs it
 * passes, for two libraries: cpu_kernels (every .c file of csrc/ but quant_kernels.c, loaded by
 * engine/layers/cpu_kernels.py) and quant_kernels (quant_kernels.c, engine/layers/quant.py).
 * Each struct has a ctypes twin there with the same fields in the same order;
 * kernel_struct_offset lets the tests compare their layouts. */
#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H
#include <stdint.h>

/* The element type of a paged KV cache, as cpu_kernels.py passes it. */
enum { KV_F32 = 0, KV_BF16 = 1 };

/* The kernels that allocate return int: 0, or KERNEL_NO_MEMORY (their outputs unwritten). */
enum { KERNEL_NO_MEMORY = -2 };

/* ---- cpu_kernels: matmul.c ---------------------------------------------------------------- */

/* Output features per weight panel: the layout cpu_kernels.kernel_weight gives a weight. */
int weight_panel(void);
/* y [M, N] = x [M, K] @ w^T, w [N, K] in panels. */
void matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads);

/* ---- cpu_kernels: ops.c, the per-row operations ------------------------------------------ */

void rms_norm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps, int num_threads);
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int num_threads);
void argmax_rows_f32(const float *x, int64_t T, int64_t N, int64_t *out, int num_threads);
void rope_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, float *y, int64_t T, int64_t nh,
              int64_t D);

/* ---- cpu_kernels: attention_f32.c, attention_bf16.c (attention_template.h) ---------------- */

int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *rows, const int64_t *start, const int64_t *len, const int64_t *slots,
                        float *out, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale, int num_threads);
int paged_attention_kv_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *rows, const int64_t *start, const int64_t *len, const int64_t *slots,
                            float *out, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale, int num_threads);

/* ---- cpu_kernels: moe.c ------------------------------------------------------------------- */

/* A sparse mixture-of-experts MLP: every weight [out, in] in matmul_f32's layout
 * (cpu_kernels.MoEArgs). */
typedef struct {
    int64_t experts, top_k, inter; /* E experts of intermediate size I (this rank's rows), top_k per token */
    int64_t normalize;             /* the chosen probabilities renormalized to sum 1 */
    int64_t shared_inter;          /* S: the shared expert's intermediate size, 0 where there is none */
    const float *router;           /* [E, Hd] */
    const float *const *gate_up;   /* [E] experts' [2 I, Hd] (gate rows, then up rows) */
    const float *const *down;      /* [E] experts' [Hd, I] */
    const float *shared_gate;      /* [1, Hd] */
    const float *shared_gate_up;   /* [2 S, Hd] */
    const float *shared_down;      /* [Hd, S] */
} moe_t;
int moe_f32(const moe_t *m, const float *h, float *out, int64_t T, int64_t Hd, int num_threads);

/* ---- cpu_kernels: layer.c, a whole decoder layer ----------------------------------------- */

/* A matmul y [M, N] = x [M, K] @ W^T whose weight W is its own handle w (quant_layer_matmul's
 * quant_matrix); returns 0 or a negative code. */
typedef int (*layer_matmul_fn)(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                               int num_threads);

/* A decoder layer's constants, the same at every step (cpu_kernels.LayerArgs). Weights [out, in]
 * in matmul_f32's layout, or mm's handles where mm is set. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim; /* Hd, H, KVH, D */
    int64_t inter;                             /* I: the gated MLP's intermediate size, 0 with moe */
    float eps, scale;                          /* the norms' epsilon, the attention's softmax scale */
    const float *ln1, *ln2;                    /* [Hd]: the input and post-attention norms' weights */
    const float *w_qkv;                        /* [(H + 2 KVH) D, In] */
    const float *w_o;                          /* [Hd, H D] */
    const float *w_gu;                         /* [2 I, Hd]: gate rows, then up rows */
    const float *w_down;                       /* [Hd, I] */
    const float *b_qkv;                        /* [(H + 2 KVH) D] or NULL: Qwen2's qkv biases */
    const float *q_norm, *k_norm;              /* [D] or NULL: Qwen3's per-head norms of q and k */
    layer_matmul_fn mm;                        /* NULL: matmul_f32 */
    const moe_t *moe;                          /* NULL: the gated MLP of w_gu and w_down (else unused,
                                                * I = 0; the experts always take matmul_f32) */
} layer_t;

/* A step's inputs of every layer (cpu_kernels.StepArgs): the rope of each token, where its new
 * key and value go, the KV slots it attends through, and the layer's scratch. */
typedef struct {
    const float *cos, *sin;                             /* [T, D] */
    const int64_t *slot_mapping;                        /* [T] */
    const int64_t *rows, *start, *len, *slots;          /* paged_attention_f32's lists */
    float *scratch;                                     /* cpu_kernels.scratch_size floats */
} step_t;

int decoder_layer_f32(const layer_t *layer, const step_t *step, float *x, const float *attn_in, int64_t In,
                      int64_t T, void *k_cache, void *v_cache, int kv_type, int num_threads);

/* ---- cpu_kernels: layout.c ---------------------------------------------------------------- */

/* The offset of `field` in the struct called `name` here ("layer_t", "step_t", "moe_t",
 * "quant_matrix"), or its size where field is NULL; -1 for a name or field it does not know. */
int64_t kernel_struct_offset(const char *name, const char *field);

/* ---- quant_kernels: quant_kernels.c ------------------------------------------------------- */

/* A weight of quant_linear's parts behind one pointer: what quant_layer_matmul reads
 * (quant._Matrix). */
typedef struct {
    int parts;
    const int *fmts;
    const uint8_t *const *ws;
    const int64_t *ns;
} quant_matrix;

void quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *dx, float *isum);
int64_t panel_bytes(int fmt, int64_t K);
int quant_linear(const float *x, int64_t M, int64_t K, int parts, const int *fmts, const uint8_t *const *ws,
                 const int64_t *ns, float *y, int num_threads);
void panel_rows(int fmt, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out);
int quant_layer_matmul(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K, int num_threads);
#endif
