/* The GEMM over weights packed in panels (fp32, or int8 with a scale per output
 * feature), and the linear layer that picks it or the GEMV (see kernels.h). */
#include "kernels.h"

/* ------------------------------------------------------------ packed GEMM */

/* y[m, n] = x[m, k] w[n, k]^T from w packed in panels of GEMM_NR output features (32
 * with AVX-512, else 16: two vector registers):
 * panel p holds w[p * NR + j, kk] at (p * k + kk) * NR + j (rows past n are 0; see
 * pd_gemm_panel_floats). Each thread takes a contiguous run of panels and, per panel,
 * the rows of x in blocks of at most GEMM_MR: a block's GEMM_MR x NR sums stay in
 * registers, K goes in chunks of GEMM_KC so a chunk of the panel (8-16 KiB) is read from
 * memory once and from L1 by the other blocks, and the first block prefetches (into L2)
 * two chunks ahead within the thread's run. Timed on an AMD EPYC (2 threads, the
 * bench55m model's 33 linears in a step's order, every weight from memory): 1.2-1.3x
 * faster than oneDNN's packed GEMM at 32 rows, 1.4-1.9x at 4-16, about equal from 128.
 * Int8 panels have the same layout in int8; each panel row is widened to fp32 in
 * registers once for the block's rows, and the sums are scaled as they are stored. */
#if LANES == 16
#define GEMM_MR 14 /* 28 sums in AVX-512's 32 registers */
#else
#define GEMM_MR 6 /* 12 sums in AVX2's 16 */
#endif
#define GEMM_NR (2 * LANES) /* a panel's output features: two vectors */
#define GEMM_KC 128
#define GEMM_PREFETCH_ROWS (2 * GEMM_KC)
#define GEMM_ROW_TILE 256 /* rows of x per pass over the panels (the sums' buffer) */

int64_t pd_gemm_panel_width(void) { return GEMM_NR; }

int64_t pd_gemm_panel_floats(int64_t n, int64_t k) {
    return (n + GEMM_NR - 1) / GEMM_NR * k * GEMM_NR;
}

/* c[mr, NR] = (or +=, after the first chunk) a[mr, k0:k1] panel[k0:k1, NR] (fp32, or
 * int8 unscaled); prefetches the panel rows GEMM_PREFETCH_ROWS ahead while they are
 * below prefetch_rows (0: none) */
