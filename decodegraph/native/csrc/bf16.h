/*
 * bfloat16 <-> float32 for the kernels (paged_attention.c and its AVX-512 path).
 */
#ifndef DECODEGRAPH_BF16_H
#define DECODEGRAPH_BF16_H

#include <stdint.h>
#include <string.h>

/* bfloat16 <-> float32, bit for bit as torch converts (round to nearest even). */
static inline float bf16_to_f32(uint16_t x)
{
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#endif
