/*
 * RMSNorm over rows of float32, in one pass per row (torch's CPU rms_norm is a
 * composite of five to seven ops, two of them copies).
 *
 * rms_norm_f32:           out[r] = x[r] / rms(x[r]) * w
 * fused_add_rms_norm_f32: res_out[r] = x[r] + res[r]; out[r] = res_out[r] / rms * w
 * (vLLM's fused_add_rms_norm, out of place). Rows are `stride` floats apart; out and
 * res_out are contiguous.
 */
#include <math.h>
#include <stdint.h>

/* In double: the kernels are compiled with -ffast-math, whose float 1/sqrtf is an
 * approximation; rounding once from double keeps this within float rounding of
 * torch.rms_norm (graphs trace the aten version, and must agree with eager). */
static inline float inv_rms(const float *x, int64_t n, float eps)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / (double)n + eps));
}

void rms_norm_f32(float *out, const float *x, const float *w, int64_t rows, int64_t n,
                  int64_t stride, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *o = out + r * n;
        const float s = inv_rms(xr, n, eps);
        for (int64_t i = 0; i < n; i++)
            o[i] = xr[i] * s * w[i];
    }
}

void fused_add_rms_norm_f32(float *out, float *res_out, const float *x, const float *res,
                            const float *w, int64_t rows, int64_t n, int64_t x_stride,
                            int64_t res_stride, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride, *rr = res + r * res_stride;
        float *o = out + r * n, *ro = res_out + r * n;
        for (int64_t i = 0; i < n; i++)
            ro[i] = xr[i] + rr[i];
        const float s = inv_rms(ro, n, eps);
        for (int64_t i = 0; i < n; i++)
            o[i] = ro[i] * s * w[i];
    }
}
