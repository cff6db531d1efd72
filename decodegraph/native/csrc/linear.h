// One row times a matrix: y[n] = dot(x, W[n]) (+ b[n]) for an x [k] and a row-major
// W [n, k], over output rows [begin, end). The batch-1 projection: MKL's sgemv keeps a
// single row on one thread, so a decode step at batch 1 reads its weights at one core's
// bandwidth whatever the thread count (docs/performance.md); the caller splits the output
// rows over torch's intra-op threads instead. Four weight rows per pass share each load
// of x.
//
// bfloat16 weights (and bias, and output) are summed in float32 against a float32 x (the
// caller widens a bf16 activation once per call): each bf16 product is exact in float32,
// and the sum is rounded to bf16 once, at the end.
#ifndef DECODEGRAPH_LINEAR_H
#define DECODEGRAPH_LINEAR_H

#include <cstdint>

#include "vec.h"

namespace decodegraph {

inline void linear_one_row_f32(float* y, const float* x, const float* w, const float* b,
                               int64_t begin, int64_t end, int64_t k) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const float *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
        int64_t i = 0;
        for (; i + kLanes <= k; i += kLanes) {
            const Vec xv = Vec::loadu(x + i);
            a0 = at::vec::fmadd(Vec::loadu(w0 + i), xv, a0);
            a1 = at::vec::fmadd(Vec::loadu(w1 + i), xv, a1);
            a2 = at::vec::fmadd(Vec::loadu(w2 + i), xv, a2);
            a3 = at::vec::fmadd(Vec::loadu(w3 + i), xv, a3);
        }
        float s0 = sum(a0), s1 = sum(a1), s2 = sum(a2), s3 = sum(a3);
        for (; i < k; i++) {
            s0 += w0[i] * x[i];
            s1 += w1[i] * x[i];
            s2 += w2[i] * x[i];
            s3 += w3[i] * x[i];
        }
        y[n] = s0 + (b ? b[n] : 0.f);
        y[n + 1] = s1 + (b ? b[n + 1] : 0.f);
        y[n + 2] = s2 + (b ? b[n + 2] : 0.f);
        y[n + 3] = s3 + (b ? b[n + 3] : 0.f);
    }
    for (; n < end; n++) {
        const float* wn = w + n * k;
        Vec a(0.f);
        int64_t i = 0;
        for (; i + kLanes <= k; i += kLanes)
            a = at::vec::fmadd(Vec::loadu(wn + i), Vec::loadu(x + i), a);
        float s = sum(a);
        for (; i < k; i++)
            s += wn[i] * x[i];
        y[n] = s + (b ? b[n] : 0.f);
    }
}

// y[n] = bf16(dot(x, W[n]) + b[n]) for a float32 x [k] and bf16 W [n, k], b [n] (b may be
// null), over output rows [begin, end).
inline void linear_one_row_bf16(uint16_t* y, const float* x, const uint16_t* w, const uint16_t* b,
                                int64_t begin, int64_t end, int64_t k) {
    using VecB = at::vec::Vectorized<c10::BFloat16>;
    constexpr int64_t kLanesB = VecB::size();  // one bf16 vector widens to two float ones
    static_assert(kLanesB == 2 * kLanes, "a bf16 vector holds two float vectors' lanes");
    // Two accumulators a row (one per half of a bf16 vector): the sum's order depends on
    // k and the ISA alone, never on the rows a thread was given.
    const auto widen = [](const uint16_t* p) {
        return at::vec::convert_bfloat16_float(VecB::loadu(p));
    };
    const int64_t kv = k - k % kLanesB;  // the values the vector loop sums
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const uint16_t *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        Vec a0(0.f), b0(0.f), a1(0.f), b1(0.f), a2(0.f), b2(0.f), a3(0.f), b3(0.f);
        int64_t i = 0;
        for (; i < kv; i += kLanesB) {
            const Vec xl = Vec::loadu(x + i), xh = Vec::loadu(x + i + kLanes);
            auto [l0, h0] = widen(w0 + i);
            a0 = at::vec::fmadd(l0, xl, a0);
            b0 = at::vec::fmadd(h0, xh, b0);
            auto [l1, h1] = widen(w1 + i);
            a1 = at::vec::fmadd(l1, xl, a1);
            b1 = at::vec::fmadd(h1, xh, b1);
            auto [l2, h2] = widen(w2 + i);
            a2 = at::vec::fmadd(l2, xl, a2);
            b2 = at::vec::fmadd(h2, xh, b2);
            auto [l3, h3] = widen(w3 + i);
            a3 = at::vec::fmadd(l3, xl, a3);
            b3 = at::vec::fmadd(h3, xh, b3);
        }
        float s0 = sum(a0 + b0), s1 = sum(a1 + b1), s2 = sum(a2 + b2), s3 = sum(a3 + b3);
        for (; i < k; i++) {
            s0 += bf16_to_f32(w0[i]) * x[i];
            s1 += bf16_to_f32(w1[i]) * x[i];
            s2 += bf16_to_f32(w2[i]) * x[i];
            s3 += bf16_to_f32(w3[i]) * x[i];
        }
        y[n] = f32_to_bf16(s0 + (b ? bf16_to_f32(b[n]) : 0.f));
        y[n + 1] = f32_to_bf16(s1 + (b ? bf16_to_f32(b[n + 1]) : 0.f));
        y[n + 2] = f32_to_bf16(s2 + (b ? bf16_to_f32(b[n + 2]) : 0.f));
        y[n + 3] = f32_to_bf16(s3 + (b ? bf16_to_f32(b[n + 3]) : 0.f));
    }
    for (; n < end; n++) {
        const uint16_t* wn = w + n * k;
        Vec a(0.f), c(0.f);
        int64_t i = 0;
        for (; i < kv; i += kLanesB) {
            auto [l, h] = widen(wn + i);
            a = at::vec::fmadd(l, Vec::loadu(x + i), a);
            c = at::vec::fmadd(h, Vec::loadu(x + i + kLanes), c);
        }
        float s = sum(a + c);
        for (; i < k; i++)
            s += bf16_to_f32(wn[i]) * x[i];
        y[n] = f32_to_bf16(s + (b ? bf16_to_f32(b[n]) : 0.f));
    }
}

// out[i] = float(in[i]) for i < k: a bf16 row widened once for linear_one_row_bf16.
inline void widen_bf16(float* out, const uint16_t* in, int64_t k) {
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes)
        load_bf16(in + i, kLanes).store(out + i);
    for (; i < k; i++)
        out[i] = bf16_to_f32(in[i]);
}

}  // namespace decodegraph

#endif
