/* The CPU kernels' per-row operations, float32, x86-64 with AVX2 and FMA: called from
 * Python one by one (the layer modules) and from the whole decoder layer (layer.c) and the
 * mixture of experts (moe.c). */
#include "common.h"
#include "specserve_kernels.h"

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

/* out[t] = the index of the first maximum of row t of x [T, N] (of the first NaN, where the
 * row has one), as torch's max(-1).indices and argmax give it: the greedy token of each row
 * of logits, one pass for the max, one for its first index, rows on the threads. */
void argmax_rows_f32(const float *x, int64_t T, int64_t N, int64_t *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(T > 1 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * N;
        __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= N; j += 8) {
            const __m256 v = _mm256_loadu_ps(r + j);
            m = _mm256_max_ps(m, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float best = -INFINITY;
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (int64_t k = j; k < N; k++) {
            has_nan |= r[k] != r[k];
            best = r[k] > best ? r[k] : best;
        }
        int64_t at = 0;
        if (has_nan) {
            while (r[at] == r[at]) at++;
        } else {
            const __m256 b = _mm256_set1_ps(best);
            for (j = 0; j + 8 <= N; j += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), b, _CMP_EQ_OQ));
                if (hit) break;
            }
            for (at = j; at < N && r[at] != best; at++) {}
        }
        out[t] = at < N ? at : 0;
    }
}
