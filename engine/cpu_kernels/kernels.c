/* pdserve's compiled CPU kernels (fp32), called from engine/cpu_kernels/__init__.py.
 *
 * Built at first use with the machine's C compiler for the machine's own CPU
 * (-O3 -march=native -fopenmp; PDSERVE_CPU_KERNELS_MARCH names another target). Vector
 * code is written with GCC/Clang vector extensions in the target's own register width
 * (LANES below) or left to the compiler (OpenMP simd), so the same source serves AVX2,
 * AVX-512 and other targets. OpenMP
 * threads come from the runtime torch already loaded (libgomp, matched by soname), so
 * these kernels share torch's thread pool instead of starting a second one.
 *
 * Every function returns 0 on success and a negative code for arguments it does not
 * handle (the caller then uses its torch path); it never reads or writes outside the
 * buffers its arguments describe.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* ---------------------------------------------------------------------- RMSNorm */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of dim floats (fp32
 * throughout, as Hugging Face computes it). Rows are split over the threads only when
 * there are enough of them to pay for waking a thread. */
int pd_rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                    float *out, int num_threads) {
    if (rows < 0 || dim < 1 || num_threads < 1) return -1;
    const int threads = rows * dim >= 65536 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; d++) squares += xr[d] * xr[d];
        const float inv = 1.f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = xr[d] * inv * weight[d];
    }
    return 0;
}

/* ------------------------------------------------------- paged decode attention */

#define ATTN_MAX_ROWS 64        /* query heads in one task */
#define ATTN_MAX_ACC 8192       /* query rows * head_dim: one task's accumulators */

/* One vector register of floats: GCC/Clang vector extensions in the target's own width
 * (16 floats with AVX-512, else 8: AVX2, and NEON as two registers). A 64-byte vector
 * on an AVX2 target is kept in memory by GCC, which made every kernel here several times
 * slower there. Loads and stores go through memcpy (unaligned). */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float fv __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t iv __attribute__((vector_size(LANES * sizeof(int32_t))));
#define ATTN_HEAD_MULTIPLE 16 /* head_dim the attention takes (what the Python side checks) */

static inline fv loadv(const float *p) {
    fv v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, fv v) { __builtin_memcpy(p, &v, sizeof v); }

/* The lane sums of LANES vectors, as one vector: out[t] = sum of v[t]'s lanes. Seen as
 * 4-float quarters, the first two rounds interleave and add within quarters (cheap
 * in-quarter shuffles: unpack by float, then by float pair), leaving quarter q of u[j]
 * with the partial sums of tokens 4j..4j+3 over quarter q's lanes; the last rounds add
 * quarters across vectors, which puts token t in lane t. */
static inline fv lane_sums(fv v[LANES]) {
#if LANES == 16
    const iv lo1 = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
    const iv hi1 = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
    const iv lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const iv hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const iv even_quarters = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const iv odd_quarters = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
#else
    const iv lo1 = {0, 8, 1, 9, 4, 12, 5, 13}, hi1 = {2, 10, 3, 11, 6, 14, 7, 15};
    const iv lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const iv even_quarters = {0, 1, 2, 3, 8, 9, 10, 11}, odd_quarters = {4, 5, 6, 7, 12, 13, 14, 15};
#endif
    fv pairs[LANES / 2], quads[LANES / 4];
    for (int i = 0; i < LANES / 2; i++)
        pairs[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1)
                   + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
    for (int i = 0; i < LANES / 4; i++)
        quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], lo2)
                   + __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], hi2);
#if LANES == 16
    for (int i = 0; i < 2; i++)
        quads[i] = __builtin_shuffle(quads[2 * i], quads[2 * i + 1], even_quarters)
                   + __builtin_shuffle(quads[2 * i], quads[2 * i + 1], odd_quarters);
#endif
    return __builtin_shuffle(quads[0], quads[1], even_quarters)
           + __builtin_shuffle(quads[0], quads[1], odd_quarters);
}

/* where mask lanes are set, a; elsewhere b */
static inline fv selectv(iv mask, fv a, fv b) {
    return (fv)((mask & (iv)a) | (~mask & (iv)b));
}

/* e^x for x <= 0 (softmax weights), lane-wise: x = n ln2 + r with |r| <= ln2 / 2, e^r by
 * its degree-6 Taylor polynomial (relative error about 2.3e-7), 2^n from the exponent
 * bits. Arguments below -87 (-inf included) give 0. */
