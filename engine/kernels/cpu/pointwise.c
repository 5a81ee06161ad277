/* Pointwise kernels: RMSNorm, SwiGLU, RoPE, the KV write and greedy argmax, each in one
 * pass (torch runs several small kernels for some of them). See kernels.h. */
#include <float.h>

#include "kernels.h"

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

/* One head's head_dim floats as an int8 slot (engine/attention/kv_quant.py): round half to
 * even of x / scale with scale = max |x| / 127 (at least FLT_MIN / 127), then that fp32
 * scale: head_dim + 4 bytes. The same arithmetic as kv_quant.quantize, so both write the
 * same bytes. */
static inline void quantize_slot(const float *x, int64_t head_dim, uint8_t *o) {
    const iv magnitude = (iv){0} + 0x7fffffff;
    float amax = 0.f;
    int64_t d = 0;
    if (head_dim >= LANES) {
        fv m = {0};
        for (; d + LANES <= head_dim; d += LANES) {
            fv v;
            memcpy(&v, x + d, sizeof v);
            const fv a = (fv)((iv)v & magnitude);
            const iv larger = a > m;
            m = (fv)(((iv)a & larger) | ((iv)m & ~larger));
        }
        for (int i = 0; i < LANES; i++) amax = fmaxf(amax, m[i]);
    }
    for (; d < head_dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float scale = (amax > FLT_MIN ? amax : FLT_MIN) / 127.f;
    /* |x / scale| <= 127 (and a hair): adding and taking away 1.5 * 2^23 rounds it half to
     * even, as nearbyintf does in the default rounding mode */
    const fv shift = (fv){0} + 0x1.8p23f, top = (fv){0} + 127.f;
    for (d = 0; d + LANES <= head_dim; d += LANES) {
        fv v;
        memcpy(&v, x + d, sizeof v);
        fv q = (v / scale + shift) - shift;
        const iv over = q > top, under = q < -top;
        q = (fv)(((iv)q & ~(over | under)) | ((iv)top & over) | ((iv)(-top) & under));
        const iv n = __builtin_convertvector(q, iv);
        for (int i = 0; i < LANES; i++) o[d + i] = (uint8_t)(int8_t)n[i];
    }
    for (; d < head_dim; d++) {
        float q = nearbyintf(x[d] / scale);
        q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
        o[d] = (uint8_t)(int8_t)q;
    }
    memcpy(o + head_dim, &scale, sizeof scale);
}

/* The same into an int8 cache: each token's heads (head_dim floats each, contiguous)
 * quantised one head at a time (quantize_slot), heads * (head_dim + 4) bytes per slot. */
int pd_write_kv_i8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                   int64_t tokens, int64_t heads, int64_t head_dim, const int64_t *slots,
                   int64_t num_slots, uint8_t *k_cache, uint8_t *v_cache) {
    const int64_t width = heads * head_dim, slot = head_dim + 4;
    if (tokens < 0 || heads < 1 || head_dim < 1 || k_stride < width || v_stride < width)
        return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -3;
    for (int64_t t = 0; t < tokens; t++)
        for (int kv = 0; kv < 2; kv++) {
            const float *x = kv ? v + t * v_stride : k + t * k_stride;
            uint8_t *out = (kv ? v_cache : k_cache) + slots[t] * heads * slot;
            for (int64_t h = 0; h < heads; h++)
                quantize_slot(x + h * head_dim, head_dim, out + h * slot);
        }
    return 0;
}

/* One float as an fp8 byte, as torch's conversion after kv_quant.quantize's clamp writes
 * it: the format's largest where |x| is larger (saturating), else rounded half to even to
 * mbits mantissa bits (bias: the exponent's), a subnormal below the smallest normal; a
 * NaN as 0x7f with its sign (a NaN code in both formats). */
static inline uint8_t to_fp8(float x, int mbits, int bias, float largest) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)(bits >> 24) & 0x80;
    if (isnan(x)) return sign | 0x7f;
    float a = fabsf(x);
    a = a > largest ? largest : a;
    const float smallest_normal = ldexpf(1.f, 1 - bias);
    if (a < smallest_normal) /* a multiple of 2^(1 - bias - mbits): exact scaling, then RNE */
        return sign | (uint8_t)nearbyintf(ldexpf(a, bias + mbits - 1));
    memcpy(&bits, &a, sizeof bits);
    const int drop = 23 - mbits;
    bits += ((1u << (drop - 1)) - 1) + ((bits >> drop) & 1); /* half to even */
    const uint32_t exponent = (bits >> 23) - 127 + (uint32_t)bias;
    return sign | (uint8_t)((exponent << mbits) | ((bits >> drop) & ((1u << mbits) - 1)));
}

/* The same into an fp8 cache (e5m2 0: float8_e4m3fn, 1: float8_e5m2): each value one
 * byte, width (heads * head_dim) bytes per slot. */
int pd_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t tokens, int64_t width, const int64_t *slots, int64_t num_slots,
                    uint8_t *k_cache, uint8_t *v_cache, int e5m2) {
    if (tokens < 0 || width < 1 || k_stride < width || v_stride < width) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -3;
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const float largest = e5m2 ? 57344.f : 448.f;
    for (int64_t t = 0; t < tokens; t++)
        for (int kv = 0; kv < 2; kv++) {
            const float *x = kv ? v + t * v_stride : k + t * k_stride;
            uint8_t *out = (kv ? v_cache : k_cache) + slots[t] * width;
            for (int64_t i = 0; i < width; i++) out[i] = to_fp8(x[i], mbits, bias, largest);
        }
    return 0;
}

/* rows contiguous heads of head_dim floats as int8 slots (quantize_slot), and back: each
 * slot's int8 values times its scale, one fp32 multiply as kv_quant.dequantize does. One
 * thread: the KV transfer's send and receive lanes call them beside the engine's step. */
int pd_quantize_kv_slots(const float *x, int64_t rows, int64_t head_dim, uint8_t *out) {
    if (rows < 0 || head_dim < 1) return -1;
    for (int64_t r = 0; r < rows; r++)
        quantize_slot(x + r * head_dim, head_dim, out + r * (head_dim + 4));
    return 0;
}

int pd_dequantize_kv_slots(const uint8_t *slots, int64_t rows, int64_t head_dim, float *out) {
    if (rows < 0 || head_dim < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = slots + r * (head_dim + 4);
        float scale;
        memcpy(&scale, s + head_dim, sizeof scale);
        float *o = out + r * head_dim;
        int64_t d = 0;
        for (; d + LANES <= head_dim; d += LANES) {
            iv n;
            for (int i = 0; i < LANES; i++) n[i] = (int8_t)s[d + i];
            const fv v = __builtin_convertvector(n, fv) * scale;
            memcpy(o + d, &v, sizeof v);
        }
        for (; d < head_dim; d++) o[d] = (float)(int8_t)s[d] * scale;
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
