/* Sampling-side kernels over a step's logits: a structured output's token bitmask applied
 * in place, the logprobs a request asked for (the sampled token's value and rank and the
 * likeliest alternatives) in a few passes over each row, and the repetition, presence
 * and frequency penalties over each row's history. See kernels.h. */
#include <stdlib.h>

#include "kernels.h"

/* ------------------------------------------------------------ token bitmask */

/* For each i < num_masks: row row_index[i] of logits (rows start row_stride floats apart,
 * cols wide) gets -inf at every column whose bit is clear in mask row i (words int32 of
 * 32 columns each, bit b of word w = column 32 w + b, as llguidance writes them); columns
 * past the mask's 32 * words are not allowed either. A word of all ones (the usual case:
 * most tokens allowed) is skipped whole. */
int pd_apply_token_bitmask_f32(float *logits, int64_t rows, int64_t cols, int64_t row_stride,
                               const int32_t *mask, int64_t words, const int64_t *row_index,
                               int64_t num_masks) {
    if (rows < 0 || cols < 1 || row_stride < cols || words < 1 || num_masks < 0) return -1;
    for (int64_t i = 0; i < num_masks; i++)
        if (row_index[i] < 0 || row_index[i] >= rows) return -1;
    for (int64_t i = 0; i < num_masks; i++) {
        float *row = logits + row_index[i] * row_stride;
        const uint32_t *bits = (const uint32_t *)(mask + i * words);
        const int64_t covered = words * 32 < cols ? words * 32 : cols;
        for (int64_t w = 0; w * 32 < covered; w++) {
            const uint32_t word = bits[w];
            if (word == 0xffffffffu) continue;
            const int64_t base = w * 32, end = base + 32 < covered ? base + 32 : covered;
            for (int64_t c = base; c < end; c++)
                if (!((word >> (c - base)) & 1u)) row[c] = -INFINITY;
        }
        for (int64_t c = covered; c < cols; c++) row[c] = -INFINITY;
    }
    return 0;
}

/* ------------------------------------------------------------------ logprobs */

/* The top-k list of one row: values descending, ties by the lower column (insertion keeps
 * an earlier equal value ahead). */
static inline void top_insert(float *values, int64_t *ids, int64_t k, int64_t *filled,
                              float v, int64_t id) {
    int64_t at = *filled < k ? *filled : k - 1;
    if (*filled == k && !(v > values[k - 1])) return;
    while (at > 0 && v > values[at - 1]) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    values[at] = v;
    ids[at] = id;
    if (*filled < k) (*filled)++;
}

/* Row r's log-softmax, as torch.log_softmax computes it ((x - max) - log(sum(e^(x - max)))),
 * read at: the chosen column chosen[r] (its value to chosen_lp[r]; its rank to rank[r]:
 * 1 + the columns with a larger log-softmax, so ties share the better rank), and the k
 * largest (columns to top_ids[r * k ..], values to top_lp[r * k ..], descending; ties by
 * the lower column). -2 for a row holding NaN or nothing but -inf (the caller then runs
 * torch, which says what such a row gives). */
int pd_token_logprobs_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride,
                          const int64_t *chosen, int64_t k, float *chosen_lp, int64_t *rank,
                          int64_t *top_ids, float *top_lp, int num_threads) {
    if (rows < 0 || cols < 1 || row_stride < cols || k < 0 || k > cols || num_threads < 1)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (chosen[r] < 0 || chosen[r] >= cols) return -1;
    const int threads = rows * cols >= 65536 ? num_threads : 1;
    const int64_t vec = cols - cols % LANES;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * row_stride;
        /* pass 1: the largest value (NaN seen on the way) */
        fv best = (fv){0} - INFINITY;
        iv nan = {0};
        for (int64_t c = 0; c < vec; c += LANES) {
            const fv v = loadv(xr + c);
            nan |= v != v;
            best = selectv(v > best, v, best);
        }
        float m = max_lanes(best);
        int any_nan = 0;
        for (int i = 0; i < LANES; i++) any_nan |= nan[i] != 0;
        for (int64_t c = vec; c < cols; c++) {
            any_nan |= xr[c] != xr[c];
            if (xr[c] > m) m = xr[c];
        }
        if (any_nan || m == -INFINITY) {
            bad = 1;
            continue;
        }
        /* pass 2: the sum of e^(x - m), the top k by value */
        fv sums = {0};
        for (int64_t c = 0; c < vec; c += LANES) sums += exp_nonpositive(loadv(xr + c) - m);
        float sum = sum_lanes(sums);
        for (int64_t c = vec; c < cols; c++) {
            fv one = (fv){0} + (xr[c] - m);
            sum += exp_nonpositive(one)[0];
        }
        const float log_sum = logf(sum);
        const float mine = (xr[chosen[r]] - m) - log_sum;
        /* pass 3: the rank (on log-softmax values, as torch compares them) and the top k */
        int64_t larger = 0, filled = 0;
        iv counts = {0}; /* lanes: -(larger values seen); at most cols / LANES each */
        float *values = top_lp + r * k;
        int64_t *ids = top_ids + r * k;
        const fv mv = (fv){0} + m, lv = (fv){0} + log_sum, minev = (fv){0} + mine;
        float threshold = -INFINITY; /* below the k-th value so far nothing enters */
        for (int64_t c = 0; c < vec; c += LANES) {
            const fv v = loadv(xr + c);
            const iv above = ((v - mv) - lv) > minev;
            counts += above;
            if (k) {
                const iv enters = v > ((fv){0} + threshold);
                int any = filled < k;
                for (int i = 0; i < LANES && !any; i++) any = enters[i] != 0;
                if (any) {
                    for (int i = 0; i < LANES; i++) top_insert(values, ids, k, &filled, v[i], c + i);
                    if (filled == k) threshold = values[k - 1];
                }
            }
        }
        for (int i = 0; i < LANES; i++) larger -= counts[i];
        for (int64_t c = vec; c < cols; c++) {
            larger += ((xr[c] - m) - log_sum) > mine;
            if (k) top_insert(values, ids, k, &filled, xr[c], c);
        }
        for (int64_t j = 0; j < k; j++) values[j] = (values[j] - m) - log_sum;
        chosen_lp[r] = mine;
        rank[r] = larger + 1;
    }
    return bad ? -2 : 0;
}

