/* The batch-1 to 3 GEMV, over fp32 weights or int8 ones with a scale per row (see
 * kernels.h). */
#include "kernels.h"

/* ------------------------------------------------------------------------- GEMV */

/* Each thread takes one contiguous run of weight rows and reads it as one stream, a
 * row at a time (four vector sums per row of x), prefetching GEMV_PREFETCH_BYTES
 * ahead within its run. Paired timings of the bench55m decode stack and LM head on an
 * AMD EPYC: 1.22x faster at batch 1 and 1.42x at batch 2 than four rows at a time with
 * the next group prefetched (the hardware prefetcher alone leaves the core waiting on
 * memory at batch 1). The prefetches go to L2 (prefetcht1): the bench55m model's 33
 * linears at batch 1, every weight from memory, ran 1.1-1.2x faster than with
 * non-temporal prefetches (prefetchnta), which were slower than none at all.
 *
 * An int8 weight is read the same way, a quarter of the bytes: each vector of int8 is
 * widened to fp32 in registers (load_weights), the sums stay fp32, and a row's sum is
 * multiplied by its scale at the end (y = (x q^T) * scale + bias). */
#define GEMV_PREFETCH_BYTES 4096
#define GEMV_CHUNK (4 * LANES) /* weights per step of a row: four vectors */

/* y[i, row] for rows [first, end) of w and rows i < m <= GEMV_MAX_X_ROWS of x; inlined
 * with m and the weight type constants, so the sums stay in registers. scales: NULL for
 * an fp32 w, else w is int8 and scales[row] its rows' scales. */
static inline __attribute__((always_inline)) void gemv_rows(
    const float *restrict x, int64_t m, int64_t k, const void *restrict w, int int8,
    const float *restrict scales, int64_t first, int64_t end, int64_t n,
    const float *restrict bias, float *restrict y) {
    const int64_t size = int8 ? 1 : (int64_t)sizeof(float);
    const char *stop = (const char *)w + end * k * size; /* this thread's run: prefetches stay inside it */
    const int64_t vec = k - k % GEMV_CHUNK;
    for (int64_t row = first; row < end; row++) {
        const char *wr = (const char *)w + row * k * size;
        fv acc[GEMV_MAX_X_ROWS][4] = {{{0}}};
        for (int64_t j = 0; j < vec; j += GEMV_CHUNK) {
            const char *ahead = wr + j * size + GEMV_PREFETCH_BYTES;
            if (ahead + GEMV_CHUNK * size <= stop)
                for (int64_t c = 0; c < GEMV_CHUNK * size; c += 64) __builtin_prefetch(ahead + c, 0, 2);
            const fv w0 = load_weights(wr, j, int8), w1 = load_weights(wr, j + LANES, int8);
            const fv w2 = load_weights(wr, j + 2 * LANES, int8);
            const fv w3 = load_weights(wr, j + 3 * LANES, int8);
            for (int64_t i = 0; i < m; i++) {
                const float *xi = x + i * k + j;
                acc[i][0] += w0 * loadv(xi);
                acc[i][1] += w1 * loadv(xi + LANES);
                acc[i][2] += w2 * loadv(xi + 2 * LANES);
                acc[i][3] += w3 * loadv(xi + 3 * LANES);
            }
        }
        for (int64_t i = 0; i < m; i++) {
            float a = sum_lanes((acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]));
            for (int64_t j = vec; j < k; j++) a += weight_at(wr, j, int8) * x[i * k + j];
            if (int8) a *= scales[row];
            y[i * n + row] = bias ? a + bias[row] : a;
        }
    }
}

/* the GEMV over either weight type (int8 a constant where inlined) */
static inline __attribute__((always_inline)) int gemv(
    const float *x, int64_t m, int64_t k, const void *w, int int8, const float *scales,
    int64_t n, const float *bias, float *y, int num_threads) {
    if (m < 1 || m > GEMV_MAX_X_ROWS || k < 1 || n < 1 || num_threads < 1) return -1;
    /* a thread only where it gets a few rows: tiny matrices stay on the caller's */
    const int threads = n >= 8 * num_threads ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = n * t / count, end = n * (t + 1) / count;
        switch (m) {
        case 1: gemv_rows(x, 1, k, w, int8, scales, first, end, n, bias, y); break;
        case 2: gemv_rows(x, 2, k, w, int8, scales, first, end, n, bias, y); break;
        default: gemv_rows(x, 3, k, w, int8, scales, first, end, n, bias, y); break;
        }
    }
    return 0;
}

/* y[m, n] = x[m, k] w[n, k]^T (+ bias[n]); all contiguous, m small (a decode batch:
 * at most GEMV_MAX_X_ROWS; the caller decides from how many a GEMM takes over). */
int pd_gemv_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                const float *bias, float *y, int num_threads) {
    return gemv(x, m, k, w, 0, NULL, n, bias, y, num_threads);
}

/* y[m, n] = (x[m, k] q[n, k]^T) * scales[n] (+ bias[n]) for an int8 q; as pd_gemv_f32. */
int pd_gemv_i8(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales,
               int64_t n, const float *bias, float *y, int num_threads) {
    if (!scales) return -1;
    return gemv(x, m, k, q, 1, scales, n, bias, y, num_threads);
}
