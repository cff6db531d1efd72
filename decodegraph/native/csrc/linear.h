// One row times a matrix: y[n] = dot(x, W[n]) (+ b[n]) for an x [k] and a row-major
// W [n, k], over output rows [begin, end). The batch-1 projection: MKL's sgemv keeps a
// single row on one thread, so a decode step at batch 1 reads its weights at one core's
// bandwidth whatever the thread count (docs/performance.md); the caller splits the output
// rows over torch's intra-op threads instead. Four weight rows per pass share each load
// of x.
//
// bfloat16 weights (and bias, and output) are summed in float32 against a float32 x (the
// caller widens a bf16 activation once per call): each bf16 product is exact in float32,
// and the sum is rounded to bf16 once, at the end. The weights are widened by integer
// shifts and masks, not by at::vec's bf16 conversion, whose lane shuffles made a
// one-thread product slower on AVX-512 (docs/performance.md).
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

// A bf16 row read as 32-bit words, each two neighbouring values (little-endian: the
// first in the low half): `w << 16` is the first of each pair as a float, `w & 0xffff0000`
// the second. A block of kBf16Block values is two float vectors, its even values then its
// odd ones, with no shuffle. x is widened once into that order (widen_bf16_pairs).
constexpr int64_t kBf16Block = 2 * kLanes;
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "bf16 pairs are read little-endian");

inline Vec bf16_even(const VecI& w) { return at::vec::cast<float>(w << VecI(16)); }
inline Vec bf16_odd(const VecI& w) {
    return at::vec::cast<float>(w & VecI(static_cast<int32_t>(0xffff0000u)));
}

// out = float(in) for k values, each whole block of kBf16Block as its even values then its
// odd ones, the rest in order: the x of linear_one_row_bf16.
inline void widen_bf16_pairs(float* out, const uint16_t* in, int64_t k) {
    const int64_t kv = k - k % kBf16Block;
    for (int64_t i = 0; i < kv; i += kBf16Block) {
        const VecI w = VecI::loadu(in + i);
        bf16_even(w).store(out + i);
        bf16_odd(w).store(out + i + kLanes);
    }
    for (int64_t i = kv; i < k; i++)
        out[i] = bf16_to_f32(in[i]);
}

// y[n] = bf16(dot(x, W[n]) + b[n]) for a float32 x [k] in widen_bf16_pairs' order and bf16
// W [n, k], b [n] (b may be null), over output rows [begin, end). The order of the sum
// depends on k and the ISA alone, never on the rows a thread was given.
inline void linear_one_row_bf16(uint16_t* y, const float* x, const uint16_t* w, const uint16_t* b,
                                int64_t begin, int64_t end, int64_t k) {
    const int64_t kv = k - k % kBf16Block;  // the values the vector loop sums
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const uint16_t *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        Vec a0(0.f), b0(0.f), a1(0.f), b1(0.f), a2(0.f), b2(0.f), a3(0.f), b3(0.f);
        int64_t i = 0;
        for (; i < kv; i += kBf16Block) {
            const Vec xe = Vec::loadu(x + i), xo = Vec::loadu(x + i + kLanes);
            const VecI u0 = VecI::loadu(w0 + i), u1 = VecI::loadu(w1 + i);
            const VecI u2 = VecI::loadu(w2 + i), u3 = VecI::loadu(w3 + i);
            a0 = at::vec::fmadd(bf16_even(u0), xe, a0);
            b0 = at::vec::fmadd(bf16_odd(u0), xo, b0);
            a1 = at::vec::fmadd(bf16_even(u1), xe, a1);
            b1 = at::vec::fmadd(bf16_odd(u1), xo, b1);
            a2 = at::vec::fmadd(bf16_even(u2), xe, a2);
            b2 = at::vec::fmadd(bf16_odd(u2), xo, b2);
            a3 = at::vec::fmadd(bf16_even(u3), xe, a3);
            b3 = at::vec::fmadd(bf16_odd(u3), xo, b3);
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
        for (; i < kv; i += kBf16Block) {
            const VecI u = VecI::loadu(wn + i);
            a = at::vec::fmadd(bf16_even(u), Vec::loadu(x + i), a);
            c = at::vec::fmadd(bf16_odd(u), Vec::loadu(x + i + kLanes), c);
        }
        float s = sum(a + c);
        for (; i < k; i++)
            s += bf16_to_f32(wn[i]) * x[i];
        y[n] = f32_to_bf16(s + (b ? bf16_to_f32(b[n]) : 0.f));
    }
}

}  // namespace decodegraph

#endif
