// Paged attention for any batch (decodes, prefills, prefill chunks, mixed), float32 or
// bfloat16 (float32 arithmetic in both; bf16 rounds where a bf16 model's reference
// attention does), any block size and head size, written once against vec.h's Vec: the
// same source is AVX-512, AVX2, NEON or plain loops, as the library was built.
//
// Writes each request's new tokens' K/V into their cache slots (slot -1: a padded row,
// skipped), then attends each token over its request's context through the block table: token
// i of a request with q_len new tokens and seq_len positions sees the first
// seq_len - q_len + i + 1 (causal, with the cached context before it), or with a sliding
// window W the last W of those: its cost follows the window, not the context, and the
// blocks before the window are never read (a sliding-window KV group frees them).
// Logit soft-capping (Gemma 2) caps each scaled score at +-softcap through tanh. One call
// does a whole layer (wrapped as a torch operator in cpu_ops.cpp), so a step pays one
// operator call per layer instead of a dozen tensor ops, or one attention per request.
//
// Caches: [num_blocks, num_kv_heads, head_size, block_size], contiguous: within a block,
//         one head's values of one dimension lie side by side for block_size positions,
//         so both products run over positions, Vec::size() of them a vector (a block in
//         ceil(block_size / Vec::size()) vectors, the last one partial), and the softmax
//         weights scale V without a horizontal sum per position.
// q/k/v:  rows of `q_stride` / `k_stride` / `v_stride` values; head h of row r at
//         r * stride + h * d.
// query_start_loc: request r's tokens are rows [qsl[r], qsl[r + 1]); rows from
//         qsl[num_reqs] on are padding: zeroed in out, nothing written.
// out:    [num_rows, num_heads * head_size].
// work:   float32, per caller thread: `max_len` scores for each query head of a KV
//         head's group (then (head_size + 1) * block_size floats this kernel no longer
//         uses); allocated once by the caller (an op never allocates inside a graph).
// A step is two calls: paged_attention_begin checks the metadata and zeroes the padding
// rows (once); paged_attention_requests writes the new K/V of requests [r0, r1) and
// attends their tokens, a request at a time (independent ranges may run on different
// threads, each with its own workspace; a request's result does not depend on the split:
// it reads only its own new K/V, in blocks no other request writes).
// paged_attention_begin returns 0, or non-zero (and touches nothing) when a slot, block
// id, length or query range is outside the caches, the block table, the rows or the
// workspace.
#ifndef DECODEGRAPH_PAGED_ATTENTION_H
#define DECODEGRAPH_PAGED_ATTENTION_H

#include <array>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cpu_vendor.h"
#include "vec.h"

namespace decodegraph {

// Refuse metadata that would read or write outside the caches, the block table, the
// rows or the workspace (checked before anything is written). Query ranges must be
// ordered, within num_rows, and no longer than their request's context.
inline int check_metadata(const int64_t *slot_mapping, const int32_t *block_tables,
                          int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens,
                          int64_t num_reqs, int64_t num_rows, int64_t bs, int64_t num_blocks,
                          int64_t bt_cols, int64_t max_len)
{
    if (qsl[0] != 0)
        return 1;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t len = seq_lens[r], q_len = (int64_t)qsl[r + 1] - qsl[r];
        const int64_t padded_len = (len + bs - 1) / bs * bs;
        if (q_len < 0 || q_len > len || qsl[r + 1] > num_rows || padded_len > max_len ||
            len > bt_cols * bs)
            return 1;
        for (int64_t b = 0; b * bs < len; b++) {
            const int32_t id = block_tables[r * bt_stride + b];
            if (id < 0 || id >= num_blocks)
                return 2;
        }
    }
    for (int64_t t = 0; t < qsl[num_reqs]; t++)
        if (slot_mapping[t] >= num_blocks * bs)
            return 1;
    return 0;
}

// Copy the K/V rows of new tokens [t0, t1) into their cache slots: element c = head * d +
// dim of a row goes to tile c / d, row c % d, lane slot % block_size. T: the element type
// (one move per value; a memcpy of a runtime size per value became a byte loop).
template <class T>
inline void write_new_kv(T *k_cache, T *v_cache, const T *k, const T *v,
                         const int64_t *slot_mapping, int64_t t0, int64_t t1, int64_t k_stride,
                         int64_t v_stride, int64_t row, int64_t bs, int64_t tile_stride)
{
    for (int64_t t = t0; t < t1; t++) {
        const int64_t s = slot_mapping[t];
        if (s < 0)
            continue;  // a padded row
        const int64_t at = (s / bs) * tile_stride + s % bs;
        const T *kt = k + t * k_stride, *vt = v + t * v_stride;
        for (int64_t c = 0; c < row; c++) {
            k_cache[at + c * bs] = kt[c];
            v_cache[at + c * bs] = vt[c];
        }
    }
}