static inline __attribute__((always_inline)) void gemm_block(
    const float *restrict a, int64_t lda, int mr, const void *restrict panel, int int8,
    int64_t k0, int64_t k1, float *restrict c, int first, int64_t prefetch_rows) {
    const int64_t size = int8 ? 1 : (int64_t)sizeof(float);
    fv acc[GEMM_MR][2];
    for (int i = 0; i < GEMM_MR; i++) {
        if (i < mr && !first) {
            acc[i][0] = loadv(c + i * GEMM_NR);
            acc[i][1] = loadv(c + i * GEMM_NR + LANES);
        } else {
            acc[i][0] = acc[i][1] = (fv){0};
        }
    }
    for (int64_t kk = k0; kk < k1; kk++) {
        const fv b0 = load_weights(panel, kk * GEMM_NR, int8);
        const fv b1 = load_weights(panel, kk * GEMM_NR + LANES, int8);
        if (kk + GEMM_PREFETCH_ROWS < prefetch_rows) /* still inside the thread's run */
            for (int64_t line = 0; line < GEMM_NR * size; line += 64)
                __builtin_prefetch((const char *)panel + (kk + GEMM_PREFETCH_ROWS) * GEMM_NR * size
                                   + line, 0, 2);
#pragma GCC unroll 14
        for (int i = 0; i < GEMM_MR; i++) {
            if (i < mr) {
                const float xi = a[i * lda + kk]; /* broadcast to one register */
                acc[i][0] += xi * b0;
                acc[i][1] += xi * b1;
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        storev(c + i * GEMM_NR, acc[i][0]);
        storev(c + i * GEMM_NR + LANES, acc[i][1]);
    }
}

/* gemm_block with mr a constant (so the unused sums vanish) */
static inline __attribute__((always_inline)) void gemm_block_any(
    const float *a, int64_t lda, int mr, const void *panel, int int8, int64_t k0, int64_t k1,
    float *c, int first, int64_t prefetch_rows) {
    switch (mr) {
#define GEMM_BLOCK_CASE(r) \
    case r: gemm_block(a, lda, r, panel, int8, k0, k1, c, first, prefetch_rows); return;
#if GEMM_MR == 14
    GEMM_BLOCK_CASE(14) GEMM_BLOCK_CASE(13) GEMM_BLOCK_CASE(12) GEMM_BLOCK_CASE(11)
    GEMM_BLOCK_CASE(10) GEMM_BLOCK_CASE(9) GEMM_BLOCK_CASE(8) GEMM_BLOCK_CASE(7)
#endif
    GEMM_BLOCK_CASE(6) GEMM_BLOCK_CASE(5) GEMM_BLOCK_CASE(4) GEMM_BLOCK_CASE(3)
    GEMM_BLOCK_CASE(2)
    default: gemm_block(a, lda, 1, panel, int8, k0, k1, c, first, prefetch_rows); return;
#undef GEMM_BLOCK_CASE
    }
}

/* the packed GEMM over either weight type (int8 a constant where inlined; scales[n]
 * where it is set) */
static inline __attribute__((always_inline)) int gemm_packed(
    const float *x, int64_t m, int64_t k, const void *panels, int int8, const float *scales,
    int64_t n, const float *bias, float *y, int num_threads) {
    if (m < 1 || k < 1 || n < 1 || num_threads < 1 || (int8 && !scales)) return -1;
    const int64_t size = int8 ? 1 : (int64_t)sizeof(float);
    const int64_t num_panels = (n + GEMM_NR - 1) / GEMM_NR;
    /* every thread gets two panels at least: a narrow output runs on fewer threads */
    const int64_t most = num_panels / 2 < 1 ? 1 : num_panels / 2;
    const int threads = num_threads < most ? num_threads : (int)most;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t p0 = num_panels * t / count, p1 = num_panels * (t + 1) / count;
        const int64_t run_rows = (p1 - p0) * k; /* k-rows of panels in the run: prefetch bound */
        float sums[GEMM_ROW_TILE * GEMM_NR];
        for (int64_t r0 = 0; r0 < m; r0 += GEMM_ROW_TILE) {
            const int64_t rows = m - r0 < GEMM_ROW_TILE ? m - r0 : GEMM_ROW_TILE;
            const int64_t blocks = (rows + GEMM_MR - 1) / GEMM_MR;
            const float *xt = x + r0 * k;
            for (int64_t p = p0; p < p1; p++) {
                const char *panel = (const char *)panels + p * k * GEMM_NR * size;
                for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
                    const int64_t k1 = k0 + GEMM_KC < k ? k0 + GEMM_KC : k;
                    for (int64_t b = 0; b < blocks; b++) { /* blocks of near-equal size */
                        const int64_t b0 = rows * b / blocks, b1 = rows * (b + 1) / blocks;
                        gemm_block_any(xt + b0 * k, k, (int)(b1 - b0), panel, int8, k0, k1,
                                       sums + b0 * GEMM_NR, k0 == 0,
                                       b == 0 ? run_rows - (p - p0) * k : 0);
                    }
                }
                const int64_t cols = n - p * GEMM_NR < GEMM_NR ? n - p * GEMM_NR : GEMM_NR;
                for (int64_t i = 0; i < rows; i++) {
                    float *yr = y + (r0 + i) * n + p * GEMM_NR;
                    const float *sr = sums + i * GEMM_NR;
                    if (int8) {
                        const float *sc = scales + p * GEMM_NR;
                        for (int64_t j = 0; j < cols; j++)
                            yr[j] = bias ? sr[j] * sc[j] + bias[p * GEMM_NR + j] : sr[j] * sc[j];
                    } else if (bias)
                        for (int64_t j = 0; j < cols; j++) yr[j] = sr[j] + bias[p * GEMM_NR + j];
                    else
                        for (int64_t j = 0; j < cols; j++) yr[j] = sr[j];
                }
            }
        }
    }
    return 0;
}

/* y[m, n] = x[m, k] w^T (+ bias[n]), w packed by panels (see above); x, y contiguous. */
int pd_gemm_packed_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                       const float *bias, float *y, int num_threads) {
    return gemm_packed(x, m, k, panels, 0, NULL, n, bias, y, num_threads);
}

/* y[m, n] = (x[m, k] q^T) * scales[n] (+ bias[n]), q int8 packed by panels as above. */
int pd_gemm_packed_i8(const float *x, int64_t m, int64_t k, const int8_t *panels,
                      const float *scales, int64_t n, const float *bias, float *y,
                      int num_threads) {
    return gemm_packed(x, m, k, panels, 1, scales, n, bias, y, num_threads);
}

/* A linear layer's product from the copies it has: the GEMV on w itself for up to
 * GEMV_MAX_X_ROWS rows where w is given, else the packed GEMM where panels are. */
int pd_linear_f32(const float *x, int64_t m, int64_t k, const float *w, const float *panels,
                  int64_t n, const float *bias, float *y, int num_threads) {
    if (w && m <= GEMV_MAX_X_ROWS) return pd_gemv_f32(x, m, k, w, n, bias, y, num_threads);
    if (panels) return pd_gemm_packed_f32(x, m, k, panels, n, bias, y, num_threads);
    return -1;
}

/* pd_linear_f32 for a weight of either type: fp32 where scales is NULL, else int8 (w
 * and panels then int8, scales[n] their output features' scales). */
int pd_linear_any(const float *x, int64_t m, int64_t k, const void *w, const void *panels,
                  const float *scales, int64_t n, const float *bias, float *y,
                  int num_threads) {
    if (!scales) return pd_linear_f32(x, m, k, w, panels, n, bias, y, num_threads);
    if (w && m <= GEMV_MAX_X_ROWS) return pd_gemv_i8(x, m, k, w, scales, n, bias, y, num_threads);
    if (panels) return pd_gemm_packed_i8(x, m, k, panels, scales, n, bias, y, num_threads);
    return -1;
}
