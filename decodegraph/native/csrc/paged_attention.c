/*
 * Paged attention for any batch (decodes, prefills, prefill chunks, mixed), float32 or
 * bfloat16 (float32 arithmetic in both; bf16 rounds where a bf16 model's reference
 * attention does). AVX-512 at block sizes that are multiples of 16
 * (paged_attention_avx512.h), the portable loops below elsewhere.
 *
 * Writes every new token's K/V into its cache slot (slot -1: a padded row, skipped),
 * then attends each token over its request's context through the block table: token
 * i of a request with q_len new tokens and seq_len positions sees the first
 * seq_len - q_len + i + 1 (causal, with the cached context before it), or with a sliding
 * window W the last W of those: its cost follows the window, not the context, and the
 * blocks before the window are never read (a sliding-window KV group frees them).
 * Logit soft-capping (Gemma 2) caps each scaled score at +-softcap through tanh. One call does a
 * whole layer (wrapped as a torch operator in cpu_ops.cpp), so a step pays one
 * operator call per layer instead of a dozen tensor ops, or one attention per request.
 *
 * Caches: [num_blocks, num_kv_heads, head_size, block_size], contiguous: within a block,
 *         one head's values of one dimension lie side by side for block_size positions,
 *         so both products run block_size wide (AVX-512: 16 positions a vector, a block
 *         of 16 or more positions in vectors of 16) and the softmax weights scale V
 *         without a horizontal sum per position.
 * q/k/v:  rows of `q_stride` / `k_stride` / `v_stride` values; head h of row r at
 *         r * stride + h * d.
 * query_start_loc: request r's tokens are rows [qsl[r], qsl[r + 1]); rows from
 *         qsl[num_reqs] on are padding: zeroed in out, nothing written.
 * out:    [num_rows, num_heads * head_size].
 * work:   float32, per caller thread: `max_len` scores for each query head of a KV
 *         head's group, then (head_size + 1) * block_size accumulators; allocated once
 *         by the caller (an op never allocates inside a graph).
 * A step is two calls: paged_attention_begin checks the metadata, writes the new K/V and
 * zeroes the padding rows (once); paged_attention_requests attends the tokens of
 * requests [r0, r1) (independent ranges may run on different threads, each with its own
 * workspace; a request's result does not depend on the split).
 * paged_attention_begin returns 0, or non-zero (and touches nothing) when a slot, block
 * id, length or query range is outside the caches, the block table, the rows or the
 * workspace.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "paged_attention_avx512.h" /* attend_request_avx512 */
#include "vec.h"

#define INLINE static inline __attribute__((always_inline))

/* Element i of a float32 or (bf16) bfloat16 array; `bf16` is a constant at every call. */
INLINE float kv_at(const void *tile, int64_t i, const int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)tile)[i]) : ((const float *)tile)[i];
}

/* Logit soft-capping (Gemma 2): cap * tanh(x / cap), rounded after each step as a bf16
 * model's reference attention computes it. */
INLINE float soft_cap(float x, float cap, const int bf16)
{
    if (!bf16)
        return cap * tanhf(x / cap);
    return round_bf16(round_bf16(tanhf(round_bf16(x / cap))) * cap);
}

/* One KV head's tile of the block holding context position p0. */
INLINE const void *tile_of(const void *cache, const int32_t *bt, int64_t p0, int64_t bs,
                           int64_t tile_stride, int64_t tile_off, const int bf16)
{
    const int64_t at = (int64_t)bt[p0 / bs] * tile_stride + tile_off;
    return (const char *)cache + at * (bf16 ? 2 : 4);
}

/* First pass of attend_head: every context position's scaled score into sc; returns
 * their maximum. float32 folds the scale into q; bfloat16 rounds the raw and the scaled
 * score to bf16, as a bf16 matmul and the multiply after it do. Lanes past the context
 * in the last block are computed but never used. */
