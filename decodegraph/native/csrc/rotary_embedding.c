/*
 * Neox-style rotary embedding over rows of float32 heads, out of place:
 *
 *   out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, (i + D/2) % D] * sin[t, i]
 *
 * with `cos` holding each frequency twice and `sin` carrying rotate-half's sign in its
 * first half (decodegraph/layers/rotary_embedding.py builds that table), so this is
 * exactly the tensor-op formula `x * cos + roll(x, D/2) * sin`: two products and one
 * sum, each rounded (no fused multiply-add), so eager, graphs and transformers agree
 * bit for bit. One pass instead of five ops (two multiplies, the roll's two slices and
 * concatenation, the add).
 *
 * x:   [rows, heads, D], head h of row t at t * x_row + h * x_head (dimension contiguous)
 * cos, sin: rows of D values, `cs_row` apart; out: [rows, heads, D] contiguous.
 */
#include <stdint.h>

#include "vec.h"

#if DECODEGRAPH_X86
/* 16 lanes at a time, the same two products and one sum per value (fp-contract off: no
 * fused multiply-add), for rows whose heads lie back to back (x_head == d):
 * - d dividing 16 (2, 4, 8, 16): a vector holds 16 / d whole heads; the rotated
 *   operand is the same vector with each head's halves swapped (one permute), and the
 *   cos/sin vectors repeat the row's d values;
 * - half a multiple of 16 (d = 32, 64, 96, 128, ...): the two halves of a head, 16
 *   lanes at a time. */
__attribute__((target("avx512f"), optimize("fp-contract=off"))) static void rotary_avx512(
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
#endif

__attribute__((optimize("fp-contract=off"))) void rotary_embedding_f32(
    float *out, const float *x, const float *cos, const float *sin, int64_t rows,
    int64_t heads, int64_t d, int64_t x_row, int64_t x_head, int64_t cs_row)
{
    const int64_t half = d / 2;
#if DECODEGRAPH_X86
    if (x_head == d && (16 % d == 0 || half % 16 == 0) && use_avx512()) {
        rotary_avx512(out, x, cos, sin, rows, heads, d, x_row, cs_row);
        return;
    }
#endif
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_row + h * x_head;
            float *o = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                const float a = xh[i] * c[i], b = xh[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                const float a = xh[i] * c[i], b = xh[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
