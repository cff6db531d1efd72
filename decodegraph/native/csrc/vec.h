// What the kernels share: one vector type for every ISA, and the helpers at::vec lacks.
//
// at::vec::Vectorized<float> (torch's headers) is __m512 under CPU_CAPABILITY_AVX512,
// __m256 under CPU_CAPABILITY_AVX2, a NEON float32x4_t on aarch64 (always: no macro), and
// otherwise an array that plain C++ loops fill (the portable "DEFAULT" version). The
// macros are not defined by the compiler: decodegraph/native/__init__.py passes the one
// that matches the -march it builds with (DECODEGRAPH_CPU_ISA forces a narrower one).
// Every kernel is written once against Vec; Vec::size() lanes a vector.
//
// Helpers that would reach Sleef in at::vec (exp, tanh: libtorch's Sleef is internal)
// are written here from at::vec's primitives, so they inline on every ISA.
#ifndef DECODEGRAPH_VEC_H
#define DECODEGRAPH_VEC_H

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace decodegraph {

using Vec = at::vec::Vectorized<float>;
using VecI = at::vec::Vectorized<int32_t>;
// On the lambdas of a kernel's loops: inlined, so that their captures are the kernel's
// own locals (an out-of-line call reloads each captured pointer after every vector store:
// vector types may alias anything).
#define DG_INLINE __attribute__((always_inline))

constexpr int64_t kLanes = Vec::size();

// The vector code this library was built with, as decodegraph.native reports it.
inline const char* vector_isa() {
#if defined(CPU_CAPABILITY_AVX512)
    return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
    return "avx2";
#elif defined(__aarch64__)
    return "neon";
#else
    return "scalar";
#endif
}

// exp(x): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (relative error
// ~1e-7). x is clamped to [-87, 88]: ~0 below rather than subnormals, ~1.7e38 above
// rather than infinity (-ffast-math assumes no infinities).
inline Vec exp(Vec x) {
    x = at::vec::clamp(x, Vec(-87.f), Vec(88.f));  // not minimum/maximum: they test for NaN
    const Vec n = (x * Vec(1.44269504f)).round();
    Vec r = at::vec::fmadd(n, Vec(-0.693145752f), x);
    r = at::vec::fmadd(n, Vec(-1.42860677e-6f), r);
    Vec p = Vec(1.f / 720.f);
    p = at::vec::fmadd(p, r, Vec(1.f / 120.f));
    p = at::vec::fmadd(p, r, Vec(1.f / 24.f));
    p = at::vec::fmadd(p, r, Vec(1.f / 6.f));
    p = at::vec::fmadd(p, r, Vec(0.5f));
    p = at::vec::fmadd(p, r, Vec(1.f));
    p = at::vec::fmadd(p, r, Vec(1.f));
    // 2^n from its exponent bits: n in [-126, 127] after the clamp.
    const VecI bits = (at::vec::convert_to_int_of_same_size(n) + VecI(127)) << VecI(23);
    return p * at::vec::cast<float>(bits);
}

// tanh(x) = sign(x) * (1 - 2 / (exp(2|x|) + 1)).
inline Vec tanh(Vec x) {
    const Vec ax = x.abs();
    const Vec t = Vec(1.f) - Vec(2.f) / (exp(ax + ax) + Vec(1.f));
    return Vec::blendv(t, Vec(0.f) - t, x < Vec(0.f));
}

// The lanes [lo, n) of a vector, as a blendv mask.
inline Vec lanes(int64_t lo, int64_t n) {
    const Vec i = Vec::arange(0.f, 1.f);
    return (i >= Vec(static_cast<float>(lo))) & (i < Vec(static_cast<float>(n)));
}

// Lane sums and maxima of one vector.
inline float sum(const Vec& v) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}
inline float max(const Vec& v) {
    return at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::clamp_min(a, b); }, v);
}

