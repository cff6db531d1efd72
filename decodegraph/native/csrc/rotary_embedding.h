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
// Vec::size() lanes at a time, the last vector of a half partial; heads of a vector or
// less run a vector at a time.
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

// One head by halves: rotate_half over each.
inline void rotary_by_halves(float* o, const float* xh, const float* c, const float* s,
                             int64_t half) {
    rotate_half(o, xh, xh + half, c, s, half);
    rotate_half(o + half, xh + half, xh, c + half, s + half, half);
}

// Heads of a vector or less (d dividing Vec::size(); D: d where constant, else 0): m heads
// a vector (adjacent ones: x_head == d, unless m is 1), whose rolled copy is the blend of
// two loads half a head either side, each lane taking the load that holds its partner,
// where by halves each partial half would be copied through memory. The same products
// and sum per lane. A row's heads past its last whole vector, and the call's first and
// last vectors (a neighbour's lanes of theirs may lie outside x), go by halves.
template <int64_t D>
void rotary_small_heads(float* out, const float* x, const float* cos, const float* sin,
                        int64_t rows, int64_t heads, int64_t d_, int64_t x_row, int64_t x_head,
                        int64_t cs_row) {
    const int64_t d = D ? D : d_, half = d / 2, m = kLanes / d, whole = heads / m * m;
    __at_align__ float first_half[kLanes], lane_c[kLanes], lane_s[kLanes];
    for (int64_t i = 0; i < kLanes; i++)
        first_half[i] = i % d < half ? 1.f : 0.f;
    const Vec low = Vec::loadu(first_half) == Vec(1.f);  // lanes in the first half of a head
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row, *xt = x + t * x_row;
        float* ot = out + t * heads * d;
        if (m > 1) {  // the row's values once a head
            for (int64_t i = 0; i < kLanes; i++) {
                lane_c[i] = c[i % d];
                lane_s[i] = s[i % d];
            }
        }
        const Vec cv = Vec::loadu(m > 1 ? lane_c : c), sv = Vec::loadu(m > 1 ? lane_s : s);
        for (int64_t h = 0; h < whole; h += m) {
            const float* xh = xt + h * x_head;
            if ((t == 0 && h == 0) || (t == rows - 1 && h + m == heads)) {
                for (int64_t j = 0; j < m; j++)
                    rotary_by_halves(ot + (h + j) * d, xh + j * x_head, c, s, half);
                continue;
            }
            const Vec rolled = Vec::blendv(Vec::loadu(xh - half), Vec::loadu(xh + half), low);
            (Vec::loadu(xh) * cv + rolled * sv).store(ot + h * d);
        }
        for (int64_t h = whole; h < heads; h++)
            rotary_by_halves(ot + h * d, xt + h * x_head, c, s, half);
    }
}

inline void rotary_embedding_f32(float* out, const float* x, const float* cos, const float* sin,
                                 int64_t rows, int64_t heads, int64_t d, int64_t x_row,
                                 int64_t x_head, int64_t cs_row) {
    if (d == kLanes)
        return rotary_small_heads<kLanes>(out, x, cos, sin, rows, heads, d, x_row, x_head,
                                          cs_row);
    if (kLanes % d == 0 && x_head == d)
        return rotary_small_heads<0>(out, x, cos, sin, rows, heads, d, x_row, x_head, cs_row);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < heads; h++)
            rotary_by_halves(out + (t * heads + h) * d, x + t * x_row + h * x_head,
                             cos + t * cs_row, sin + t * cs_row, d / 2);
}

}  // namespace decodegraph

#endif