INLINE float score_pass(const float *qh, const void *k_cache, const int32_t *bt, int64_t start,
                        int64_t len, int64_t tile_stride, int64_t tile_off, int64_t d,
                        const int64_t bs, float scale, float softcap, float *__restrict__ sc,
                        const int bf16)
{
    const float q_scale = bf16 ? 1.f : scale;
    float m = -FLT_MAX;
    for (int64_t p0 = start / bs * bs; p0 < len; p0 += bs) {
        const void *kt = tile_of(k_cache, bt, p0, bs, tile_stride, tile_off, bf16);
        float *s = sc + p0;
        for (int64_t j = 0; j < bs; j++)
            s[j] = 0.f;
        for (int64_t i = 0; i < d; i++) {
            const float qi = qh[i] * q_scale;
            for (int64_t j = 0; j < bs; j++)
                s[j] += qi * kv_at(kt, i * bs + j, bf16);
        }
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        for (int64_t j = 0; j < n; j++) {
            if (bf16)
                s[j] = round_bf16(round_bf16(s[j]) * scale);
            if (softcap > 0.f)
                s[j] = soft_cap(s[j], softcap, bf16);
            if (p0 + j < start)
                s[j] = -FLT_MAX; /* before the window: weight 0 */
            m = s[j] > m ? s[j] : m;
        }
    }
    return m;
}

/* o[i] = inv * (sum over the block_size lanes of accumulator row i). */
INLINE void reduce_lanes(const float *acc, int64_t d, int64_t bs, float inv, float *o)
{
    for (int64_t i = 0; i < d; i++) {
        float sum = 0.f;
        for (int64_t j = 0; j < bs; j++)
            sum += acc[i * bs + j];
        o[i] = sum * inv;
    }
}

/* Second pass of attend_head over one block: the first n lanes' weights exp(s - m) into
 * s, their sums into l, and the weighted V rows into acc. */
INLINE void weigh_block(float *__restrict__ s, const float *vt, float m, int64_t d,
                        const int64_t bs, const int64_t n, float *__restrict__ l,
                        float *__restrict__ acc)
{
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        l[j] += s[j];
    }
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = 0; j < n; j++)
            acc[i * bs + j] += s[j] * vt[i * bs + j];
}

/* One query head over its KV head's context, float32, in two passes: scores and their
 * maximum, then exp-weighted sums of V (no running rescale). Callers pass `bs` as a
 * constant where they can, which makes every inner loop exactly one vector wide. */
INLINE void attend_head(const float *qh, const float *k_cache, const float *v_cache,
                        const int32_t *bt, int64_t start, int64_t len, int64_t tile_stride,
                        int64_t tile_off, int64_t d, const int64_t bs, float scale,
                        float softcap, float *__restrict__ sc, float *__restrict__ acc,
                        float *__restrict__ o)
{
    const float m = score_pass(qh, k_cache, bt, start, len, tile_stride, tile_off, d, bs, scale,
                               softcap, sc, 0);
    memset(acc, 0, (size_t)(d + 1) * bs * sizeof(float));
    float *l = acc + d * bs; /* per-lane sums of the weights */
    for (int64_t p0 = start / bs * bs; p0 < len; p0 += bs) {
        const float *vt = v_cache + (int64_t)bt[p0 / bs] * tile_stride + tile_off;
        if (len - p0 >= bs) /* n = bs: a constant where bs is, so one vector wide */
            weigh_block(sc + p0, vt, m, d, bs, bs, l, acc);
        else /* the last, partial block: only its first n lanes hold context */
            weigh_block(sc + p0, vt, m, d, bs, len - p0, l, acc);
    }
    float total = 0.f;
    for (int64_t j = 0; j < bs; j++)
        total += l[j];
    reduce_lanes(acc, d, bs, 1.f / total, o);
}

/* attend_head for bf16 caches (q and o in float32), rounding to bf16 where a bf16
 * model's reference attention does (transformers' eager attention, our tensor-op path):
 * the scaled scores, and the normalised weights before they multiply V. Sums are float32
 * throughout, as in a bf16 matmul. */
