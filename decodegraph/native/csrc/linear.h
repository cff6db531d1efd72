// One row times a matrix: y[n] = dot(x, W[n]) (+ b[n]) for an x [k] and a row-major
// W [n, k], over output rows [begin, end). The batch-1 projection: MKL's sgemv keeps a
// single row on one thread, so a decode step at batch 1 reads its weights at one core's
// bandwidth whatever the thread count (docs/performance.md); the caller splits the output
// rows over torch's intra-op threads instead. Each row is summed with four accumulators.
// A thread mostly reads its rows one after another: one sequential stream through W
// (four neighbouring rows read side by side, sharing each load of x, were slower on a
// large W on an AMD EPYC: docs/performance.md), every cache line of it fetched a little
// ahead in software (the hardware prefetcher alone left the stream below a plain sum's
// rate on an Intel Xeon, where it stops at each 4 KiB page; on an AMD Zen 4 a float32
// stream alone ran a tenth faster without the fetches, but a model's batch-1 step did not
// measurably). Where the CPU platform measured it the faster (on Intel cores before any
// measurement: rows of some lengths), rows are read several at a time, far apart, with no
// software fetches (rows_side_by_side). The same bits either way.
//
// bfloat16 weights (and bias, and output) are summed in float32 against a float32 x (the
// caller widens a bf16 activation once per call): each bf16 product is exact in float32,
// and the sum is rounded to bf16 once, at the end. The weights are widened by integer
// shifts and masks, not by at::vec's bf16 conversion, whose lane shuffles made a
// one-thread product slower on AVX-512 (docs/performance.md).
#ifndef DECODEGRAPH_LINEAR_H
#define DECODEGRAPH_LINEAR_H

#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cpu_vendor.h"  // env_switch, cpu_is_intel
#include "vec.h"

