// The hand-written AVX-512 intrinsics the kernels had before vec.h's Vec, kept beside
// them for one comparison (benchmarks/bench_kernels.py, DECODEGRAPH_CPU_INTRINSICS=1 in
// an AVX-512 build): attention at block sizes that are multiples of 16, silu_and_mul and
// rotary_embedding. Not built into any other variant.
#ifndef DECODEGRAPH_INTRINSICS_AVX512_H
#define DECODEGRAPH_INTRINSICS_AVX512_H

#include <cfloat>
#include <cstdint>
#include <cstdlib>

#include "vec.h"

namespace decodegraph {

inline bool use_intrinsics() {
#if defined(CPU_CAPABILITY_AVX512)
    static const bool on = [] {
        const char* v = std::getenv("DECODEGRAPH_CPU_INTRINSICS");
        return v && v[0] == '1';
    }();
    return on;
#else
    return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
namespace intrinsics {

#define AVX512 __attribute__((always_inline)) static inline

/* exp(x), 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6
 * (relative error ~1e-7). x is clamped to [-87, 88]: ~0 below rather than denormals,
 * ~1.7e38 above rather than infinity. */
AVX512 __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
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

/* A mask of the first min(n, 16) of 16 lanes (n >= 0): a row's last, partial vector. */
static inline __mmask16 first_lanes(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* Attention in AVX-512 for block sizes that are multiples of 16, for the G query heads
 * that share one KV head (grouped-query attention): each K and V row is loaded once for
 * all of them. Sixteen positions of a tile row are one register (a block of bs positions
 * is bs / 16 of them), the running maxima and weight sums stay vertical until the end,
 * and at constant `d` and `G` with G * d up to ~24 the accumulators live in registers.
 * Lanes past the context are masked: loaded as 0, scored as -FLT_MAX, weighted 0. The
 * scores of head j go to sc + j * sc_stride.
 * bf16 caches (q and o in float32 here) round where attend_head_bf16 does: the raw and
 * the scaled scores, and the normalised weights (so the weights are normalised before V,
 * in a pass of their own over the scores). */
enum { MAX_GROUP_ACC = 512, MAX_GROUP = 64 };

/* Sixteen positions of a tile row as float32, lanes past `live` zero. A bf16 row is
 * read whole (it lies inside its tile at every block size that is a multiple of 16). */
AVX512 __m512 load_row16(const void *row, __mmask16 live, const int bf16)
{
    if (!bf16)
        return _mm512_maskz_loadu_ps(live, row);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row));
    return _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}

/* round_bf16 of 16 lanes (round to nearest even; NaN stays NaN). */
AVX512 __m512 round_bf16_16(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_mov_epi32(r, nan, quiet), hi));
}

/* The sums of 16 vectors' lanes, as one vector (lane k: the sum of v[k]), added in the
 * order _mm512_reduce_add_ps adds one vector's lanes (halves, then quarters, then
 * pairs), with some 45 instructions instead of 16 reductions' 128. */
