// Greedy sampling's argmax over rows of float32 logits: per row, the index of the first
// maximum, with torch's NaN rule (a NaN is the maximum: the first NaN's index). One pass
// keeps each lane's maximum and the index where it first occurred, and whether any value
// is a NaN; the lanes are merged at the end (the greatest, then the lowest index). torch's
// CPU max(dim) reduces a row a value at a time; a sampler's rows are a few hundred to a
// few hundred thousand logits.
//
// The library is built with -ffast-math, so NaNs are told apart by their bits (vec.h).
//
// x: [rows, n], rows `x_row` apart; out: [rows] int64.
#ifndef DECODEGRAPH_ARGMAX_H
#define DECODEGRAPH_ARGMAX_H

#include <array>
#include <cstdint>

#include "vec.h"

namespace decodegraph {

// Lanes of kWays running maxima (each vector of a row goes to one of kWays, in turn), so
// that the compare-and-blend chains of successive vectors overlap.
constexpr int64_t kWays = 4;

inline int64_t argmax_row_f32(const float* x, int64_t n) {
    const int64_t whole = n / kLanes * kLanes;
    float best = x[0];
    int64_t at = 0;
    bool nan = false;
    if (whole > 0) {
        // Per lane, the maximum and the index of its first occurrence (a later value
        // replaces it only when greater). Indices as floats: exact below 2^24.
        const Vec first = Vec::loadu(x), lane = Vec::arange(0.f, 1.f);
        std::array<Vec, kWays> m, idx;
        for (int64_t w = 0; w < kWays; w++) {
            m[w] = first;
            idx[w] = lane;
        }
        VecI bad = nan_bits(at::vec::cast<int32_t>(first));
        auto take = [&](int64_t w, int64_t i) DG_INLINE {
            const Vec v = Vec::loadu(x + i);
            const Vec gt = v > m[w];
            m[w] = Vec::blendv(m[w], v, gt);
            idx[w] = Vec::blendv(idx[w], lane + Vec(static_cast<float>(i)), gt);
            bad = bad | nan_bits(at::vec::cast<int32_t>(v));
        };
        int64_t i = kLanes;
        for (; i + kWays * kLanes <= whole; i += kWays * kLanes)
            for (int64_t w = 0; w < kWays; w++)
                take(w, i + w * kLanes);
        for (int64_t w = 0; i < whole; i += kLanes, w++)
            take(w, i);
        __at_align__ float ms[kWays * kLanes], is[kWays * kLanes];
        __at_align__ int32_t bads[kLanes];
        for (int64_t w = 0; w < kWays; w++) {
            m[w].store(ms + w * kLanes);
            idx[w].store(is + w * kLanes);
        }
        bad.store(bads);
        for (int64_t k = 0; k < kWays * kLanes; k++) {
            const int64_t j = static_cast<int64_t>(is[k]);
            if (ms[k] > best || (ms[k] == best && j < at)) {
                best = ms[k];
                at = j;
            }
        }
        for (int64_t k = 0; k < kLanes; k++)
            nan = nan || bads[k] != 0;
    }
    for (int64_t i = whole; i < n; i++) {
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
        nan = nan || is_nan(x[i]);
    }
    if (nan)
        for (int64_t i = 0; i < n; i++)
            if (is_nan(x[i]))
                return i;
    return at;
}

inline void argmax_rows_f32(int64_t* out, const float* x, int64_t rows, int64_t n,
                            int64_t x_row) {
    for (int64_t t = 0; t < rows; t++)
        out[t] = argmax_row_f32(x + t * x_row, n);
}

}  // namespace decodegraph

#endif