static inline fv exp_nonpositive(fv x) {
    const fv zero = {0}, lowest = zero - 87.f, magic = zero + 12582912.f; /* 1.5 * 2^23 rounds */
    const iv underflow = x < lowest;
    x = selectv(underflow, lowest, x);
    fv n = (x * 1.44269504f + magic) - magic;
    fv r = x - n * 0.693359375f + n * 2.12194440e-4f;
    fv p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    iv bits = (__builtin_convertvector(n, iv) + 127) << 23;
    return selectv(underflow, zero, p * (fv)bits);
}

/* The dot products of query qg [chunks * LANES] with n <= LANES keys, token t's at
 * kb + t * stride, as one vector (lanes past n are 0). A full run keeps its LANES
 * partial sums in registers (the loops have constant bounds). */
static inline fv score_run(const float *qg, const float *kb, int64_t stride, int64_t chunks,
                           int64_t n) {
    fv dots[LANES];
    for (int t = 0; t < LANES; t++) dots[t] = (fv){0};
    if (n == LANES) {
        for (int64_t c = 0; c < chunks; c++) {
            const fv qc = loadv(qg + c * LANES);
#pragma GCC unroll 16
            for (int t = 0; t < LANES; t++) dots[t] += qc * loadv(kb + t * stride + c * LANES);
        }
    } else {
        for (int t = 0; t < n; t++)
            for (int64_t c = 0; c < chunks; c++)
                dots[t] += loadv(qg + c * LANES) * loadv(kb + t * stride + c * LANES);
    }
    return lane_sums(dots);
}

/* v with its lanes moved by `by` within each group of 2 * by (a butterfly step) */
static inline fv swap_lanes(fv v, int by) {
#if LANES == 16
    static const iv masks[4] = {
        {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
        {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
        {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
        {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}};
#else
    static const iv masks[3] = {
        {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5}, {4, 5, 6, 7, 0, 1, 2, 3}};
#endif
    return __builtin_shuffle(v, masks[by == 1 ? 0 : by == 2 ? 1 : by == 4 ? 2 : LANES / 8 + 1]);
}

/* the largest lane (NaN-free input), by butterfly steps */
static inline float max_lanes(fv v) {
    for (int by = LANES / 2; by >= 1; by /= 2) {
        const fv w = swap_lanes(v, by);
        v = selectv(w > v, w, v);
    }
    return v[0];
}

static inline float sum_lanes(fv v) {
    for (int by = LANES / 2; by >= 1; by /= 2) v += swap_lanes(v, by);
    return v[0];
}

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
#define GEMV_MAX_X_ROWS 3 /* four were slower than oneDNN on an AMD EPYC */
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
 * faster than oneDNN's packed GEMM at 32 rows, 1.4-1.9x at 4-16, about equal from 128. */
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

/* c[mr, NR] = (or +=, after the first chunk) a[mr, k0:k1] panel[k0:k1, NR]; prefetches
 * the panel rows GEMM_PREFETCH_ROWS ahead while they are below prefetch_rows (0: none) */
static inline __attribute__((always_inline)) void gemm_block(
    const float *restrict a, int64_t lda, int mr, const float *restrict panel, int64_t k0,
    int64_t k1, float *restrict c, int first, int64_t prefetch_rows) {
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
        const fv b0 = loadv(panel + kk * GEMM_NR), b1 = loadv(panel + kk * GEMM_NR + LANES);
        if (kk + GEMM_PREFETCH_ROWS < prefetch_rows) /* still inside the thread's run */
            for (int line = 0; line < GEMM_NR; line += 64 / (int)sizeof(float))
                __builtin_prefetch(panel + (kk + GEMM_PREFETCH_ROWS) * GEMM_NR + line, 0, 2);
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
static void gemm_block_any(const float *a, int64_t lda, int mr, const float *panel, int64_t k0,
                           int64_t k1, float *c, int first, int64_t prefetch_rows) {
    switch (mr) {
#define GEMM_BLOCK_CASE(r) \
    case r: gemm_block(a, lda, r, panel, k0, k1, c, first, prefetch_rows); return;
#if GEMM_MR == 14
    GEMM_BLOCK_CASE(14) GEMM_BLOCK_CASE(13) GEMM_BLOCK_CASE(12) GEMM_BLOCK_CASE(11)
    GEMM_BLOCK_CASE(10) GEMM_BLOCK_CASE(9) GEMM_BLOCK_CASE(8) GEMM_BLOCK_CASE(7)
#endif
    GEMM_BLOCK_CASE(6) GEMM_BLOCK_CASE(5) GEMM_BLOCK_CASE(4) GEMM_BLOCK_CASE(3)
    GEMM_BLOCK_CASE(2)
    default: gemm_block(a, lda, 1, panel, k0, k1, c, first, prefetch_rows); return;
#undef GEMM_BLOCK_CASE
    }
}

/* y[m, n] = x[m, k] w^T (+ bias[n]), w packed by panels (see above); x, y contiguous. */
int pd_gemm_packed_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                       const float *bias, float *y, int num_threads) {
    if (m < 1 || k < 1 || n < 1 || num_threads < 1) return -1;
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
                const float *panel = panels + p * k * GEMM_NR;
                for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
                    const int64_t k1 = k0 + GEMM_KC < k ? k0 + GEMM_KC : k;
                    for (int64_t b = 0; b < blocks; b++) { /* blocks of near-equal size */
                        const int64_t b0 = rows * b / blocks, b1 = rows * (b + 1) / blocks;
                        gemm_block_any(xt + b0 * k, k, (int)(b1 - b0), panel, k0, k1,
                                       sums + b0 * GEMM_NR, k0 == 0,
                                       b == 0 ? run_rows - (p - p0) * k : 0);
                    }
                }
                const int64_t cols = n - p * GEMM_NR < GEMM_NR ? n - p * GEMM_NR : GEMM_NR;
                for (int64_t i = 0; i < rows; i++) {
                    float *yr = y + (r0 + i) * n + p * GEMM_NR;
                    const float *sr = sums + i * GEMM_NR;
                    if (bias)
                        for (int64_t j = 0; j < cols; j++) yr[j] = sr[j] + bias[p * GEMM_NR + j];
                    else
                        for (int64_t j = 0; j < cols; j++) yr[j] = sr[j];
                }
            }
        }
    }
    return 0;
}