AVX512 __m512 sum_lanes16(const __m512 *v)
{
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* lanes 0-7: v[k]'s halves added; 8-15: v[k + 8]'s */
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44),
                             _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
    for (int k = 0; k < 4; k++) /* quarters: v[k], v[k + 8], v[k + 4], v[k + 12] */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[k], t[k + 4], 0x88),
                             _mm512_shuffle_f32x4(t[k], t[k + 4], 0xDD));
    for (int k = 0; k < 2; k++) /* per quarter: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] */
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(u[k], u[k + 2]),
                             _mm512_unpackhi_ps(u[k], u[k + 2]));
    const __m512d a = _mm512_castps_pd(w[0]), b = _mm512_castps_pd(w[1]);
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    /* z's lanes hold v[0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15]: its own
     * inverse, so the same indices put every sum in its lane. */
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* tanh of 16 lanes, as 1 - 2 / (exp(2|x|) + 1) with the sign of x. */
AVX512 __m512 tanh16(__m512 x)
{
    const __m512 ax = _mm512_abs_ps(x), one = _mm512_set1_ps(1.f);
    const __m512 e = exp16(_mm512_add_ps(ax, ax));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(t),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* Soft-capping of 16 scores: cap * tanh(x / cap), rounded as soft_cap rounds for bf16. */
AVX512 __m512 soft_cap16(__m512 x, float cap, const int bf16)
{
    const __m512 c = _mm512_set1_ps(cap);
    if (!bf16)
        return _mm512_mul_ps(c, tanh16(_mm512_div_ps(x, c)));
    return round_bf16_16(
        _mm512_mul_ps(round_bf16_16(tanh16(round_bf16_16(_mm512_div_ps(x, c)))), c));
}

/* Lanes of the 16 positions from p0 on that lie in [start, len). */
AVX512 __mmask16 window_lanes(int64_t p0, int64_t start, int64_t len)
{
    const __mmask16 live = first_lanes(len - p0);
    return start > p0 ? (__mmask16)(live & ~first_lanes(start - p0)) : live;
}

AVX512 void attend_group_avx512(const float *q, const void *k_cache, const void *v_cache,
                                const int32_t *bt, int64_t start, int64_t len,
                                int64_t tile_stride, int64_t tile_off, const int64_t d,
                                const int64_t G, const int64_t bs, float scale, float softcap,
                                float *__restrict__ sc, int64_t sc_stride, float *o,
                                const int bf16)
{
    const int64_t elem = bf16 ? 2 : 4;
    /* The first block the window reaches, and its first position. */
    const int64_t b0 = start / bs, first = b0 * bs;
    __m512 acc[MAX_GROUP_ACC], mv[MAX_GROUP], lv[MAX_GROUP], s[MAX_GROUP];
    for (int64_t j = 0; j < G; j++) {
        mv[j] = _mm512_set1_ps(-FLT_MAX);
        lv[j] = _mm512_setzero_ps();
    }
    for (int64_t b = b0, p0 = first; p0 < len; b++) {
        const char *kb = (const char *)k_cache + ((int64_t)bt[b] * tile_stride + tile_off) * elem;
        for (int64_t c = 0; c < bs && p0 < len; c += 16, p0 += 16) { /* 16 positions */
            const char *kt = kb + c * elem;
            const __mmask16 live = window_lanes(p0, start, len);
            for (int64_t j = 0; j < G; j++)
                s[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                const __m512 k_row = load_row16(kt + i * bs * elem, live, bf16);
                for (int64_t j = 0; j < G; j++)
                    s[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i]), k_row, s[j]);
            }
            for (int64_t j = 0; j < G; j++) {
                __m512 x;
                if (bf16)
                    x = round_bf16_16(_mm512_mul_ps(round_bf16_16(s[j]), _mm512_set1_ps(scale)));
                else
                    x = _mm512_mul_ps(s[j], _mm512_set1_ps(scale));
                if (softcap > 0.f)
                    x = soft_cap16(x, softcap, bf16);
                x = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), live, x);
                _mm512_storeu_ps(sc + j * sc_stride + p0, x);
                mv[j] = _mm512_max_ps(mv[j], x);
            }
        }
    }
    for (int64_t j = 0; j < G; j++)
        mv[j] = _mm512_set1_ps(_mm512_reduce_max_ps(mv[j]));
    __m512 total[MAX_GROUP];
    if (bf16) { /* the weights' sums first: bf16 normalises each weight before V */
        for (int64_t p0 = first; p0 < len; p0 += 16) {
            const __mmask16 live = window_lanes(p0, start, len);
            for (int64_t j = 0; j < G; j++) {
                float *x = sc + j * sc_stride + p0;
                const __m512 e =
                    _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(x), mv[j])));
                _mm512_storeu_ps(x, e);
                lv[j] = _mm512_add_ps(lv[j], e);
            }
        }
        for (int64_t j = 0; j < G; j++)
            total[j] = _mm512_set1_ps(_mm512_reduce_add_ps(lv[j]));
    }
    for (int64_t i = 0; i < G * d; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t b = b0, p0 = first; p0 < len; b++) {
        const char *vb = (const char *)v_cache + ((int64_t)bt[b] * tile_stride + tile_off) * elem;
        for (int64_t c = 0; c < bs && p0 < len; c += 16, p0 += 16) {
            const char *vt = vb + c * elem;
            const __mmask16 live = window_lanes(p0, start, len);
            for (int64_t j = 0; j < G; j++) {
                const __m512 x = _mm512_loadu_ps(sc + j * sc_stride + p0);
                if (bf16) {
                    s[j] = round_bf16_16(_mm512_div_ps(x, total[j]));
                } else {
                    s[j] = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, mv[j])));
                    lv[j] = _mm512_add_ps(lv[j], s[j]);
                }
            }
            for (int64_t i = 0; i < d; i++) {
                const __m512 v_row = load_row16(vt + i * bs * elem, live, bf16);
                for (int64_t j = 0; j < G; j++)
                    acc[j * d + i] = _mm512_fmadd_ps(s[j], v_row, acc[j * d + i]);
            }
        }
    }
    /* o[j * d + i] = (lane sum of acc[j * d + i]) / (lane sum of lv[j]), 16 at a time. */
    float inv[MAX_GROUP_ACC];
    for (int64_t j = 0; j < G; j++) {
        const float inv_j = bf16 ? 1.f : 1.f / _mm512_reduce_add_ps(lv[j]);
        for (int64_t i = 0; i < d; i++)
            inv[j * d + i] = inv_j;
    }
    for (int64_t c = 0; c < G * d; c += 16) {
        const int64_t n = G * d - c < 16 ? G * d - c : 16;
        __m512 v[16];
        for (int64_t k = 0; k < 16; k++)
            v[k] = k < n ? acc[c + k] : _mm512_setzero_ps();
        const __mmask16 live = first_lanes(n);
        const __m512 scale = _mm512_maskz_loadu_ps(live, inv + c);
        _mm512_mask_storeu_ps(o + c, live, _mm512_mul_ps(sum_lanes16(v), scale));
    }
}