// out[k] = sum(v[k]) for k < n <= Vec::size(), as one vector (lanes from n on zero).
inline Vec sum_lanes(const Vec* v, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
    // The 16 sums by a transpose-and-add (some 45 instructions for 16 reductions' 128),
    // in the order a single reduction adds one vector's lanes (halves, quarters, pairs).
    __m512 x[16], t[8], u[4], w[2];
    for (int k = 0; k < 16; k++)
        x[k] = k < n ? static_cast<__m512>(v[k]) : _mm512_setzero_ps();
    for (int k = 0; k < 8; k++)  // lanes 0-7: x[k]'s halves added; 8-15: x[k + 8]'s
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[k], x[k + 8], 0x44),
                             _mm512_shuffle_f32x4(x[k], x[k + 8], 0xEE));
    for (int k = 0; k < 4; k++)  // quarters: x[k], x[k + 8], x[k + 4], x[k + 12]
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[k], t[k + 4], 0x88),
                             _mm512_shuffle_f32x4(t[k], t[k + 4], 0xDD));
    for (int k = 0; k < 2; k++)  // per quarter: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(u[k], u[k + 2]),
                             _mm512_unpackhi_ps(u[k], u[k + 2]));
    const __m512d a = _mm512_castps_pd(w[0]), b = _mm512_castps_pd(w[1]);
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    // z's lanes hold the sums of x[0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15]:
    // a permutation that is its own inverse.
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, z);
#elif defined(CPU_CAPABILITY_AVX2)
    // The 8 sums the same way, in vec_reduce_all's order (halves, then pairs two apart,
    // then neighbours).
    __m256 x[8], t[4], u[2];
    for (int k = 0; k < 8; k++)
        x[k] = k < n ? static_cast<__m256>(v[k]) : _mm256_setzero_ps();
    for (int k = 0; k < 4; k++)  // lanes 0-3: x[k]'s halves added; 4-7: x[k + 4]'s
        t[k] = _mm256_add_ps(_mm256_permute2f128_ps(x[k], x[k + 4], 0x20),
                             _mm256_permute2f128_ps(x[k], x[k + 4], 0x31));
    for (int k = 0; k < 2; k++)  // per half: [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
        u[k] = _mm256_add_ps(_mm256_shuffle_ps(t[k], t[k + 2], 0x44),
                             _mm256_shuffle_ps(t[k], t[k + 2], 0xEE));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88),
                                   _mm256_shuffle_ps(u[0], u[1], 0xDD));
    // z's lanes hold the sums of x[0, 2, 1, 3, 4, 6, 5, 7].
    return _mm256_permute_ps(z, 0xD8);
#else
    __at_align__ float out[kLanes] = {};
    for (int64_t k = 0; k < n; k++)
        out[k] = sum(v[k]);
    return Vec::loadu(out);
#endif
}

// bfloat16 <-> float32, bit for bit as torch converts (round to nearest even).
inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Whether float32 bits are a NaN (exponent all ones, mantissa not zero), per value or per
// lane: by bits, since -ffast-math lets a compiler assume no float is a NaN.
inline bool nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
inline VecI nan_bits(const VecI& u) { return (u & VecI(0x7fffffff)) > VecI(0x7f800000); }

inline bool is_nan(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return nan_bits(u);
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (nan_bits(u))
        return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// The first n (1..size()) of Vec::size() bfloat16 values as float32, the rest zero.
inline Vec load_bf16(const uint16_t* p, int64_t n) {
    using VecB = at::vec::Vectorized<c10::BFloat16>;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (n == kLanes) {  // one load and a widening shift (VecB's count load copies on AVX2)
        Vec v;
        at::vec::load_fp32_from_bf16(reinterpret_cast<const c10::BFloat16*>(p), v);
        return v;
    }
#endif
    return std::get<0>(at::vec::convert_bfloat16_float(VecB::loadu(p, n)));
}

// round_bf16 of every lane, in integer operations (f32_to_bf16's, NaN kept).
inline Vec round_bf16(const Vec& x) {
    const VecI u = at::vec::cast<int32_t>(x);
    const VecI r = (u + VecI(0x7fff) + ((u >> VecI(16)) & VecI(1))) & VecI(-65536);
    const VecI nan = nan_bits(u);
    return Vec::blendv(at::vec::cast<float>(r), x, at::vec::cast<float>(nan));
}

// Flush-to-zero (and on x86 denormals-are-zero) on the calling thread for the span of a
// kernel; returns the previous mode for restore_fp_mode. A softmax weight of a score far
// below its row's maximum times a small V value is a subnormal, and x86 takes a
// microcode assist for every instruction that reads or writes one (stories260K at 256
// requests has such a layer: docs/performance.md); ARM cores differ, and FPCR.FZ makes
// them all equal. The values flushed are below 2^-126, in sums whose largest term is 1.
inline uint64_t flush_denormals() {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040);  // MXCSR.FTZ (bit 15) | MXCSR.DAZ (bit 6)
    return saved;
#elif defined(__aarch64__)
    uint64_t saved;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved | (uint64_t{1} << 24)));  // FPCR.FZ
    return saved;
#else
    return 0;
#endif
}

inline void restore_fp_mode(uint64_t saved) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned int>(saved));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved));
#else
    (void)saved;
#endif
}

}  // namespace decodegraph

#endif
