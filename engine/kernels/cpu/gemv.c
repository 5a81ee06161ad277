/* The batch-1 to 3 GEMV (see kernels.h). */
#include "kernels.h"

/* ------------------------------------------------------------------------- GEMV */

/* Each thread takes one contiguous run of weight rows and reads it as one stream, a
 * row at a time (four vector sums per row of x), prefetching GEMV_PREFETCH_FLOATS
 * ahead within its run. Paired timings of the bench55m decode stack and LM head on an
 * AMD EPYC: 1.22x faster at batch 1 and 1.42x at batch 2 than four rows at a time with
 * the next group prefetched (the hardware prefetcher alone leaves the core waiting on
 * memory at batch 1). The prefetches go to L2 (prefetcht1): the bench55m model's 33
 * linears at batch 1, every weight from memory, ran 1.1-1.2x faster than with
 * non-temporal prefetches (prefetchnta), which were slower than none at all. */
#define GEMV_PREFETCH_FLOATS 1024 /* 4 KiB */
#define GEMV_CHUNK (4 * LANES)

/* y[i, row] for rows [first, end) of w and rows i < m <= GEMV_MAX_X_ROWS of x; inlined
 * with m a constant, so the sums stay in registers */
static inline __attribute__((always_inline)) void gemv_rows(
    const float *restrict x, int64_t m, int64_t k, const float *restrict w, int64_t first,
    int64_t end, int64_t n, const float *restrict bias, float *restrict y) {
    const float *stop = w + end * k; /* this thread's run: prefetches stay inside it */
    const int64_t vec = k - k % GEMV_CHUNK;
    for (int64_t row = first; row < end; row++) {
        const float *wr = w + row * k;
        fv acc[GEMV_MAX_X_ROWS][4] = {{{0}}};
        for (int64_t j = 0; j < vec; j += GEMV_CHUNK) {
            const float *ahead = wr + j + GEMV_PREFETCH_FLOATS;
            if (ahead + GEMV_CHUNK <= stop)
                for (int c = 0; c < 4; c++) __builtin_prefetch(ahead + c * LANES, 0, 2);
            const fv w0 = loadv(wr + j), w1 = loadv(wr + j + LANES);
            const fv w2 = loadv(wr + j + 2 * LANES), w3 = loadv(wr + j + 3 * LANES);
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
            for (int64_t j = vec; j < k; j++) a += wr[j] * x[i * k + j];
            y[i * n + row] = bias ? a + bias[row] : a;
        }
    }
}

/* y[m, n] = x[m, k] w[n, k]^T (+ bias[n]); all contiguous, m small (a decode batch:
 * at most GEMV_MAX_X_ROWS; the caller decides from how many a GEMM takes over). */
int pd_gemv_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                const float *bias, float *y, int num_threads) {
    if (m < 1 || m > GEMV_MAX_X_ROWS || k < 1 || n < 1 || num_threads < 1) return -1;
    /* a thread only where it gets a few rows: tiny matrices stay on the caller's */
    const int threads = n >= 8 * num_threads ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = n * t / count, end = n * (t + 1) / count;
        switch (m) {
        case 1: gemv_rows(x, 1, k, w, first, end, n, bias, y); break;
        case 2: gemv_rows(x, 2, k, w, first, end, n, bias, y); break;
        default: gemv_rows(x, 3, k, w, first, end, n, bias, y); break;
        }
    }
    return 0;
}