INLINE void attend_head_bf16(const float *qh, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *bt, int64_t start, int64_t len, int64_t tile_stride,
                             int64_t tile_off, int64_t d, const int64_t bs, float scale,
                             float softcap, float *__restrict__ sc, float *__restrict__ acc,
                             float *__restrict__ o)
{
    const float m = score_pass(qh, k_cache, bt, start, len, tile_stride, tile_off, d, bs, scale,
                               softcap, sc, 1);
    const int64_t first = start / bs * bs; /* the first block the window reaches */
    float total = 0.f;
    for (int64_t p = first; p < len; p++) {
        sc[p] = expf(sc[p] - m);
        total += sc[p];
    }
    memset(acc, 0, (size_t)d * bs * sizeof(float));
    for (int64_t p0 = first; p0 < len; p0 += bs) {
        const uint16_t *vt = v_cache + (int64_t)bt[p0 / bs] * tile_stride + tile_off;
        float *s = sc + p0;
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        for (int64_t j = 0; j < n; j++)
            s[j] = round_bf16(s[j] / total);
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < n; j++)
                acc[i * bs + j] += s[j] * bf16_to_f32(vt[i * bs + j]);
    }
    reduce_lanes(acc, d, bs, 1.f, o);
}

/* Refuse metadata that would read or write outside the caches, the block table, the
 * rows or the workspace (checked before anything is written). Query ranges must be
 * ordered, within num_rows, and no longer than their request's context. */
static int check_metadata(const int64_t *slot_mapping, const int32_t *block_tables,
                          int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens,
                          int64_t num_reqs, int64_t num_rows, int64_t bs, int64_t num_blocks,
                          int64_t bt_cols, int64_t max_len)
{
    if (qsl[0] != 0)
        return 1;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t len = seq_lens[r], q_len = (int64_t)qsl[r + 1] - qsl[r];
        const int64_t padded_len = (len + bs - 1) / bs * bs;
        if (q_len < 0 || q_len > len || qsl[r + 1] > num_rows || padded_len > max_len ||
            len > bt_cols * bs)
            return 1;
        for (int64_t b = 0; b * bs < len; b++) {
            const int32_t id = block_tables[r * bt_stride + b];
            if (id < 0 || id >= num_blocks)
                return 2;
        }
    }
    for (int64_t t = 0; t < qsl[num_reqs]; t++)
        if (slot_mapping[t] >= num_blocks * bs)
            return 1;
    return 0;
}

/* Copy each new token's K/V row into its cache slot: element c = head * d + dim of the
 * row goes to tile c / d, row c % d, lane slot % block_size. `elem` bytes per value. */
static void write_new_kv(char *k_cache, char *v_cache, const char *k, const char *v,
                         const int64_t *slot_mapping, int64_t num_tokens, int64_t k_stride,
                         int64_t v_stride, int64_t row, int64_t bs, int64_t tile_stride,
                         size_t elem)
{
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slot_mapping[t];
        if (s < 0)
            continue; /* a padded row */
        const int64_t at = (s / bs) * tile_stride + s % bs;
        for (int64_t c = 0; c < row; c++) {
            memcpy(k_cache + (at + c * bs) * elem, k + (t * k_stride + c) * elem, elem);
            memcpy(v_cache + (at + c * bs) * elem, v + (t * v_stride + c) * elem, elem);
        }
    }
}

enum { BF16_MAX_HEAD = 512 };

/* One token's row: all heads over the first `len` positions of block table `bt`. */
static void attend_row(const void *q_row, void *o_row, const void *k_cache,
                       const void *v_cache, const int32_t *bt, int64_t start, int64_t len,
                       int64_t num_heads, int64_t g, int64_t d, int64_t bs, int64_t tile_stride,
                       float scale, float softcap, float *sc, int64_t sc_stride, float *acc,
                       int avx512, int bf16)
{
#if DECODEGRAPH_X86
    if (avx512) {
        attend_request_avx512(q_row, k_cache, v_cache, bt, start, len, tile_stride, num_heads,
                              g, d, bs, scale, softcap, sc, sc_stride, o_row, bf16);
        return;
    }
#endif
    const int64_t tile = d * bs;
    float qf[BF16_MAX_HEAD], of[BF16_MAX_HEAD];
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t off = (h / g) * tile;
        if (bf16) {
            const uint16_t *qh = (const uint16_t *)q_row + h * d;
            for (int64_t i = 0; i < d; i++)
                qf[i] = bf16_to_f32(qh[i]);
            const uint16_t *kc = (const uint16_t *)k_cache, *vc = (const uint16_t *)v_cache;
            if (bs == 16)
                attend_head_bf16(qf, kc, vc, bt, start, len, tile_stride, off, d, 16, scale,
                                 softcap, sc, acc, of);
            else
                attend_head_bf16(qf, kc, vc, bt, start, len, tile_stride, off, d, bs, scale,
                                 softcap, sc, acc, of);
            for (int64_t i = 0; i < d; i++)
                ((uint16_t *)o_row)[h * d + i] = f32_to_bf16(of[i]);
            continue;
        }
        const float *qh = (const float *)q_row + h * d;
        const float *kc = (const float *)k_cache, *vc = (const float *)v_cache;
        float *o = (float *)o_row + h * d;
        if (bs == 16)
            attend_head(qh, kc, vc, bt, start, len, tile_stride, off, d, 16, scale, softcap, sc,
                        acc, o);
        else
            attend_head(qh, kc, vc, bt, start, len, tile_stride, off, d, bs, scale, softcap, sc,
                        acc, o);
    }
}