// At most this many accumulators (query heads x head size) per group: a KV head's query
// heads go in groups of at most kMaxGroupAcc / d (all of them, for every model we know;
// one head at a time, in slices of its dimensions, above 512). Head sizes up to kMaxHead.
constexpr int64_t kMaxGroupAcc = 512, kMaxGroup = 64, kMaxHead = 4096;

// Positions [p, p + n) of a tile row as float32 (n = Vec::size() when Full), lanes from
// n on zero.
template <bool Full, class KV>
inline Vec load_kv(const KV* row, int64_t n) {
    if constexpr (std::is_same_v<KV, float>)
        return Full ? Vec::loadu(row) : Vec::loadu(row, n);
    else
        return load_bf16(row, Full ? kLanes : n);
}

// cap * tanh(x / cap), rounded after each step for bf16 as a bf16 model's reference
// attention computes it.
template <bool Bf16>
inline Vec soft_cap(const Vec& x, float cap) {
    const Vec c(cap);
    if constexpr (!Bf16)
        return c * tanh(x / c);
    else
        return round_bf16(round_bf16(tanh(round_bf16(x / c))) * c);
}


// N vectors of storage, none constructed: each is written before it is read.
template <int64_t N>
struct Uninitialized {
    alignas(Vec) unsigned char raw[N * sizeof(Vec)];
    Vec& operator[](int64_t i) { return reinterpret_cast<Vec*>(raw)[i]; }
};

// A later decode row's whole blocks (K and V, every KV head: one contiguous run a block),
// fetched into L2 a few cache lines at a time while this row's vectors go by: `step()`
// after each vector of K or V the kernels visit, `lines` lines of each cache over the
// row's `visits` steps, evenly (a running credit: one line each time it reaches
// `visits`), so that the fetches spread over the row's compute and end with it. Asked
// for in one burst instead, the lines queue behind the core's few miss buffers and the
// core waits for the burst before it computes; asked for a whole line a step where the
// rate is a fraction (2.1 lines a step rounded up to 3), the fetches ran ahead of the
// compute in the same way, on a smaller scale (docs/performance.md, "rows ahead,
// trickled", and 2026-12-08).
struct RowFetch {
    const char *kc, *vc;
    const int32_t* bt;
    int64_t block, end;  // the next block to fetch, and the row's last block + 1
    int64_t at, bytes;   // the next line's offset in its block's run, and the run's bytes
    int64_t lines, visits;  // lines of each cache to fetch over `visits` steps
    int64_t credit;         // lines x steps taken, less visits x lines fetched

    DG_INLINE void step() {
        credit += lines;
        while (credit >= visits && block < end) {
            credit -= visits;
            next_line();
        }
    }
    // What is left, at once (the row ended before its vectors had fetched it all).
    void finish() {
        while (block < end)
            next_line();
    }
    // The next line of K and of V.
    DG_INLINE void next_line() {
        const int64_t o = static_cast<int64_t>(bt[block]) * bytes + at;
        __builtin_prefetch(kc + o, 0, 2);
        __builtin_prefetch(vc + o, 0, 2);
        at += 64;
        if (at >= bytes) {
            at = 0;
            block++;
        }
    }
};

