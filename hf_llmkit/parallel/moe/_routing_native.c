/* The MoE layer's routing copies on the CPU (float32): a token's K routed slots gathered and summed in one pass.
 *
 * Rows are the expert-sorted copies of the tokens, `rows [N, H]`; `pos [T * K]` maps each (token, slot) to its row,
 * and a slot dropped by the capacity limit points at row N, which reads as zero. torch runs each direction as a
 * row gather into a `[T, K, H]` copy followed by a product or a sum over K (and backward adds a `[T, K, H]` product
 * and a second gather); here each reads its inputs once and writes its outputs once, with no `[T, K, H]` copy.
 *   combine forward:   out[t] = sum_k w[t, k] * rows[pos[t K + k]]
 *   combine backward:  drows[pos[t K + k]] = w[t, k] * dout[t],  dw[t, k] = rows[pos[t K + k]] . dout[t]
 *   gather backward:   dx[t] = sum_k drows[pos[t K + k]]     (the gradient of rows = x[token of each row])
 * Every kept row is one slot's, so no two slots write the same row: tokens are shared among OpenMP threads with
 * no atomics. Sums run in slot order k = 0, 1, ... (what torch's sum over K does); a dot product runs in 8 lanes
 * (the compiler vectorizes it), so dw differs from torch's by float32 rounding.
 */
#include <stddef.h>
#include <stdint.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += a[i + j] * b[i + j];
    float sum = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out [T, H] = each token's weighted sum of its K rows (rows [N, H], w [T, K] or NULL for weights of 1,
 * pos [T * K]). */
void routing_combine_forward(const float *rows, const float *w, const int64_t *pos, int64_t tokens, int64_t k,
                             int64_t hidden, int64_t n, float *out, int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float *restrict o = out + t * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t p = pos[t * k + j];
            if (p >= n) continue;
            const float *restrict r = rows + p * hidden;
            if (w == NULL) {
                for (int64_t i = 0; i < hidden; i++) o[i] += r[i];
                continue;
            }
            float wt = w[t * k + j];
            for (int64_t i = 0; i < hidden; i++) o[i] += wt * r[i];
        }
    }
}

/* drows [N, H] (every kept row written) and dw [T, K] (0 for a dropped slot) from dout [T, H]. */
void routing_combine_backward(const float *rows, const float *w, const int64_t *pos, const float *dout,
                              int64_t tokens, int64_t k, int64_t hidden, int64_t n, float *drows, float *dw,
                              int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *restrict d = dout + t * hidden;
        for (int64_t j = 0; j < k; j++) {
            int64_t p = pos[t * k + j];
            if (p >= n) {
                dw[t * k + j] = 0.0f;
                continue;
            }
            float wt = w[t * k + j];
            float *restrict dr = drows + p * hidden;
            for (int64_t i = 0; i < hidden; i++) dr[i] = wt * d[i];
            dw[t * k + j] = dot(rows + p * hidden, d, hidden);
        }
    }
}

/* dx [T, H] = the sum of each token's K row gradients (drows [N, H]). */
void routing_gather_backward(const float *drows, const int64_t *pos, int64_t tokens, int64_t k, int64_t hidden,
                             int64_t n, float *dx, int threads) {
    routing_combine_forward(drows, NULL, pos, tokens, k, hidden, n, dx, threads);
}
