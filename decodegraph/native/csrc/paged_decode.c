/*
 * Paged attention for a uniform decode batch (one new token per request), float32 or
 * bfloat16 (portable loops there; float32 arithmetic in both).
 *
 * Writes each request's new K/V into its cache slot (slot -1: a padded row, skipped),
 * then attends over the request's context through its block table. One call does a
 * whole layer (wrapped as a torch operator in cpu_ops.cpp), so a decode step
 * pays one operator call per layer instead of a dozen tensor ops.
 *
 * Caches: [num_blocks, num_kv_heads, head_size, block_size], contiguous: within a block,
 *         one head's values of one dimension lie side by side for block_size positions,
 *         so both products run block_size wide (one AVX-512 vector at block size 16)
 *         and the softmax weights scale V without a horizontal sum per position.
 * q/k/v:  rows of `q_stride` / `k_stride` / `v_stride` values; head h of row r at
 *         r * stride + h * d.
 * out:    [num_rows, num_heads * head_size]; rows past num_reqs are zeroed.
 * work:   float32: `max_len` scores, then (head_size + 1) * block_size accumulators;
 *         allocated once by the caller (an op never allocates inside a graph).
 * Returns 0, or non-zero (and touches nothing) when a slot, block id or length is
 * outside the caches, the block table or the workspace.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bfloat16 <-> float32, bit for bit as torch converts (round to nearest even). */
static inline float bf16_to_f32(uint16_t x)
{
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#define INLINE static inline __attribute__((always_inline))

/* Element i of a float32 or (bf16) bfloat16 array; `bf16` is a constant at every call. */
INLINE float kv_at(const void *tile, int64_t i, const int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)tile)[i]) : ((const float *)tile)[i];
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
INLINE float score_pass(const float *qh, const void *k_cache, const int32_t *bt, int64_t len,
                        int64_t tile_stride, int64_t tile_off, int64_t d, const int64_t bs,
                        float scale, float *__restrict__ sc, const int bf16)
{
    const float q_scale = bf16 ? 1.f : scale;
    float m = -FLT_MAX;
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
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

/* One query head over its KV head's context, float32, in two passes: scores and their
 * maximum, then exp-weighted sums of V (no running rescale). Callers pass `bs` as a
 * constant where they can, which makes every inner loop exactly one vector wide. */
INLINE void attend_head(const float *qh, const float *k_cache, const float *v_cache,
                        const int32_t *bt, int64_t len, int64_t tile_stride, int64_t tile_off,
                        int64_t d, const int64_t bs, float scale, float *__restrict__ sc,
                        float *__restrict__ acc, float *__restrict__ o)
{
    const float m = score_pass(qh, k_cache, bt, len, tile_stride, tile_off, d, bs, scale, sc, 0);
    memset(acc, 0, (size_t)(d + 1) * bs * sizeof(float));
    float *l = acc + d * bs; /* per-lane sums of the weights */
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        const float *vt = v_cache + (int64_t)bt[p0 / bs] * tile_stride + tile_off;
        float *s = sc + p0;
        if (len - p0 >= bs) {
            for (int64_t j = 0; j < bs; j++) {
                s[j] = expf(s[j] - m);
                l[j] += s[j];
            }
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < bs; j++)
                    acc[i * bs + j] += s[j] * vt[i * bs + j];
        } else { /* the last, partial block: only its first n lanes hold context */
            const int64_t n = len - p0;
            for (int64_t j = 0; j < n; j++) {
                s[j] = expf(s[j] - m);
                l[j] += s[j];
            }
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < n; j++)
                    acc[i * bs + j] += s[j] * vt[i * bs + j];
        }
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
                             const int32_t *bt, int64_t len, int64_t tile_stride,
                             int64_t tile_off, int64_t d, const int64_t bs, float scale,
                             float *__restrict__ sc, float *__restrict__ acc,
                             float *__restrict__ o)
{
    const float m = score_pass(qh, k_cache, bt, len, tile_stride, tile_off, d, bs, scale, sc, 1);
    float total = 0.f;
    for (int64_t p = 0; p < len; p++) {
        sc[p] = expf(sc[p] - m);
        total += sc[p];
    }
    memset(acc, 0, (size_t)d * bs * sizeof(float));
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f"), always_inline)) static inline

/* exp(x) for x <= 0, 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree
 * 6 (relative error ~1e-7); x below -87 gives ~0 rather than denormals. */
AVX512 __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* attend_head for block size 16 in AVX-512: a block row is one register, the running
 * maximum and weight sums stay vertical until the end, and at a constant `d` up to 16
 * the accumulators live in registers. Lanes past the context are masked: loaded as 0,
 * scored as -FLT_MAX, weighted 0. */
AVX512 void attend_head16(const float *qh, const float *k_cache, const float *v_cache,
                          const int32_t *bt, int64_t len, int64_t tile_stride, int64_t tile_off,
                          const int64_t d, float scale, float *__restrict__ sc, float *o)
{
    enum { MAX_D = 512 };
    __m512 acc[MAX_D];
    __m512 mv = _mm512_set1_ps(-FLT_MAX), lv = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        const float *kt = k_cache + (int64_t)bt[p0 / 16] * tile_stride + tile_off;
        const __mmask16 live = len - p0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - p0)) - 1);
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i++)
            s = _mm512_fmadd_ps(_mm512_set1_ps(qh[i]), _mm512_maskz_loadu_ps(live, kt + i * 16), s);
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), live, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
        _mm512_storeu_ps(sc + p0, s);
        mv = _mm512_max_ps(mv, s);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    for (int64_t i = 0; i < d; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        const float *vt = v_cache + (int64_t)bt[p0 / 16] * tile_stride + tile_off;
        const __mmask16 live = len - p0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - p0)) - 1);
        const __m512 w = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + p0), m)));
        lv = _mm512_add_ps(lv, w);
        for (int64_t i = 0; i < d; i++)
            acc[i] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(live, vt + i * 16), acc[i]);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(lv);
    for (int64_t i = 0; i < d; i++)
        o[i] = _mm512_reduce_add_ps(acc[i]) * inv;
}

