/* What every compiled CPU kernel file shares (engine/kernels/cpu/): the vector type of
 * the target's own width, its loads, stores and lane helpers, the limits one file's
 * kernel puts on another's callers, and every kernel's prototype.
 *
 * The kernels are built at first use with the machine's C compiler for the machine's own
 * CPU (-O3 -march=native -fopenmp; PDSERVE_CPU_KERNELS_MARCH names another target), every
 * .c file of this directory into one library (engine/kernels/cpu/build.py). Vector code is
 * written with GCC/Clang vector extensions in the target's own register width (LANES
 * below) or left to the compiler (OpenMP simd), so the same source serves AVX2, AVX-512
 * and other targets. OpenMP threads come from the runtime torch already loaded (libgomp,
 * matched by soname), so these kernels share torch's thread pool instead of starting a
 * second one.
 *
 * Every function returns 0 on success and a negative code for arguments it does not
 * handle (the caller then uses its torch path); it never reads or writes outside the
 * buffers its arguments describe. The Python face is engine/kernels/cpu/ (one module
 * per family, as here).
 */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* ---------------------------------------------------------------- vectors */

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

/* The linears' weights are fp32, or int8 with an fp32 scale per output feature (weight-
 * only quantisation: x, the sums and y stay fp32). These read LANES weights, or one,
 * from element j of a run of either type, as fp32 (int8 widened in registers); inlined
 * with int8 a constant, the test vanishes. The widening is written with intrinsics on
 * x86: GCC 12 turns __builtin_convertvector of int8 lanes into one scalar conversion per
 * lane, which made the int8 GEMV 3-4x slower than the fp32 one. */
static inline __attribute__((always_inline)) fv widen_int8(const int8_t *p) {
#if defined(__AVX512F__)
    return (fv)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (fv)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    fv v;
    for (int i = 0; i < LANES; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* LANES fp8 bytes from p as fp32, exactly as torch converts them (float8_e4m3fn with
 * mbits 3, bias 7; float8_e5m2 with 2, 15): a value is its mantissa with the implicit bit
 * (none for a subnormal) times a power of two built as a normal fp32, so no subnormal fp32
 * is ever made; the top exponent is NaN (e4m3fn: with mantissa 7 only) or, in e5m2 with
 * mantissa 0, infinity. Inlined with the format a constant, its tests vanish. */
static inline __attribute__((always_inline)) fv widen_fp8(const uint8_t *p, int mbits, int bias) {
#if defined(__AVX512F__)
    const iv x = (iv)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    const iv x = (iv)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    iv x;
    for (int i = 0; i < LANES; i++) x[i] = p[i];
#endif
    const int top = (1 << (7 - mbits)) - 1, mask = (1 << mbits) - 1;
    const iv e = (x >> mbits) & top, m = x & mask, normal = e != 0;
    const iv mantissa = m | (normal & (1 << mbits));
    const iv power = (e - (e == 0) - bias - mbits + 127) << 23; /* 2^(e or 1, less both) */
    iv bits = (iv)(__builtin_convertvector(mantissa, fv) * (fv)power);
    const iv special = e == top, nan = mbits == 3 ? special & (m == mask) : special & (m != 0);
    if (mbits != 3) bits = (bits & ~(special & ~nan)) | (special & ~nan & 0x7f800000); /* inf */
    bits = (bits & ~nan) | (nan & 0x7fc00000);
    return (fv)(bits | ((x & 0x80) << 24));
}

static inline __attribute__((always_inline)) fv load_weights(const void *run, int64_t j, int int8) {
    return int8 ? widen_int8((const int8_t *)run + j) : loadv((const float *)run + j);
}

static inline __attribute__((always_inline)) float weight_at(const void *run, int64_t j, int int8) {
    return int8 ? (float)((const int8_t *)run)[j] : ((const float *)run)[j];
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

/* ------------------------------------------------- limits other files rely on */

#define ATTN_MAX_ROWS 64        /* query heads in one task */
#define ATTN_MAX_ACC 8192       /* query rows * head_dim: one task's accumulators */
#define GEMV_MAX_X_ROWS 3 /* four were slower than oneDNN on an AMD EPYC */

/* ---------------------------------------------------------------- prototypes */

/* pointwise.c */
int pd_rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                    float *out, int num_threads);
int pd_silu_mul_f32(const float *gate_up, int64_t rows, int64_t half, float *out,
                    int num_threads);
int pd_rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t dim,
                int64_t token_stride, const float *cos, const float *sin, float *out,
                int num_threads);
int pd_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t tokens, int64_t width, const int64_t *slots, int64_t num_slots,
                    float *k_cache, float *v_cache);