/* A linear layer's product from the copies it has: the GEMV on w itself for up to
 * GEMV_MAX_X_ROWS rows where w is given, else the packed GEMM where panels are. */
int pd_linear_f32(const float *x, int64_t m, int64_t k, const float *w, const float *panels,
                  int64_t n, const float *bias, float *y, int num_threads) {
    if (w && m <= GEMV_MAX_X_ROWS) return pd_gemv_f32(x, m, k, w, n, bias, y, num_threads);
    if (panels) return pd_gemm_packed_f32(x, m, k, panels, n, bias, y, num_threads);
    return -1;
}

/* ------------------------------------------------------------------- SwiGLU */

/* out[r, d] = silu(gu[r, d]) * gu[r, half + d] for rows of 2 * half floats, silu(g) =
 * g / (1 + e^-g), written with e = e^-|g| so the exponential never overflows: g / (1 + e)
 * for g >= 0, g e / (1 + e) below (as torch: silu(inf) = inf, silu(-inf) = NaN). */
int pd_silu_mul_f32(const float *gate_up, int64_t rows, int64_t half, float *out,
                    int num_threads) {
    if (rows < 0 || half < 1 || num_threads < 1) return -1;
    const int threads = rows * half >= 16384 ? num_threads : 1;
    const int64_t vec = half - half % LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * half, *u = g + half;
        float *o = out + r * half;
        for (int64_t d = 0; d < vec; d += LANES) {
            const fv gv = loadv(g + d), zero = {0};
            const iv positive = gv >= zero;
            const fv e = exp_nonpositive(selectv(positive, zero - gv, gv));
            const fv silu = selectv(positive, gv, gv * e) / (1.f + e);
            storev(o + d, silu * loadv(u + d));
        }
        for (int64_t d = vec; d < half; d++) {
            const float e = expf(-fabsf(g[d]));
            o[d] = (g[d] >= 0.f ? g[d] : g[d] * e) / (1.f + e) * u[d];
        }
    }
    return 0;
}

/* --------------------------------------------------------------------- RoPE */

/* Rotary embedding in the "rotate half" layout: for token t and head h of x
 * (x + t * token_stride + h * dim, heads contiguous), with c = cos[t], s = sin[t] (each
 * [dim], the second half of s already negated on the first: (-sin | sin)),
 * out[t, h] = x * c + [x2 | x1] * s where x = [x1 | x2]. out is [tokens, heads, dim]. */
int pd_rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t dim,
                int64_t token_stride, const float *cos, const float *sin, float *out,
                int num_threads) {
    if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 || token_stride < heads * dim
        || num_threads < 1)
        return -1;
    const int64_t half = dim / 2;
    const int threads = tokens * heads * dim >= 65536 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * token_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) o[d] = xh[d] * c[d] + xh[d + half] * s[d];
#pragma omp simd
            for (int64_t d = half; d < dim; d++) o[d] = xh[d] * c[d] + xh[d - half] * s[d];
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ KV write */