// attend_group for float32 at constant D, G and BS with the whole context in view (no
// sliding window, no soft-capping), where the accumulators are few enough for registers:
// straight passes, each a loop over whole blocks and then the last block's live vectors,
// with no per-vector branch (attend_group's loops, one body for full and partial vectors,
// keep their accumulators in memory). One pass scores all G heads (G accumulators, each
// vector of K loaded once for all); then passes of GV heads at a time weigh V (GV x D
// accumulators, each weight made as its vector of V is weighed): G where the group's
// G x D fit the registers, fewer where they would spill. The same sums in the same order
// as attend_group's, so the same result to the bit on AVX2 and AVX-512 (the portable
// loops' lane sums are plain loops that -ffast-math may reorder differently in each).
template <int64_t D, int64_t G, int64_t BS, int64_t GV = G>
void attend_group_blocks(const float* q, const float* kc, const float* vc, const int32_t* bt,
                         int64_t len, int64_t tile_stride, int64_t tile_off, float scale,
                         float* __restrict__ sc, int64_t sc_stride, float* o, RowFetch* fetch) {
    static_assert(BS % kLanes == 0, "whole vectors per block");
    const int64_t full = len / BS, tail = len - full * BS;
    // f(tile row at position p, p, live lanes n) for each vector of `cache`'s tiles: the
    // whole blocks, then the last block's live vectors (one pass of K's or V's), each
    // followed by a step of the later row's fetch, where there is one.
    auto each_vector = [&](const float* cache, auto&& f) DG_INLINE {
        for (int64_t b = 0; b < full; b++) {
            const float* t = cache + static_cast<int64_t>(bt[b]) * tile_stride + tile_off;
            for (int64_t c = 0; c < BS; c += kLanes) {
                f(t + c, b * BS + c, kLanes);
                if (fetch != nullptr)
                    fetch->step();
            }
        }
        const float* last =
            cache + (tail ? static_cast<int64_t>(bt[full]) * tile_stride : 0) + tile_off;
        for (int64_t c = 0; c < tail; c += kLanes) {
            f(last + c, full * BS + c, tail - c < kLanes ? tail - c : kLanes);
            if (fetch != nullptr)
                fetch->step();
        }
    };
    std::array<Vec, G> m, l;
    for (int64_t j = 0; j < G; j++) {
        m[j] = Vec(-FLT_MAX);
        l[j] = Vec(0.f);
    }
    // Scores: the vector of positions [p, p + n) of the tile at `k`; lanes from n on are
    // scored -FLT_MAX (the scores hold whole blocks: max_len is a multiple of BS).
    auto score = [&](const float* k, int64_t p, int64_t n) DG_INLINE {
        std::array<Vec, G> s;
        for (int64_t j = 0; j < G; j++)
            s[j] = Vec(0.f);
        for (int64_t i = 0; i < D; i++) {
            const Vec kv = n == kLanes ? Vec::loadu(k + i * BS) : Vec::loadu(k + i * BS, n);
            for (int64_t j = 0; j < G; j++)
                s[j] = at::vec::fmadd(Vec(q[j * D + i]), kv, s[j]);
        }
        for (int64_t j = 0; j < G; j++) {
            Vec x = s[j] * Vec(scale);
            if (n < kLanes)
                x = Vec::blendv(Vec(-FLT_MAX), x, lanes(0, n));
            x.store(sc + j * sc_stride + p);
            m[j] = at::vec::clamp_min(m[j], x);
        }
    };
    each_vector(kc, score);
    for (int64_t j = 0; j < G; j++)
        m[j] = Vec(max(m[j]));
    // The weighted sums of V for heads [j0, j0 + GV), each vector's weights made as it is
    // weighed (exp of the score less the maximum, 0 past the context, added to their
    // sum): V's loads past the context are 0 too. The first pass steps the later row's
    // fetch (with the scores' pass, a pass of K and one of V, as for one head).
    for (int64_t j0 = 0; j0 < G; j0 += GV) {
        std::array<Vec, GV * D> acc;
        for (int64_t i = 0; i < GV * D; i++)
            acc[i] = Vec(0.f);
        auto weigh = [&](const float* v, int64_t p, int64_t n) DG_INLINE {
            std::array<Vec, GV> w;
            for (int64_t j = 0; j < GV; j++) {
                w[j] = exp(Vec::loadu(sc + (j0 + j) * sc_stride + p) - m[j0 + j]);
                if (n < kLanes)
                    w[j] = Vec::blendv(Vec(0.f), w[j], lanes(0, n));
                l[j0 + j] = l[j0 + j] + w[j];
            }
            for (int64_t i = 0; i < D; i++) {
                const Vec vv = n == kLanes ? Vec::loadu(v + i * BS) : Vec::loadu(v + i * BS, n);
                for (int64_t j = 0; j < GV; j++)
                    acc[j * D + i] = at::vec::fmadd(w[j], vv, acc[j * D + i]);
            }
        };
        each_vector(vc, weigh);
        if (j0 == 0)
            fetch = nullptr;
        // o[(j0 + j) * D + i] = (lane sum of acc[j * D + i]) / (lane sum of l[j0 + j]),
        // Vec::size() outputs at a time: sum_lanes adds them in sum's order, in a few
        // shuffles for all.
        float inv[GV * D];
        for (int64_t j = 0; j < GV; j++) {
            const float inv_j = 1.f / sum(l[j0 + j]);
            for (int64_t i = 0; i < D; i++)
                inv[j * D + i] = inv_j;
        }
        float* out = o + j0 * D;
        for (int64_t c = 0; c < GV * D; c += kLanes) {
            const int64_t n = GV * D - c < kLanes ? GV * D - c : kLanes;
            (sum_lanes(&acc[c], n) * Vec::loadu(inv + c, n)).store(out + c, n);
        }
    }
}

// Vector registers the compiler has for Vec values: 32 with AVX-512; 16 with AVX2 and on
// NEON (where a Vec is two of its 32 registers); 16 taken for the portable loops.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kVecRegisters = 32;
#else
constexpr int64_t kVecRegisters = 16;
#endif

