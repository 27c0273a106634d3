/* The sparse mixture-of-experts MLP of the CPU kernels, float32 (engine/models/moe.py):
 * routing, the chosen experts and their weighted sum in one call, from the layer modules
 * (cpu_kernels.moe) and from the whole decoder layer (decoder_layer_f32) alike. */
#include "common.h"
#include "specserve_kernels.h"

/* The router: probs [E] = softmax(logits [E]) in place; the top_k largest (ties: the lower
 * expert id) go to ids [top_k] and their probabilities to w [top_k], in rank order,
 * renormalized to sum 1 when `normalize`. */
static void route(float *probs, int64_t E, int64_t top_k, int64_t normalize, int64_t *ids, float *w) {
    float mx = probs[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) mx = probs[e] > mx ? probs[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += probs[e] = expf(probs[e] - mx);
    for (int64_t e = 0; e < E; e++) probs[e] /= sum;
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = best, w[j] = probs[best];
        chosen += w[j];
    }
    for (int64_t j = 0; normalize && j < top_k; j++) w[j] /= chosen;
}

/* The gated MLP down(silu(gate(x)) * up(x)) of n rows x [n, Hd] -> y [n, Hd]: gu [n, 2 I]
 * and a [n, I] are its scratch. The same kernels, in the same order, as LlamaMLP's. */
static void gated_mlp(const float *w_gu, const float *w_down, const float *x, float *gu, float *a, float *y,
                      int64_t n, int64_t Hd, int64_t I, int num_threads) {
    matmul_f32(x, w_gu, gu, n, 2 * I, Hd, num_threads);
    silu_mul_f32(gu, a, n, I, num_threads);
    matmul_f32(a, w_down, y, n, Hd, I, num_threads);
}

/* The counting sort of the P = T * K (token, rank) pairs by expert: ``first`` [E + 1] the
 * start of each expert's run, ``pos`` [P] each pair's sorted row, ``xs`` [P, Hd] its token's row
 * copied there (tokens in order within an expert). ``next`` [E + 1]: the sort's cursors. */
static void sort_by_expert(const int64_t *ids, const float *h, int64_t P, int64_t E, int64_t K, int64_t Hd,
                           int64_t *first, int64_t *next, int64_t *pos, float *xs) {
    memset(first, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) first[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    memcpy(next, first, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) {
        pos[p] = next[ids[p]]++;
        memcpy(xs + pos[p] * Hd, h + p / K * Hd, sizeof(float) * Hd);
    }
}

/* out [T, Hd] = each token's experts' outputs ``ys`` (at rows ``pos``) weighted by ``w`` [T, K],
 * summed in rank order. */
static void combine_experts(const float *ys, const float *w, const int64_t *pos, float *out, int64_t T, int64_t K,
                            int64_t Hd) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * Hd;
        const float *y0 = ys + pos[t * K] * Hd;
        for (int64_t i = 0; i < Hd; i++) o[i] = w[t * K] * y0[i];
        for (int64_t j = 1; j < K; j++) {
            const float wj = w[t * K + j], *yj = ys + pos[t * K + j] * Hd;
            for (int64_t i = 0; i < Hd; i++) o[i] += wj * yj[i];
        }
    }
}

/* out += sigmoid(h . shared_gate) * the shared expert's MLP of h; ``scratch``: T (1 + 3 S + Hd) floats. */
static void add_shared_expert(const moe_t *m, const float *h, float *scratch, float *out, int64_t T, int64_t Hd,
                              int num_threads) {
    const int64_t S = m->shared_inter;
    float *g = scratch, *sgu = g + T;              /* [T]: the shared expert's gate, [T, 2 S] */
    float *sa = sgu + T * 2 * S, *sy = sa + T * S; /* [T, S], [T, Hd] */
    matmul_f32(h, m->shared_gate, g, T, 1, Hd, num_threads);
    gated_mlp(m->shared_gate_up, m->shared_down, h, sgu, sa, sy, T, Hd, S, num_threads);
    for (int64_t t = 0; t < T; t++) {
        const float s = 1.0f / (1.0f + expf(-g[t]));
        for (int64_t i = 0; i < Hd; i++) out[t * Hd + i] += s * sy[t * Hd + i];
    }
}