/* The step's keys and values into their cache slots: token t's width floats (its KV
 * heads, contiguous) from k + t * k_stride and v + t * v_stride to slot slots[t] of
 * k_cache and v_cache (width floats per slot). Every slot is checked first. */
int pd_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t tokens, int64_t width, const int64_t *slots, int64_t num_slots,
                    float *k_cache, float *v_cache) {
    if (tokens < 0 || width < 1 || k_stride < width || v_stride < width) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -3;
    for (int64_t t = 0; t < tokens; t++) {
        __builtin_memcpy(k_cache + slots[t] * width, k + t * k_stride, width * sizeof(float));
        __builtin_memcpy(v_cache + slots[t] * width, v + t * v_stride, width * sizeof(float));
    }
    return 0;
}

/* ------------------------------------------------------------------- argmax */

/* out[r] = the index of the largest of x[r, 0..cols), the first one on ties, as
 * torch.argmax does; a row holding NaN gives its first NaN's index (torch counts NaN
 * as the largest). Rows start row_stride floats apart. One pass: ARGMAX_ACC sets of
 * lanes each keep the largest value they saw and where they first saw it (a later
 * equal value does not replace it); the row's answer is the least index holding the
 * largest of them, then the scalar tail (strictly larger only). Found by a scan for the
 * first match, the index took three times as long as the maximum (32000 columns). */
#define ARGMAX_ACC 4 /* independent compare-select chains: one would wait on its latency */
int pd_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride,
                       int64_t *out, int num_threads) {
    if (rows < 0 || cols < 1 || row_stride < cols || cols > INT32_MAX || num_threads < 1)
        return -1;
    const int threads = rows * cols >= 65536 ? num_threads : 1;
    const int64_t step = ARGMAX_ACC * LANES, vec = cols - cols % step;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * row_stride;
        float m = xr[0];
        int64_t found = 0;
        iv nan = {0};
        if (vec) {
            fv best[ARGMAX_ACC];
            iv where[ARGMAX_ACC], at[ARGMAX_ACC];
            const iv advance = (iv){0} + (int32_t)step;
            int32_t lane[LANES];
            for (int i = 0; i < LANES; i++) lane[i] = i;
            iv iota;
            memcpy(&iota, lane, sizeof iota);
            for (int a = 0; a < ARGMAX_ACC; a++) {
                best[a] = (fv){0} - INFINITY;
                where[a] = at[a] = iota + a * LANES;
            }
            for (int64_t c = 0; c < vec; c += step) {
                for (int a = 0; a < ARGMAX_ACC; a++) {
                    const fv v = loadv(xr + c + a * LANES);
                    const iv larger = v > best[a];
                    nan |= v != v;
                    best[a] = selectv(larger, v, best[a]);
                    where[a] = (larger & at[a]) | (~larger & where[a]);
                    at[a] += advance;
                }
            }
            m = -INFINITY;
            found = cols;
            for (int a = 0; a < ARGMAX_ACC; a++)
                for (int i = 0; i < LANES; i++)
                    if (best[a][i] > m || (best[a][i] == m && where[a][i] < found)) {
                        m = best[a][i];
                        found = where[a][i];
                    }
        }
        int any_nan = 0;
        for (int i = 0; i < LANES; i++) any_nan |= nan[i] != 0;
        for (int64_t c = vec; c < cols && !any_nan; c++) {
            any_nan = xr[c] != xr[c];
            if (xr[c] > m) {
                m = xr[c];
                found = c;
            }
        }
        if (any_nan) /* the first NaN, as torch */
            for (int64_t c = 0; c < cols; c++)
                if (xr[c] != xr[c]) {
                    found = c;
                    break;
                }
        out[r] = found;
    }
    return 0;
}

/* Positions in the run from pos: up to LANES, fewer where its block or the context ends
 * (a run never spans two blocks). */
static inline int64_t run_length(int64_t pos, int64_t block_size, int64_t ctx) {
    const int64_t to_block_end = block_size - pos % block_size;
    const int64_t n = to_block_end < LANES ? to_block_end : LANES;
    return ctx - pos < n ? ctx - pos : n;
}

/* Prefetch (into L2) the keys and values of the run of up to LANES positions from pos,
 * heads_width floats of each token from head_offset: a run starts in a block anywhere in
 * the cache, where the hardware prefetcher cannot guess it. */