// Shapes attend_group_blocks takes: constant, whole vectors per block, and at most 16
// accumulators (a group's G x D).
template <int64_t D, int64_t G, int64_t BS>
constexpr bool kWholeBlocks = D != 0 && G != 0 && BS != 0 && BS % kLanes == 0 && D * G <= 16;

// The G query heads that share one KV head (grouped-query attention), in two passes over
// the context: every scaled score and its maximum, then the exp-weighted sums of V (no
// running rescale). Each K and V vector is loaded once for all G heads; the maxima and
// weight sums stay vertical until the end, and at constant D and G (BS: the block size,
// where constant) with G * D up to ~24 the accumulators live in registers. A vector of
// positions [p, p + n) is live in its lanes [lo, n): lanes before a sliding window's
// start (lo > 0) or past the block or the context (n < Vec::size()) are scored -FLT_MAX
// and weighted 0. The scores of head j go to sc + j * sc_stride.
// bf16 caches (q and o in float32 here) round where the reference does: the raw and the
// scaled scores, and the normalised weights (so the weights are normalised before V, in a
// pass of their own over the scores).
template <bool Bf16, int64_t D, int64_t G, int64_t BS>
void attend_group(const float* q, const void* k_cache, const void* v_cache, const int32_t* bt,
                  int64_t start, int64_t len, int64_t tile_stride, int64_t tile_off,
                  int64_t d_, int64_t g_, int64_t bs_, float scale, float softcap,
                  float* __restrict__ sc, int64_t sc_stride, float* o, RowFetch* fetch) {
    using KV = std::conditional_t<Bf16, uint16_t, float>;
    const int64_t d = D ? D : d_, g = G ? G : g_, bs = BS ? BS : bs_;
    const KV *kc = static_cast<const KV*>(k_cache), *vc = static_cast<const KV*>(v_cache);
    // The first block the window reaches, and its first position.
    const int64_t b0 = start / bs, first = b0 * bs;
    // Exactly G * D accumulators where both are constants (registers); otherwise room for
    // the largest group, left unconstructed (Vec's constructor stores a zero).
    using Acc = std::conditional_t<D && G, std::array<Vec, (D && G ? D * G : 1)>,
                                   Uninitialized<kMaxGroupAcc>>;
    using PerHead = std::conditional_t<G != 0, std::array<Vec, (G ? G : 1)>,
                                       Uninitialized<kMaxGroup>>;
    Acc acc;
    PerHead m, l, s, total;
    for (int64_t j = 0; j < g; j++) {
        m[j] = Vec(-FLT_MAX);
        l[j] = Vec(0.f);
    }
    // fn(full, p, c, lo, n) for each vector of positions p = p0 + c of block b (c: its
    // offset in the block) from the window's start to len; `full` a std::bool_constant.
    auto for_vectors = [&](auto&& fn) DG_INLINE {
        for (int64_t b = b0, p0 = first; p0 < len; b++, p0 += bs) {
            for (int64_t c = 0; c < bs && p0 + c < len; c += kLanes) {
                const int64_t p = p0 + c, lo = start > p ? start - p : 0;
                const int64_t left = bs - c < len - p ? bs - c : len - p;
                const int64_t n = left < kLanes ? left : kLanes;
                const int64_t tile = static_cast<int64_t>(bt[b]) * tile_stride + tile_off + c;
                if (n == kLanes && lo == 0)
                    fn(std::true_type{}, tile, p, lo, n);
                else
                    fn(std::false_type{}, tile, p, lo, n);
                if (fetch != nullptr)
                    fetch->step();
            }
        }
    };
    for_vectors([&](auto full, int64_t tile, int64_t p, int64_t lo, int64_t n) DG_INLINE {
        constexpr bool F = decltype(full)::value;
        for (int64_t j = 0; j < g; j++)
            s[j] = Vec(0.f);
        for (int64_t i = 0; i < d; i++) {
            const Vec k = load_kv<F>(kc + tile + i * bs, n);
            for (int64_t j = 0; j < g; j++)
                s[j] = at::vec::fmadd(Vec(q[j * d + i]), k, s[j]);
        }
        for (int64_t j = 0; j < g; j++) {
            Vec x = Bf16 ? round_bf16(round_bf16(s[j]) * Vec(scale)) : s[j] * Vec(scale);
            if (softcap > 0.f)
                x = soft_cap<Bf16>(x, softcap);
            float* out = sc + j * sc_stride + p;
            if constexpr (F) {
                x.store(out);
            } else {
                x = Vec::blendv(Vec(-FLT_MAX), x, lanes(lo, n));
                x.store(out, n);
            }
            m[j] = at::vec::clamp_min(m[j], x);  // max without maximum's NaN test
        }
    });
    for (int64_t j = 0; j < g; j++)
        m[j] = Vec(max(m[j]));
    if constexpr (Bf16) {  // the weights' sums first: bf16 normalises each weight before V
        for (int64_t p = first; p < len; p += kLanes) {
            const int64_t n = len - p < kLanes ? len - p : kLanes;
            const int64_t lo = start > p ? start - p : 0;
            for (int64_t j = 0; j < g; j++) {
                float* x = sc + j * sc_stride + p;
                Vec e = exp(Vec::loadu(x, n) - m[j]);
                if (n < kLanes || lo > 0)
                    e = Vec::blendv(Vec(0.f), e, lanes(lo, n));
                e.store(x, n);
                l[j] = l[j] + e;
            }
        }
        for (int64_t j = 0; j < g; j++)
            total[j] = Vec(sum(l[j]));
    }
    // The weighted sums of V for dimensions [i0, i0 + dn) of every head: all of them in one
    // pass unless a head is wider than the accumulators (then a pass per slice, each
    // recomputing the weights; only the first adds up their sums).
    auto v_pass = [&](int64_t i0, int64_t dn) DG_INLINE {
        for (int64_t i = 0; i < g * dn; i++)
            acc[i] = Vec(0.f);
        for_vectors([&](auto full, int64_t tile, int64_t p, int64_t lo, int64_t n) DG_INLINE {
            constexpr bool F = decltype(full)::value;
            const Vec live = F ? Vec(0.f) : lanes(lo, n);
            for (int64_t j = 0; j < g; j++) {
                const float* x = sc + j * sc_stride + p;
                if constexpr (Bf16) {  // lanes past n load 0; those before lo hold weight 0
                    s[j] = round_bf16((F ? Vec::loadu(x) : Vec::loadu(x, n)) / total[j]);
                } else {
                    s[j] = exp((F ? Vec::loadu(x) : Vec::loadu(x, n)) - m[j]);
                    if constexpr (!F)
                        s[j] = Vec::blendv(Vec(0.f), s[j], live);
                    if (i0 == 0)
                        l[j] = l[j] + s[j];
                }
            }
            for (int64_t i = 0; i < dn; i++) {
                Vec v = load_kv<F>(vc + tile + (i0 + i) * bs, n);
                if constexpr (!F)
                    v = Vec::blendv(Vec(0.f), v, live);  // 0 * a non-finite value is not 0
                for (int64_t j = 0; j < g; j++)
                    acc[j * dn + i] = at::vec::fmadd(s[j], v, acc[j * dn + i]);
            }
        });
        // o[j * d + i0 + i] = (lane sum of acc[j * dn + i]) / (lane sum of l[j]), a vector
        // at a time: across heads where the slice is the whole head (the accumulators then
        // lie as the output does), else per head.
        float inv[kMaxGroupAcc];
        for (int64_t j = 0; j < g; j++) {
            const float inv_j = Bf16 ? 1.f : 1.f / sum(l[j]);
            for (int64_t i = 0; i < dn; i++)
                inv[j * dn + i] = inv_j;
        }
        const int64_t rows = dn == d ? 1 : g, width = dn == d ? g * d : dn;
        for (int64_t j = 0; j < rows; j++) {
            for (int64_t c = 0; c < width; c += kLanes) {
                const int64_t n = width - c < kLanes ? width - c : kLanes, at = j * dn + c;
                (sum_lanes(&acc[at], n) * Vec::loadu(inv + at, n)).store(o + j * d + i0 + c, n);
            }
        }
    };
    if (g * d <= kMaxGroupAcc) {
        v_pass(0, d);
    } else {
        const int64_t span = kMaxGroupAcc / g;
        for (int64_t i0 = 0; i0 < d; i0 += span)
            v_pass(i0, d - i0 < span ? d - i0 : span);
    }
}