/* ---------------------------------------------------------------- penalties */

/* The repetition, presence and frequency penalties of rows row_index[i] of logits, in
 * place, in that order (as engine/core/logits.py applies them): each token of row i's
 * prompt ids (prompts[i]: prompt_lens[i] int32, any order, repeats allowed) or output ids
 * (outputs[i], outputs_lens[i]) once divided by repetition[i] where positive, multiplied
 * where not; then each distinct output token less frequency[i] * its count + presence[i].
 * Ids outside [0, cols) are skipped. The per-token work is a count in a scratch array of
 * cols entries per thread (cleared again token by token), so a row costs its history's
 * length, not the vocabulary. -3 (nothing changed) when the scratch cannot be had. */
int pd_penalties_f32(float *logits, int64_t rows, int64_t cols, int64_t row_stride,
                     const int64_t *row_index, int64_t num_rows, const int64_t *prompts,
                     const int64_t *prompt_lens, const int64_t *outputs,
                     const int64_t *output_lens, const float *repetition,
                     const float *presence, const float *frequency, int num_threads) {
    if (rows < 0 || cols < 1 || row_stride < cols || num_rows < 0 || num_threads < 1) return -1;
    int64_t work = 0;
    for (int64_t i = 0; i < num_rows; i++) {
        if (row_index[i] < 0 || row_index[i] >= rows || prompt_lens[i] < 0 || output_lens[i] < 0)
            return -1;
        work += prompt_lens[i] + output_lens[i];
    }
    const int threads = work >= 65536 && num_rows > 1 ? num_threads : 1;
    /* every thread's scratch, had before anything is changed (0 between rows) */
    int32_t *scratch = num_rows ? calloc((size_t)threads * (size_t)cols, sizeof *scratch) : NULL;
    if (num_rows && !scratch) return -3;
#pragma omp parallel num_threads(threads)
    {
        int32_t *counts = scratch + (size_t)omp_get_thread_num() * (size_t)cols;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_rows; i++) {
            float *row = logits + row_index[i] * row_stride;
            const int32_t *prompt = (const int32_t *)(intptr_t)prompts[i];
            const int32_t *output = (const int32_t *)(intptr_t)outputs[i];
            const float rep = repetition[i];
            if (rep != 1.f) { /* counts[t] = 1: t penalized already */
                for (int pass = 0; pass < 2; pass++) {
                    const int32_t *ids = pass ? output : prompt;
                    const int64_t n = pass ? output_lens[i] : prompt_lens[i];
                    for (int64_t j = 0; j < n; j++) {
                        const int32_t t = ids[j];
                        if (t < 0 || t >= cols || counts[t]) continue;
                        counts[t] = 1;
                        row[t] = row[t] > 0 ? row[t] / rep : row[t] * rep;
                    }
                }
                for (int pass = 0; pass < 2; pass++) {
                    const int32_t *ids = pass ? output : prompt;
                    const int64_t n = pass ? output_lens[i] : prompt_lens[i];
                    for (int64_t j = 0; j < n; j++)
                        if (ids[j] >= 0 && ids[j] < cols) counts[ids[j]] = 0;
                }
            }
            if (presence[i] != 0.f || frequency[i] != 0.f) {
                for (int64_t j = 0; j < output_lens[i]; j++)
                    if (output[j] >= 0 && output[j] < cols) counts[output[j]]++;
                for (int64_t j = 0; j < output_lens[i]; j++) {
                    const int32_t t = output[j];
                    if (t < 0 || t >= cols || !counts[t]) continue;
                    row[t] += -(frequency[i] * (float)counts[t] + presence[i]);
                    counts[t] = 0; /* once per distinct token; cleared for the next row */
                }
            }
        }
    }
    free(scratch);
    return 0;
}