/* One token's row at a block size that is a multiple of 16: each KV head with its query
 * heads, in groups of at most MAX_GROUP_ACC / d heads (all of them, for every model we
 * know). float32 shapes we know get constant d and G, at block size 16 and at any other.
 * bf16 rows are converted to float32 per group, and the output rounded back. */
static void attend_request_avx512(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *bt, int64_t start,
    int64_t len, int64_t tile_stride, int64_t num_heads, int64_t g, int64_t d, int64_t bs,
    float scale, float softcap, float *sc, int64_t sc_stride, void *o_row, int bf16)
{
    const int64_t tile = d * bs, max_g = MAX_GROUP_ACC / d < MAX_GROUP ? MAX_GROUP_ACC / d
                                                                        : MAX_GROUP;
    float qf[MAX_GROUP_ACC], of[MAX_GROUP_ACC];
    for (int64_t h = 0; h < num_heads; h += g) {
        const int64_t off = (h / g) * tile;
        for (int64_t h0 = h; h0 < h + g; h0 += max_g) {
            const int64_t G = h + g - h0 < max_g ? h + g - h0 : max_g;
            if (bf16) {
                const uint16_t *qh = (const uint16_t *)q + h0 * d;
                for (int64_t i = 0; i < G * d; i++)
                    qf[i] = bf16_to_f32(qh[i]);
                if (bs == 16)
                    attend_group_avx512(qf, k_cache, v_cache, bt, start, len, tile_stride, off,
                                        d, G, 16, scale, softcap, sc, sc_stride, of, 1);
                else
                    attend_group_avx512(qf, k_cache, v_cache, bt, start, len, tile_stride, off,
                                        d, G, bs, scale, softcap, sc, sc_stride, of, 1);
                for (int64_t i = 0; i < G * d; i++)
                    ((uint16_t *)o_row)[h0 * d + i] = f32_to_bf16(of[i]);
                continue;
            }
            const float *qg = (const float *)q + h0 * d;
            float *og = (float *)o_row + h0 * d;
#define GROUP(D, NG, BS)                                                                      \
    attend_group_avx512(qg, k_cache, v_cache, bt, start, len, tile_stride, off, D, NG, BS,     \
                        scale, softcap, sc, sc_stride, og, 0)
#define SHAPES(BS)                                                                            \
    if (d == 8 && G == 1)                                                                     \
        GROUP(8, 1, BS);                                                                      \
    else if (d == 8 && G == 2)                                                                \
        GROUP(8, 2, BS);                                                                      \
    else if (d == 8 && G == 4)                                                                \
        GROUP(8, 4, BS);                                                                      \
    else if (d == 16 && G == 1)                                                               \
        GROUP(16, 1, BS);                                                                     \
    else if (d == 16 && G == 2)                                                               \
        GROUP(16, 2, BS);                                                                     \
    else if (d == 64 && G == 1)                                                               \
        GROUP(64, 1, BS);                                                                     \
    else                                                                                      \
        GROUP(d, G, BS)
            if (bs == 16)
                SHAPES(16);
            else
                SHAPES(bs);
#undef SHAPES
#undef GROUP
        }
    }
}