// A float32 group: attend_group_blocks where it applies, else attend_group.
template <int64_t D, int64_t G, int64_t BS>
inline void attend_f32(const float* q, const void* k_cache, const void* v_cache, const int32_t* bt,
                       int64_t start, int64_t len, int64_t tile_stride, int64_t tile_off,
                       int64_t d, int64_t g, int64_t bs, float scale, float softcap, float* sc,
                       int64_t sc_stride, float* o, RowFetch* fetch) {
    if constexpr (kWholeBlocks<D, G, BS>) {
        if (start == 0 && softcap == 0.f) {
            const float *kc = static_cast<const float*>(k_cache),
                        *vc = static_cast<const float*>(v_cache);
            // V weighed one head at a time where the group's G x D accumulators would not
            // fit the registers (spilled, they cost more than loading V again from L1).
            constexpr int64_t GV = G * D + 4 > kVecRegisters ? 1 : G;
            attend_group_blocks<D, G, BS, GV>(q, kc, vc, bt, len, tile_stride, tile_off, scale,
                                              sc, sc_stride, o, fetch);
            return;
        }
    }
    attend_group<false, D, G, BS>(q, k_cache, v_cache, bt, start, len, tile_stride, tile_off, d,
                                  g, bs, scale, softcap, sc, sc_stride, o, fetch);
}

