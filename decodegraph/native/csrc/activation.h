// vLLM's silu_and_mul over rows of float32, out of place: for a row [gate | up] of 2 * d
// values, out = silu(gate) * up = gate / (1 + exp(-gate)) * up, in one pass instead of
// three ops (silu, a multiply, and the slices' views). vec.h's exp: within a few ulp of
// torch's silu.
//
// x: [rows, 2 * d], rows `x_row` apart; out: [rows, d] contiguous.
#ifndef DECODEGRAPH_ACTIVATION_H
#define DECODEGRAPH_ACTIVATION_H

#include <cstdint>

#include "vec.h"

namespace decodegraph {

inline Vec silu_mul(const Vec& g, const Vec& u) {
    return g / (Vec(1.f) + exp(Vec(0.f) - g)) * u;
}

inline void silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t d,
                             int64_t x_row) {
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * x_row, *up = gate + d;
        float* o = out + t * d;
        int64_t i = 0;
        for (; i + kLanes <= d; i += kLanes)
            silu_mul(Vec::loadu(gate + i), Vec::loadu(up + i)).store(o + i);
        if (i < d) {
            const int64_t n = d - i;
            silu_mul(Vec::loadu(gate + i, n), Vec::loadu(up + i, n)).store(o + i, n);
        }
    }
}

}  // namespace decodegraph

#endif