static inline void prefetch_run(const float *k_cache, const float *v_cache, const int64_t *table,
                                int64_t block_size, int64_t token_stride, int64_t head_offset,
                                int64_t heads_width, int64_t pos, int64_t ctx) {
    const int64_t blk = pos / block_size, off = pos % block_size;
    const int64_t n = run_length(pos, block_size, ctx);
    const int64_t first = (table[blk] * block_size + off) * token_stride + head_offset;
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < heads_width; d += 64 / sizeof(float)) {
            __builtin_prefetch(k_cache + first + t * token_stride + d, 0, 2);
            __builtin_prefetch(v_cache + first + t * token_stride + d, 0, 2);
        }
}

/* One query token per sequence against the keys and values of its blocks, read where
 * they lie in the paged cache (no gather). A task is one sequence and a range of its KV
 * heads (all of them when there are enough sequences to keep every thread busy, so a
 * task reads each token's K and V contiguously); its query rows are the query heads
 * sharing those KV heads. For each row, LANES keys at a time are scored into one vector
 * (lane_sums) and folded into an online softmax (running max and sum, the
 * accumulator rescaled when the max grows). head_dim must be a multiple of 16.
 *
 * q        [B, Hk * G, D], token i's heads at q + i * q_stride   out [B, Hk * G, D]
 * k_cache, v_cache: token t of block b, KV head h at ((b * S + t) * Hk + h) * D
 * tables   [B, max_blocks] int64    context_lens [B] int64 (>= 1, <= max_blocks * S)
 */
int pd_paged_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                  const float *v_cache, int64_t num_cache_blocks,
                                  int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t group, const int64_t *tables, int64_t max_blocks,
                                  const int64_t *context_lens, int64_t num_seqs, float scale,
                                  float *out, int num_threads) {
    if (group < 1 || group > ATTN_MAX_ROWS || head_dim < ATTN_HEAD_MULTIPLE
        || head_dim % ATTN_HEAD_MULTIPLE
        || group * head_dim > ATTN_MAX_ACC || block_size < 1 || num_kv_heads < 1
        || q_stride < num_kv_heads * group * head_dim || num_threads < 1 || num_seqs < 0)
        return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t ctx = context_lens[s];
        if (ctx < 1 || ctx > max_blocks * block_size) return -2;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            int64_t id = tables[s * max_blocks + b];
            if (id < 0 || id >= num_cache_blocks) return -3;
        }
    }
    /* KV heads per task: as many as the accumulators hold, fewer when splitting the
     * heads is what gives every thread two tasks */
    int64_t fit = ATTN_MAX_ACC / (group * head_dim);
    fit = fit < ATTN_MAX_ROWS / group ? fit : ATTN_MAX_ROWS / group;
    const int64_t splits = num_seqs >= 2 * num_threads ? 1
                         : (2 * num_threads + num_seqs - 1) / (num_seqs ? num_seqs : 1);
    int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    heads_per_task = heads_per_task < fit ? heads_per_task : fit;
    const int64_t tasks_per_seq = (num_kv_heads + heads_per_task - 1) / heads_per_task;
    const int64_t hq = num_kv_heads * group, token_stride = num_kv_heads * head_dim;
    const int64_t chunks = head_dim / LANES;