// Ask the memory system for `tile` elements `off` into each block over blocks [b0, b1),
// of K and V, into L1 (one KV head's tiles, the next head's): every cache line of them at
// once, so that their misses overlap.
inline void prefetch_tiles(const void* k_cache, const void* v_cache, const int32_t* bt,
                           int64_t b0, int64_t b1, int64_t tile_stride, int64_t off,
                           int64_t tile, size_t elem) {
    const char *kc = static_cast<const char*>(k_cache), *vc = static_cast<const char*>(v_cache);
    const int64_t e = static_cast<int64_t>(elem), bytes = tile * e;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t at = (static_cast<int64_t>(bt[b]) * tile_stride + off) * e;
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(kc + at + o, 0, 3);
            __builtin_prefetch(vc + at + o, 0, 3);
        }
    }
}

// What a decode row fetches ahead (paged_attention_requests): all along, a later row's
// blocks (`later`, null: none); or else, while it attends one KV head, the next head's
// tiles, and while it attends its last, the next row's first head's (`bt` null: none).
struct Lookahead {
    const int32_t* bt;
    int64_t start, len;
    RowFetch* later;
};

// One token's row: each KV head with its query heads, in groups of at most
// kMaxGroupAcc / d heads. float32 shapes we know get constant d and G, at block size 16
// and at any other; bf16 rows are converted to float32 per group, and the output rounded
// back.
inline void attend_row(const void* q_row, void* o_row, const void* k_cache, const void* v_cache,
                       const int32_t* bt, int64_t start, int64_t len, int64_t num_heads,
                       int64_t g, int64_t d, int64_t bs, int64_t tile_stride, float scale,
                       float softcap, float* sc, int64_t sc_stride, int bf16,
                       const Lookahead* ahead) {
    const int64_t tile = d * bs;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t fit = kMaxGroupAcc / d > 1 ? kMaxGroupAcc / d : 1;
    const int64_t max_g = fit < kMaxGroup ? fit : kMaxGroup;
    float qf[kMaxGroupAcc > kMaxHead ? kMaxGroupAcc : kMaxHead], of[sizeof qf / sizeof(float)];
    RowFetch* const later = ahead != nullptr ? ahead->later : nullptr;
    const bool tiles = ahead != nullptr && later == nullptr;
    for (int64_t h = 0; h < num_heads; h += g) {
        const int64_t off = (h / g) * tile;
        if (tiles && h + g < num_heads)
            prefetch_tiles(k_cache, v_cache, bt, start / bs, (len + bs - 1) / bs, tile_stride,
                           off + tile, tile, elem);
        else if (tiles && ahead->bt != nullptr)
            prefetch_tiles(k_cache, v_cache, ahead->bt, ahead->start / bs,
                           (ahead->len + bs - 1) / bs, tile_stride, 0, tile, elem);
        for (int64_t h0 = h; h0 < h + g; h0 += max_g) {
            const int64_t G = h + g - h0 < max_g ? h + g - h0 : max_g;
            if (bf16) {
                const uint16_t* qh = static_cast<const uint16_t*>(q_row) + h0 * d;
                for (int64_t i = 0; i < G * d; i++)
                    qf[i] = bf16_to_f32(qh[i]);
                if (bs == 16)
                    attend_group<true, 0, 0, 16>(qf, k_cache, v_cache, bt, start, len,
                                                 tile_stride, off, d, G, bs, scale, softcap, sc,
                                                 sc_stride, of, later);
                else
                    attend_group<true, 0, 0, 0>(qf, k_cache, v_cache, bt, start, len,
                                                tile_stride, off, d, G, bs, scale, softcap, sc,
                                                sc_stride, of, later);
                for (int64_t i = 0; i < G * d; i++)
                    static_cast<uint16_t*>(o_row)[h0 * d + i] = f32_to_bf16(of[i]);
                continue;
            }
            const float* qg = static_cast<const float*>(q_row) + h0 * d;
            float* og = static_cast<float*>(o_row) + h0 * d;
#define GROUP(D_, G_, BS_)                                                                    \
    attend_f32<D_, G_, BS_>(qg, k_cache, v_cache, bt, start, len, tile_stride, off, d, G, bs,   \
                            scale, softcap, sc, sc_stride, og, later)
#define SHAPES(BS_)                                                                           \
    if (d == 8 && G == 1)                                                                     \
        GROUP(8, 1, BS_);                                                                     \
    else if (d == 8 && G == 2)                                                                \
        GROUP(8, 2, BS_);                                                                     \
    else if (d == 8 && G == 4)                                                                \
        GROUP(8, 4, BS_);                                                                     \
    else if (d == 16 && G == 1)                                                               \
        GROUP(16, 1, BS_);                                                                    \
    else if (d == 16 && G == 2)                                                               \
        GROUP(16, 2, BS_);                                                                    \
    else if (d == 64 && G == 1)                                                               \
        GROUP(64, 1, BS_);                                                                    \
    else                                                                                      \
        GROUP(0, 0, BS_)
            if (bs == 16)
                SHAPES(16);
            else
                SHAPES(0);
#undef SHAPES
#undef GROUP
        }
    }
}

