/* A whole decoder stack's decode step in one call, over the other files' kernels (see
 * kernels.h). */
#include "kernels.h"

/* ------------------------------------------------------ decoder stack, decode step */

/* One Llama-family decoder layer's weights (checkpoint layout, contiguous fp32, or int8
 * where their scales are given), its KV cache, and the packed copies of its weights
 * where it has them. The biases and the per-head q/k norms are NULL where the model has
 * none. */
typedef struct {
    const float *input_norm, *post_norm;    /* [hidden] each */
    const void *qkv_w;                      /* [(Hq + 2 Hk) D, hidden]: q | k | v heads */
    const float *qkv_b;
    const float *q_norm, *k_norm;           /* [D] each (Qwen3), or NULL */
    const void *o_w;                        /* [hidden, Hq D] */
    const float *o_b;
    const void *gate_up_w;                  /* [2 I, hidden]: gate | up */
    const void *down_w;                     /* [hidden, I] */
    const float *down_b;
    void *k_cache, *v_cache; /* [num_cache_blocks * block_size, Hk, D] fp32, int8 slots of
                              * D + 4 bytes, or fp8 bytes (kv_kind; kv_quant.py) */
    /* the four weights packed for pd_gemm_packed_f32 / _i8 (pd_gemm_panel_floats
     * elements each), or NULL: a stack without them takes at most GEMV_MAX_X_ROWS rows.
     * With them, the *_w above may be NULL: the packed GEMM then takes every row count
     * (no GEMV: a speculating engine's packed_gemm kernels) */
    const void *qkv_p, *o_p, *gate_up_p, *down_p;
    /* each weight's scales (one per output feature) where it is int8 (its *_w and *_p
     * then int8 too), NULL where it is fp32 */
    const float *qkv_s, *o_s, *gate_up_s, *down_s;
} pd_decoder_layer;

typedef struct {
    int64_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_cache_blocks, block_size;
    float rms_eps, scale;
    int64_t kv_kind; /* the caches' elements: KV_F32, KV_I8, KV_E4M3 or KV_E5M2 (kernels.h) */
} pd_decoder_shape;

/* whether every kernel of the stack takes these sizes (the attention's limits) */
int pd_decoder_shape_ok(const pd_decoder_shape *s) {
    const int64_t hq = s->num_q_heads, hk = s->num_kv_heads, d = s->head_dim;
    return hq >= 1 && hk >= 1 && hq % hk == 0 && d >= ATTN_HEAD_MULTIPLE
           && d % ATTN_HEAD_MULTIPLE == 0
           && hq / hk <= ATTN_MAX_ROWS && hq / hk * d <= ATTN_MAX_ACC
           && s->kv_kind >= KV_F32 && s->kv_kind <= KV_E5M2;
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
 * projection and residual; each projection by pd_linear_any: the GEMV up to
 * GEMV_MAX_X_ROWS rows where the weight is given, the packed GEMM beyond (or at every
 * row count where it is not), which every layer then needs), so
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
    for (int64_t l = 0; l < num_layers; l++) {
        const pd_decoder_layer *L = layers + l;
        const int packed = L->qkv_p && L->o_p && L->gate_up_p && L->down_p;
        if (rows > GEMV_MAX_X_ROWS && !packed)
            return -1; /* past the GEMV's rows every projection needs its packed copy */
        if (!packed && (!L->qkv_w || !L->o_w || !L->gate_up_w || !L->down_w))
            return -1; /* a projection with neither its weight nor its packed copy */
    }
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
        rc |= pd_linear_any(xn, rows, hidden, L->qkv_w, L->qkv_p, L->qkv_s, qkv_width,
                            L->qkv_b, qkv, num_threads);
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
        if (s->kv_kind == KV_E4M3 || s->kv_kind == KV_E5M2)
            rc |= pd_write_kv_fp8(rot + hq * d, qk_width, qkv + qk_width, qkv_width, rows,
                                  hk * d, slots, num_slots, L->k_cache, L->v_cache,
                                  s->kv_kind == KV_E5M2);
        else if (s->kv_kind == KV_I8)
            rc |= pd_write_kv_i8(rot + hq * d, qk_width, qkv + qk_width, qkv_width, rows, hk, d,
                                 slots, num_slots, L->k_cache, L->v_cache);
        else
            rc |= pd_write_kv_f32(rot + hq * d, qk_width, qkv + qk_width, qkv_width, rows,
                                  hk * d, slots, num_slots, L->k_cache, L->v_cache);
        rc |= pd_paged_decode_attention(rot, qk_width, L->k_cache, L->v_cache,
                                        s->num_cache_blocks, s->block_size, hk, d, hq / hk,
                                        tables, max_blocks, context_lens, rows, s->scale, att,
                                        num_threads, (int)s->kv_kind);
        rc |= pd_linear_any(att, rows, hq * d, L->o_w, L->o_p, L->o_s, hidden, NULL, y,
                            num_threads);
        add_residual(h, y, L->o_b, rows, hidden);
        rc |= pd_rms_norm_f32(h, rows, hidden, L->post_norm, s->rms_eps, xn, num_threads);
        rc |= pd_linear_any(xn, rows, hidden, L->gate_up_w, L->gate_up_p, L->gate_up_s,
                            2 * inter, NULL, gate_up, num_threads);
        rc |= pd_silu_mul_f32(gate_up, rows, inter, act, num_threads);
        rc |= pd_linear_any(act, rows, inter, L->down_w, L->down_p, L->down_s, hidden, NULL, y,
                            num_threads);
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
