/* The paged decode attention (see kernels.h). */
#include "kernels.h"

/* ------------------------------------------------------- paged decode attention */

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

/* The fp32 scale of an int8 slot whose values start at element (byte) slot of kb: it
 * follows its head_dim values */
static inline float slot_scale(const void *kb, int64_t slot, int64_t head_dim) {
    float scale;
    memcpy(&scale, (const char *)kb + slot + head_dim, sizeof scale);
    return scale;
}

/* LANES keys' (or values') elements from element index j of a run: fp32, or int8 or fp8
 * widened in registers (inlined with the kind a constant, the tests vanish) */
static inline __attribute__((always_inline)) fv load_kv(const void *run, int64_t j, int kind) {
    if (kind == KV_I8) return widen_int8((const int8_t *)run + j);
    if (kind == KV_E4M3) return widen_fp8((const uint8_t *)run + j, 3, 7);
    if (kind == KV_E5M2) return widen_fp8((const uint8_t *)run + j, 2, 15);
    return loadv((const float *)run + j);
}

/* The dot products of query qg [chunks * LANES] with n <= LANES keys, token t's at
 * kb + t * stride (elements: floats, fp8 bytes, or int8 values each scaled by the fp32
 * that follows the slot's chunks * LANES of them), as one vector (lanes past n are 0). A full run keeps
 * its LANES partial sums in registers (the loops have constant bounds). */
static inline __attribute__((always_inline)) fv score_run(const float *qg, const void *kb,
                                                          int64_t stride, int64_t chunks,
                                                          int64_t n, int kind) {
    fv dots[LANES];
    for (int t = 0; t < LANES; t++) dots[t] = (fv){0};
    if (n == LANES) {
        for (int64_t c = 0; c < chunks; c++) {
            const fv qc = loadv(qg + c * LANES);
#pragma GCC unroll 16
            for (int t = 0; t < LANES; t++) dots[t] += qc * load_kv(kb, t * stride + c * LANES, kind);
        }
    } else {
        for (int t = 0; t < n; t++)
            for (int64_t c = 0; c < chunks; c++)
                dots[t] += loadv(qg + c * LANES) * load_kv(kb, t * stride + c * LANES, kind);
    }
    fv sums = lane_sums(dots);
    if (kind == KV_I8) {
        float scales[LANES] = {0};
        for (int t = 0; t < n; t++) scales[t] = slot_scale(kb, t * stride, chunks * LANES);
        sums *= loadv(scales);
    }
    return sums;
}

/* Positions in the run from pos: up to LANES, fewer where its block or the context ends
 * (a run never spans two blocks). */
static inline int64_t run_length(int64_t pos, int64_t block_size, int64_t ctx) {
    const int64_t to_block_end = block_size - pos % block_size;
    const int64_t n = to_block_end < LANES ? to_block_end : LANES;
    return ctx - pos < n ? ctx - pos : n;
}

/* Prefetch (into L2) the keys and values of the run of up to LANES positions from pos,
 * heads_bytes of each token from head_offset (bytes): a run starts in a block anywhere in
 * the cache, where the hardware prefetcher cannot guess it. */
static inline void prefetch_run(const char *k_cache, const char *v_cache, const int64_t *table,
                                int64_t block_size, int64_t token_bytes, int64_t head_offset,
                                int64_t heads_bytes, int64_t pos, int64_t ctx) {
    const int64_t blk = pos / block_size, off = pos % block_size;
    const int64_t n = run_length(pos, block_size, ctx);
    const int64_t first = (table[blk] * block_size + off) * token_bytes + head_offset;
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < heads_bytes; d += 64) {
            __builtin_prefetch(k_cache + first + t * token_bytes + d, 0, 2);
            __builtin_prefetch(v_cache + first + t * token_bytes + d, 0, 2);
        }
}

/* Whether decode rows a and b read the same blocks: equal table rows (the rows of one
 * speculated chunk, which attend up to successive positions of one sequence) */
static inline int same_table(const int64_t *tables, int64_t max_blocks, int64_t a, int64_t b) {
    return memcmp(tables + a * max_blocks, tables + b * max_blocks,
                  (size_t)max_blocks * sizeof *tables) == 0;
}

