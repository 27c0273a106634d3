/* The machine's streaming read speed, the floor under a decode step's time: the sum of n
 * floats read once, 64-byte aligned, by num_threads threads in contiguous shares, each share
 * read as STREAMS streams side by side, 128 bytes of each in turn (a core reads memory faster
 * from several streams than from one; 8 was the fastest on a Zen 2 EPYC, about twice one
 * stream). bench/kernels.py compiles and calls it. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define STREAMS 8

float stream_read_f32(const float *a, int64_t n, int num_threads) {
    float total = 0;
    #pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int64_t share = n / omp_get_num_threads(), len = share / STREAMS / 32 * 32; /* floats per stream */
        const float *base = a + omp_get_thread_num() * share;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < len; i += 32)
            for (int s = 0; s < STREAMS; s++) {
                const float *p = base + s * len + i;
                s0 = _mm256_add_ps(s0, _mm256_load_ps(p));
                s1 = _mm256_add_ps(s1, _mm256_load_ps(p + 8));
                s2 = _mm256_add_ps(s2, _mm256_load_ps(p + 16));
                s3 = _mm256_add_ps(s3, _mm256_load_ps(p + 24));
            }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (int j = 0; j < 8; j++) total += lanes[j];
    }
    return total;
}