// One layer's attention step (see the top of this file). All tensors float32, or all
// bfloat16 when `bf16`; head_size at most kMaxHead.
struct paged_attention_step {
    const void *q, *k, *v;
    void *out, *k_cache, *v_cache;
    const int64_t *slot_mapping;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    int64_t bt_stride, num_reqs, num_rows, q_stride, k_stride, v_stride;
    int64_t num_heads, num_kv_heads, head_size, block_size;
    float scale;
    int64_t num_blocks, bt_cols, max_len;  // max_len: context positions a workspace holds
    int bf16;
    // Sliding window: a token sees the last `window` positions up to its own (0: all);
    // logit soft-capping: scores become softcap * tanh(score / softcap) (0: none).
    int64_t window;
    float softcap;
};

// Check the step and zero the padding rows of out: 0, or non-zero with nothing touched
// (3: a head size above kMaxHead).
inline int paged_attention_begin(const paged_attention_step *a)
{
    const int64_t d = a->head_size, bs = a->block_size;
    const size_t elem = a->bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t row_bytes = (size_t)(a->num_heads * d) * elem;
    if (d > kMaxHead)
        return 3;
    const int bad = check_metadata(a->slot_mapping, a->block_tables, a->bt_stride,
                                   a->query_start_loc, a->seq_lens, a->num_reqs, a->num_rows,
                                   bs, a->num_blocks, a->bt_cols, a->max_len);
    if (bad)
        return bad;
    const int64_t num_tokens = a->query_start_loc[a->num_reqs];
    memset((char *)a->out + num_tokens * row_bytes, 0,
           (size_t)(a->num_rows - num_tokens) * row_bytes);
    return 0;
}

// Write request r's new K/V (after paged_attention_begin): just before its tokens are
// attended, so that a decode's slot is in the block its row fetched ahead.
inline void write_request_kv(const paged_attention_step *a, int64_t r)
{
    const int64_t row = a->num_kv_heads * a->head_size, bs = a->block_size;
    const int64_t t0 = a->query_start_loc[r], t1 = a->query_start_loc[r + 1];
    if (a->bf16)
        write_new_kv(static_cast<uint16_t *>(a->k_cache), static_cast<uint16_t *>(a->v_cache),
                     static_cast<const uint16_t *>(a->k), static_cast<const uint16_t *>(a->v),
                     a->slot_mapping, t0, t1, a->k_stride, a->v_stride, row, bs, row * bs);
    else
        write_new_kv(static_cast<float *>(a->k_cache), static_cast<float *>(a->v_cache),
                     static_cast<const float *>(a->k), static_cast<const float *>(a->v),
                     a->slot_mapping, t0, t1, a->k_stride, a->v_stride, row, bs, row * bs);
}

// Below this many bytes of K and V per layer, a step's caches are taken to be in the
// core's own caches, where fetching ahead only adds instructions.
constexpr int64_t kLookaheadBytes = int64_t{1} << 20;

// How many decode rows ahead a row fetches a later row's whole blocks (into L2): far
// enough for the memory system to answer before that row starts, near enough that its
// lines are still in L2 then (docs/performance.md, "rows ahead").
constexpr int64_t kRowsAhead = 4;

// Whether decode rows fetch a later row's whole blocks into L2 (kRowsAhead), decided once
// per process: DECODEGRAPH_CPU_ROWS_AHEAD=1 or 0 where set, else yes except on Intel
// cores. A software prefetch holds one of the core's few L1 fill buffers until its line
// arrives on Intel cores, so a row's burst of them stalls the loads behind it: there the
// burst cost more than it saved, even with the caches in memory, while AMD cores gained
// from it (docs/performance.md, "rows ahead"). The fetch is now trickled (RowFetch), not
// a burst; Intel cores keep it off until that is measured there. Where it is on, a row no
// longer fetches its next KV head's tiles into L1 as well: on a Zen 4 those fetches cost
// more instructions than their loads then waited (docs/performance.md, 2026-12-06).
inline bool fetch_rows_ahead() {
    static const bool yes = env_switch("DECODEGRAPH_CPU_ROWS_AHEAD", !cpu_is_intel());
    return yes;
}

