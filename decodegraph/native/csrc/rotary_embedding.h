// Neox-style rotary embedding over rows of float32 heads, out of place:
//
//   out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, (i + D/2) % D] * sin[t, i]
//
// with `cos` holding each frequency twice and `sin` carrying rotate-half's sign in its
// first half (decodegraph/layers/rotary_embedding.py builds that table), so this is
// exactly the tensor-op formula `x * cos + roll(x, D/2) * sin`: two products and one
// sum, each rounded (the library is built with -ffp-contract=off: no fused multiply-add),
// so eager, graphs and transformers agree bit for bit. One pass instead of five ops (two
// multiplies, the roll's two slices and concatenation, the add). Each half of a head runs
// Vec::size() lanes at a time, the last vector of a half partial.
//
// x:   [rows, heads, D], head h of row t at t * x_row + h * x_head (dimension contiguous)
// cos, sin: rows of D values, `cs_row` apart; out: [rows, heads, D] contiguous.
#ifndef DECODEGRAPH_ROTARY_EMBEDDING_H
#define DECODEGRAPH_ROTARY_EMBEDDING_H

#include <cstdint>

#include "vec.h"

namespace decodegraph {

// o[i] = a[i] * c[i] + b[i] * s[i] for i < n.
inline void rotate_half(float* o, const float* a, const float* b, const float* c,
                        const float* s, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        (Vec::loadu(a + i) * Vec::loadu(c + i) + Vec::loadu(b + i) * Vec::loadu(s + i))
            .store(o + i);
    if (i < n) {
        const int64_t k = n - i;
        (Vec::loadu(a + i, k) * Vec::loadu(c + i, k) + Vec::loadu(b + i, k) * Vec::loadu(s + i, k))
            .store(o + i, k);
    }
}

inline void rotary_embedding_f32(float* out, const float* x, const float* cos, const float* sin,
                                 int64_t rows, int64_t heads, int64_t d, int64_t x_row,
                                 int64_t x_head, int64_t cs_row) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int64_t h = 0; h < heads; h++) {
            const float* xh = x + t * x_row + h * x_head;
            float* o = out + (t * heads + h) * d;
            rotate_half(o, xh, xh + half, c, s, half);
            rotate_half(o + half, xh + half, xh, c + half, s + half, half);
        }
    }
}

}  // namespace decodegraph

#endif
