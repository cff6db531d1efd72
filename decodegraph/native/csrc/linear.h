// One row times a matrix: y[n] = dot(x, W[n]) (+ b[n]) for a float32 x [k] and a
// row-major W [n, k], over output rows [begin, end). The batch-1 projection: MKL's sgemv
// keeps a single row on one thread, so a decode step at batch 1 reads its weights at one
// core's bandwidth whatever the thread count (docs/performance.md); the caller splits
// the output rows over torch's intra-op threads instead. Four weight rows per pass share
// each load of x.
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

}  // namespace decodegraph

#endif
