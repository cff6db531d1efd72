// RMSNorm over rows of float32, in one pass per row (torch's CPU rms_norm is a
// composite of five to seven ops, two of them copies).
//
// rms_norm_f32:           out[r] = x[r] / rms(x[r]) * w
// fused_add_rms_norm_f32: res_out[r] = x[r] + res[r]; out[r] = res_out[r] / rms * w
// (vLLM's fused_add_rms_norm, out of place). Rows are `stride` floats apart; out and
// res_out are contiguous.
#ifndef DECODEGRAPH_RMS_NORM_H
#define DECODEGRAPH_RMS_NORM_H

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace decodegraph {

// The sum of squares in double: the kernels are compiled with -ffast-math, whose float
// 1/sqrtf is an approximation; rounding once from double keeps this within float
// rounding of torch.rms_norm (graphs trace the aten version, and must agree with eager).
// A plain loop: -ffast-math lets the compiler vectorise it for the build's ISA, widening
// floats to doubles in registers, which at::vec's float-to-double convert does not beat
// (docs/performance.md).
inline float inv_rms(const float* x, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += static_cast<double>(x[i]) * x[i];
    return static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
}

// o = x * s * w over n values.
inline void scale_row(float* o, const float* x, const float* w, float s, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        (Vec::loadu(x + i) * Vec(s) * Vec::loadu(w + i)).store(o + i);
    if (i < n)
        (Vec::loadu(x + i, n - i) * Vec(s) * Vec::loadu(w + i, n - i)).store(o + i, n - i);
}

inline void rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t n,
                         int64_t stride, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * stride;
        scale_row(out + r * n, xr, w, inv_rms(xr, n, eps), n);
    }
}

inline void fused_add_rms_norm_f32(float* out, float* res_out, const float* x, const float* res,
                                   const float* w, int64_t rows, int64_t n, int64_t x_stride,
                                   int64_t res_stride, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride, *rr = res + r * res_stride;
        float *o = out + r * n, *ro = res_out + r * n;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes)
            (Vec::loadu(xr + i) + Vec::loadu(rr + i)).store(ro + i);
        if (i < n)
            (Vec::loadu(xr + i, n - i) + Vec::loadu(rr + i, n - i)).store(ro + i, n - i);
        scale_row(o, ro, w, inv_rms(ro, n, eps), n);
    }
}

}  // namespace decodegraph

#endif