#if LANES == 16
    const iv lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const iv lane_index = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
        const int64_t s = task / tasks_per_seq, ctx = context_lens[s];
        const int64_t h0 = task % tasks_per_seq * heads_per_task;
        const int64_t h1 = h0 + heads_per_task < num_kv_heads ? h0 + heads_per_task : num_kv_heads;
        const int64_t rows = (h1 - h0) * group; /* query heads h0 * group .. h1 * group - 1 */
        const float *q_rows = q + s * q_stride + h0 * group * head_dim;
        float acc[ATTN_MAX_ACC], run_max[ATTN_MAX_ROWS], run_sum[ATTN_MAX_ROWS];
        float weights[ATTN_MAX_ROWS * LANES]; /* [rows][LANES]: one run of keys */
        for (int64_t i = 0; i < rows * head_dim; i++) acc[i] = 0.f;
        for (int64_t r = 0; r < rows; r++) {
            run_max[r] = -INFINITY;
            run_sum[r] = 0.f;
        }
        for (int64_t pos = 0; pos < ctx;) { /* one run of run_length positions a turn */
            const int64_t blk = pos / block_size, off = pos % block_size;
            const int64_t n = run_length(pos, block_size, ctx);
            const int64_t first = (tables[s * max_blocks + blk] * block_size + off) * token_stride;
            const iv valid = lane_index < (iv){0} + (int32_t)n;
            if (pos + n < ctx) /* the next run's keys and values start on their way */
                prefetch_run(k_cache, v_cache, tables + s * max_blocks, block_size, token_stride,
                             h0 * head_dim, (h1 - h0) * head_dim, pos + n, ctx);
            for (int64_t r = 0; r < rows; r++) {
                const float *kb = k_cache + first + (h0 + r / group) * head_dim;
                fv sc = score_run(q_rows + r * head_dim, kb, token_stride, chunks, n) * scale;
                sc = selectv(valid, sc, (fv){0} - INFINITY);
                const float new_max = max_lanes(sc) > run_max[r] ? max_lanes(sc) : run_max[r];
                const fv p = selectv(valid, exp_nonpositive(sc - new_max), (fv){0});
                /* the running sums were taken against run_max: rescale them when it grew */
                const float correction = new_max == run_max[r] ? 1.f
                    : run_max[r] == -INFINITY ? 0.f
                    : exp_nonpositive((fv){0} + (run_max[r] - new_max))[0];
                if (correction != 1.f) {
                    float *ar = acc + r * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) ar[d] *= correction;
                }
                run_sum[r] = run_sum[r] * correction + sum_lanes(p);
                run_max[r] = new_max;
                storev(weights + r * LANES, p);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float *wr = weights + r * LANES;
                const float *vb = v_cache + first + (h0 + r / group) * head_dim;
                for (int64_t c = 0; c < chunks; c++) {
                    float *ar = acc + r * head_dim + c * LANES;
                    const float *vc = vb + c * LANES;
                    /* four sums: one FMA chain would wait on its own latency */
                    fv a0 = loadv(ar), a1 = {0}, a2 = {0}, a3 = {0};
                    int t = 0;
                    for (; t + 4 <= n; t += 4) {
                        a0 += wr[t] * loadv(vc + t * token_stride);
                        a1 += wr[t + 1] * loadv(vc + (t + 1) * token_stride);
                        a2 += wr[t + 2] * loadv(vc + (t + 2) * token_stride);
                        a3 += wr[t + 3] * loadv(vc + (t + 3) * token_stride);
                    }
                    for (; t < n; t++) a0 += wr[t] * loadv(vc + t * token_stride);
                    storev(ar, (a0 + a1) + (a2 + a3));
                }
            }
            pos += n;
        }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = 1.f / run_sum[r];
            float *o = out + (s * hq + h0 * group + r) * head_dim;
            const float *ar = acc + r * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
        }
    }
    return 0;
}

/* ------------------------------------------------------ decoder stack, decode step */

/* One Llama-family decoder layer's weights (checkpoint layout, contiguous fp32), its KV
 * cache, and the packed copies of its weights where it has them. The biases and the
 * per-head q/k norms are NULL where the model has none. */
typedef struct {
    const float *input_norm, *post_norm;    /* [hidden] each */
    const float *qkv_w, *qkv_b;             /* [(Hq + 2 Hk) D, hidden]: q | k | v heads */
    const float *q_norm, *k_norm;           /* [D] each (Qwen3), or NULL */
    const float *o_w, *o_b;                 /* [hidden, Hq D] */
    const float *gate_up_w;                 /* [2 I, hidden]: gate | up */
    const float *down_w, *down_b;           /* [hidden, I] */
    float *k_cache, *v_cache;               /* [num_cache_blocks * block_size, Hk, D] */
    /* the four weights packed for pd_gemm_packed_f32 (pd_gemm_panel_floats each), or
     * NULL: a stack without them takes at most GEMV_MAX_X_ROWS rows */
    const float *qkv_p, *o_p, *gate_up_p, *down_p;
} pd_decoder_layer;

typedef struct {
    int64_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_cache_blocks, block_size;
    float rms_eps, scale;
} pd_decoder_shape;

/* whether every kernel of the stack takes these sizes (the attention's limits) */
int pd_decoder_shape_ok(const pd_decoder_shape *s) {
    const int64_t hq = s->num_q_heads, hk = s->num_kv_heads, d = s->head_dim;
    return hq >= 1 && hk >= 1 && hq % hk == 0 && d >= ATTN_HEAD_MULTIPLE
           && d % ATTN_HEAD_MULTIPLE == 0
           && hq / hk <= ATTN_MAX_ROWS && hq / hk * d <= ATTN_MAX_ACC;
}

/* floats of scratch one row of the batch needs (see pd_decoder_stack_f32) */
int64_t pd_decoder_scratch_floats(const pd_decoder_shape *s) {
    const int64_t qk = (s->num_q_heads + s->num_kv_heads) * s->head_dim;
    const int64_t qkv = qk + s->num_kv_heads * s->head_dim;
    return 2 * s->hidden + qkv + 2 * qk + s->num_q_heads * s->head_dim + 3 * s->intermediate;
}