__attribute__((target("avx512f"))) static void attend_request16(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *bt, int64_t len,
    int64_t tile_stride, int64_t num_heads, int64_t g, int64_t d, float scale, float *sc,
    float *o_row)
{
    const int64_t tile = d * 16;
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t off = (h / g) * tile;
        if (d == 8)
            attend_head16(q + h * d, k_cache, v_cache, bt, len, tile_stride, off, 8, scale, sc,
                          o_row + h * d);
        else if (d == 16)
            attend_head16(q + h * d, k_cache, v_cache, bt, len, tile_stride, off, 16, scale, sc,
                          o_row + h * d);
        else
            attend_head16(q + h * d, k_cache, v_cache, bt, len, tile_stride, off, d, scale, sc,
                          o_row + h * d);
    }
}

static int use_avx512(void)
{
    static int cached = -1;
    if (cached < 0) {
        const char *off = getenv("DECODEGRAPH_CPU_NO_AVX512");
        cached = __builtin_cpu_supports("avx512f") && !(off && off[0] == '1');
    }
    return cached;
}
#else
static int use_avx512(void) { return 0; }
#endif

/* Refuse metadata that would read or write outside the caches, the block table or the
 * workspace (checked before anything is written). */
static int check_metadata(const int64_t *slot_mapping, const int32_t *block_tables,
                          int64_t bt_stride, const int32_t *seq_lens, int64_t num_reqs,
                          int64_t bs, int64_t num_blocks, int64_t bt_cols, int64_t max_len)
{
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t s = slot_mapping[r], len = seq_lens[r];
        const int64_t padded_len = (len + bs - 1) / bs * bs;
        if (s >= num_blocks * bs || padded_len > max_len || len > bt_cols * bs)
            return 1;
        for (int64_t b = 0; b * bs < len; b++) {
            const int32_t id = block_tables[r * bt_stride + b];
            if (id < 0 || id >= num_blocks)
                return 2;
        }
    }
    return 0;
}

/* Copy each request's new K/V row into its cache slot: element c = head * d + dim of the
 * row goes to tile c / d, row c % d, lane slot % block_size. `elem` bytes per value. */
