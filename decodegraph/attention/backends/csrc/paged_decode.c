/*
 * Paged attention for a uniform decode batch (one new token per request), float32.
 *
 * Writes each request's new K/V into its cache slot (slot -1: a padded row, skipped),
 * then attends over the request's context through its block table. One call does a
 * whole layer (wrapped as a torch operator in paged_decode_op.cpp), so a decode step
 * pays one operator call per layer instead of a dozen tensor ops. `scores` is a workspace of num_heads / num_kv_heads * max_model_len
 * floats, allocated once by the caller (an op never allocates inside a graph).
 *
 * Caches: [num_blocks, block_size, num_kv_heads, head_size], contiguous.
 * q/k/v:  rows of `q_stride` / `k_stride` / `v_stride` floats; head h of row r at
 *         r * stride + h * d.
 * out:    [num_rows, num_heads * head_size]; rows past num_reqs are zeroed.
 * Returns 0, or non-zero (and touches nothing) when a slot, block id or length is
 * outside the caches, the block table or the workspace.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

int paged_decode_f32(const float *q, const float *k, const float *v, float *out,
                      float *k_cache, float *v_cache, const int64_t *slot_mapping,
                      const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                      int64_t num_reqs, int64_t num_rows, int64_t q_stride, int64_t k_stride,
                      int64_t v_stride,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, float scale, float *scores, int64_t num_blocks,
                      int64_t bt_cols, int64_t max_len)
{
    const int64_t d = head_size, kvh = num_kv_heads, g = num_heads / num_kv_heads;
    const int64_t tok = kvh * d; /* floats per cached token */
    /* Refuse metadata that would read or write outside the caches (nothing written yet). */
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t s = slot_mapping[r], len = seq_lens[r];
        if (s >= num_blocks * block_size || len > max_len || len > bt_cols * block_size)
            return 1;
        for (int64_t b = 0; b * block_size < len; b++) {
            const int32_t id = block_tables[r * bt_stride + b];
            if (id < 0 || id >= num_blocks)
                return 2;
        }
    }
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t s = slot_mapping[r];
        if (s >= 0) {
            memcpy(k_cache + s * tok, k + r * k_stride, tok * sizeof(float));
            memcpy(v_cache + s * tok, v + r * v_stride, tok * sizeof(float));
        }
    }
    for (int64_t r = 0; r < num_reqs; r++) {
        const int32_t *bt = block_tables + r * bt_stride;
        const int64_t len = seq_lens[r];
        float *o_row = out + r * num_heads * d;
        memset(o_row, 0, num_heads * d * sizeof(float));
        if (len <= 0)
            continue;
        for (int64_t kh = 0; kh < kvh; kh++) {
            const float *qg = q + r * q_stride + kh * g * d;
            /* scores[gi * len + p] = q(head kh*g+gi) . k(p) * scale */
            for (int64_t p0 = 0; p0 < len; p0 += block_size) {
                const float *kb = k_cache + (int64_t)bt[p0 / block_size] * block_size * tok + kh * d;
                const int64_t n = len - p0 < block_size ? len - p0 : block_size;
                for (int64_t j = 0; j < n; j++) {
                    const float *kp = kb + j * tok;
                    for (int64_t gi = 0; gi < g; gi++) {
                        const float *qh = qg + gi * d;
                        float sc = 0.f;
                        for (int64_t i = 0; i < d; i++)
                            sc += qh[i] * kp[i];
                        scores[gi * len + p0 + j] = sc * scale;
                    }
                }
            }
            /* softmax per query head (max-subtracted; no infinities involved) */
            for (int64_t gi = 0; gi < g; gi++) {
                float *sg = scores + gi * len;
                float m = sg[0];
                for (int64_t p = 1; p < len; p++)
                    m = sg[p] > m ? sg[p] : m;
                float l = 0.f;
                for (int64_t p = 0; p < len; p++) {
                    sg[p] = expf(sg[p] - m);
                    l += sg[p];
                }
                const float inv = 1.f / l;
                for (int64_t p = 0; p < len; p++)
                    sg[p] *= inv;
            }
            float *o = o_row + kh * g * d;
            for (int64_t p0 = 0; p0 < len; p0 += block_size) {
                const float *vb = v_cache + (int64_t)bt[p0 / block_size] * block_size * tok + kh * d;
                const int64_t n = len - p0 < block_size ? len - p0 : block_size;
                for (int64_t j = 0; j < n; j++) {
                    const float *vp = vb + j * tok;
                    for (int64_t gi = 0; gi < g; gi++) {
                        const float w = scores[gi * len + p0 + j];
                        float *og = o + gi * d;
                        for (int64_t i = 0; i < d; i++)
                            og[i] += w * vp[i];
                    }
                }
            }
        }
    }
    for (int64_t r = num_reqs; r < num_rows; r++)
        memset(out + r * num_heads * d, 0, num_heads * d * sizeof(float));
    return 0;
}