/* h[i] += y[i] + bias[i] (the projection's bias first, as the layer adds it) */
static void add_residual(float *restrict h, const float *restrict y, const float *bias,
                         int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n;
        const float *yr = y + r * n;
        if (bias) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) hr[i] = hr[i] + (yr[i] + bias[i]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) hr[i] = hr[i] + yr[i];
        }
    }
}

/* A decode step of the whole decoder stack for `rows` sequences, one token each, in one
 * call: the same kernels, in the same order, as the model's per-layer forward runs them
 * (RMSNorm, the qkv projection, the q/k norms, RoPE, the KV write, paged attention, the
 * o projection and residual, RMSNorm, the gate/up projection, SwiGLU, the down
 * projection and residual; each projection by pd_linear_f32: the GEMV up to
 * GEMV_MAX_X_ROWS rows, the packed GEMM beyond, which every layer then needs), so
 * the result is the same to the bit; what it saves is the interpreter and dispatch
 * between them. h [rows, hidden] is updated in place (the embeddings in, the last
 * layer's output out); cos, sin [rows, D] as pd_rope_f32 takes them; slots [rows];
 * tables [rows, max_blocks], context_lens [rows] as the attention takes them; scratch
 * holds rows * pd_decoder_scratch_floats floats. Slots, context lengths and block ids
 * are all checked before anything is written: -3 for a slot outside the cache, -2 for
 * a context length outside its table, -4 for a block id outside the cache. */
int pd_decoder_stack_f32(const pd_decoder_layer *layers, int64_t num_layers,
                         const pd_decoder_shape *s, float *h, int64_t rows, const float *cos,
                         const float *sin, const int64_t *slots, const int64_t *tables,
                         int64_t max_blocks, const int64_t *context_lens, float *scratch,
                         int num_threads) {
    const int64_t hq = s->num_q_heads, hk = s->num_kv_heads, d = s->head_dim;
    if (num_layers < 1 || rows < 1 || hq < 1 || hk < 1 || hq % hk || s->hidden < 1
        || s->intermediate < 1 || s->block_size < 1 || s->num_cache_blocks < 1 || max_blocks < 1
        || num_threads < 1 || !pd_decoder_shape_ok(s))
        return -1;
    for (int64_t l = 0; rows > GEMV_MAX_X_ROWS && l < num_layers; l++)
        if (!layers[l].qkv_p || !layers[l].o_p || !layers[l].gate_up_p || !layers[l].down_p)
            return -1; /* past the GEMV's rows every projection needs its packed copy */
    const int64_t num_slots = s->num_cache_blocks * s->block_size;
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= num_slots) return -3;
        const int64_t ctx = context_lens[r];
        if (ctx < 1 || ctx > max_blocks * s->block_size) return -2;
        for (int64_t b = 0; b < (ctx + s->block_size - 1) / s->block_size; b++)
            if (tables[r * max_blocks + b] < 0 || tables[r * max_blocks + b] >= s->num_cache_blocks)
                return -4;
    }
    const int64_t hidden = s->hidden, inter = s->intermediate;
    const int64_t qk_width = (hq + hk) * d, qkv_width = qk_width + hk * d;
    float *xn = scratch, *qkv = xn + rows * hidden, *qk_normed = qkv + rows * qkv_width;
    float *rot = qk_normed + rows * qk_width, *att = rot + rows * qk_width;
    float *y = att + rows * hq * d, *gate_up = y + rows * hidden, *act = gate_up + rows * 2 * inter;
    for (int64_t l = 0; l < num_layers; l++) {
        const pd_decoder_layer *L = layers + l;
        int rc = pd_rms_norm_f32(h, rows, hidden, L->input_norm, s->rms_eps, xn, num_threads);
        rc |= pd_linear_f32(xn, rows, hidden, L->qkv_w, L->qkv_p, qkv_width, L->qkv_b, qkv,
                             num_threads);
        const float *qk = qkv;
        int64_t qk_stride = qkv_width;
        if (L->q_norm && L->k_norm) { /* each head RMS-normalised, as Qwen3 does */
            for (int64_t r = 0; r < rows; r++) {
                float *o = qk_normed + r * qk_width;
                const float *in = qkv + r * qkv_width;
                rc |= pd_rms_norm_f32(in, hq, d, L->q_norm, s->rms_eps, o, num_threads);
                rc |= pd_rms_norm_f32(in + hq * d, hk, d, L->k_norm, s->rms_eps, o + hq * d,
                                      num_threads);
            }
            qk = qk_normed;
            qk_stride = qk_width;
        }
        rc |= pd_rope_f32(qk, rows, hq + hk, d, qk_stride, cos, sin, rot, num_threads);
        rc |= pd_write_kv_f32(rot + hq * d, qk_width, qkv + qk_width, qkv_width, rows, hk * d,
                              slots, num_slots, L->k_cache, L->v_cache);
        rc |= pd_paged_decode_attention_f32(rot, qk_width, L->k_cache, L->v_cache,
                                            s->num_cache_blocks, s->block_size, hk, d, hq / hk,
                                            tables, max_blocks, context_lens, rows, s->scale,
                                            att, num_threads);
        rc |= pd_linear_f32(att, rows, hq * d, L->o_w, L->o_p, hidden, NULL, y, num_threads);
        add_residual(h, y, L->o_b, rows, hidden);
        rc |= pd_rms_norm_f32(h, rows, hidden, L->post_norm, s->rms_eps, xn, num_threads);
        rc |= pd_linear_f32(xn, rows, hidden, L->gate_up_w, L->gate_up_p, 2 * inter, NULL,
                             gate_up, num_threads);
        rc |= pd_silu_mul_f32(gate_up, rows, inter, act, num_threads);
        rc |= pd_linear_f32(act, rows, inter, L->down_w, L->down_p, hidden, NULL, y, num_threads);
        add_residual(h, y, L->down_b, rows, hidden);
        if (rc) return -1; /* a kernel refused its shape: checked by the caller beforehand */
    }
    return 0;
}

