/*
 * What the kernels share on x86-64: the AVX-512 function attribute, a 16-lane exp, the
 * mask of a partial vector, the floating-point mode for a kernel's span, and the
 * run-time switch (AVX-512 present, and not turned off with DECODEGRAPH_CPU_NO_AVX512=1,
 * which the tests use to check the portable loops).
 */
#ifndef DECODEGRAPH_VEC_H
#define DECODEGRAPH_VEC_H

#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define DECODEGRAPH_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f"), always_inline)) static inline

/* exp(x), 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6
 * (relative error ~1e-7). x is clamped to [-87, 88]: ~0 below rather than denormals,
 * ~1.7e38 above rather than infinity. */
AVX512 __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* A mask of the first min(n, 16) of 16 lanes (n >= 0): a row's last, partial vector. */
static inline __mmask16 first_lanes(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* Flush-to-zero and denormals-are-zero on the calling thread (MXCSR), for the span of a
 * kernel; returns the previous mode for restore_fp_mode. A softmax weight of a score far
 * below its row's maximum times a small V value is a denormal, and x86 takes a
 * microcode assist for every instruction that reads or writes one (stories260K at 256
 * requests has such a layer: docs/performance.md). The values flushed are below 2^-126,
 * in sums whose largest term is 1. */
static unsigned int flush_denormals(void)
{
    const unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */
    return saved;
}

static void restore_fp_mode(unsigned int saved) { _mm_setcsr(saved); }

static int use_avx512(void)
{
    static int cached = -1;
    if (cached < 0) {
        const char *off = getenv("DECODEGRAPH_CPU_NO_AVX512");
        cached = __builtin_cpu_supports("avx512f") && !(off && off[0] == '1');
    }
    return cached;
}
#else
#define DECODEGRAPH_X86 0
static int use_avx512(void) { return 0; }
static unsigned int flush_denormals(void) { return 0; }
static void restore_fp_mode(unsigned int saved) { (void)saved; }
#endif

#endif