// Write the new K/V of requests [r0, r1) and attend their tokens (after
// paged_attention_begin), with `work` holding one thread's workspace. Where their K and V
// are large (kLookaheadBytes), decode rows fetch ahead at two distances: each row's blocks
// kRowsAhead rows early into L2, trickled over the vectors of the row kRowsAhead before it
// (RowFetch; where fetch_rows_ahead), or else each KV head's tiles one head early into L1
// (Lookahead). Blocks are scattered, so the hardware
// prefetchers cannot see the next tile coming, and each tile's first loads would otherwise
// wait on memory in turn.
inline void paged_attention_requests(const paged_attention_step* a, int64_t r0, int64_t r1,
                                     float* work) {
    const int64_t d = a->head_size, g = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const size_t elem = a->bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t row_bytes = static_cast<size_t>(a->num_heads * d) * elem;
    const int64_t tile_stride = a->num_kv_heads * d * bs;
    // Token t of request r sees the context up to and including its own position (len
    // of them), or within a sliding window the last `window` of those.
    auto span = [a](int64_t r, int64_t t, int64_t* start, int64_t* len) DG_INLINE {
        *len = a->seq_lens[r] - (a->query_start_loc[r + 1] - 1 - t);
        *start = a->window > 0 && *len > a->window ? *len - a->window : 0;
    };
    int64_t kv_bytes = 0;
    for (int64_t r = r0; r < r1; r++) {
        int64_t start, len;
        span(r, a->query_start_loc[r + 1] - 1, &start, &len);
        kv_bytes += (len - start) * tile_stride / bs * 2 * static_cast<int64_t>(elem);
    }
    const bool fetch_ahead = kv_bytes >= kLookaheadBytes;
    const bool rows_ahead = fetch_ahead && fetch_rows_ahead();
    // A decode row (its request's only new token) and the row after it, if that is one too.
    auto decode = [a](int64_t r) DG_INLINE {
        return a->query_start_loc[r + 1] - a->query_start_loc[r] == 1;
    };
    const uint64_t fp_mode = flush_denormals();
    if (fetch_ahead && r0 < r1 && decode(r0)) {  // the first row's first head: no row before
        int64_t start, len;
        span(r0, a->query_start_loc[r0], &start, &len);
        prefetch_tiles(a->k_cache, a->v_cache, a->block_tables + r0 * a->bt_stride, start / bs,
                       (len + bs - 1) / bs, tile_stride, 0, d * bs, elem);
    }
    for (int64_t r = r0; r < r1; r++) {
        const int32_t* bt = a->block_tables + r * a->bt_stride;
        const int64_t first = a->query_start_loc[r], end = a->query_start_loc[r + 1];
        Lookahead ahead{nullptr, 0, 0, nullptr};
        const bool look = fetch_ahead && decode(r);
        if (look && r + 1 < r1 && decode(r + 1)) {
            ahead.bt = a->block_tables + (r + 1) * a->bt_stride;
            span(r + 1, a->query_start_loc[r + 1], &ahead.start, &ahead.len);
        }
        const int64_t later = r + kRowsAhead;
        RowFetch fetch{};
        if (look && rows_ahead && later < r1 && decode(later)) {
            int64_t start, len, own_start, own_len;
            span(later, a->query_start_loc[later], &start, &len);
            span(r, first, &own_start, &own_len);
            const int64_t bytes = tile_stride * static_cast<int64_t>(elem);
            // Its lines over this row's vector visits (K's and V's pass for each KV head).
            const int64_t b0 = start / bs, b1 = (len + bs - 1) / bs;
            const int64_t lines = (b1 - b0) * ((bytes + 63) / 64);
            const int64_t visits =
                a->num_kv_heads * 2 * ((own_len - own_start + kLanes - 1) / kLanes);
            fetch = RowFetch{static_cast<const char*>(a->k_cache),
                             static_cast<const char*>(a->v_cache),
                             a->block_tables + later * a->bt_stride,
                             b0,
                             b1,
                             0,
                             bytes,
                             lines,
                             visits > 0 ? visits : 1,
                             0};
            ahead.later = &fetch;
        }
        write_request_kv(a, r);
        for (int64_t t = first; t < end; t++) {
            int64_t start, len;
            span(r, t, &start, &len);
            const void* q = static_cast<const char*>(a->q) + t * a->q_stride * elem;
            void* o = static_cast<char*>(a->out) + t * row_bytes;
            attend_row(q, o, a->k_cache, a->v_cache, bt, start, len, a->num_heads, g, d, bs,
                       tile_stride, a->scale, a->softcap, work, a->max_len, a->bf16,
                       look ? &ahead : nullptr);
        }
        fetch.finish();
    }
    restore_fp_mode(fp_mode);
}

}  // namespace decodegraph

#endif