/* ------------------------------------------------- decode step: tokens to final norm */

/* What a decode step reads around the decoder stack: the input embedding, the RoPE
 * tables (cos and sin of position * inverse frequency, as the model's rotary module
 * holds them) and the final norm. */
typedef struct {
    const float *embed;                /* [vocab, hidden] */
    const float *rope_cos, *rope_sin;  /* [max_positions, D / 2] each */
    const float *final_norm;           /* [hidden] */
    int64_t vocab, max_positions;
    float final_eps;
} pd_decoder_ends;

/* floats of scratch one row needs in pd_decoder_step_f32: its embedding, its cos and
 * sin rows, and what the stack needs */
int64_t pd_decoder_step_scratch_floats(const pd_decoder_shape *s) {
    return s->hidden + 2 * s->head_dim + pd_decoder_scratch_floats(s);
}

/* A whole decode step short of the LM head: each row's token embedding, its cos and sin
 * laid out as pd_rope_f32 takes them ((cos | cos), (-sin | sin), as the model's rotary
 * module builds them), pd_decoder_stack_f32, then the final RMSNorm into out [rows,
 * hidden]. The same values, in the same order, as the model's forward, so the same
 * result to the bit; what goes is the interpreter time of the embedding, the RoPE lookup
 * and the final norm. Token ids and positions are checked before anything is written
 * (-5: a token id outside the embedding, -6: a position outside the RoPE tables), then
 * the stack's checks and codes; scratch holds rows * pd_decoder_step_scratch_floats
 * floats. */
int pd_decoder_step_f32(const pd_decoder_layer *layers, int64_t num_layers,
                        const pd_decoder_shape *s, const pd_decoder_ends *e,
                        const int64_t *token_ids, const int64_t *positions, int64_t rows,
                        const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                        const int64_t *context_lens, float *out, float *scratch,
                        int num_threads) {
    const int64_t hidden = s->hidden, d = s->head_dim, half = s->head_dim / 2;
    if (rows < 1 || hidden < 1 || d < 2 || d % 2 || e->vocab < 1 || e->max_positions < 1)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (token_ids[r] < 0 || token_ids[r] >= e->vocab) return -5;
        if (positions[r] < 0 || positions[r] >= e->max_positions) return -6;
    }
    float *h = scratch, *cos = h + rows * hidden, *sin = cos + rows * d;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(h + r * hidden, e->embed + token_ids[r] * hidden, (size_t)hidden * sizeof(float));
        const float *c = e->rope_cos + positions[r] * half, *sn = e->rope_sin + positions[r] * half;
        float *cr = cos + r * d, *sr = sin + r * d;
        for (int64_t i = 0; i < half; i++) {
            cr[i] = cr[half + i] = c[i];
            sr[i] = -sn[i];
            sr[half + i] = sn[i];
        }
    }
    const int rc = pd_decoder_stack_f32(layers, num_layers, s, h, rows, cos, sin, slots, tables,
                                        max_blocks, context_lens, sin + rows * d, num_threads);
    if (rc) return rc;
    return pd_rms_norm_f32(h, rows, hidden, e->final_norm, e->final_eps, out, num_threads);
}
