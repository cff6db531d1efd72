// The attention kernel of decodegraph/native (at::vec, csrc/paged_attention.h) against the
// hand-written AVX-512 intrinsics it replaced (csrc/intrinsics_avx512.h), in one process:
// 41 rounds of `reps` calls of each, alternating, on one token's row (all heads over
// `ctx` positions); prints the medians, the median of the per-round ratios and the largest
// difference of the outputs. Only where the sources still carry the intrinsics:
//
//   T=$(.venv/bin/python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   g++ -std=c++20 -O3 -ffast-math -ffp-contract=off -march=native -DCPU_CAPABILITY_AVX512 \
//       -DCPU_CAPABILITY=dg_avx512 -I decodegraph/native/csrc -isystem $T/include \
//       benchmarks/native/attention_ab.cpp -o /tmp/attention_ab -L$T/lib -lc10 -Wl,-rpath,$T/lib
//   /tmp/attention_ab BF16 HEADS KV_HEADS HEAD_SIZE BLOCK_SIZE CONTEXT REPS
//   /tmp/attention_ab 0 8 4 8 16 256 200       # stories260K
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "paged_attention.h"

using namespace decodegraph;

int main(int argc, char** argv) {
    if (argc != 8) {
        std::fprintf(stderr, "usage: %s bf16 heads kv_heads head_size block_size ctx reps\n",
                     argv[0]);
        return 2;
    }
    const int bf16 = std::atoi(argv[1]);
    const int64_t H = std::atoi(argv[2]), KVH = std::atoi(argv[3]), d = std::atoi(argv[4]);
    const int64_t bs = std::atoi(argv[5]), ctx = std::atoi(argv[6]), reps = std::atoi(argv[7]);
    const int64_t nb = (ctx + bs - 1) / bs + 1, g = H / KVH, cache_n = nb * KVH * d * bs;
    std::mt19937 rng(0);
    std::normal_distribution<float> normal;
    std::vector<float> kf(cache_n), vf(cache_n), qf(H * d);
    for (auto* v : {&kf, &vf, &qf})
        for (auto& x : *v)
            x = normal(rng);
    std::vector<uint16_t> kb(cache_n), vb(cache_n), qb(H * d);
    for (int64_t i = 0; i < cache_n; i++) {
        kb[i] = f32_to_bf16(kf[i]);
        vb[i] = f32_to_bf16(vf[i]);
    }
    for (int64_t i = 0; i < H * d; i++)
        qb[i] = f32_to_bf16(qf[i]);
    std::vector<int32_t> bt(nb);
    for (int64_t i = 0; i < nb; i++)
        bt[i] = static_cast<int32_t>((i * 7) % nb);
    const int64_t max_len = nb * bs, tile_stride = KVH * d * bs;
    std::vector<float> work(g * max_len), o1(H * d), o2(H * d);
    const void* kc = bf16 ? static_cast<const void*>(kb.data()) : kf.data();
    const void* vc = bf16 ? static_cast<const void*>(vb.data()) : vf.data();
    const void* q = bf16 ? static_cast<const void*>(qb.data()) : qf.data();
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    auto at_vec = [&] {
        attend_row(q, o1.data(), kc, vc, bt.data(), 0, ctx, H, g, d, bs, tile_stride, scale, 0.f,
                   work.data(), max_len, bf16);
    };
    auto intrinsic = [&] {
        intrinsics::attend_request_avx512(q, kc, vc, bt.data(), 0, ctx, tile_stride, H, g, d, bs,
                                          scale, 0.f, work.data(), max_len, o2.data(), bf16);
    };
    std::vector<double> ta, tb, ratio;
    for (int r = 0; r < 41; r++) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < reps; i++)
            at_vec();
        const auto t1 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < reps; i++)
            intrinsic();
        const auto t2 = std::chrono::steady_clock::now();
        ta.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / reps);
        tb.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count() / reps);
        ratio.push_back(ta.back() / tb.back());
    }
    for (auto* v : {&ta, &tb, &ratio})
        std::sort(v->begin(), v->end());
    double diff = 0;
    for (int64_t i = 0; i < H * d; i++) {
        const float a = bf16 ? bf16_to_f32(reinterpret_cast<uint16_t*>(o1.data())[i]) : o1[i];
        const float b = bf16 ? bf16_to_f32(reinterpret_cast<uint16_t*>(o2.data())[i]) : o2[i];
        diff = std::max(diff, static_cast<double>(std::fabs(a - b)));
    }
    std::printf("bf16=%d heads=%ld/%ld d=%ld bs=%ld ctx=%ld: at::vec %.2f us, intrinsics %.2f us, "
                "median ratio %.3f, max |diff| %.2g\n",
                bf16, H, KVH, d, bs, ctx, ta[20], tb[20], ratio[20], diff);
}