/* One query token per decode row against the keys and values of its blocks, read where
 * they lie in the paged cache (no gather). Consecutive rows with the same block table (a
 * speculated chunk's tokens, each attending up to its own position) form one group, up to
 * the rows one task holds: a task is one group and a range of its KV heads (all of them
 * when there are enough groups to keep every thread busy, so a task reads each token's K
 * and V contiguously), and its query rows are the query heads sharing those KV heads, for
 * every row of the group, so each run of keys and values is read once for all of them
 * rather than once per row. For each row, LANES keys at a time are scored into one vector
 * (lane_sums) and folded into an online softmax (running max and sum, the accumulator
 * rescaled when the max grows); a row skips the positions past its own context. Each
 * row's arithmetic is the same whatever group it is in. head_dim must be a multiple of 16.
 *
 * q        [B, Hk * G, D], row i's heads at q + i * q_stride   out [B, Hk * G, D]
 * k_cache, v_cache: token t of block b, KV head h's slot at ((b * S + t) * Hk + h) * W
 *          elements: fp32 (W = D), or int8 (W = D + 4 bytes: D int8 values, then their fp32
 *          scale; engine/attention/kv_quant.py), the int8 values widened in registers and
 *          each key's dot product and each value's weight multiplied by its scale, or fp8
 *          (W = D bytes, no scale) widened in registers
 * tables   [B, max_blocks] int64    context_lens [B] int64 (>= 1, <= max_blocks * S)
 */
static inline __attribute__((always_inline)) int paged_decode_attention(
        const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
        int64_t num_cache_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
        int64_t group, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
        int64_t num_seqs, float scale, float *out, int num_threads, int kind) {
    const int int8 = kind == KV_I8;
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
    /* the groups: rows firsts[g] .. firsts[g + 1] - 1, at most max_rows each (one KV
     * head's query rows for every row of a group fit one task), and small enough that
     * there are tasks for every thread (a group's tasks are at most one per KV head) */
    int64_t max_rows = ATTN_MAX_ROWS / group;
    max_rows = max_rows < ATTN_MAX_ACC / (group * head_dim) ? max_rows
             : ATTN_MAX_ACC / (group * head_dim);
    const int64_t groups_wanted = (num_threads + num_kv_heads - 1) / num_kv_heads;
    const int64_t spread = num_seqs / groups_wanted > 1 ? num_seqs / groups_wanted : 1;
    max_rows = spread < max_rows ? spread : max_rows;
    int64_t firsts[num_seqs + 1], num_groups = 0, widest = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (num_groups == 0 || s - firsts[num_groups - 1] == max_rows
            || !same_table(tables, max_blocks, s - 1, s))
            firsts[num_groups++] = s;
        const int64_t m = s + 1 - firsts[num_groups - 1];
        widest = m > widest ? m : widest;
    }
    firsts[num_groups] = num_seqs;
    /* KV heads per task: as many as the accumulators hold for the widest group, fewer
     * when splitting the heads is what gives every thread two tasks */
    int64_t fit = ATTN_MAX_ACC / (widest * group * head_dim);
    fit = fit < ATTN_MAX_ROWS / (widest * group) ? fit : ATTN_MAX_ROWS / (widest * group);
    const int64_t splits = num_groups >= 2 * num_threads ? 1
                         : (2 * num_threads + num_groups - 1) / (num_groups ? num_groups : 1);
    int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    heads_per_task = heads_per_task < fit ? heads_per_task : fit;
    const int64_t tasks_per_group = (num_kv_heads + heads_per_task - 1) / heads_per_task;
    const int64_t slot = int8 ? head_dim + 4 : head_dim; /* elements of one token-head */
    const int64_t elem = kind != KV_F32 ? 1 : (int64_t)sizeof(float);
    const int64_t hq = num_kv_heads * group, token_stride = num_kv_heads * slot;
    const int64_t chunks = head_dim / LANES;