namespace decodegraph {

// Not inlined: a single copy of each row kernel, so that the caller's one-thread path and
// its thread pool's run the same code (-ffast-math may vectorise a loop's tail one way in
// one inlined copy and another way in the next, which changed the bits with the thread
// count).
#define DG_ONE_COPY __attribute__((noinline))

// How far ahead linear_one_row_f32 prefetches its weights where it does, in values (2
// KiB), and the values of a 64-byte cache line: each iteration fetches every line of the
// block that far ahead (past the row's end into the next rows, which follow it in memory,
// and past the last row's end too: a prefetch never faults).
constexpr int64_t kF32PrefetchAhead = 512;
constexpr int64_t kLineFloats = 16;
static_assert((4 * kLanes) % kLineFloats == 0, "an iteration covers whole cache lines");

// Whether linear_one_row_f32 fetches its weights ahead in software, decided once per
// process: DECODEGRAPH_CPU_WEIGHTS_AHEAD=0 switches it off (to measure it on a CPU).
inline bool fetch_weights_ahead() {
    static const bool yes = env_switch("DECODEGRAPH_CPU_WEIGHTS_AHEAD", true);
    return yes;
}

// Whether linear_one_row_f32 reads rows of k values side by side (kF32RowsSideBySide
// streams at once, far apart, each summed exactly as a row alone is) rather than one
// stream fetched ahead in software. Which is the faster depends on the machine, not only
// on its vendor: on an Intel Xeon with the weights on 2 MiB pages
// (CpuPlatform.place_parameters) the one fetched stream read rows of 2048 < k < 6144 values
// more slowly than shorter and longer ones, and slower than distant rows side by side, on
// both vector widths; at other lengths it was the faster. On one AMD Zen 4 VM six rows side
// by side were the faster at every length and both widths, where another Zen 4 VM's one
// stream alone reached a plain sum's rate (docs/performance.md, "weights on huge pages",
// "six rows side by side on a Zen 4"). So the CPU platform measures both on a loaded
// model's weights once per process and sets the faster for every k
// (set_rows_side_by_side); until it does, or where it did not (weights that fit the
// caches), Intel cores take the rule above for float32 rows, and every other row is one
// stream. The choice covers linear_one_row_bf16's rows too (kBf16RowsSideBySide).
// DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE=1 or 0 sets it for every k and both dtypes, over both.
// Six rows with 16-lane vectors, three with 8-lane ones: their accumulators and x fill
// the 32 or 16 registers.
constexpr int64_t kF32RowsSideBySide = kLanes == 16 ? 6 : 3;
constexpr int64_t kSideBySideAboveK = 2048, kSideBySideBelowK = 6144;

// The measured choice: -1 none (the vendor rule), 0 one stream, 1 side by side.
inline std::atomic<int>& rows_side_by_side_choice() {
    static std::atomic<int> choice{-1};
    return choice;
}

inline bool rows_side_by_side(int64_t k, bool bf16 = false) {
    static const char* kVar = "DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE";
    static const bool set = env_switch(kVar, false) || !env_switch(kVar, true);
    static const bool forced = env_switch(kVar, false);
    static const bool intel = cpu_is_intel();
    if (set)
        return forced;
    const int choice = rows_side_by_side_choice().load(std::memory_order_relaxed);
    if (choice >= 0)
        return choice == 1;
    return !bf16 && intel && k > kSideBySideAboveK && k < kSideBySideBelowK;
}

// The end of one output: a row's four accumulators over its whole blocks of 4 vectors
// (up to i), then its remaining whole vectors, the accumulators' sum and the last values.
// One copy for every row count below, so that they give the same bits.
DG_ONE_COPY float finish_row_f32(Vec a0, Vec a1, Vec a2, Vec a3, const float* wn,
                                 const float* x, int64_t i, int64_t k) {
    for (; i + kLanes <= k; i += kLanes)
        a0 = at::vec::fmadd(Vec::loadu(wn + i), Vec::loadu(x + i), a0);
    float s = sum((a0 + a1) + (a2 + a3));
    for (; i < k; i++)
        s += wn[i] * x[i];
    return s;
}

// R rows at a time (the rows left over one at a time), each with its own four
// accumulators, every load of x shared by the R rows; with kFetch every cache line of
// each row's stream is fetched kF32PrefetchAhead values ahead in software. The R rows of
// a step are 1/R of [begin, end) apart: R streams through distant pages rather than one
// region read in R interleaved pieces.
template <int64_t R, bool kFetch>
DG_ONE_COPY void linear_one_row_f32_rows(float* y, const float* x, const float* w,
                                         const float* b, int64_t begin, int64_t end,
                                         int64_t k) {
    const int64_t steps = (end - begin) / R;  // the rows [begin, begin + R * steps)
    for (int64_t n = begin; n < begin + steps; n++) {
        std::array<const float*, R> wr;  // rows n, n + steps, ...
        for (int64_t r = 0; r < R; r++)
            wr[r] = w + (n + r * steps) * k;
        std::array<Vec, 4 * R> a;
        for (int64_t j = 0; j < 4 * R; j++)
            a[j] = Vec(0.f);
        int64_t i = 0;
        for (; i + 4 * kLanes <= k; i += 4 * kLanes) {
            if constexpr (kFetch)
                for (int64_t r = 0; r < R; r++)
                    for (int64_t line = 0; line < 4 * kLanes; line += kLineFloats)
                        __builtin_prefetch(wr[r] + i + kF32PrefetchAhead + line, 0, 3);
            Vec xs[4];
            for (int64_t q = 0; q < 4; q++)
                xs[q] = Vec::loadu(x + i + q * kLanes);
            for (int64_t r = 0; r < R; r++)
                for (int64_t q = 0; q < 4; q++)
                    a[4 * r + q] =
                        at::vec::fmadd(Vec::loadu(wr[r] + i + q * kLanes), xs[q], a[4 * r + q]);
        }
        for (int64_t r = 0; r < R; r++)
            y[n + r * steps] = finish_row_f32(a[4 * r], a[4 * r + 1], a[4 * r + 2],
                                              a[4 * r + 3], wr[r], x, i, k) +
                               (b ? b[n + r * steps] : 0.f);
    }
    if constexpr (R > 1)
        linear_one_row_f32_rows<1, kFetch>(y, x, w, b, begin + R * steps, end, k);
}

// All three sum each row in the same order: the fetches and the row order change the
// time, never the bits.
inline void linear_one_row_f32(float* y, const float* x, const float* w, const float* b,
                               int64_t begin, int64_t end, int64_t k) {
    if (rows_side_by_side(k))
        linear_one_row_f32_rows<kF32RowsSideBySide, false>(y, x, w, b, begin, end, k);
    else if (fetch_weights_ahead())
        linear_one_row_f32_rows<1, true>(y, x, w, b, begin, end, k);
    else
        linear_one_row_f32_rows<1, false>(y, x, w, b, begin, end, k);
}

// A few rows times a matrix: y[m, n] = dot(x[m], W[n]) (+ b[n]) for x [M, k] and a
// row-major W [n, k], over output columns [begin, end), M from 2 to kMaxFewRows. BLAS
// packs W for each call at so few rows and reads it at a fraction of the bandwidth a
// single stream reaches (docs/performance.md); here W is one sequential stream, read
// once for all M rows: R of its rows at a time (R x M accumulators, at most 16), each
// vector of W used by M fused multiply-adds against x's rows (from the core's caches).
// Each of the R rows' streams is fetched ahead in software, past its end into the same
// row of the next R (the rows of a group are short next to the fetch distance at small
// hidden sizes, where only the hardware prefetcher saw the next group coming). Each
// output is one accumulator's lanes over k, then their sum: its bits depend on k and the
// ISA alone, not on M, R or the columns a thread was given. The accumulator is summed a
// chunk of kFewRowsChunk values at a time, each chunk's sum added to a running total (kept
// in memory, touched once a chunk): one sequential accumulator over a long row (a down
// projection's k of several thousand) strayed several times further from the exact product
// than BLAS's blocked sums, where the chunks keep it level with them.
constexpr int64_t kMaxFewRows = 8;
constexpr int64_t kFewRowsChunk = 256;

// A bf16 row read as 32-bit words, each two neighbouring values (little-endian: the
// first in the low half): `w << 16` is the first of each pair as a float, `w & 0xffff0000`
// the second. A block of kBf16Block values is two float vectors, its even values then its
// odd ones, with no shuffle. x is widened once into that order (widen_bf16_pairs).
constexpr int64_t kBf16Block = 2 * kLanes;
// How far ahead linear_one_row_bf16 prefetches its weights, in values (4 KiB).
constexpr int64_t kBf16PrefetchAhead = 2048;
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
// depends on k and the ISA alone, never on the rows a thread was given, nor on how many
// rows are read at once: one fetched stream, or kBf16RowsSideBySide far apart (as
// linear_one_row_f32's, rows_side_by_side).
// Four rows with 16-lane vectors, two with narrower ones: four accumulators each and
// x's four vectors fit the registers.
constexpr int64_t kBf16RowsSideBySide = kLanes == 16 ? 4 : 2;

// The end of one bf16 output: a row's four accumulators over its whole pairs of blocks
// (up to i), then its remaining whole blocks, the accumulators' sum, the last values and
// the bias, rounded to bf16 once. One copy for every row count below.
DG_ONE_COPY inline uint16_t finish_row_bf16(Vec a0, Vec b0, Vec a1, Vec b1, const uint16_t* wn,
                                            const float* x, int64_t i, int64_t kv, int64_t k,
                                            const uint16_t* bias) {
    for (; i < kv; i += kBf16Block) {
        const VecI u = VecI::loadu(wn + i);
        a0 = at::vec::fmadd(bf16_even(u), Vec::loadu(x + i), a0);
        b0 = at::vec::fmadd(bf16_odd(u), Vec::loadu(x + i + kLanes), b0);
    }
    float s = sum((a0 + b0) + (a1 + b1));
    for (; i < k; i++)
        s += bf16_to_f32(wn[i]) * x[i];
    return f32_to_bf16(s + (bias ? bf16_to_f32(*bias) : 0.f));
}

// R rows at a time (the rows left over one at a time), 1/R of [begin, end) apart, each
// with its own four accumulators, every load of x shared by the R rows; with kFetch each
// row's stream is fetched kBf16PrefetchAhead values ahead in software (past the row's
// end into the next ones, which follow it in memory): twice the instructions per byte of
// the float32 loop leave fewer of its loads in flight.
template <int64_t R, bool kFetch>
DG_ONE_COPY void linear_one_row_bf16_rows(uint16_t* y, const float* x, const uint16_t* w,
                                          const uint16_t* b, int64_t begin, int64_t end,
                                          int64_t k) {
    const int64_t kv = k - k % kBf16Block;  // the values the vector loops sum
    const int64_t steps = (end - begin) / R;  // the rows [begin, begin + R * steps)
    for (int64_t n = begin; n < begin + steps; n++) {
        std::array<const uint16_t*, R> wr;  // rows n, n + steps, ...
        for (int64_t r = 0; r < R; r++)
            wr[r] = w + (n + r * steps) * k;
        std::array<Vec, 4 * R> a;  // per row: a0, b0, a1, b1
        for (int64_t j = 0; j < 4 * R; j++)
            a[j] = Vec(0.f);
        int64_t i = 0;
        for (; i + 2 * kBf16Block <= kv; i += 2 * kBf16Block) {
            if constexpr (kFetch)
                for (int64_t r = 0; r < R; r++) {
                    __builtin_prefetch(wr[r] + i + kBf16PrefetchAhead, 0, 3);
                    __builtin_prefetch(wr[r] + i + kBf16PrefetchAhead + kBf16Block, 0, 3);
                }
            const Vec x0 = Vec::loadu(x + i), x1 = Vec::loadu(x + i + kLanes);
            const Vec x2 = Vec::loadu(x + i + kBf16Block);
            const Vec x3 = Vec::loadu(x + i + kBf16Block + kLanes);
            for (int64_t r = 0; r < R; r++) {
                const VecI u0 = VecI::loadu(wr[r] + i), u1 = VecI::loadu(wr[r] + i + kBf16Block);
                a[4 * r] = at::vec::fmadd(bf16_even(u0), x0, a[4 * r]);
                a[4 * r + 1] = at::vec::fmadd(bf16_odd(u0), x1, a[4 * r + 1]);
                a[4 * r + 2] = at::vec::fmadd(bf16_even(u1), x2, a[4 * r + 2]);
                a[4 * r + 3] = at::vec::fmadd(bf16_odd(u1), x3, a[4 * r + 3]);
            }
        }
        for (int64_t r = 0; r < R; r++) {
            const int64_t row = n + r * steps;
            y[row] = finish_row_bf16(a[4 * r], a[4 * r + 1], a[4 * r + 2], a[4 * r + 3], wr[r],
                                     x, i, kv, k, b ? b + row : nullptr);
        }
    }
    if constexpr (R > 1)
        linear_one_row_bf16_rows<1, kFetch>(y, x, w, b, begin + R * steps, end, k);
}

inline void linear_one_row_bf16(uint16_t* y, const float* x, const uint16_t* w, const uint16_t* b,
                                int64_t begin, int64_t end, int64_t k) {
    if (rows_side_by_side(k, /*bf16=*/true))
        linear_one_row_bf16_rows<kBf16RowsSideBySide, false>(y, x, w, b, begin, end, k);
    else
        linear_one_row_bf16_rows<1, true>(y, x, w, b, begin, end, k);
}

// One output of few_rows_block from its accumulator: the lanes' sum, the values
// past the last whole vector, the bias; rounded to bf16 for bf16 weights. One copy per
// weight type for every block shape, so that an output's bits do not depend on the
// shape that computed it (DG_ONE_COPY).
DG_ONE_COPY inline float few_rows_output(const Vec& acc, const float* w_row, const float* x_row,
                                         int64_t kv, int64_t k, const float* bias) {
    float s = sum(acc);
    for (int64_t i = kv; i < k; i++)
        s += w_row[i] * x_row[i];
    return s + (bias ? *bias : 0.f);
}

DG_ONE_COPY inline uint16_t few_rows_output(const Vec& acc, const uint16_t* w_row,
                                            const float* x_row, int64_t kv, int64_t k,
                                            const uint16_t* bias) {
    float s = sum(acc);
    for (int64_t i = kv; i < k; i++)
        s += bf16_to_f32(w_row[i]) * x_row[i];
    return f32_to_bf16(s + (bias ? bf16_to_f32(*bias) : 0.f));
}

// The few-rows product over output columns [begin, end) for float32 weights (T float)
// or bfloat16 ones (T uint16_t: weights, bias and output bf16, x float32 in
// widen_bf16_pairs' order, each row k apart; each block of kBf16Block weight values
// widened once and used by all M rows, summed in float32 and rounded once, as
// linear_one_row_bf16 does). One accumulator per output in both.
template <class T, int64_t M, int64_t R>
DG_ONE_COPY void few_rows_block(T* y, const float* x, const T* w, const T* b,
                                       int64_t begin, int64_t end, int64_t k, int64_t n_total) {
    static_assert(M * R <= 16, "accumulators for registers");
    constexpr bool kF32 = std::is_same_v<T, float>;
    constexpr int64_t kStep = kF32 ? kLanes : kBf16Block;
    constexpr int64_t kAhead = kF32 ? kF32PrefetchAhead : kBf16PrefetchAhead;
    static_assert(kFewRowsChunk % kStep == 0, "whole steps to a chunk");
    const int64_t kv = k - k % kStep;
    int64_t n = begin;
    auto columns = [&](auto rows) DG_INLINE {
        constexpr int64_t RR = decltype(rows)::value;
        Vec total[M * RR];  // the chunks' sums so far
        for (int64_t j = 0; j < M * RR; j++)
            total[j] = Vec(0.f);
        const T* wn = w + n * k;
        for (int64_t c = 0; c < kv; c += kFewRowsChunk) {
            const int64_t c_end = c + kFewRowsChunk < kv ? c + kFewRowsChunk : kv;
            Vec acc[M * RR];
            for (int64_t j = 0; j < M * RR; j++)
                acc[j] = Vec(0.f);
            for (int64_t i = c; i < c_end; i += kStep) {
                if (!kF32 || i % kLineFloats == 0) {  // each row's stream ahead, into the next R
                    const int64_t ahead = i + kAhead;
                    const T* p = ahead < k ? wn + ahead : wn + RR * k + (ahead - k);
                    for (int64_t r = 0; r < RR; r++)
                        __builtin_prefetch(p + r * k, 0, 3);
                }
                if constexpr (kF32) {
                    Vec wr[RR];
                    for (int64_t r = 0; r < RR; r++)
                        wr[r] = Vec::loadu(wn + r * k + i);
                    for (int64_t m = 0; m < M; m++) {
                        const Vec xm = Vec::loadu(x + m * k + i);
                        for (int64_t r = 0; r < RR; r++)
                            acc[m * RR + r] = at::vec::fmadd(wr[r], xm, acc[m * RR + r]);
                    }
                } else {
                    Vec even[RR], odd[RR];
                    for (int64_t r = 0; r < RR; r++) {
                        const VecI u = VecI::loadu(wn + r * k + i);
                        even[r] = bf16_even(u);
                        odd[r] = bf16_odd(u);
                    }
                    for (int64_t m = 0; m < M; m++) {
                        const Vec xe = Vec::loadu(x + m * k + i);
                        const Vec xo = Vec::loadu(x + m * k + i + kLanes);
                        for (int64_t r = 0; r < RR; r++) {
                            Vec& a = acc[m * RR + r];
                            a = at::vec::fmadd(odd[r], xo, at::vec::fmadd(even[r], xe, a));
                        }
                    }
                }
            }
            for (int64_t j = 0; j < M * RR; j++)
                total[j] = total[j] + acc[j];
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < RR; r++)
                y[m * n_total + n + r] = few_rows_output(total[m * RR + r], wn + r * k, x + m * k,
                                                         kv, k, b ? b + n + r : nullptr);
        n += RR;
    };
    while (n + R <= end)
        columns(std::integral_constant<int64_t, R>{});
    while (n < end)
        columns(std::integral_constant<int64_t, 1>{});
}

// few_rows_block for `m` rows (2 <= m <= kMaxFewRows): four weight rows at a time
// up to four rows of x, two above (16 accumulators at most).
template <class T>
inline void few_rows_product(T* y, const float* x, const T* w, const T* b, int64_t m,
                            int64_t begin, int64_t end, int64_t k, int64_t n_total) {
    switch (m) {
    case 2: return few_rows_block<T, 2, 4>(y, x, w, b, begin, end, k, n_total);
    case 3: return few_rows_block<T, 3, 4>(y, x, w, b, begin, end, k, n_total);
    case 4: return few_rows_block<T, 4, 4>(y, x, w, b, begin, end, k, n_total);
    case 5: return few_rows_block<T, 5, 2>(y, x, w, b, begin, end, k, n_total);
    case 6: return few_rows_block<T, 6, 2>(y, x, w, b, begin, end, k, n_total);
    case 7: return few_rows_block<T, 7, 2>(y, x, w, b, begin, end, k, n_total);
    default: return few_rows_block<T, 8, 2>(y, x, w, b, begin, end, k, n_total);
    }
}

}  // namespace decodegraph

#endif