/* One layer's attention step (see the top of this file). All tensors float32, or all
 * bfloat16 when `bf16` (head_size at most BF16_MAX_HEAD). */
struct paged_attention_step {
    const void *q, *k, *v;
    void *out, *k_cache, *v_cache;
    const int64_t *slot_mapping;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    int64_t bt_stride, num_reqs, num_rows, q_stride, k_stride, v_stride;
    int64_t num_heads, num_kv_heads, head_size, block_size;
    float scale;
    int64_t num_blocks, bt_cols, max_len; /* max_len: context positions a workspace holds */
    int bf16;
    /* Sliding window: a token sees the last `window` positions up to its own (0: all);
     * logit soft-capping: scores become softcap * tanh(score / softcap) (0: none). */
    int64_t window;
    float softcap;
};

/* Check the step, write its new K/V into the caches and zero the padding rows of out:
 * 0, or non-zero with nothing touched (3: a bf16 head size above BF16_MAX_HEAD). */
int paged_attention_begin(const struct paged_attention_step *a)
{
    const int64_t d = a->head_size, kvh = a->num_kv_heads, bs = a->block_size;
    const size_t elem = a->bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t row_bytes = (size_t)(a->num_heads * d) * elem;
    if (a->bf16 && d > BF16_MAX_HEAD)
        return 3;
    const int bad = check_metadata(a->slot_mapping, a->block_tables, a->bt_stride,
                                   a->query_start_loc, a->seq_lens, a->num_reqs, a->num_rows,
                                   bs, a->num_blocks, a->bt_cols, a->max_len);
    if (bad)
        return bad;
    const int64_t num_tokens = a->query_start_loc[a->num_reqs];
    write_new_kv((char *)a->k_cache, (char *)a->v_cache, (const char *)a->k,
                 (const char *)a->v, a->slot_mapping, num_tokens, a->k_stride, a->v_stride,
                 kvh * d, bs, kvh * d * bs, elem);
    memset((char *)a->out + num_tokens * row_bytes, 0,
           (size_t)(a->num_rows - num_tokens) * row_bytes);
    return 0;
}

/* Attend every token of requests [r0, r1) (after paged_attention_begin), with `work`
 * holding one thread's workspace. */
void paged_attention_requests(const struct paged_attention_step *a, int64_t r0, int64_t r1,
                              float *work)
{
    const int64_t d = a->head_size, g = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const size_t elem = a->bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t row_bytes = (size_t)(a->num_heads * d) * elem;
    float *sc = work, *acc = work + g * a->max_len;
    const int avx512 = bs % 16 == 0 && d <= 512 && use_avx512();
    const unsigned int fp_mode = flush_denormals();
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *bt = a->block_tables + r * a->bt_stride;
        const int64_t first = a->query_start_loc[r], end = a->query_start_loc[r + 1];
        /* Token t sees the context up to and including its own position (len of them),
         * or within a sliding window the last `window` of those. */
        for (int64_t t = first; t < end; t++) {
            const int64_t len = a->seq_lens[r] - (end - 1 - t);
            const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
            attend_row((const char *)a->q + t * a->q_stride * elem,
                       (char *)a->out + t * row_bytes, a->k_cache, a->v_cache, bt, start, len,
                       a->num_heads, g, d, bs, a->num_kv_heads * d * bs, a->scale, a->softcap,
                       sc, a->max_len, acc, avx512, a->bf16);
        }
    }
    restore_fp_mode(fp_mode);
}