#if LANES == 16
    const iv lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const iv lane_index = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_groups * tasks_per_group; task++) {
        const int64_t g = task / tasks_per_group, s0 = firsts[g], m = firsts[g + 1] - s0;
        const int64_t h0 = task % tasks_per_group * heads_per_task;
        const int64_t h1 = h0 + heads_per_task < num_kv_heads ? h0 + heads_per_task : num_kv_heads;
        const int64_t head_rows = (h1 - h0) * group; /* query heads h0 * group .. h1 * group - 1 */
        const int64_t rows = m * head_rows; /* row r: decode row s0 + r / head_rows */
        int64_t ctx = 0; /* the group's longest context */
        for (int64_t j = 0; j < m; j++) ctx = context_lens[s0 + j] > ctx ? context_lens[s0 + j] : ctx;
        const int64_t *table = tables + s0 * max_blocks;
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
            const int64_t first = (table[blk] * block_size + off) * token_stride;
            if (pos + n < ctx) /* the next run's keys and values start on their way */
                prefetch_run((const char *)k_cache, (const char *)v_cache, table, block_size,
                             token_stride * elem, h0 * slot * elem, (h1 - h0) * slot * elem,
                             pos + n, ctx);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t s = s0 + r / head_rows, hr = r % head_rows;
                const int64_t nr = context_lens[s] - pos < n ? context_lens[s] - pos : n;
                if (nr <= 0) continue; /* past this row's context */
                const iv valid = lane_index < (iv){0} + (int32_t)nr;
                const int64_t at = first + (h0 + hr / group) * slot;
                const void *kb = (const char *)k_cache + at * elem;
                fv sc = score_run(q + s * q_stride + (h0 * group + hr) * head_dim, kb,
                                  token_stride, chunks, nr, kind) * scale;
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
                const int64_t s = s0 + r / head_rows, hr = r % head_rows;
                const int64_t nr = context_lens[s] - pos < n ? context_lens[s] - pos : n;
                if (nr <= 0) continue;
                const int64_t at = first + (h0 + hr / group) * slot;
                const void *vb = (const char *)v_cache + at * elem;
                float wr[LANES]; /* each value's weight (times its scale: int8) */
                for (int t = 0; t < LANES; t++)
                    wr[t] = weights[r * LANES + t]
                            * (int8 && t < nr ? slot_scale(vb, t * token_stride, head_dim) : 1.f);
                for (int64_t c = 0; c < chunks; c++) {
                    float *ar = acc + r * head_dim + c * LANES;
                    const int64_t vc = c * LANES;
                    /* four sums: one FMA chain would wait on its own latency */
                    fv a0 = loadv(ar), a1 = {0}, a2 = {0}, a3 = {0};
                    int t = 0;
                    for (; t + 4 <= nr; t += 4) {
                        a0 += wr[t] * load_kv(vb, vc + t * token_stride, kind);
                        a1 += wr[t + 1] * load_kv(vb, vc + (t + 1) * token_stride, kind);
                        a2 += wr[t + 2] * load_kv(vb, vc + (t + 2) * token_stride, kind);
                        a3 += wr[t + 3] * load_kv(vb, vc + (t + 3) * token_stride, kind);
                    }
                    for (; t < nr; t++) a0 += wr[t] * load_kv(vb, vc + t * token_stride, kind);
                    storev(ar, (a0 + a1) + (a2 + a3));
                }
            }
            pos += n;
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t s = s0 + r / head_rows, hr = r % head_rows;
            const float inv = 1.f / run_sum[r];
            float *o = out + (s * hq + h0 * group + hr) * head_dim;
            const float *ar = acc + r * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
        }
    }
    return 0;
}

/* The kernel over a cache of kind (KV_F32, ...): each kind its own inlined copy */
int pd_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                              const void *v_cache, int64_t num_cache_blocks, int64_t block_size,
                              int64_t num_kv_heads, int64_t head_dim, int64_t group,
                              const int64_t *tables, int64_t max_blocks,
                              const int64_t *context_lens, int64_t num_seqs, float scale,
                              float *out, int num_threads, int kind) {
#define ATTEND(k) paged_decode_attention(q, q_stride, k_cache, v_cache, num_cache_blocks, \
                                         block_size, num_kv_heads, head_dim, group, tables, \
                                         max_blocks, context_lens, num_seqs, scale, out, \
                                         num_threads, k)
    switch (kind) {
    case KV_F32: return ATTEND(KV_F32);
    case KV_I8: return ATTEND(KV_I8);
    case KV_E4M3: return ATTEND(KV_E4M3);
    case KV_E5M2: return ATTEND(KV_E5M2);
    default: return -1;
    }
#undef ATTEND
}
