/* The machine's streaming read speed, the floor under a decode step's time: the sum of n
 * floats read once, 64-byte aligned, by num_threads threads in contiguous shares, each
 * prefetching 6 KiB ahead into L2 as the matmul does (bench/kernels.py compiles and calls it). */
#include <immintrin.h>
#include <stdint.h>

float stream_read_f32(const float *a, int64_t n, int num_threads) {
    float total = 0;
    #pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n - 31; i += 32) {
            _mm_prefetch((const char *)(a + i + 1536), _MM_HINT_T1);
            _mm_prefetch((const char *)(a + i + 1552), _MM_HINT_T1);
            s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
            s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
            s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
            s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (int j = 0; j < 8; j++) total += lanes[j];
    }
    return total;
}