static void silu_and_mul_avx512(float *out, const float *x,
                                                                    int64_t rows, int64_t d,
                                                                    int64_t x_row)
{
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * x_row, *up = gate + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 live = first_lanes(d - i);
            const __m512 g = _mm512_maskz_loadu_ps(live, gate + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(o + i, live, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(live, up + i)));
        }
    }
}

/* 16 lanes at a time, the same two products and one sum per value (fp-contract off: no
 * fused multiply-add), for rows whose heads lie back to back (x_head == d):
 * - d dividing 16 (2, 4, 8, 16): a vector holds 16 / d whole heads; the rotated
 *   operand is the same vector with each head's halves swapped (one permute), and the
 *   cos/sin vectors repeat the row's d values;
 * - half a multiple of 16 (d = 32, 64, 96, 128, ...): the two halves of a head, 16
 *   lanes at a time. */
static void rotary_avx512(
    float *out, const float *x, const float *cos, const float *sin, int64_t rows,
    int64_t heads, int64_t d, int64_t x_row, int64_t cs_row)
{
    const int64_t half = d / 2, n = heads * d;
    if (16 % d == 0) {
        int32_t perm[16], rep[16];
        for (int l = 0; l < 16; l++) {
            perm[l] = (int32_t)(l / d * d + (l % d + half) % d);
            rep[l] = (int32_t)(l % d);
        }
        const __m512i p = _mm512_loadu_si512(perm), r = _mm512_loadu_si512(rep);
        const __mmask16 row = first_lanes(d);
        for (int64_t t = 0; t < rows; t++) {
            const __m512 c = _mm512_permutexvar_ps(r, _mm512_maskz_loadu_ps(row, cos + t * cs_row));
            const __m512 s = _mm512_permutexvar_ps(r, _mm512_maskz_loadu_ps(row, sin + t * cs_row));
            const float *xr = x + t * x_row;
            float *o = out + t * n;
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 live = first_lanes(n - i);
                const __m512 v = _mm512_maskz_loadu_ps(live, xr + i);
                const __m512 a = _mm512_mul_ps(v, c);
                const __m512 b = _mm512_mul_ps(_mm512_permutexvar_ps(p, v), s);
                _mm512_mask_storeu_ps(o + i, live, _mm512_add_ps(a, b));
            }
        }
        return;
    }
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_row + h * d;
            float *o = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 lo = _mm512_loadu_ps(xh + i), hi = _mm512_loadu_ps(xh + i + half);
                _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + i)),
                                                      _mm512_mul_ps(hi, _mm512_loadu_ps(s + i))));
                _mm512_storeu_ps(o + i + half,
                                 _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + i + half)),
                                               _mm512_mul_ps(lo, _mm512_loadu_ps(s + i + half))));
            }
        }
    }
}

#undef AVX512

}  // namespace intrinsics
#endif

}  // namespace decodegraph

#endif