static void write_new_kv(char *k_cache, char *v_cache, const char *k, const char *v,
                         const int64_t *slot_mapping, int64_t num_reqs, int64_t k_stride,
                         int64_t v_stride, int64_t row, int64_t bs, int64_t tile_stride,
                         size_t elem)
{
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t s = slot_mapping[r];
        if (s < 0)
            continue; /* a padded row */
        const int64_t at = (s / bs) * tile_stride + s % bs;
        for (int64_t c = 0; c < row; c++) {
            memcpy(k_cache + (at + c * bs) * elem, k + (r * k_stride + c) * elem, elem);
            memcpy(v_cache + (at + c * bs) * elem, v + (r * v_stride + c) * elem, elem);
        }
    }
}

enum { BF16_MAX_HEAD = 512 };

/* The layer's decode step (see the top of this file); all tensors float32, or all
 * bfloat16 when `bf16` (portable loops there, head_size at most BF16_MAX_HEAD, else 3). */
int paged_decode_layer(const void *q, const void *k, const void *v, void *out, void *k_cache,
                       void *v_cache, const int64_t *slot_mapping, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, int64_t num_reqs,
                       int64_t num_rows, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                       int64_t block_size, float scale, float *work, int64_t num_blocks,
                       int64_t bt_cols, int64_t max_len, int bf16)
{
    const int64_t d = head_size, kvh = num_kv_heads, g = num_heads / num_kv_heads;
    const int64_t bs = block_size, tile = d * bs, tile_stride = kvh * tile;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    if (bf16 && d > BF16_MAX_HEAD)
        return 3;
    const int bad = check_metadata(slot_mapping, block_tables, bt_stride, seq_lens, num_reqs,
                                   bs, num_blocks, bt_cols, max_len);
    if (bad)
        return bad;
    write_new_kv((char *)k_cache, (char *)v_cache, (const char *)k, (const char *)v,
                 slot_mapping, num_reqs, k_stride, v_stride, kvh * d, bs, tile_stride, elem);
    float *sc = work, *acc = work + max_len;
    const int avx512 = !bf16 && bs == 16 && d <= 512 && use_avx512();
    float qf[BF16_MAX_HEAD], of[BF16_MAX_HEAD];
    for (int64_t r = 0; r < num_reqs; r++) {
        const int32_t *bt = block_tables + r * bt_stride;
        const int64_t len = seq_lens[r];
        char *o_row = (char *)out + r * num_heads * d * elem;
        if (len <= 0) {
            memset(o_row, 0, num_heads * d * elem); /* 0 is all-zero bits in both types */
            continue;
        }
#if defined(__x86_64__) && defined(__GNUC__)
        if (avx512) {
            attend_request16((const float *)q + r * q_stride, (const float *)k_cache,
                             (const float *)v_cache, bt, len, tile_stride, num_heads, g, d,
                             scale, sc, (float *)o_row);
            continue;
        }
#endif
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t off = (h / g) * tile;
            if (bf16) {
                const uint16_t *qh = (const uint16_t *)q + r * q_stride + h * d;
                for (int64_t i = 0; i < d; i++)
                    qf[i] = bf16_to_f32(qh[i]);
                const uint16_t *kc = (const uint16_t *)k_cache, *vc = (const uint16_t *)v_cache;
                if (bs == 16)
                    attend_head_bf16(qf, kc, vc, bt, len, tile_stride, off, d, 16, scale, sc,
                                     acc, of);
                else
                    attend_head_bf16(qf, kc, vc, bt, len, tile_stride, off, d, bs, scale, sc,
                                     acc, of);
                for (int64_t i = 0; i < d; i++)
                    ((uint16_t *)o_row)[h * d + i] = f32_to_bf16(of[i]);
                continue;
            }
            const float *qh = (const float *)q + r * q_stride + h * d;
            const float *kc = (const float *)k_cache, *vc = (const float *)v_cache;
            float *o = (float *)o_row + h * d;
            if (bs == 16)
                attend_head(qh, kc, vc, bt, len, tile_stride, off, d, 16, scale, sc, acc, o);
            else
                attend_head(qh, kc, vc, bt, len, tile_stride, off, d, bs, scale, sc, acc, o);
        }
    }
    for (int64_t r = num_reqs; r < num_rows; r++)
        memset((char *)out + r * num_heads * d * elem, 0, num_heads * d * elem);
    return 0;
}