int pd_write_kv_i8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                   int64_t tokens, int64_t heads, int64_t head_dim, const int64_t *slots,
                   int64_t num_slots, uint8_t *k_cache, uint8_t *v_cache);
int pd_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t tokens, int64_t width, const int64_t *slots, int64_t num_slots,
                    uint8_t *k_cache, uint8_t *v_cache, int e5m2);
int pd_quantize_kv_slots(const float *x, int64_t rows, int64_t head_dim, uint8_t *out);
int pd_dequantize_kv_slots(const uint8_t *slots, int64_t rows, int64_t head_dim, float *out);
int pd_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride,
                       int64_t *out, int num_threads);
/* gemv.c */
int pd_gemv_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                const float *bias, float *y, int num_threads);
int pd_gemv_i8(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales,
               int64_t n, const float *bias, float *y, int num_threads);
/* gemm.c */
int64_t pd_gemm_panel_width(void);
int64_t pd_gemm_panel_floats(int64_t n, int64_t k);
int pd_gemm_packed_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                       const float *bias, float *y, int num_threads);
int pd_gemm_packed_i8(const float *x, int64_t m, int64_t k, const int8_t *panels,
                      const float *scales, int64_t n, const float *bias, float *y,
                      int num_threads);
int pd_linear_f32(const float *x, int64_t m, int64_t k, const float *w, const float *panels,
                  int64_t n, const float *bias, float *y, int num_threads);
int pd_linear_any(const float *x, int64_t m, int64_t k, const void *w, const void *panels,
                  const float *scales, int64_t n, const float *bias, float *y,
                  int num_threads);
/* attention.c */
/* kind: what the caches' elements are (also pd_decoder_shape.kv_kind; the Python side's
 * KV_KINDS): fp32, int8 slots of D + 4 bytes (D values, then their fp32 scale), or fp8
 * bytes (float8_e4m3fn, float8_e5m2) */
enum { KV_F32 = 0, KV_I8 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };
int pd_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                              const void *v_cache, int64_t num_cache_blocks, int64_t block_size,
                              int64_t num_kv_heads, int64_t head_dim, int64_t group,
                              const int64_t *tables, int64_t max_blocks,
                              const int64_t *context_lens, int64_t num_seqs, float scale,
                              float *out, int num_threads, int kind);
/* sampling.c */
int pd_apply_token_bitmask_f32(float *logits, int64_t rows, int64_t cols, int64_t row_stride,
                               const int32_t *mask, int64_t words, const int64_t *row_index,
                               int64_t num_masks);
int pd_token_logprobs_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride,
                          const int64_t *chosen, int64_t k, float *chosen_lp, int64_t *rank,
                          int64_t *top_ids, float *top_lp, int num_threads);
int pd_penalties_f32(float *logits, int64_t rows, int64_t cols, int64_t row_stride,
                     const int64_t *row_index, int64_t num_rows, const int64_t *prompts,
                     const int64_t *prompt_lens, const int64_t *outputs,
                     const int64_t *output_lens, const float *repetition,
                     const float *presence, const float *frequency, int num_threads);

#endif