/* out [T, Hd] = for each token of h [T, Hd], the sum over its top_k experts in rank order
 * of weight * expert(h), plus sigmoid(shared_gate . h) * shared(h) where there is a shared
 * expert. The T * top_k (token, rank) pairs are sorted by expert (a counting sort, tokens
 * in order within an expert); each expert multiplies its run of gathered rows, all experts
 * in one grouped_matmul_f32 per matrix (one fork and join, not one per expert), whose every
 * row is the same bits at any row count, so a token's result never depends on which
 * tokens share its experts. Its buffers are allocated here: their size
 * depends on T and top_k only. */
int moe_f32(const moe_t *m, const float *h, float *out, int64_t T, int64_t Hd, int num_threads) {
    const int64_t E = m->experts, K = m->top_k, I = m->inter, S = m->shared_inter, P = T * K;
    const int64_t ints = 2 * P + 2 * (E + 1);
    const int64_t floats = T * E + P + P * (2 * Hd + 3 * I) + (S ? T * (1 + 3 * S + Hd) : 0);
    int64_t *buf = malloc(sizeof(int64_t) * ints + sizeof(float) * floats);
    if (!buf) return KERNEL_NO_MEMORY;
    int64_t *ids = buf;            /* [T, K]: each pair's expert */
    int64_t *pos = ids + P;        /* [T, K]: each pair's row among the sorted ones */
    int64_t *first = pos + P;      /* [E + 1]: expert e's sorted rows are first[e] .. first[e + 1] - 1 */
    int64_t *next = first + E + 1; /* [E + 1]: the counting sort's cursors */
    float *probs = (float *)(next + E + 1); /* [T, E] */
    float *w = probs + T * E;      /* [T, K]: each pair's weight */
    float *xs = w + P;             /* [P, Hd]: the pairs' token rows, expert by expert */
    float *gu = xs + P * Hd;       /* [P, 2 I] */
    float *a = gu + P * 2 * I;     /* [P, I] */
    float *ys = a + P * I;         /* [P, Hd]: the pairs' expert outputs */
    matmul_f32(h, m->router, probs, T, E, Hd, num_threads);
    for (int64_t t = 0; t < T; t++) route(probs + t * E, E, K, m->normalize, ids + t * K, w + t * K);
    sort_by_expert(ids, h, P, E, K, Hd, first, next, pos, xs);
    const float *gu_in[E], *gu_w[E], *down_in[E], *down_w[E]; /* the experts with rows: inputs and weights */
    float *gu_out[E], *down_out[E];
    int64_t rows[E], used = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t r = first[e];
        if (first[e + 1] == r)
            continue;
        gu_in[used] = xs + r * Hd, gu_w[used] = m->gate_up[e], gu_out[used] = gu + r * 2 * I;
        down_in[used] = a + r * I, down_w[used] = m->down[e], down_out[used] = ys + r * Hd;
        rows[used++] = first[e + 1] - r;
    }
    /* gated_mlp's kernels, each over every expert at once */
    if (grouped_matmul_f32(used, gu_in, gu_w, gu_out, rows, 2 * I, Hd, num_threads)) {
        free(buf);
        return KERNEL_NO_MEMORY;
    }
    silu_mul_f32(gu, a, P, I, num_threads);
    if (grouped_matmul_f32(used, down_in, down_w, down_out, rows, Hd, I, num_threads)) {
        free(buf);
        return KERNEL_NO_MEMORY;
    }
    combine_experts(ys, w, pos, out, T, K, Hd);
    if (S) add_shared_expert(m, h, ys + P * Hd, out, T, Hd, num_threads);
    free(buf);
    return 0;
}
